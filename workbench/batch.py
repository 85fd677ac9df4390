"""Batch execution of notebooks through papermill: parameter grids, seeds, parallel jobs, resume.

Each job is one notebook with one set of parameters and one seed. It ends up in its own directory
``OUT/<slug>/<scale>[-<grid point>]/seed-<n>/`` holding the executed notebook, the papermill log,
the notebook's ``metrics.json`` and ``figures/``, and ``job.json`` (status, duration, error, and the
``digest`` of the notebook's content and parameters that ``--resume`` compares).

A job never writes into its final directory. It runs in a staging directory (``.seed-<n>.partial``
beside it, or a temporary directory on a Dask worker whose files are shipped back as bytes), and
when it ends the staging directory replaces the final one with ``os.replace``. So an interrupted
batch (Ctrl-C, a killed runner, a lost worker) keeps every job that finished and leaves no
half-written ``metrics.json`` where a resume would look; a job that was cut short simply has no
``job.json`` and runs again.

Jobs run as local processes (``run_batch``, the default) or as tasks on a Dask cluster
(:func:`workbench.cluster.run_dask`, which imports this module, never the reverse); both call
:func:`execute` and :func:`commit`, so the results and the report are the same. No torch here: the CLI imports this module.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .notebooks import NotebookInfo, parameters

RESERVED = {"scale": "--scale", "seed": "--seeds", "out_dir": "--out"}
KERNEL_START_FAILURE = re.compile(
    r"Kernel didn't respond|Kernel died before replying|Failed to start the kernel|"
    r"No such kernel named|Timeout waiting for kernel_info|kernel_info request timed out")
#: What a job's status means. ``passed`` is true for the first two.
STATUSES = {
    "ok": "ran to the end and wrote metrics.json",
    "cached": "skipped by --resume: complete for the same notebook content and parameters",
    "failed": "the notebook raised (its error cell is reported) or wrote no metrics.json",
    "timeout": "ran past --timeout and was stopped",
    "died": "its kernel died (killed, out of memory, a crash in native code)",
    "worker-died": "its Dask worker died more often than --retries allows",
    "interrupted": "the batch was stopped (Ctrl-C) before this job finished",
}


class ParameterError(ValueError):
    """A ``-p`` name or value the notebook's parameters cell does not accept."""


@dataclass
class Job:
    slug: str
    path: str
    scale: str
    seed: int
    params: dict                # the -p values of this grid point (typed)
    out: str                    # the job's (final) directory
    digest: str = ""            # notebook content + parameters, see job_digest()

    @property
    def all_params(self) -> dict:
        return self.run_params(self.out)

    def run_params(self, out_dir) -> dict:
        """What papermill injects: the grid point, scale, seed, and where the notebook writes."""
        return {**self.params, "scale": self.scale, "seed": self.seed, "out_dir": str(out_dir)}


@dataclass
class JobResult:
    job: Job
    status: str                 # one of STATUSES
    duration_s: float
    error: str = ""
    attempts: int = 1           # times the job was started (kernel-start and worker-death retries)
    claims: list = field(default_factory=list)
    error_cell: str = ""        # "cell 3: raise ValueError(...)" for a notebook that raised
    note: str = ""              # e.g. "retried on another worker: its worker died (1x)"

    @property
    def passed(self) -> bool:
        return self.status in ("ok", "cached")


# -- parameters --------------------------------------------------------------------------------
def _coerce(raw: str, type_name: str):
    """Turn a command-line string into the parameter's declared type; ValueError if it can't."""
    if isinstance(raw, str) and raw.strip().lower() in ("none", "null"):
        return None
    t = (type_name or "None").replace("typing.", "").replace("Optional[", "").rstrip("]").strip()
    if t == "int":
        return int(raw)
    if t == "float":
        return float(raw)
    if t == "bool":
        low = str(raw).strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ValueError("want true or false")
    if t == "str":
        return str(raw)
    import yaml                 # untyped parameter: read it as YAML would (numbers, lists, ...)
    return yaml.safe_load(raw)


