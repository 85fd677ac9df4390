"""Batch execution of notebooks through papermill: parameter grids, seeds, parallel jobs.

Each job is one notebook with one set of parameters and one seed. It runs as its own papermill
process in its own directory ``OUT/<slug>/<scale>[-<grid point>]/seed-<n>/``, which ends up holding
the executed notebook, the papermill log, the notebook's ``metrics.json`` and ``figures/``, and
``job.json`` (status, duration, error). A job that fails, dies or times out is reported and the
others go on. No torch here: the CLI imports this module.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .notebooks import NotebookInfo, parameters

RESERVED = {"scale": "--scale", "seed": "--seeds", "out_dir": "--out"}
KERNEL_START_FAILURE = re.compile(
    r"Kernel didn't respond|Kernel died before replying|Failed to start the kernel|"
    r"No such kernel named|Timeout waiting for kernel_info|kernel_info request timed out")


class ParameterError(ValueError):
    """A ``-p`` name or value the notebook's parameters cell does not accept."""


@dataclass
class Job:
    slug: str
    path: str
    scale: str
    seed: int
    params: dict                # the -p values of this grid point (typed)
    out: str                    # the job's directory

    @property
    def all_params(self) -> dict:
        return {**self.params, "scale": self.scale, "seed": self.seed, "out_dir": self.out}


@dataclass
class JobResult:
    job: Job
    status: str                 # ok | failed | timeout | died | cached
    duration_s: float
    error: str = ""
    attempts: int = 1
    claims: list = field(default_factory=list)

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
    """
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


def plan(notebooks: list[NotebookInfo], out: Path, scale: str = "smoke",
         raw_params: dict[str, list[str]] | None = None, seeds=(0,)) -> list[Job]:
    """Validate parameters against every notebook, then lay out one job per grid point x seed.
    Nothing runs here, so a bad parameter fails before any job starts."""
    jobs = []
    for info in notebooks:
        typed = validate_params(info, raw_params or {})
        for point in grid(typed):
            sub = scale + (f"-{_tag(point)}" if point else "")
            for seed in seeds:
                jobs.append(Job(info.slug, str(info.path), scale, int(seed), point,
                                str(Path(out).resolve() / info.slug / sub / f"seed-{seed}")))
    return jobs


# -- running -----------------------------------------------------------------------------------
def _papermill_cmd(job: Job, timeout: float) -> list[str]:
    out = Path(job.out)
    return [sys.executable, "-m", "papermill", job.path, str(out / f"{job.slug}.ipynb"),
            "-f", str(out / "parameters.yaml"), "--cwd", str(out), "-k", "python3",
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


def _same_params(job: Job) -> bool:
    """For --resume: the job finished before with exactly these parameters."""
    path = Path(job.out) / "job.json"
    if not path.exists() or not (Path(job.out) / "metrics.json").exists():
        return False
    old = json.loads(path.read_text())
    return old.get("status") == "ok" and old.get("job", {}).get("params") == job.params \
        and old.get("job", {}).get("scale") == job.scale


def run_job(job: Job, timeout: float = 900, resume: bool = False, strict: bool = False,
            retries: int = 1, threads: int | None = None) -> JobResult:
    """Execute one job in a fresh papermill process; never raises for a notebook's failure."""
    import yaml
    out = Path(job.out)
    if resume and _same_params(job):
        old = json.loads((out / "job.json").read_text())
        return JobResult(job, "cached", old.get("duration_s", 0.0), claims=old.get("claims", []))
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.json", "job.json"):
        (out / stale).unlink(missing_ok=True)
    (out / "parameters.yaml").write_text(yaml.safe_dump(job.all_params, sort_keys=False))
    env = dict(os.environ, WORKBENCH_BATCH="1", PYTHONUNBUFFERED="1")
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
        with open(out / "log.txt", "w") as log:
            proc = subprocess.Popen(_papermill_cmd(job, timeout), stdout=log,
                                    stderr=subprocess.STDOUT, env=env, cwd=out,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                _kill(proc)
                rc, timed_out = proc.returncode, True
        text = (out / "log.txt").read_text(errors="replace")
        if rc != 0 and not timed_out and attempt <= retries and KERNEL_START_FAILURE.search(text) \
                and "Executing Cell 1" not in text:
            continue            # the kernel never came up: try once more
        break
    duration = time.time() - t0
    metrics = out / "metrics.json"
    claims = json.loads(metrics.read_text()).get("claims", []) if metrics.exists() else []
    if timed_out or "CellTimeoutError" in text or "Cell execution timed out" in text:
        status, error = "timeout", f"exceeded the {timeout:g} s limit"
    elif rc == 0 and metrics.exists():
        status, error = "ok", ""
    elif rc == 0:
        status, error = "failed", "the notebook finished without writing metrics.json " \
                                  "(no run.finish()?)"
    elif rc < 0 or "DeadKernelError" in text or "Kernel died" in text:
        status, error = "died", _last_error(text) or f"killed by signal {-rc}"
    else:
        status, error = "failed", _last_error(text)
    result = JobResult(job, status, round(duration, 2), error, attempt, claims)
    (out / "job.json").write_text(json.dumps(_as_dict(result), indent=2))
    return result


def _as_dict(r: JobResult) -> dict:
    return {"job": asdict(r.job), "status": r.status, "duration_s": r.duration_s,
            "error": r.error, "attempts": r.attempts, "claims": r.claims}


def run_batch(jobs: list[Job], n_jobs: int | None = None, timeout: float = 900,
              resume: bool = False, strict: bool = False, show_progress: bool = True
              ) -> list[JobResult]:
    """Run jobs in parallel processes (``n_jobs`` defaults to the core count); results keep the
    order of ``jobs`` and every job gets one, whatever the others did."""
    from .progress import progress
    n_jobs = max(1, n_jobs or os.cpu_count() or 1)
    threads = max(1, (os.cpu_count() or 1) // min(n_jobs, max(1, len(jobs))))
    results: dict[int, JobResult] = {}
    with ThreadPoolExecutor(max_workers=n_jobs) as pool:
        futures = {pool.submit(run_job, job, timeout, resume, strict, 1, threads): i
                   for i, job in enumerate(jobs)}
        bar = progress(total=len(jobs), desc="jobs", disable=not show_progress)
        for fut in as_completed(futures):
            i = futures[fut]
            try:
                results[i] = fut.result()
            except Exception as e:          # a bug here must not lose the other jobs' results
                results[i] = JobResult(jobs[i], "failed", 0.0, f"runner error: {e!r}")
            r = results[i]
            bar.set_postfix_str(f"{r.job.slug} seed {r.job.seed}: {r.status}", refresh=False)
            bar.update(1)
        bar.close()
    return [results[i] for i in range(len(jobs))]


def summary_table(results: list[JobResult]) -> str:
    """One line per job: notebook, grid point, seed, status, time, claims held."""
    rows = [("notebook", "params", "seed", "status", "time", "claims", "note")]
    for r in results:
        held = sum(1 for c in r.claims if c.get("holds"))
        bad = [c["id"] for c in r.claims if c.get("robust") and not c.get("holds")]
        note = r.error or (f"robust claim(s) not holding: {', '.join(bad)}" if bad else "")
        rows.append((r.job.slug, _tag(r.job.params) or "-", str(r.job.seed), r.status,
                     f"{r.duration_s:.0f}s", f"{held}/{len(r.claims)}" if r.claims else "-",
                     note[:70]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    ok = sum(r.passed for r in results)
    lines.append(f"\n{ok}/{len(results)} jobs passed")
    return "\n".join(lines)
