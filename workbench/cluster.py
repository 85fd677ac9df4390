"""Batch jobs as tasks on a Dask cluster (``workbench run --executor dask``).

A job is the same as with the process executor (one notebook x one parameter set, run by
:func:`workbench.batch.execute`), wrapped in one Dask task. The task gets the notebook as bytes and
runs it in a temporary directory of its worker; it returns every file the job wrote, as bytes,
and the runner commits them into ``--out`` as the process executor does. So nothing assumes the
worker shares the runner's file system, and the report is the same for both executors. The
worker needs the same environment (the workbench package, papermill, a ``python3`` kernel).

When a worker dies mid-job (killed, lost its node), the scheduler runs the task again on another
worker, up to ``allowed-failures`` times (``--retries`` for the local cluster; on an existing
cluster its own ``distributed.scheduler.allowed-failures``). The runner asks the scheduler how
often that happened and reports it. A notebook that fails on its own is a normal result of the
task, so Dask does not retry it.

``distributed`` is an optional dependency (``pip install 'workbench[dask]'``) imported only here.
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import uuid
from pathlib import Path

from . import batch
from .batch import Job, JobResult


#: Dask settings for workers whose tasks wait on a notebook's kernel (the local cluster's; on your
#: own cluster, set them in its configuration, see docs/batches.md). A worker samples its task
#: thread's stack every 10 ms for the dashboard's profile (here a thread blocked in ``wait``),
#: and every process of the cluster measures itself every 0.5 s and its event loop every 20 ms:
#: 7% of a core for a scheduler and two workers, which two kernels on two cores give up. With
#: these, 1%. None of it changes what a job computes.
QUIET_WORKERS = {
    "distributed.worker.profile.enabled": False,
    "distributed.admin.system-monitor.interval": "5s",
    "distributed.admin.tick.interval": "1s",
}


class SchedulerError(RuntimeError):
    """The Dask scheduler cannot be reached, or distributed is not installed."""


def _distributed():
    try:
        import distributed
    except ImportError:
        raise SchedulerError("--executor dask needs distributed: pip install 'workbench[dask]' "
                             "(or pip install distributed)") from None
    return distributed


def connect(scheduler: str | None = None, n_workers: int | None = None, retries: int = 1,
            timeout: float = 10):
    """A ``distributed.Client``: on the scheduler at ``scheduler`` or, without one, on a new
    ``LocalCluster`` of ``n_workers`` single-threaded worker processes. Raises
    :class:`SchedulerError` with what to do when the scheduler does not answer in ``timeout`` s.
    Close the client (and its local cluster) with :func:`close`."""
    distributed = _distributed()
    if scheduler:
        try:
            return distributed.Client(scheduler, timeout=f"{timeout}s")
        except (OSError, TimeoutError, ValueError) as e:
            raise SchedulerError(
                f"cannot reach the Dask scheduler at {scheduler!r} ({type(e).__name__}: {e}). "
                "Check the address (tcp://HOST:8786), start the cluster (`dask scheduler` and "
                "`dask worker ADDRESS`, or a dask-jobqueue / dask-kubernetes cluster), or leave "
                "out --scheduler to run on a local cluster.") from None
    import importlib.util

    import dask
    # Each task spends its time in a papermill child process, so one thread per worker process
    # and no memory limit (the worker's own memory is small; the kernel's is not the worker's).
    # worker-saturation 1.0: a worker holds only the job it runs, so a dying worker takes no
    # queued job with it and a free worker gets the next job. QUIET_WORKERS: the workers'
    # own housekeeping, which only takes CPU from the kernels beside it.
    with dask.config.set({"distributed.scheduler.worker-saturation": 1.0, **QUIET_WORKERS}):
        cluster = distributed.LocalCluster(
            n_workers=max(1, n_workers or os.cpu_count() or 1), threads_per_worker=1,
            processes=True, memory_limit=0, scheduler_kwargs={"allowed_failures": retries},
            dashboard_address=":0" if importlib.util.find_spec("bokeh") else None)
    return distributed.Client(cluster)


def close(client) -> None:
    cluster = getattr(client, "cluster", None)
    client.close()
    if cluster is not None:
        cluster.close()


def _threads_per_host(client) -> dict[str, int]:
    """host -> worker threads on it: the jobs that may run there side by side."""
    from distributed.comm.addressing import get_address_host
    out: dict[str, int] = {}
    for addr, w in client.scheduler_info(n_workers=-1)["workers"].items():
        out[get_address_host(addr)] = out.get(get_address_host(addr), 0) + w["nthreads"]
    return out


def remote_job(spec: dict, notebook: bytes, timeout: float, strict: bool) -> dict:
    """The Dask task: run one job in a temporary directory of this worker and return its result
    with ``files`` (relative path -> bytes). It is never given a path of the runner's machine.

    Its kernel gets the host's cores divided by the jobs that can run on the host at once (as
    the process executor does): two jobs of two BLAS threads each on two cores stall both."""
    try:
        from distributed import get_worker
        from distributed.comm.addressing import get_address_host
        worker = get_worker()
        base = worker.local_directory
        slots = spec.get("slots", {}).get(get_address_host(worker.address), worker.state.nthreads)
    except (ImportError, ValueError):
        base, slots = None, 1
    work = Path(tempfile.mkdtemp(prefix="workbench-job-", dir=base))
    try:
        nb = work / "input" / f"{spec['slug']}.ipynb"
        nb.parent.mkdir()
        nb.write_bytes(notebook)
        out = work / "out"
        out.mkdir()
        params = {**spec["params"], "scale": spec["scale"], "seed": spec["seed"],
                  "out_dir": str(out)}
        threads = max(1, (os.cpu_count() or 1) // max(1, slots))
        # The nanny sets its workers' environment (MALLOC_TRIM_THRESHOLD_=65536 to return memory
        # to the OS, PYTHONHASHSEED, one BLAS thread): tuning for the worker, not for the
        # notebook, whose kernel then sees the same environment as under the process executor.
        import dask
        drop = tuple(dask.config.get("distributed.nanny.pre-spawn-environ", {}) or ()) + \
            ("PYTHONHASHSEED",)
        r = batch.execute(nb, out, spec["slug"], params, timeout, strict, threads,
                          env_drop=drop)
        r["files"] = {p.relative_to(out).as_posix(): p.read_bytes()
                      for p in sorted(out.rglob("*")) if p.is_file()}
        r["worker_dir"] = str(out)
        return r
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _task_history(key, dask_scheduler=None) -> int:
    """On the scheduler: how many times a worker died while running this task."""
    ts = dask_scheduler.tasks.get(key)
    return ts.suspicious if ts is not None else 0


def _commit_remote(job: Job, r: dict, deaths: int) -> JobResult:
    """Write what the worker sent back into the job's staging directory, then commit it."""
    stage = batch.staging_dir(job)
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    for rel, data in r.get("files", {}).items():
        path = (stage / rel).resolve()
        if stage.resolve() not in path.parents:         # a worker writes only inside the job
            raise ValueError(f"a worker sent a file outside its job: {rel!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    notes = []
    if deaths:
        notes.append(f"retried on another worker after its worker died ({deaths}x)")
    if r.get("attempts", 1) > 1:
        notes.append("the kernel failed to start; retried")
    result = JobResult(job, r["status"], r.get("duration_s", 0.0), r.get("error", ""),
                       r.get("attempts", 1) + deaths, r.get("claims", []),
                       r.get("error_cell", ""), "; ".join(notes))
    return batch.commit(result, stage, wrote_to=r.get("worker_dir"))


def run_dask(jobs: list[Job], client=None, n_workers: int | None = None, timeout: float = 900,
             resume: bool = False, strict: bool = False, retries: int = 1,
             show_progress: bool = True) -> list[JobResult]:
    """Run ``jobs`` as Dask tasks (see the module docstring); same contract as
    :func:`workbench.batch.run_batch`. Without ``client``, on a new local cluster of
    ``n_workers`` workers. ``n_workers`` also bounds the jobs in flight (default: the cluster's
    threads; on an adaptive cluster give it, so the backlog is there for it to scale to)."""
    distributed = _distributed()
    from .progress import progress
    own = client is None
    if own:
        n_workers = min(n_workers or os.cpu_count() or 1, len(jobs) or 1)
        client = connect(None, n_workers=n_workers, retries=retries)
    # At most `window` jobs on the cluster at a time, so that each worker holds only the job it
    # runs: a job the scheduler pushed into a busy worker's queue would die with that worker
    # (and be reported as retried) without having started, and would wait there while another
    # worker is idle. The scheduler's own queuing does not cover small batches of distinct tasks.
    window = max(1, n_workers or sum(client.nthreads().values()) or 1)
    try:
        slots = _threads_per_host(client)
    except Exception:           # no scheduler info: each worker divides its host by its threads
        slots = {}
    results: dict[int, JobResult] = {}
    pending = {}
    blobs: dict[str, bytes] = {}
    bar = progress(total=len(jobs), desc="jobs", disable=not show_progress)

    def submit(i: int):
        job = jobs[i]
        if job.path not in blobs:
            blobs[job.path] = Path(job.path).read_bytes()
        spec = {"slug": job.slug, "scale": job.scale, "seed": job.seed, "params": job.params,
                "slots": slots}
        fut = client.submit(remote_job, spec, blobs[job.path], timeout, strict, pure=False,
                            key=f"workbench-{job.slug}-seed{job.seed}-{uuid.uuid4().hex[:8]}")
        pending[fut] = i
        return fut

    # Ctrl-C must stop the batch even when this process inherited SIGINT as ignored (started
    # with `&` from a script, or by nohup): Python then installs no handler of its own
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        todo = []
        for i, job in enumerate(jobs):
            if resume and (cached := batch.cached_result(job)) is not None:
                results[i] = cached
                bar.update(1)
            else:
                todo.append(i)
        todo.reverse()
        running = distributed.as_completed([submit(todo.pop()) for _ in range(min(window,
                                                                                  len(todo)))])
        for fut in running:
            if todo:
                running.add(submit(todo.pop()))
            i, job = pending[fut], jobs[pending[fut]]
            try:
                deaths = client.run_on_scheduler(_task_history, fut.key)
            except Exception:           # a scheduler that refuses run_on_scheduler: unknown
                deaths = 0
            try:
                r = fut.result()
            except distributed.KilledWorker as e:
                r = {"status": "worker-died", "error": f"its Dask worker died {deaths} time(s) "
                     f"and the scheduler gave up (allowed-failures): {e}"}
                deaths = max(0, deaths - 1)     # the last death was not followed by a retry
            except Exception as e:              # the task itself broke: not the notebook
                r = {"status": "failed", "error": f"runner error on the worker: {e!r}"}
            try:
                results[i] = _commit_remote(job, r, deaths)
            except Exception as e:
                results[i] = JobResult(job, "failed", 0.0, f"runner error: {e!r}")
            fut.release()
            bar.set_postfix_str(f"{job.slug} seed {job.seed}: {results[i].status}",
                                refresh=False)
            bar.update(1)
    except KeyboardInterrupt:
        client.cancel([f for f, i in pending.items() if i not in results])
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        bar.close()
        if own:
            close(client)       # stops the workers, whose papermill children die with them
    return [results.get(i) or JobResult(job, "interrupted", 0.0, batch.STATUSES["interrupted"])
            for i, job in enumerate(jobs)]