def validate_params(info: NotebookInfo, raw: dict[str, list[str]]) -> dict[str, list]:
    """Check every name against the notebook's parameters cell and coerce every value.

    Raises :class:`ParameterError` naming the notebook, the parameter and the valid choices.
    With no ``-p`` values there is nothing to check, and the parameters cell is not inspected:
    inspection imports papermill (about 1.4 s, most of the runner's overhead on one job).
    """
    if not raw:
        return {}
    spec = parameters(info.path)
    typed = {}
    for name, values in raw.items():
        if name in RESERVED:
            raise ParameterError(f"{info.slug}: set '{name}' with {RESERVED[name]}, not -p")
        if name not in spec:
            valid = ", ".join(f"{n} ({s['type']}, default {s['default']})"
                              for n, s in spec.items() if n not in RESERVED)
            raise ParameterError(f"{info.slug}: unknown parameter '{name}'. "
                                 f"Valid parameters: {valid or '(none)'}")
        out = []
        for v in values:
            try:
                out.append(_coerce(v, spec[name]["type"]))
            except (ValueError, TypeError) as e:
                raise ParameterError(
                    f"{info.slug}: parameter '{name}' expects {spec[name]['type']} "
                    f"(default {spec[name]['default']}), got {v!r} ({e})") from None
        typed[name] = out
    return typed


def split_values(value: str) -> list[str]:
    """``"4,3,2"`` -> ``["4", "3", "2"]``: a comma list makes a grid."""
    parts = [p.strip() for p in str(value).split(",")]
    if any(p == "" for p in parts):
        raise ParameterError(f"empty value in {value!r}")
    return parts


def grid(typed: dict[str, list]) -> list[dict]:
    """The Cartesian product of the value lists, in a stable order."""
    names = list(typed)
    return [dict(zip(names, combo)) for combo in itertools.product(*(typed[n] for n in names))] \
        or [{}]


def _tag(point: dict) -> str:
    text = ",".join(f"{k}={v}" for k, v in point.items())
    return re.sub(r"[^A-Za-z0-9_.,=+-]", "_", text)


def notebook_digest(path) -> str:
    """SHA-256 of what the notebook computes: each cell's type and source, in order.

    Outputs, execution counts and metadata are left out, so cleaning or re-saving a notebook does
    not invalidate finished results; editing any cell (code or markdown) does."""
    nb = json.loads(Path(path).read_text())
    cells = [(c.get("cell_type"), "".join(c.get("source", ""))) for c in nb.get("cells", [])]
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()


def job_digest(nb_digest: str, job: Job) -> str:
    """The key ``--resume`` compares: notebook content + scale + seed + the -p values (typed)."""
    key = {"notebook": nb_digest, "scale": job.scale, "seed": job.seed, "params": job.params}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=repr).encode()).hexdigest()


def plan(notebooks: list[NotebookInfo], out: Path, scale: str = "smoke",
         raw_params: dict[str, list[str]] | None = None, seeds=(0,)) -> list[Job]:
    """Validate parameters against every notebook, then lay out one job per grid point x seed.
    Nothing runs here, so a bad parameter fails before any job starts."""
    jobs = []
    for info in notebooks:
        typed = validate_params(info, raw_params or {})
        nb_digest = notebook_digest(info.path)
        for point in grid(typed):
            sub = scale + (f"-{_tag(point)}" if point else "")
            for seed in seeds:
                job = Job(info.slug, str(info.path), scale, int(seed), point,
                          str(Path(out).resolve() / info.slug / sub / f"seed-{seed}"))
                job.digest = job_digest(nb_digest, job)
                jobs.append(job)
    return jobs


# -- running one notebook (on this machine or on a Dask worker) ---------------------------------
# papermill runs in a child that asks the kernel (Linux prctl) to kill it when its parent dies, so
# a runner or Dask worker killed with SIGKILL leaves no papermill behind; the kernel then exits by
# itself (ipykernel polls its parent). The parent's pid guards the race before prctl takes effect.
_LAUNCH = (
    "import ctypes, os, runpy, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG\n"
    "except Exception:\n"
    "    pass\n"
    "if os.getppid() != int(os.environ['WORKBENCH_RUNNER_PID']):\n"
    "    sys.exit('the runner died before papermill started')\n"
    "sys.argv = ['papermill'] + sys.argv[1:]\n"
    "runpy.run_module('papermill', run_name='__main__', alter_sys=True)\n")

