"""The Dask executor on a small LocalCluster (two single-threaded worker processes), on fixture
notebooks: outputs shipped back as bytes, a killed worker's job retried and reported, a failing
notebook not retried, --resume by content and parameters, a bad scheduler address refused."""
import dataclasses
import json
import os
import re
import time
from pathlib import Path

import dask
import nbformat
import pandas as pd
import pytest
from distributed import Client, LocalCluster

from workbench import batch, cli, cluster
from workbench.notebooks import discover

pytestmark = pytest.mark.slow   # a LocalCluster and papermill jobs


@pytest.fixture(scope="module")
def client():
    # Like the executor's own local cluster, with one retry after a worker dies.
    with dask.config.set({"distributed.scheduler.worker-saturation": 1.0}), LocalCluster(n_workers=2, threads_per_worker=1, processes=True, memory_limit=0,
                      dashboard_address=None, scheduler_kwargs={"allowed_failures": 1}) as lc, \
            Client(lc) as c:
        yield c


def _infos(d):
    return {i.slug: i for i in discover(d)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_outputs_come_back_from_a_worker_that_writes_elsewhere(fixture_notebooks, tmp_path,
                                                              client):
    infos = _infos(fixture_notebooks)
    out = tmp_path / "out"
    jobs = batch.plan([infos["05-figure"], infos["01-ok"]], out)
    results = cluster.run_dask(jobs, client=client, timeout=300,
                              show_progress=False)
    assert [r.status for r in results] == ["ok", "ok"], [r.error for r in results]
    fig = Path(results[0].job.out)
    for name in ("05-figure.ipynb", "metrics.json", "params.json", "log.txt", "job.json",
                 "figures/line.png"):
        assert (fig / name).is_file(), name
    assert (fig / "figures/line.png").read_bytes()[:4] == b"\x89PNG"
    m = json.loads((fig / "metrics.json").read_text())
    assert m["figures"] == ["line.png"] and m["metrics"]["y"] == 1.0
    assert m["params"]["out_dir"] == str(fig)          # rewritten to where the files are now
    # the notebook ran in the worker's own directory, never in --out; its injected out_dir is
    # rewritten to the job's folder, so re-running it in Jupyter writes there
    nb = nbformat.read(fig / "05-figure.ipynb", as_version=4)
    injected = next(c.source for c in nb.cells if "injected-parameters" in c.metadata.get("tags", []))
    assert injected.split('out_dir = "')[1].split('"')[0] == str(fig)
    for name in ("05-figure.ipynb", "log.txt"):     # (papermill's input_path stays as it was)
        assert not re.search(r"workbench-job-[^/\"]*/out", (fig / name).read_text())
    assert not list(out.rglob(".*partial*"))


def test_failures_kinds_retry_after_worker_death_and_exit_status(fixture_notebooks, tmp_path,
                                                                 client, capsys):
    infos = _infos(fixture_notebooks)
    out = tmp_path / "out"
    marker = tmp_path / "first-attempt"
    jobs = batch.plan([infos["06-kills-worker"]], out, raw_params={"marker": [str(marker)]})
    jobs += batch.plan([infos[s] for s in ("01-ok", "02-raises", "04-dies")], out)
    results = cluster.run_dask(jobs, client=client, timeout=300,
                              show_progress=False)
    by = {r.job.slug: r for r in results}
    assert {s: r.status for s, r in by.items()} == {
        "06-kills-worker": "ok", "01-ok": "ok", "02-raises": "failed", "04-dies": "died"}
    # the killed worker's job ran again on another worker, and says so
    killed = by["06-kills-worker"]
    assert killed.attempts == 2 and "worker died (1x)" in killed.note
    first_kernel = int(marker.read_text())
    deadline = time.time() + 15                 # its kernel does not outlive its worker
    while _alive(first_kernel) and time.time() < deadline:
        time.sleep(0.5)
    assert not _alive(first_kernel)
    # a notebook that fails on its own is not retried, and its error cell is reported
    raised = by["02-raises"]
    assert raised.attempts == 1 and not raised.note
    assert raised.error == "RuntimeError: boom from the notebook"
    assert raised.error_cell == 'cell 3: raise RuntimeError("boom from the notebook")'
    assert by["04-dies"].attempts == 1
    assert "retried on another worker" in batch.summary_table(results)
    # a job past its timeout, on the same cluster
    (slow,) = cluster.run_dask(batch.plan([infos["03-slow"]], out), client=client, timeout=8,
                               show_progress=False)
    assert slow.status == "timeout"
    # the CLI on an existing scheduler: exit status 1, the report has every kind
    rc = cli.main(["run", str(infos["01-ok"].path), str(infos["02-raises"].path),
                   "--scheduler", client.scheduler.address, "--out", str(out),
                   "--timeout", "300", "--resume"])
    assert rc == 1
    summary = capsys.readouterr().out
    assert "cached" in next(ln for ln in summary.splitlines() if ln.startswith("01-ok"))
    res = pd.read_csv(out / "results.csv").set_index("notebook")
    assert res.loc["02-raises", "status"] == "failed" and res.loc["06-kills-worker", "attempts"] == 2
    assert set(res["status"]) == {"ok", "failed", "died", "timeout"}
    page = (out / "index.html").read_text()
    assert 'cell 3: raise RuntimeError(&#34;boom from the notebook&#34;)' in page
    assert "retried on another worker after its worker died (1x)" in page


def test_resume_skips_complete_jobs_and_reruns_changed_ones(fixture_notebooks, tmp_path, client):
    info = _infos(fixture_notebooks)["01-ok"]
    out = tmp_path / "out"
    jobs = batch.plan([info], out, seeds=[0, 1])
    run = lambda js: cluster.run_dask(js, client=client, timeout=300,
                                     resume=True, show_progress=False)
    assert [r.status for r in run(jobs)] == ["ok", "ok"]
    stamp = [(Path(j.out) / "job.json").stat().st_mtime_ns for j in jobs]
    assert [r.status for r in run(batch.plan([info], out, seeds=[0, 1]))] == ["cached", "cached"]
    assert [(Path(j.out) / "job.json").stat().st_mtime_ns for j in jobs] == stamp

    # the same directory asked for with other parameters: run again, with the new ones
    changed = dataclasses.replace(jobs[0], params={"x": 5})
    changed.digest = batch.job_digest(batch.notebook_digest(info.path), changed)
    (r,) = run([changed])
    assert r.status == "ok"
    assert json.loads((Path(changed.out) / "metrics.json").read_text())["metrics"]["x"] == 5

    # editing the notebook's code re-runs every job of it, even with the same parameters
    nb = nbformat.read(info.path, as_version=4)
    nb.cells[2].source = nb.cells[2].source.replace("x_plus_seed=x + seed", "x_plus_seed=x + seed + 10")
    nbformat.write(nb, info.path)
    again = run(batch.plan([info], out, seeds=[0, 1]))
    assert [r.status for r in again] == ["ok", "ok"]
    m = json.loads((Path(again[1].job.out) / "metrics.json").read_text())
    assert m["metrics"]["x_plus_seed"] == 1 + 1 + 10
    # ...while cleaning outputs or metadata does not
    nb = nbformat.read(info.path, as_version=4)
    nb.metadata["something"] = "else"
    nbformat.write(nb, info.path)
    assert [r.status for r in run(batch.plan([info], out, seeds=[0, 1]))] == ["cached", "cached"]


def test_unreachable_scheduler_is_refused_before_anything_runs(fixture_notebooks, tmp_path,
                                                              capsys):
    out = tmp_path / "never"
    nb = str(fixture_notebooks / "01-ok.ipynb")
    rc = cli.main(["run", nb, "--scheduler", "tcp://127.0.0.1:9", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot reach the Dask scheduler at 'tcp://127.0.0.1:9'" in err
    assert "leave out --scheduler" in err and not out.exists()


def test_a_local_cluster_by_default(fixture_notebooks, tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli.main(["run", str(fixture_notebooks / "01-ok.ipynb"), "--executor", "dask",
                   "--jobs", "1", "--out", str(out), "--timeout", "300"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "a local cluster of 1 worker(s)" in text
    assert json.loads(next(out.rglob("job.json")).read_text())["status"] == "ok"


# What a kernel sees of the thread settings: the variables, torch's and the BLAS pools'
# thread counts, the CPUs it may run on.
THREADS_BODY = '''import os
env = {v: os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                      "MALLOC_TRIM_THRESHOLD_", "PYTHONHASHSEED")}
import threadpoolctl
import torch
import workbench
run = workbench.start("09-threads", scale=scale, seed=seed, device="cpu", out_dir=out_dir)
run.record(env=env, torch_threads=torch.get_num_threads(), cpus=len(os.sched_getaffinity(0)),
           pools=sorted((p["internal_api"], p["num_threads"]) for p in threadpoolctl.threadpool_info()))
run.finish()
'''


def test_a_dask_jobs_kernel_sees_the_thread_settings_of_a_process_jobs(tmp_path, client,
                                                                      monkeypatch):
    """Two jobs at a time either way: two single-threaded workers, or two processes. The nanny's
    worker tuning (one BLAS thread, MALLOC_TRIM_THRESHOLD_, PYTHONHASHSEED) is not the kernel's."""
    from conftest import make_notebook
    # The fixture's nannies live in this process and wrote their tuning into its environment
    # (distributed's Nanny does os.environ.update); a runner of the process executor has none.
    for var in dask.config.get("distributed.nanny.pre-spawn-environ"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    (tmp_path / "nb").mkdir()
    make_notebook(tmp_path / "nb" / "09-threads.ipynb", THREADS_BODY)
    (info,) = discover(tmp_path / "nb")
    by_process = batch.run_batch(batch.plan([info], tmp_path / "p", seeds=[0, 1]), n_jobs=2,
                                 timeout=300, show_progress=False)
    by_dask = cluster.run_dask(batch.plan([info], tmp_path / "d", seeds=[0, 1]), client=client,
                               timeout=300, show_progress=False)
    seen = [[json.loads((Path(r.job.out) / "metrics.json").read_text())["metrics"] for r in rs]
            for rs in (by_process, by_dask)]
    assert seen[0] == seen[1]
    threads = max(1, (os.cpu_count() or 1) // 2)
    assert seen[1][0]["torch_threads"] == threads
    assert seen[1][0]["env"] == {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                                 "OPENBLAS_NUM_THREADS": str(threads),
                                 "MALLOC_TRIM_THRESHOLD_": None, "PYTHONHASHSEED": None}


def test_the_local_cluster_keeps_its_housekeeping_quiet():
    """The executor's own cluster runs with QUIET_WORKERS: no 10 ms stack sampling of the task
    thread, the system monitor every 5 s (CPU the kernels beside it would give up)."""
    client = cluster.connect(None, n_workers=1)
    try:
        got = client.run(lambda dask_worker: ("profile" in dask_worker.periodic_callbacks,
                                               dask_worker.periodic_callbacks["monitor"].callback_time))
        assert list(got.values()) == [(False, 5000)]
    finally:
        cluster.close(client)
