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