_live: set[subprocess.Popen] = set()        # papermill processes, for Ctrl-C
_live_lock = threading.Lock()


def _papermill_cmd(notebook: Path, workdir: Path, slug: str, timeout: float) -> list[str]:
    return [sys.executable, "-c", _LAUNCH, str(notebook), str(workdir / f"{slug}.ipynb"),
            "-f", str(workdir / "parameters.yaml"), "--cwd", str(workdir), "-k", "python3",
            "--execution-timeout", str(int(timeout)), "--log-output", "--no-progress-bar",
            "--request-save-on-cell-execute"]


def _last_error(log: str) -> str:
    """The most telling line of a papermill log: the exception the notebook raised."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for pat in (r"^(\w+(Error|Exception|Failed|Interrupt)\b.*)$", r"(Error|Exception).*"):
        hits = [ln for ln in lines if re.search(pat, ln) and "Traceback" not in ln]
        if hits:
            return hits[-1][:400]
    return lines[-1][:400] if lines else ""


def error_cell(executed: Path) -> tuple[str, str]:
    """(``"cell N: <first source line>"``, ``"Ename: evalue"``) of the first cell of an executed
    notebook with an error output; empty strings when there is none. N counts the cells of the
    notebook as written, from 1: the cells papermill adds (injected parameters, error banners)
    are not counted."""
    try:
        nb = json.loads(executed.read_text())
    except (OSError, ValueError):
        return "", ""
    added = {"injected-parameters", "papermill-error-cell-tag"}
    cells = [c for c in nb.get("cells", []) if not added & set(c.get("metadata", {}).get("tags", []))]
    for n, cell in enumerate(cells, 1):
        for o in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            if o.get("output_type") == "error":
                src = [ln for ln in "".join(cell.get("source", "")).splitlines() if ln.strip()]
                first = src[0].strip() if src else ""
                if len(src) > 1:
                    first += " ..."
                return f"cell {n}: {first[:160]}", f"{o.get('ename')}: {o.get('evalue')}"[:400]
    return "", ""


def _kill(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def kill_running() -> None:
    """Stop every papermill process this runner started (Ctrl-C)."""
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        _kill(proc)


def execute(notebook: Path, workdir: Path, slug: str, params: dict, timeout: float = 900,
            strict: bool = False, threads: int | None = None, retries: int = 1,
            env_drop: tuple = ()) -> dict:
    """Run one notebook with papermill, writing everything into ``workdir`` (its ``out_dir``).

    Returns a dict with status, error, error_cell, attempts, duration_s and claims; never raises
    for a notebook's failure. A kernel that never comes up is retried ``retries`` times; a notebook
    that raises is not. A ``metrics.json`` is kept only when the job is ok: a kernel killed while
    writing it leaves half a file, and nothing downstream may read that. ``env_drop``: variables
    of this process the kernel must not inherit (a Dask worker's own tuning)."""
    import yaml
    workdir = Path(workdir)
    (workdir / "parameters.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env.update(WORKBENCH_BATCH="1", PYTHONUNBUFFERED="1", WORKBENCH_RUNNER_PID=str(os.getpid()))
    if threads:     # parallel jobs share the cores: oversubscribed BLAS threads stall small nets
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(threads)
    env.pop("WORKBENCH_STRICT", None)
    if strict:
        env["WORKBENCH_STRICT"] = "1"
    t0 = time.time()
    attempt = 0
    while True:
        attempt += 1
        with open(workdir / "log.txt", "w") as log:
            proc = subprocess.Popen(_papermill_cmd(Path(notebook), workdir, slug, timeout),
                                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                                    start_new_session=True)
            with _live_lock:
                _live.add(proc)
            try:
                rc = proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                _kill(proc)
                rc, timed_out = proc.returncode, True
            finally:
                with _live_lock:
                    _live.discard(proc)
        text = (workdir / "log.txt").read_text(errors="replace")
        if rc != 0 and not timed_out and attempt <= retries and KERNEL_START_FAILURE.search(text) \
                and "Executing Cell 1" not in text:
            continue            # the kernel never came up: try once more
        break
    duration = time.time() - t0
    metrics_path = workdir / "metrics.json"
    try:
        metrics = json.loads(metrics_path.read_text())
    except FileNotFoundError:
        metrics = None
    except ValueError:
        metrics = False         # there but not JSON: cut short while writing
    cell, exc = error_cell(workdir / f"{slug}.ipynb")
    if timed_out or "CellTimeoutError" in text or "Cell execution timed out" in text:
        status, error = "timeout", f"exceeded the {timeout:g} s limit"
    elif rc == 0 and isinstance(metrics, dict):
        status, error = "ok", ""
    elif rc == 0:
        status, error = "failed", "the notebook finished without writing a readable " \
                                  "metrics.json (no run.finish()?)"
    elif rc < 0 or "DeadKernelError" in text or "Kernel died" in text:
        status, error = "died", _last_error(text) or f"killed by signal {-rc}"
    else:
        status, error = "failed", exc or _last_error(text)
    if status != "ok":
        metrics_path.unlink(missing_ok=True)
    claims = metrics.get("claims", []) if status == "ok" else []
    return {"status": status, "error": error, "error_cell": cell if status != "ok" else "",
            "attempts": attempt, "duration_s": round(duration, 2), "claims": claims}


# -- committing a job's directory ---------------------------------------------------------------
def staging_dir(job: Job) -> Path:
    """Where a job is assembled before it replaces ``job.out``: a hidden sibling, on the same file
    system so that ``os.replace`` is a rename (the report skips hidden directories)."""
    out = Path(job.out)
    return out.parent / f".{out.name}.partial"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _as_dict(r: JobResult) -> dict:
    return {"job": asdict(r.job), "digest": r.job.digest, "status": r.status,
            "duration_s": r.duration_s, "error": r.error, "error_cell": r.error_cell,
            "attempts": r.attempts, "note": r.note, "claims": r.claims}


def commit(result: JobResult, stage: Path) -> JobResult:
    """Make ``stage`` the job's directory: write ``job.json`` into it, then swap it in.

    ``metrics.json`` and ``params.json`` name the staging directory as ``out_dir`` (that is where
    the notebook wrote); they are rewritten to name where the files now are."""
    final = Path(result.job.out)
    for name in ("metrics.json", "params.json"):
        path = stage / name
        if path.exists():
            data = json.loads(path.read_text())
            params = data.get("params", data) if name == "metrics.json" else data
            if isinstance(params, dict) and "out_dir" in params:
                params["out_dir"] = str(final)
                _atomic_write(path, json.dumps(data, indent=2))
    _atomic_write(stage / "job.json", json.dumps(_as_dict(result), indent=2))
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(stage, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return result


def cached_result(job: Job) -> JobResult | None:
    """For ``--resume``: the job's previous result when it is complete (job.json says ok, for the
    same digest, and metrics.json reads as JSON); None when the job must run."""
    out = Path(job.out)
    try:
        old = json.loads((out / "job.json").read_text())
        metrics = json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError):
        return None
    if old.get("status") != "ok" or not job.digest or old.get("digest") != job.digest:
        return None
    return JobResult(job, "cached", old.get("duration_s", 0.0),
                     claims=metrics.get("claims", []), note="complete from an earlier run")


def run_job(job: Job, timeout: float = 900, resume: bool = False, strict: bool = False,
            retries: int = 1, threads: int | None = None,
            cancel: threading.Event | None = None) -> JobResult:
    """Execute one job in a fresh papermill process; never raises for a notebook's failure."""
    if resume and (cached := cached_result(job)) is not None:
        return cached
    if cancel is not None and cancel.is_set():
        return JobResult(job, "interrupted", 0.0, STATUSES["interrupted"])
    stage = staging_dir(job)
    shutil.rmtree(stage, ignore_errors=True)        # what a killed runner left
    stage.mkdir(parents=True)
    r = execute(Path(job.path), stage, job.slug, job.run_params(stage), timeout, strict,
                threads, retries)
    if cancel is not None and cancel.is_set():      # killed by Ctrl-C: nothing to keep
        shutil.rmtree(stage, ignore_errors=True)
        return JobResult(job, "interrupted", r["duration_s"], STATUSES["interrupted"])
    note = "the kernel failed to start; retried" if r["attempts"] > 1 else ""
    result = JobResult(job, r["status"], r["duration_s"], r["error"], r["attempts"],
                       r["claims"], r["error_cell"], note)
    return commit(result, stage)


def run_batch(jobs: list[Job], n_jobs: int | None = None, timeout: float = 900,
              resume: bool = False, strict: bool = False, show_progress: bool = True
              ) -> list[JobResult]:
    """Run jobs as ``n_jobs`` papermill processes at a time (default: the core count); results
    keep the order of ``jobs`` and every job gets one, whatever the others did. Ctrl-C stops the
    running jobs and marks them ``interrupted``; finished ones are kept. (The Dask executor,
    :func:`workbench.cluster.run_dask`, has the same contract.)"""
    from .progress import progress
    n_jobs = max(1, n_jobs or os.cpu_count() or 1)
    threads = max(1, (os.cpu_count() or 1) // min(n_jobs, max(1, len(jobs))))
    results: dict[int, JobResult] = {}
    cancel = threading.Event()
    pool = ThreadPoolExecutor(max_workers=n_jobs)
    futures = {pool.submit(run_job, job, timeout, resume, strict, 1, threads, cancel): i
               for i, job in enumerate(jobs)}
    bar = progress(total=len(jobs), desc="jobs", disable=not show_progress)
    # Ctrl-C sets a flag that the loop polls, rather than raising KeyboardInterrupt wherever the
    # main thread happens to be (inside a future's lock, say, which would leave a worker thread
    # unable to finish and the runner hanging)
    interrupted = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    try:
        pending = set(futures)
        while pending and not interrupted.is_set():
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            for fut in done:
                i = futures[fut]
                results[i] = _result_of(fut, jobs[i])
                r = results[i]
                bar.set_postfix_str(f"{r.job.slug} seed {r.job.seed}: {r.status}", refresh=False)
                bar.update(1)
        if interrupted.is_set():
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        if previous is not None:      # a second Ctrl-C while we stop the jobs is Python's own
            signal.signal(signal.SIGINT, previous)
            previous = None
        cancel.set()
        pool.shutdown(wait=False, cancel_futures=True)
        while not all(f.done() for f in futures):   # a thread may start one as we kill the rest
            kill_running()
            time.sleep(0.2)
        for fut, i in futures.items():
            if i not in results and not fut.cancelled():
                results[i] = _result_of(fut, jobs[i])
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    return [results.get(i) or JobResult(job, "interrupted", 0.0, STATUSES["interrupted"])
            for i, job in enumerate(jobs)]


def _result_of(fut, job: Job) -> JobResult:
    try:
        return fut.result()
    except Exception as e:          # a bug here must not lose the other jobs' results
        return JobResult(job, "failed", 0.0, f"runner error: {e!r}")


def summary_table(results: list[JobResult]) -> str:
    """One line per job: notebook, grid point, seed, status, time, claims held, note."""
    rows = [("notebook", "params", "seed", "status", "time", "claims", "note")]
    for r in results:
        held = sum(1 for c in r.claims if c.get("holds"))
        bad = [c["id"] for c in r.claims if c.get("robust") and not c.get("holds")]
        note = "; ".join(x for x in (
            r.error, r.error_cell, r.note,
            f"robust claim(s) not holding: {', '.join(bad)}" if bad else "") if x)
        rows.append((r.job.slug, _tag(r.job.params) or "-", str(r.job.seed), r.status,
                     f"{r.duration_s:.0f}s", f"{held}/{len(r.claims)}" if r.claims else "-",
                     note[:110]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    ok = sum(r.passed for r in results)
    lines.append(f"\n{ok}/{len(results)} jobs passed")
    return "\n".join(lines)
