"""The batch runner end to end through papermill, on fixture notebooks and on notebook 12."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from workbench import batch, cli, report
from workbench.notebooks import discover, resolve


def test_unknown_parameter_fails_before_anything_runs(fixture_notebooks, tmp_path):
    infos = discover(fixture_notebooks)
    with pytest.raises(batch.ParameterError) as err:
        batch.plan(infos[:1], tmp_path / "out", raw_params={"no_such": ["1"]})
    msg = str(err.value)
    assert "01-ok" in msg and "'no_such'" in msg and "x (int, default 1)" in msg
    assert not (tmp_path / "out").exists()


def test_wrong_type_and_reserved_names(fixture_notebooks, tmp_path):
    ok = discover(fixture_notebooks)[:1]
    with pytest.raises(batch.ParameterError, match=r"'x' expects int.*'abc'"):
        batch.plan(ok, tmp_path, raw_params={"x": ["1", "abc"]})
    with pytest.raises(batch.ParameterError, match="--seeds"):
        batch.plan(ok, tmp_path, raw_params={"seed": ["1"]})


def test_grid_and_seeds_make_one_job_each(fixture_notebooks, tmp_path):
    ok = discover(fixture_notebooks)[:1]
    jobs = batch.plan(ok, tmp_path, raw_params={"x": batch.split_values("1,-1")}, seeds=[0, 1])
    assert [(j.params["x"], j.seed) for j in jobs] == [(1, 0), (1, 1), (-1, 0), (-1, 1)]
    assert len({j.out for j in jobs}) == 4


@pytest.mark.slow   # papermill end to end
def test_batch_keeps_going_past_failures_and_reports(fixture_notebooks, tmp_path):
    infos = {i.slug: i for i in discover(fixture_notebooks)}
    out = tmp_path / "out"
    jobs = batch.plan([infos["01-ok"]], out, raw_params={"x": ["1", "-1"]}, seeds=[0, 1])
    jobs += batch.plan([infos["02-raises"]], out)
    jobs += batch.plan([infos["04-dies"]], out)
    slow = batch.plan([infos["03-slow"]], out)
    # generous limit for the jobs that should finish (CI machines can be slow to start kernels);
    # a short one for the notebook that sleeps a minute
    results = batch.run_batch(jobs, n_jobs=2, timeout=300, show_progress=False)
    results += batch.run_batch(slow, n_jobs=1, timeout=10, show_progress=False)
    status = {(r.job.slug, r.job.params.get("x"), r.job.seed): r.status for r in results}
    assert status == {("01-ok", 1, 0): "ok", ("01-ok", 1, 1): "ok", ("01-ok", -1, 0): "ok",
                      ("01-ok", -1, 1): "ok", ("02-raises", None, 0): "failed",
                      ("03-slow", None, 0): "timeout", ("04-dies", None, 0): "died"}
    failed = next(r for r in results if r.job.slug == "02-raises")
    assert "boom from the notebook" in failed.error
    # every job leaves its log and job.json; the good ones their metrics and executed notebook
    for r in results:
        assert (Path(r.job.out) / "log.txt").exists() and (Path(r.job.out) / "job.json").exists()
    good = [r for r in results if r.status == "ok"]
    for r in good:
        m = json.loads((Path(r.job.out) / "metrics.json").read_text())
        assert m["params"]["x"] == r.job.params["x"] and m["seed"] == r.job.seed
    # a robust claim that fails is visible in the summary without failing the job
    assert "robust claim(s) not holding: C1" in batch.summary_table(results)

    index = report.build(out)
    res = pd.read_csv(out / "results.csv")
    assert len(res) == 7 and set(res["status"]) == {"ok", "failed", "timeout", "died"}
    agg = pd.read_csv(out / "aggregate.csv")
    assert list(agg.columns) == ["notebook", "params", "metric", "mean", "std", "n", "seeds"]
    row = agg.set_index(["params", "metric"]).loc[("scale=smoke, x=1", "x_plus_seed")]
    assert (row["n"], row["seeds"], row["mean"]) == (2, "0,1", pytest.approx(1.5))
    assert row["std"] == pytest.approx(2 ** -0.5)
    held = agg[agg["metric"] == "claim:C1"].set_index("params")["mean"]
    assert held["scale=smoke, x=-1"] == 0.0 and held["scale=smoke, x=1"] == 1.0
    assert set(agg["notebook"]) == {"01-ok"}          # failed jobs are not aggregated
    page = index.read_text()
    assert "02-raises" in page and "boom from the notebook" in page and "executed notebook" in page
    # the raising notebook is reported with its error cell, and was run once
    assert failed.error_cell.startswith("cell 3: raise RuntimeError") and failed.attempts == 1
    assert "cell 3: raise RuntimeError" in page

    # --resume skips exactly the jobs that finished (same notebook and parameters)
    again = batch.run_batch(jobs, n_jobs=2, timeout=300, resume=True, show_progress=False)
    assert [r.status for r in again if r.job.slug == "01-ok"] == ["cached"] * 4
    assert next(r for r in again if r.job.slug == "02-raises").status == "failed"
    # no staging directory is left behind, and metrics.json is where the job ended up
    assert not [p for p in out.rglob(".*partial*")]
    m = json.loads((Path(good[0].job.out) / "metrics.json").read_text())
    assert m["params"]["out_dir"] == good[0].job.out


def _run_with_stand_in(script, fixture_notebooks, tmp_path, monkeypatch):
    """Run one planned job with ``script`` (given the run directory) in papermill's place."""
    monkeypatch.setattr(batch, "_papermill_cmd",
                        lambda nb, workdir, slug, timeout: [sys.executable, "-c", script, workdir])
    (job,) = batch.plan(discover(fixture_notebooks)[:1], tmp_path)
    return job, batch.run_job(job, timeout=30)


@pytest.mark.slow   # papermill end to end
def test_kernel_that_fails_to_start_is_retried_once(fixture_notebooks, tmp_path, monkeypatch):
    # Stand in for papermill: the first attempt fails the way a kernel that never starts does,
    # the second writes the notebook's metrics. The runner must retry exactly once.
    script = (
        "import json, pathlib, sys\n"
        "out = pathlib.Path(sys.argv[1]); n = out.parent / 'attempts'\n"
        "k = int(n.read_text()) + 1 if n.exists() else 1; n.write_text(str(k))\n"
        "if k == 1:\n"
        "    print('RuntimeError: Kernel didn\\'t respond in 60 seconds'); sys.exit(1)\n"
        "(out / 'metrics.json').write_text(json.dumps({'claims': []}))\n")
    job, r = _run_with_stand_in(script, fixture_notebooks, tmp_path, monkeypatch)
    assert (r.status, r.attempts) == ("ok", 2)


@pytest.mark.slow   # papermill end to end
def test_a_notebook_error_is_not_retried(fixture_notebooks, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(batch, "_papermill_cmd", lambda *a: calls.append(1) or [
        sys.executable, "-c", "print('ValueError: bad input'); raise SystemExit(1)"])
    (job,) = batch.plan(discover(fixture_notebooks)[:1], tmp_path)
    r = batch.run_job(job, timeout=30)
    assert (r.status, r.attempts, len(calls)) == ("failed", 1, 1) and "bad input" in r.error


def test_list_shows_notebooks_and_claims(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "12-nfi" in out and "C1" in out and "last result" in out


@pytest.mark.slow   # papermill end to end
def test_strict_batch_fails_a_job_whose_robust_claim_fails(fixture_notebooks, tmp_path):
    ok = discover(fixture_notebooks)[:1]
    jobs = batch.plan(ok, tmp_path, raw_params={"x": ["-1"]})
    (r,) = batch.run_batch(jobs, n_jobs=1, timeout=60, strict=True, show_progress=False)
    assert r.status == "failed" and "ClaimFailed" in r.error


def test_cli_rejects_unknown_parameter_of_notebook_12(tmp_path, capsys):
    out = tmp_path / "never"
    rc = cli.main(["run", "12-nfi", "-p", "no_such_parameter", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "12-nfi" in err and "no_such_parameter" in err and "Valid parameters:" in err
    valid = err.split("Valid parameters:")[1]
    assert "steps (int" in valid                      # a real knob of notebook 12 is offered
    for reserved in ("scale (", "seed (", "out_dir ("):  # ...but not what --scale/--seeds/--out set
        assert reserved not in valid
    assert not out.exists()


def test_cli_unknown_notebook(capsys):
    assert cli.main(["run", "99-nothing"]) == 2
    assert "known notebooks" in capsys.readouterr().err


@pytest.mark.slow
def test_notebook_12_through_the_cli(tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli.main(["run", "12-nfi", "--out", str(out), "--jobs", "1", "--timeout", "600"])
    text = capsys.readouterr().out
    assert rc == 0, text
    m = json.loads(next(out.rglob("metrics.json")).read_text())
    assert m["notebook"] == "12-nfi" and m["claims"]
    assert all(c["holds"] for c in m["claims"] if c["robust"])
    assert (out / "index.html").exists() and (out / "results.csv").exists()
    assert resolve("12").slug == "12-nfi"


@pytest.mark.slow   # papermill end to end
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "killed"])
def test_an_interrupted_batch_keeps_finished_jobs_and_no_half_written_result(
        fixture_notebooks, tmp_path, sig):
    # The CLI in its own process: 01-ok finishes, 07-half half-writes metrics.json into its
    # out_dir and hangs; then the runner gets Ctrl-C (SIGINT) or is killed outright.
    out, pidfile = tmp_path / "out", tmp_path / "kernel.pid"
    cmd = [sys.executable, "-m", "workbench.cli", "run", str(fixture_notebooks / "01-ok.ipynb"),
           str(fixture_notebooks / "07-half.ipynb"), "--jobs", "2", "--out", str(out),
           "--timeout", "300"]
    env = dict(os.environ, WB_TEST_HANG=str(pidfile))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ok_job, half_job = out / "01-ok/smoke/seed-0", out / "07-half/smoke/seed-0"
    deadline = time.time() + 240
    while not ((ok_job / "job.json").exists() and pidfile.exists()) and time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()
        time.sleep(0.3)
    assert (half_job.parent / ".seed-0.partial" / "metrics.json").exists()   # half-written
    proc.send_signal(sig)
    text = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL), text
    # the finished job is kept whole; the cut one has no result anywhere a reader looks
    assert json.loads((ok_job / "job.json").read_text())["status"] == "ok"
    assert json.loads((ok_job / "metrics.json").read_text())["claims"]
    assert not half_job.exists()
    assert all(r["notebook"] != "07-half" for r in report.collect(out))
    # ...but the report lists it, as interrupted (every planned job is reported)
    report.build(out, html=False)
    res = pd.read_csv(out / "results.csv").set_index("notebook")
    assert (res.loc["01-ok", "status"], res.loc["07-half", "status"]) == ("ok", "interrupted")
    # its kernel did not outlive the runner
    kernel = int(pidfile.read_text())
    deadline = time.time() + 15
    while Path(f"/proc/{kernel}").exists() and time.time() < deadline:
        time.sleep(0.5)
    assert not Path(f"/proc/{kernel}").exists()
    if sig == signal.SIGINT:
        assert "interrupted" in text and "--resume" in text
    # --resume keeps the finished job and runs the cut one
    env.pop("WB_TEST_HANG")
    again = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    lines = {ln.split()[0]: ln for ln in again.stdout.splitlines() if ln[:3] in ("01-", "07-")}
    assert " cached " in lines["01-ok"] and " ok " in lines["07-half"]
    assert json.loads((half_job / "metrics.json").read_text())["metrics"]["done"] == 1
    assert not list(out.rglob("*.partial"))     # what the killed runner left is gone


@pytest.mark.slow   # papermill end to end
def test_a_string_parameter_holding_code_runs_as_a_string(fixture_notebooks, tmp_path):
    # papermill writes parameters as Python literals: source code in a value stays text
    canary = tmp_path / "PWNED"
    payload = f'x"\nopen({str(canary)!r}, "w")  # \'\'\' """ \\'
    info = discover(fixture_notebooks)[7]
    assert info.slug == "08-echo"
    jobs = batch.plan([info], tmp_path / "out", raw_params={"text": [payload]})
    (r,) = batch.run_batch(jobs, n_jobs=1, timeout=300, show_progress=False)
    assert r.status == "ok", r.error
    m = json.loads((Path(r.job.out) / "metrics.json").read_text())
    assert m["metrics"] == {"text": payload, "text_type": "str"}
    assert not canary.exists()


def test_a_path_like_notebook_name_is_refused(tmp_path, capsys):
    for name in ("../x", "../../etc/passwd", "notebooks/../12-nfi"):
        assert cli.main(["run", name, "--out", str(tmp_path / "never")]) == 2
        assert f"no notebook named {name!r}" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


@pytest.mark.slow   # papermill end to end
def test_a_half_written_metrics_json_is_not_trusted(fixture_notebooks, tmp_path, monkeypatch):
    # papermill stand-in: the kernel "dies" after writing half of metrics.json
    script = ("import pathlib, sys\n"
              "pathlib.Path(sys.argv[1], 'metrics.json').write_text('{\"claims\": [')\n"
              "print('DeadKernelError: Kernel died'); sys.exit(1)\n")
    job, r = _run_with_stand_in(script, fixture_notebooks, tmp_path, monkeypatch)
    assert r.status == "died"
    assert not (Path(job.out) / "metrics.json").exists()      # removed, not committed
    assert json.loads((Path(job.out) / "job.json").read_text())["status"] == "died"
    assert batch.cached_result(job) is None                    # and a resume runs it again


# -- batches that cannot hurt each other --------------------------------------------------------
def _fixture_helpers():
    """tests/conftest.py's notebook makers, loaded by path: the module name ``conftest`` may
    be the root conftest.py when the whole suite runs."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_batch_fixture_helpers",
                                                  Path(__file__).with_name("conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_helpers = _fixture_helpers()
OK_BODY, make_notebook = _helpers.OK_BODY, _helpers.make_notebook

LIMITS_PARAMS = ('n: int = 3  # how many [1..5]\n'
                 'lr: float = None  # learning rate (None: the default) (0..]\n'
                 'p: float = 0.5  # a probability [0..1]\n'
                 'mode: str = "a"  # the mode {a|b}\n')


def _cli(tmp_path, *args):
    return [sys.executable, "-m", "workbench.cli", *args]


@pytest.mark.slow   # two real runners
def test_two_runs_on_one_out_folder_cannot_hurt_each_other(fixture_notebooks, tmp_path):
    # item 1: the second run is refused (exit 2, naming the owner); the first keeps every job
    out = tmp_path / "out"
    nb = make_notebook(fixture_notebooks / "09-waits.ipynb", "import time\ntime.sleep(4)\n"
                       + OK_BODY, "x: int = 1  # a number\n")
    first = subprocess.Popen(_cli(tmp_path, "run", str(nb), "--seeds", "0,1", "--jobs", "1",
                                  "--out", str(out), "--timeout", "300"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not (out / "plan.json").exists() and time.time() < deadline:
        assert first.poll() is None, first.stdout.read()
        time.sleep(0.2)
    second = subprocess.run(_cli(tmp_path, "run", str(nb), "--seeds", "0,1", "--jobs", "1",
                                 "--out", str(out)),
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 2, second.stdout + second.stderr
    assert "in use by another workbench run" in second.stderr
    assert f"pid {first.pid}" in second.stderr and "Traceback" not in second.stderr
    text = first.communicate(timeout=300)[0]
    assert first.returncode == 0, text
    res = pd.read_csv(out / "results.csv")
    assert sorted(res["status"]) == ["ok", "ok"]
    # once the first run is over the folder is free again (the lock died with its owner)
    lock = batch.claim_run_dir(out)
    lock.close()


def test_default_run_folders_never_collide(tmp_path, monkeypatch):
    # item 1: runs/<timestamp> had one-second resolution; two runs in one second shared it
    monkeypatch.setattr(batch.time, "strftime", lambda fmt, *a: "20261205-120000")
    a, lock_a = batch.new_run_dir(tmp_path)
    b, lock_b = batch.new_run_dir(tmp_path)
    assert a != b and a.is_dir() and b.is_dir()
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["20261205-120000",
                                                          "20261205-120000-2"]
    with pytest.raises(batch.RunDirError, match="in use"):
        batch.claim_run_dir(a)              # same process, second open file: still refused
    lock_a.close(), lock_b.close()


def test_a_value_with_commas_is_one_value_in_brackets_or_quotes(fixture_notebooks, tmp_path):
    # item 2: a comma always made a grid; brackets or quotes now make one value
    echo = [i for i in discover(fixture_notebooks) if i.slug == "08-echo"]
    one = lambda v: [j.params["text"] for j in batch.plan(   # noqa: E731
        echo, tmp_path, raw_params={"text": batch.split_values(v)})]
    assert one("lm-base,lm-gpt2") == ["lm-base", "lm-gpt2"]          # a grid, as before
    assert one("[lm-base,lm-gpt2]") == ["lm-base,lm-gpt2"]           # one str, comma-joined
    assert one('"a,b"') == ["a,b"]
    assert one('[a,b],"c,d",e') == ["a,b", "c,d", "e"]               # a grid of three values
    assert batch._coerce("[1, 2]", "None") == [1, 2]                 # untyped: a YAML list
    with pytest.raises(batch.ParameterError, match="unclosed"):
        batch.split_values("[a,b")
    helptext = cli.parser()._subparsers._group_actions[0].choices["run"].format_help()
    assert "Commas make a grid" in helptext and "'[lm-base,lm-gpt2]'" in helptext


def test_duplicates_are_merged_and_distinct_parameter_sets_never_share_a_folder(
        fixture_notebooks, tmp_path):
    # item 3: --seeds 0,0, a notebook named three times, and cuda:0 vs cuda_0
    infos = discover(fixture_notebooks)
    ok, echo = infos[0], infos[7]
    notes = []
    jobs = batch.plan([ok, ok, ok], tmp_path, seeds=batch.parse_seeds("0,0"), notes=notes)
    assert len(jobs) == 1 and len(notes) == 2
    jobs = batch.plan([ok], tmp_path, raw_params={"x": ["1", "1", "2"]})
    assert [j.params["x"] for j in jobs] == [1, 2]
    jobs = batch.plan([echo], tmp_path, raw_params={"text": ["cuda:0", "cuda_0", "a/b", "a_b"]})
    assert len({j.out for j in jobs}) == 4
    assert all(Path(j.out).parent.parent == tmp_path.resolve() / "08-echo" for j in jobs)
    # the folder of a point whose text survives as a file name is unchanged (resume works)
    assert Path(jobs[1].out).parent.name == "smoke-text=cuda_0"
    # the same point gets the same folder in every plan
    again = batch.plan([echo], tmp_path, raw_params={"text": ["cuda:0"]})
    assert again[0].out == jobs[0].out


def test_a_broken_notebook_is_named_and_skipped(fixture_notebooks, monkeypatch, capsys):
    # item 4: a truncated .ipynb made `workbench list` print a traceback
    broken = fixture_notebooks / "09-broken.ipynb"
    broken.write_text((fixture_notebooks / "01-ok.ipynb").read_text()[:200])
    monkeypatch.setenv("WORKBENCH_HOME", str(fixture_notebooks.parent))
    assert cli.main(["list"]) == 0
    cap = capsys.readouterr()
    assert "09-broken.ipynb" in cap.err and "01-ok" in cap.out and "Traceback" not in cap.err
    assert cli.main(["run", "01-ok", "--dry-run"]) == 0
    capsys.readouterr()
    assert cli.main(["run", "09-broken", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "09-broken.ipynb" in err and "not a readable notebook" in err
    assert cli.main(["run", str(broken), "--dry-run"]) == 2
    assert "09-broken.ipynb" in capsys.readouterr().err


def test_an_unusable_out_is_refused_in_one_line_with_exit_2(fixture_notebooks, tmp_path,
                                                             capsys):
    # item 5: an existing file, a folder under a file, /proc -> a one-line reason, exit 2
    afile = tmp_path / "afile"
    afile.write_text("x")
    nb = str(fixture_notebooks / "01-ok.ipynb")
    for out, why in ((afile, "is a file"), (afile / "sub", "cannot create"),
                     (Path("/proc/out"), "cannot create")):
        assert cli.main(["run", nb, "--out", str(out)]) == 2, out
        err = capsys.readouterr().err
        assert err.startswith("error: ") and why in err and len(err.strip().splitlines()) == 1
    assert afile.read_text() == "x"


def test_declared_limits_are_checked_before_any_job_starts(fixture_notebooks, tmp_path):
    # item 6: a value outside the limit written at the end of the help comment is refused
    from workbench.notebooks import parameters, parse_limit
    nb = make_notebook(fixture_notebooks / "09-limits.ipynb", OK_BODY.replace("x=x", "x=n")
                       .replace("x + seed", "n").replace("x > 0", "n > 0").replace("x=x", "x=n"),
                       LIMITS_PARAMS)
    spec = parameters(nb)
    assert spec["n"]["limit"].text == "[1..5]" and spec["mode"]["limit"].choices == ("a", "b")
    assert spec["lr"]["limit"].low_open and spec["lr"]["help"].startswith("learning rate")
    (info,) = [i for i in discover(fixture_notebooks) if i.slug == "09-limits"]
    for name, value, limit in (("n", "9", "[1..5]"), ("n", "0", "[1..5]"), ("lr", "0", "(0..]"),
                               ("p", "1.5", "[0..1]"), ("mode", "c", "{a|b}")):
        with pytest.raises(batch.ParameterError) as err:
            batch.plan([info], tmp_path / "never", raw_params={name: [value]})
        msg = str(err.value)
        assert "09-limits" in msg and f"'{name}'" in msg and value in msg and limit in msg
    ok = batch.plan([info], tmp_path, raw_params={"n": ["1", "5"], "lr": ["none", "1e-3"],
                                                  "p": ["0", "1"], "mode": ["b"]})
    assert len(ok) == 8
    assert parse_limit("steps (None: the scale's size)") is None
    assert parse_limit("see (1..n)") is None
    assert parse_limit("x (0..1]").allows(1) and not parse_limit("x (0..1]").allows(0)
    device = parse_limit("auto, cpu or cuda {auto|cpu|cuda}")
    assert device.allows("cuda:1") and not device.allows("cuda:x") and not device.allows("gpu")
    assert not (tmp_path / "never").exists()


def test_notebook_limits_refuse_before_a_kernel_starts(tmp_path, capsys):
    # item 6 on the real notebooks: 17 -p pattern_length 9 failed at cell 4, 12 -p steps -5
    # deep in the notebook; both are refused by the runner now, as are negative seeds
    out = tmp_path / "never"
    for argv, words in ((["17-rnn-abstraction", "-p", "pattern_length", "9"],
                         ["pattern_length", "9", "[2..6]"]),
                        (["12-nfi", "-p", "steps", "-5"], ["steps", "-5", "[1..]"]),
                        (["12-nfi", "-p", "lr", "0"], ["lr", "(0..]"]),
                        (["12-nfi", "--seeds", "-1"], ["--seeds", "-1", "[0..]"])):
        assert cli.main(["run", *argv, "--out", str(out)]) == 2, argv
        err = capsys.readouterr().err
        assert all(w in err for w in words) and argv[0] in err, err
    assert not out.exists()


@pytest.mark.parametrize("argv,option", [(["--jobs", "0"], "--jobs"), (["--jobs", "-3"], "--jobs"),
                                         (["--timeout", "-5"], "--timeout"),
                                         (["--timeout", "0"], "--timeout"),
                                         (["--timeout", "nan"], "--timeout"),
                                         (["--retries", "-1"], "--retries")])
def test_nonsense_runner_options_are_refused(fixture_notebooks, tmp_path, capsys, argv, option):
    # item 7
    with pytest.raises(SystemExit) as e:
        cli.main(["run", str(fixture_notebooks / "01-ok.ipynb"), "--out", str(tmp_path / "o"),
                  *argv])
    assert e.value.code == 2
    assert option in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_seeds_that_are_not_numbers_name_the_option(fixture_notebooks, tmp_path, capsys):
    # item 10
    assert cli.main(["run", str(fixture_notebooks / "01-ok.ipynb"), "--seeds", "x",
                     "--out", str(tmp_path / "o")]) == 2
    assert "--seeds: 'x' is not an integer" in capsys.readouterr().err
    assert cli.main(["run", str(fixture_notebooks / "01-ok.ipynb"), "--resume"]) == 2
    assert "--resume needs --out" in capsys.readouterr().err


def test_a_long_value_gets_a_short_stable_folder(fixture_notebooks, tmp_path):
    # item 8: a 300-character value gave "File name too long" and the job vanished
    echo = [i for i in discover(fixture_notebooks) if i.slug == "08-echo"]
    long = "v" * 300
    (job,) = batch.plan(echo, tmp_path, raw_params={"text": [long]})
    name = Path(job.out).parent.name
    assert len(name) <= batch.MAX_TAG + 6 and name.startswith("smoke-text=vvv")
    assert batch.plan(echo, tmp_path, raw_params={"text": [long]})[0].out == job.out
    (other,) = batch.plan(echo, tmp_path, raw_params={"text": [long + "w"]})
    assert other.out != job.out
    Path(job.out).mkdir(parents=True)       # the file system takes it


def test_every_planned_job_is_in_the_report(fixture_notebooks, tmp_path):
    # item 8: jobs that never ran (interrupted, runner killed) are listed, not dropped
    infos = discover(fixture_notebooks)[:1]
    jobs = batch.plan(infos, tmp_path, seeds=[0, 1, 2])
    batch.write_plan(tmp_path, jobs, infos, "workbench run 01-ok --seeds 0,1,2")
    stage = batch.staging_dir(jobs[0])
    stage.mkdir(parents=True)
    (stage / "metrics.json").write_text(json.dumps({"notebook": "01-ok", "claims": []}))
    batch.commit(batch.JobResult(jobs[0], "ok", 1.0), stage)
    report.build(tmp_path, html=False)
    res = pd.read_csv(tmp_path / "results.csv")
    assert sorted(zip(res["seed"], res["status"])) == [(0, "ok"), (1, "interrupted"),
                                                       (2, "interrupted")]
    assert "--resume" in res.set_index("seed").loc[1, "error"]


@pytest.mark.slow   # papermill end to end
def test_after_a_timeout_no_kernel_outlives_the_runner(fixture_notebooks, tmp_path):
    # item 9: the kernel outlived its runner by 1-3 s and wrote into the staging folder after
    # the commit; the executed notebook's out_dir named the staging folder
    pidfile = tmp_path / "kernel.pid"
    make_notebook(fixture_notebooks / "09-sleeps.ipynb",
                  "import os, pathlib, time\npathlib.Path(pidfile).write_text(str(os.getpid()))\n"
                  "print('writing to', out_dir)\ntime.sleep(120)",
                  'pidfile: str = ""  # where the kernel writes its pid\n')
    infos = {i.slug: i for i in discover(fixture_notebooks)}
    jobs = batch.plan([infos["09-sleeps"]], tmp_path / "out",
                      raw_params={"pidfile": [str(pidfile)]})
    jobs += batch.plan([infos["01-ok"]], tmp_path / "out")
    results = batch.run_batch(jobs, n_jobs=2, timeout=60, show_progress=False)
    assert [r.status for r in results] == ["timeout", "ok"], [r.error for r in results]
    kernel = int(pidfile.read_text())
    assert not Path(f"/proc/{kernel}").exists() or \
        Path(f"/proc/{kernel}/stat").read_text().split(")")[1].split()[0] == "Z"
    time.sleep(3)
    assert not list((tmp_path / "out").rglob("*.partial*"))
    assert "cell 3: import os, pathlib, time ... (running)" == results[0].error_cell
    for r in results:
        final = Path(r.job.out)
        nb_text = (final / f"{r.job.slug}.ipynb").read_text()
        assert ".partial" not in nb_text and ".partial" not in (final / "log.txt").read_text()
        injected = next(c for c in json.loads(nb_text)["cells"]
                        if "injected-parameters" in c["metadata"].get("tags", []))
        assert f'out_dir = "{final}"' in "".join(injected["source"])
    # what the notebooks printed names the final folder too (the log, the executed notebook)
    assert f"writing to {results[0].job.out}" in (Path(results[0].job.out) / "log.txt").read_text()
    assert f"out={results[1].job.out}" in (Path(results[1].job.out) / "01-ok.ipynb").read_text()


@pytest.mark.slow   # papermill end to end
def test_a_dead_kernel_names_the_cell_it_was_running(fixture_notebooks, tmp_path):
    # item 10: a job whose kernel died did not say which cell was running
    (job,) = batch.plan([i for i in discover(fixture_notebooks) if i.slug == "04-dies"], tmp_path)
    (r,) = batch.run_batch([job], n_jobs=1, timeout=120, show_progress=False)
    assert r.status == "died" and r.error_cell == "cell 3: import os, signal ... (running)"
    assert "cell 3: import os, signal" in batch.summary_table([r])


@pytest.mark.slow   # a Dask cluster and a real runner
def test_dask_stops_on_ctrl_c_when_sigint_was_inherited_ignored(fixture_notebooks, tmp_path):
    # item 10: started with SIGINT ignored (`cmd &` in a script), the Dask executor went on
    pytest.importorskip("distributed")
    pidfile = tmp_path / "kernel.pid"
    proc = subprocess.Popen(
        _cli(tmp_path, "run", str(fixture_notebooks / "07-half.ipynb"), "--executor", "dask",
             "--jobs", "1", "--out", str(tmp_path / "out"), "--timeout", "300"),
        env=dict(os.environ, WB_TEST_HANG=str(pidfile)), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.time() + 180
    while not pidfile.exists() and time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    try:
        text = proc.communicate(timeout=90)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the runner ignored Ctrl-C")
    assert proc.returncode == 130, text


def test_dashboard_is_named_only_when_it_is_served(monkeypatch):
    # item 10: without bokeh nothing listens on the dashboard address
    import importlib.util

    class Client:
        dashboard_link = "http://127.0.0.1:8787/status"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bokeh" else real(name, *a))
    assert cli._dashboard_link(Client()) is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert cli._dashboard_link(Client()) == Client.dashboard_link


def test_progress_names_the_running_cell_and_the_live_log(fixture_notebooks, tmp_path):
    # a long --jobs 1 run showed 0/1 for its whole length
    (job,) = batch.plan(discover(fixture_notebooks)[:1], tmp_path)
    stage = batch.staging_dir(job)
    stage.mkdir(parents=True)
    (stage / "log.txt").write_text("Executing notebook\nExecuting Cell 2----\nExecuting Cell 3---\n")
    said = []
    with batch._running_lock:
        batch._running[1] = (job, stage, time.time())
    try:
        assert batch.running_progress(set(), said.append) == "01-ok seed 0: cell 3/4"
    finally:
        batch._running.pop(1)
    assert said == [f"started 01-ok smoke seed 0; live log: {stage / 'log.txt'}"]


def test_run_help_and_dry_run(fixture_notebooks, tmp_path, capsys):
    helptext = cli.parser()._subparsers._group_actions[0].choices["run"].format_help()
    for words in ("examples:", "--dry-run", "smoke (CPU", "live log", "Exit status"):
        assert words in helptext
    out = tmp_path / "o"
    assert cli.main(["run", str(fixture_notebooks / "01-ok.ipynb"), "-p", "x", "1,2",
                     "--seeds", "0,1", "--dry-run", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "4 job(s)" in text and "01-ok/smoke-x=2/seed-1" in text
    assert "timeout 900 s each" in text
    assert not out.exists()


def test_the_default_timeout_follows_the_scale(fixture_notebooks, tmp_path, capsys):
    """A mid job may take 15 minutes alone: smoke's 900 s default would stop it on a busy laptop."""
    nb = str(fixture_notebooks / "01-ok.ipynb")
    for scale, limit in (("mid", "1800"), ("full", "86400")):
        assert cli.main(["run", nb, "--scale", scale, "--dry-run",
                         "--out", str(tmp_path / scale)]) == 0
        assert f"timeout {limit} s each" in capsys.readouterr().out
    assert cli.main(["run", nb, "--scale", "mid", "--timeout", "60", "--dry-run",
                     "--out", str(tmp_path / "t")]) == 0
    assert "timeout 60 s each" in capsys.readouterr().out


def test_list_fits_100_columns_and_reads_a_chosen_run_folder(tmp_path, capsys):
    d = tmp_path / "myrun" / "12-nfi" / "smoke" / "seed-3"
    d.mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps({"scale": "smoke", "seed": 3, "claims": [
        {"id": "C1", "holds": True}, {"id": "C2", "holds": False}]}))
    assert cli.main(["list", "--runs", str(tmp_path / "myrun")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(ln) for ln in lines) <= 100
    (nfi,) = [ln for ln in lines if " 12-nfi " in ln]
    assert "1/2 hold, smoke s3" in nfi
    assert cli.main(["list", "--runs", str(tmp_path / "nothing")]) == 2


def test_the_owner_of_a_folder_removes_what_a_killed_runner_left(fixture_notebooks, tmp_path,
                                                                  monkeypatch):
    # item 9: a runner killed with SIGKILL cannot clean up; the next run on the folder does
    out = tmp_path / "out"
    for stale in (".seed-0.partial", ".seed-1.old-1234abcd"):
        (out / "01-ok" / "smoke" / stale / "figures").mkdir(parents=True)
    (out / "01-ok" / "smoke" / "seed-5").mkdir()            # a finished job: kept
    monkeypatch.setattr(batch, "run_batch", lambda jobs, **kw: [
        batch.JobResult(j, "ok", 0.0) for j in jobs])
    assert cli.main(["run", str(fixture_notebooks / "01-ok.ipynb"), "--out", str(out)]) == 0
    assert sorted(p.name for p in (out / "01-ok" / "smoke").iterdir()) == ["seed-5"]


def test_a_read_only_out_is_refused(fixture_notebooks, tmp_path, capsys):
    # item 5 on a real read-only mount (a bind mount remounted read-only; needs root)
    src, ro = tmp_path / "src", tmp_path / "ro"
    (src / "existing").mkdir(parents=True)
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount here (needs root)")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)],
                          capture_output=True).returncode:
            pytest.skip("cannot remount read-only here")
        nb = str(fixture_notebooks / "01-ok.ipynb")
        for out, why in ((ro / "new", "cannot create"), (ro / "existing", "cannot write in")):
            assert cli.main(["run", nb, "--out", str(out)]) == 2
            err = capsys.readouterr().err
            assert why in err and "Read-only file system" in err and len(err.splitlines()) == 1
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


def test_a_dry_run_checks_that_out_can_be_created(fixture_notebooks, tmp_path, capsys):
    # the dry run said it would write into /proc/nope; the real run then refused the folder
    nb = str(fixture_notebooks / "01-ok.ipynb")
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, why in ((Path("/proc/nope"), "cannot create"), (afile, "is a file"),
                     (afile / "sub", "cannot create")):
        assert cli.main(["run", nb, "--dry-run", "--out", str(out)]) == 2, out
        err = capsys.readouterr().err
        assert err.startswith("error: ") and why in err and str(out) in err, err
        assert len(err.strip().splitlines()) == 1
    with pytest.raises(batch.RunDirError, match="give --out a folder you can write"):
        batch.check_run_dir(Path("/proc/nope"))
    fine = tmp_path / "new" / "run"
    assert cli.main(["run", nb, "--dry-run", "--out", str(fine)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "notebooks"]   # no trace


def test_a_dry_run_names_the_run_that_owns_out(fixture_notebooks, tmp_path, capsys):
    out = tmp_path / "busy"
    lock = batch.claim_run_dir(out, "workbench run 01-ok")
    try:
        assert cli.main(["run", str(fixture_notebooks / "01-ok.ipynb"), "--dry-run",
                         "--out", str(out)]) == 2
        assert "in use by another workbench run" in capsys.readouterr().err
    finally:
        lock.close()
    assert cli.main(["run", str(fixture_notebooks / "01-ok.ipynb"), "--dry-run",
                     "--out", str(out)]) == 0


def test_run_writes_its_report_and_records_nothing(fixture_notebooks, tmp_path, monkeypatch):
    # the recorded results are tracked files: a plain run never rewrites them (`workbench
    # record` does, on purpose); the run's own report is written into --out
    home = fixture_notebooks.parent
    monkeypatch.setenv("WORKBENCH_HOME", str(home))

    def three_ok(jobs, **kw):
        for j in jobs:
            d = Path(j.out)
            d.mkdir(parents=True)
            (d / "metrics.json").write_text(json.dumps({
                "notebook": j.slug, "scale": j.scale, "seed": j.seed, "metrics": {"x": 1},
                "claims": [{"id": "C1", "text": "x", "holds": True, "robust": True}]}))
            (d / "job.json").write_text(json.dumps({"status": "ok"}))
        return [batch.JobResult(j, "ok", 0.0) for j in jobs]

    monkeypatch.setattr(batch, "run_batch", three_ok)
    out = tmp_path / "run"
    assert cli.main(["run", "01-ok", "--seeds", "0,1,2", "--out", str(out)]) == 0
    assert (out / "aggregate.csv").exists() and (out / "index.html").exists()
    assert not (home / "notebooks" / "results").exists()


def test_one_git_info_one_reserved_set_one_limit_check(tmp_path, monkeypatch):
    # the runner's plan.json and the kernel's env.json disagreed on "dirty" (one counted
    # untracked files); the reserved names and the limit check each had two homes
    from workbench import env, notebooks, runtime
    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a],
                                    cwd=repo, check=True, capture_output=True)
    git("init", "-q")
    (repo / "a.txt").write_text("a")
    git("add", "a.txt")
    git("commit", "-q", "-m", "a")
    (repo / "scratch.txt").write_text("untracked")
    info = env.git_info(repo)
    assert len(info["commit"]) == 40 and info["dirty"] is False       # untracked: not dirty
    (repo / "a.txt").write_text("b")
    assert env.git_info(repo)["dirty"] is True
    assert env.git_info(tmp_path) == {"commit": None, "dirty": None}   # not a repository
    monkeypatch.setenv("WORKBENCH_HOME", str(repo))
    assert runtime.environment_info()["git"] == env.git_info(repo) == batch.git_info()
    assert runtime.RESERVED is notebooks.RESERVED is batch.RESERVED
    assert list(notebooks.RESERVED) == ["scale", "seed", "device", "out_dir"]
    monkeypatch.delenv("WORKBENCH_HOME")
    with pytest.raises(batch.ParameterError) as kernel:
        runtime.check_limits({"steps": -5}, "12-nfi")
    with pytest.raises(batch.ParameterError) as runner:
        batch.plan([resolve("12-nfi")], tmp_path / "never", raw_params={"steps": ["-5"]})
    assert str(kernel.value) == str(runner.value)
    assert "'steps' = -5 is outside its limit [1..]" in str(kernel.value)
