"""Batch execution of notebooks through papermill: parameter grids, seeds, parallel jobs, resume.

Each job is one notebook with one set of parameters and one seed. It ends up in its own directory
``OUT/<slug>/<scale>[-<grid point>]/seed-<n>/`` (a grid point that a file name cannot hold as
written, or a long one, is shortened and given a stable hash: :func:`folder_name`) holding the
executed notebook, the papermill log, the notebook's ``metrics.json`` and ``figures/``, and
``job.json`` (status, duration, error, and the ``digest`` of the notebook's content and
parameters that ``--resume`` compares).

A job never writes into its final directory. It runs in a staging directory (``.seed-<n>.partial``
beside it, or a temporary directory on a Dask worker whose files are shipped back as bytes), and
when it ends the staging directory replaces the final one with ``os.replace``. So an interrupted
batch (Ctrl-C, a killed runner, a lost worker) keeps every job that finished and leaves no
half-written ``metrics.json`` where a resume would look; a job that was cut short simply has no
``job.json`` and runs again.

One run owns ``OUT`` while it runs (:func:`claim_run_dir`, a ``flock``), so two runs never
delete each other's staging directories; ``plan.json`` lists every planned job for the report.
Every value is checked against the notebook's parameters cell, declared limits included
(``[1..]``, ``(0..1]``, ``{a|b}`` at the end of a help comment), before any job starts.

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
import tempfile
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .env import git_info
from .models import checkpoint
from .notebooks import (RESERVED, NotebookError, NotebookInfo, ParameterError, check_limit,
                        parameters, read_notebook)

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
_OPEN = {"[": "]", "{": "}", '"': '"', "'": "'"}


def _coerce(raw: str, type_name: str):
    """Turn a command-line string into the parameter's declared type; ValueError if it can't.

    A value written in brackets (``[a,b]``) is one list, and in quotes (``"a,b"``) one string,
    read as YAML; a ``str`` parameter gets a list as its items joined by commas (the notebooks'
    comma-separated parameters)."""
    if isinstance(raw, str) and raw.strip().lower() in ("none", "null"):
        return None
    t = (type_name or "None").replace("typing.", "").replace("Optional[", "").rstrip("]").strip()
    text = raw.strip() if isinstance(raw, str) else raw
    literal = isinstance(text, str) and text[:1] in _OPEN and text[-1:] == _OPEN[text[:1]]
    if literal:
        import yaml
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"not a YAML value: {str(e).splitlines()[0]}") from None
        if t == "str":
            if isinstance(value, list):
                return ",".join(str(v) for v in value)
            if isinstance(value, str):
                return value
            raise ValueError("want text, or a list written [a,b]")
        if t in ("int", "float", "bool") and isinstance(value, (list, dict)):
            raise ValueError(f"a list or mapping is not a {t}")
        if t in ("int", "float", "bool"):
            raw = str(value)
        else:
            return value
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


def validate_params(info: NotebookInfo, raw: dict[str, list[str]], seeds=(),
                    scale: str | None = None, spec: dict | None = None) -> dict[str, list]:
    """Check every name against the notebook's parameters cell, coerce every value and check it
    against the parameter's declared limit; the seeds and the scale too, when the cell declares
    theirs. Raises :class:`ParameterError` naming the notebook, the parameter, the value and the
    limit (or the valid choices), before any job starts. The cell is read with ``ast``: cheap."""
    try:
        spec = parameters(info.path) if spec is None else spec
    except NotebookError as e:
        raise ParameterError(str(e)) from None
    for seed in seeds:
        if "seed" in spec:
            check_limit(info.slug, "seed", seed, spec["seed"], f"--seeds: seed {seed}")
    if scale is not None and "scale" in spec:
        check_limit(info.slug, "scale", scale, spec["scale"], f"--scale {scale}")
    typed = {}
    for name, values in raw.items():
        if RESERVED.get(name):
            raise ParameterError(f"{info.slug}: set '{name}' with {RESERVED[name]}, not -p")
        renamed = checkpoint.RENAMED.get(info.slug, {}).get(name)
        if name not in spec and renamed in spec:
            raise ParameterError(f"{info.slug}: parameter '{name}' is now '{renamed}' (one model "
                                 f"parameter convention): -p {renamed} ...")
        if name not in spec:
            valid = ", ".join(f"{n} ({s['type']}, default {s['default']})"
                              + (f" {s['limit'].text}" if s.get("limit") else "")
                              for n, s in spec.items() if not RESERVED.get(n))
            raise ParameterError(f"{info.slug}: unknown parameter '{name}'. "
                                 f"Valid parameters: {valid or '(none)'}")
        out = []
        for v in values:
            try:
                value = _coerce(v, spec[name]["type"])
            except (ValueError, TypeError) as e:
                raise ParameterError(
                    f"{info.slug}: parameter '{name}' expects {spec[name]['type']} "
                    f"(default {spec[name]['default']}), got {v!r} ({e})") from None
            check_limit(info.slug, name, value, spec[name])
            out.append(value)
        typed[name] = out
    for name, values in typed.items():        # a checkpoint a notebook cannot use: refused now
        values[:] = [checkpoint.absolute(info.slug, name, v) for v in values]
        for value in values:
            try:
                for w in checkpoint.validate_params(info.slug, {name: value}):
                    print(f"warning: {info.slug}: {w}", file=sys.stderr)
            except checkpoint.CheckpointError as e:
                raise ParameterError(str(e)) from None
    # and each checkpoint with each value of the knobs its shapes must fit, at this scale
    fitted = {n: v for n, v in typed.items()
              if n in checkpoint.NOTEBOOK_NEEDS.get(info.slug, {}) or n in checkpoint.FIT_KNOBS}
    if scale is None and "scale" in spec:
        scale = _coerce(spec["scale"]["default"], "str")
    if scale is not None and fitted:
        said = set()
        for point in grid(fitted):
            try:
                for w in checkpoint.fit(info.slug, point, scale):
                    if w not in said:
                        said.add(w)
                        print(f"warning: {info.slug}: {w}", file=sys.stderr)
            except checkpoint.CheckpointError as e:
                raise ParameterError(str(e)) from None
    return typed


def split_values(value: str, option: str = "-p") -> list[str]:
    """``"4,3,2"`` -> ``["4", "3", "2"]``: commas at the top level make a grid.

    A value that holds commas is written as one YAML value: in brackets (``[lm-base,lm-gpt2]``,
    a list) or in quotes (``"a,b"``, a string); its commas do not split. ``-p x '[1,2],[3]'`` is
    a grid of two lists."""
    text, parts, i = str(value), [], 0
    while True:
        while i < len(text) and text[i] == " ":
            i += 1
        j = i
        if j < len(text) and text[j] in _OPEN:
            stack = [_OPEN[text[j]]]
            j += 1
            while j < len(text) and stack:
                ch = text[j]
                if stack[-1] in "\"'":              # inside quotes only the quote closes
                    if ch == stack[-1]:
                        stack.pop()
                elif ch in _OPEN:
                    stack.append(_OPEN[ch])
                elif ch == stack[-1]:
                    stack.pop()
                j += 1
            if stack:
                raise ParameterError(f"{option}: {value!r} has an unclosed {text[i]!r}")
        k = text.find(",", j)
        k = len(text) if k < 0 else k
        part = text[i:k].strip()
        if part == "":
            raise ParameterError(f"{option}: empty value in {value!r}")
        parts.append(part)
        if k >= len(text):
            return parts
        i = k + 1


def parse_seeds(text: str) -> list[int]:
    """``--seeds 0,1,2`` -> ``[0, 1, 2]``; :class:`ParameterError` naming ``--seeds``."""
    seeds = []
    for part in split_values(text, "--seeds"):
        try:
            seeds.append(int(part))
        except ValueError:
            raise ParameterError(f"--seeds: {part!r} is not an integer (want a comma list "
                                 "such as --seeds 0,1,2)") from None
    return seeds


def grid(typed: dict[str, list]) -> list[dict]:
    """The Cartesian product of the value lists, in a stable order."""
    names = list(typed)
    return [dict(zip(names, combo)) for combo in itertools.product(*(typed[n] for n in names))] \
        or [{}]


def point_text(point: dict, width: int = 40) -> str:
    """A grid point as shown to people: ``lr=0.01,device=cuda:0`` (values as given, no
    newlines, shortened to ``width`` characters)."""
    text = " ".join(",".join(f"{k}={v}" for k, v in point.items()).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _tag(point: dict) -> str:
    text = ",".join(f"{k}={v}" for k, v in point.items())
    return re.sub(r"[^A-Za-z0-9_.,=+-]", "_", text)


def _key(point: dict) -> str:
    """A canonical text of a parameter set (types kept: 1 and "1" differ)."""
    return json.dumps(point, sort_keys=True, default=repr)


MAX_TAG = 60       # characters of a grid point's folder name before it is shortened


def folder_name(scale: str, point: dict, hashed: bool = False) -> str:
    """The folder of a grid point: ``smoke-lr=0.01``. A point whose text is changed by making it
    a file name (``cuda:0`` -> ``cuda_0``), or is long, gets a short prefix and a stable hash
    of its values, so that distinct parameter sets never share a folder and no name is too long
    for the file system."""
    if not point:
        return scale
    raw = ",".join(f"{k}={v}" for k, v in point.items())
    safe = _tag(point)
    if not hashed and safe == raw and len(raw) <= MAX_TAG and not raw.startswith("."):
        return f"{scale}-{raw}"
    digest = hashlib.sha256(_key(point).encode()).hexdigest()[:10]
    return f"{scale}-{safe[:MAX_TAG - 20].rstrip('.')}-{digest}"


def notebook_digest(path) -> str:
    """SHA-256 of what the notebook computes: each cell's type and source, in order.

    Outputs, execution counts and metadata are left out, so cleaning or re-saving a notebook does
    not invalidate finished results; editing any cell (code or markdown) does."""
    nb = read_notebook(Path(path))
    cells = [(c.get("cell_type"), "".join(c.get("source", ""))) for c in nb.get("cells", [])]
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()


def job_digest(nb_digest: str, job: Job) -> str:
    """The key ``--resume`` compares: notebook content + scale + seed + the -p values (typed)."""
    key = {"notebook": nb_digest, "scale": job.scale, "seed": job.seed, "params": job.params}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=repr).encode()).hexdigest()


def plan(notebooks: list[NotebookInfo], out: Path, scale: str = "smoke",
         raw_params: dict[str, list[str]] | None = None, seeds=(0,),
         notes: list[str] | None = None) -> list[Job]:
    """Validate parameters, seeds and limits against every notebook, then lay out one job per
    grid point x seed. Nothing runs here, so a bad value fails before any job starts.

    A notebook, a value or a seed given twice is planned once (said in ``notes`` when given);
    distinct parameter sets always get distinct folders (see :func:`folder_name`)."""
    notes = [] if notes is None else notes
    seen_nb: dict[str, NotebookInfo] = {}
    for info in notebooks:
        key = str(Path(info.path).resolve())
        if key in seen_nb:
            note = f"{info.slug} was named more than once: planned once"
            if note not in notes:
                notes.append(note)
        else:
            seen_nb[key] = info
    uniq_seeds = list(dict.fromkeys(int(s) for s in seeds))
    if len(uniq_seeds) < len(list(seeds)):
        notes.append(f"a seed was given twice: seeds {','.join(map(str, uniq_seeds))} "
                     "planned once each")
    jobs = []
    for info in seen_nb.values():
        typed = validate_params(info, raw_params or {}, uniq_seeds, scale)
        for name, values in typed.items():
            uniq = list({_key(v): v for v in values}.values())
            if len(uniq) < len(values):
                notes.append(f"{info.slug}: -p {name} has a value given twice: planned once")
                typed[name] = uniq
        nb_digest = notebook_digest(info.path)
        points = grid(typed)
        names = [folder_name(scale, p) for p in points]
        clash = {n for n in names if names.count(n) > 1}
        names = [folder_name(scale, p, hashed=n in clash) for p, n in zip(points, names)]
        for point, sub in zip(points, names):
            for seed in uniq_seeds:
                job = Job(info.slug, str(info.path), scale, int(seed), point,
                          str(Path(out).resolve() / info.slug / sub / f"seed-{seed}"))
                job.digest = job_digest(nb_digest, job)
                jobs.append(job)
    if len({j.out for j in jobs}) != len(jobs):           # a bug, never a user's doing
        raise ParameterError("two planned jobs share a folder; please report this")
    return jobs


# -- the run folder: one owner, and the plan ---------------------------------------------------
LOCK_NAME = ".workbench.lock"
PLAN_NAME = "plan.json"


class RunDirError(RuntimeError):
    """``--out`` cannot be used: not a folder, not writable, or owned by another run."""


def _in_use(out: Path) -> RunDirError:
    return RunDirError(f"--out {out} is in use by another workbench run "
                       f"({_owner(Path(out) / LOCK_NAME)}); wait for it to finish or choose "
                       "another --out")


def _owner(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return (f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}: "
                f"{info.get('command')}")
    except (OSError, ValueError):
        return "another process"


WRITABLE_HINT = "give --out a folder you can write (default: a new one under runs/)"


def check_run_dir(out: Path) -> None:
    """What :func:`claim_run_dir` would refuse, found without creating ``out`` (``--dry-run``):
    :class:`RunDirError` when ``out`` is a file, cannot be created or written, or is in use by
    another run. A hidden folder is made and removed at once in ``out`` or its nearest existing
    parent: the one sure test (permission bits do not bind root, and ``/proc`` refuses all)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file, not a folder; give a folder for the results")
    base = out.absolute()
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise RunDirError(f"cannot create --out {out}: {base} is a file, not a folder; "
                          f"{WRITABLE_HINT}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".workbench-check-", dir=base))
    except OSError as e:
        what = "write in" if base == out.absolute() else "create"
        raise RunDirError(f"cannot {what} --out {out}: {e.strerror or e}; {WRITABLE_HINT}"
                          ) from None
    try:
        import fcntl
        fh = open(out / LOCK_NAME)
    except (ImportError, OSError):      # no flock (Windows), or no run has held this folder
        return
    with fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)      # released on close
        except OSError:
            raise _in_use(out) from None


def claim_run_dir(out: Path, command: str = "", exclusive: bool = False):
    """Create ``out`` (``exclusive``: it must not exist yet) and take its lock: an open file
    holding an exclusive ``flock`` for as long as this process lives (the kernel drops it when
    the process dies, however it dies, so no stale lock is left). Returns the open lock file;
    keep it. :class:`RunDirError` with a one-line reason when ``out`` is not a folder, cannot
    be written, or is in use by another run (whose pid and command it names)."""
    import platform
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file, not a folder; give a folder for the results")
    try:
        out.mkdir(parents=True, exist_ok=not exclusive)
    except FileExistsError:
        raise
    except OSError as e:
        raise RunDirError(f"cannot create --out {out}: {e.strerror or e}; {WRITABLE_HINT}"
                          ) from None
    path = out / LOCK_NAME
    try:
        fh = open(path, "a+")
    except OSError as e:
        raise RunDirError(f"cannot write in --out {out}: {e.strerror or e}") from None
    try:
        import fcntl
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:         # no flock (Windows): the lock is advisory only
        pass
    except OSError:
        fh.close()
        raise _in_use(out) from None
    try:
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps({"pid": os.getpid(), "host": platform.node(),
                             "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                             "command": command}))
        fh.flush()
    except OSError as e:
        fh.close()
        raise RunDirError(f"cannot write in --out {out}: {e.strerror or e}") from None
    return fh


def remove_stale_staging(out: Path) -> int:
    """Remove the staging folders (``.seed-N.partial``, ``.seed-N.old-*``) that a killed runner
    left in ``out``. Only for the owner of ``out`` (:func:`claim_run_dir`): nothing else writes
    there. Returns how many were removed."""
    n = 0
    for d in sorted(Path(out).rglob(".*"), reverse=True):
        if d.is_dir() and (d.name.endswith(".partial") or ".old-" in d.name):
            shutil.rmtree(d, ignore_errors=True)
            n += 1
    return n


def new_run_dir(base: Path, command: str = ""):
    """A fresh ``base/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... when that one exists: two runs
    started in the same second never share one), created and locked. Returns (path, lock)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        out = Path(base) / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            return out, claim_run_dir(out, command, exclusive=True)
        except FileExistsError:
            continue
    raise RunDirError(f"cannot find a free run folder under {base}")


def write_plan(out: Path, jobs: list[Job], infos: list[NotebookInfo], command: str = "") -> Path:
    """``plan.json``: when the batch started, from which commit, the notebooks' titles and every
    planned job (folder relative to ``out``), so that the report lists each planned job, those
    that never ran included."""
    out = Path(out)
    plan_ = {"started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": command,
             "git": git_info(), "titles": {i.slug: i.title for i in infos},
             "jobs": [{"slug": j.slug, "scale": j.scale, "seed": j.seed, "params": j.params,
                       "dir": Path(j.out).resolve().relative_to(out.resolve()).as_posix(),
                       "digest": j.digest} for j in jobs]}
    path = out / PLAN_NAME
    _atomic_write(path, json.dumps(plan_, indent=2, default=repr))
    return path


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


def error_cell(executed: Path, running: bool = False) -> tuple[str, str]:
    """(``"cell N: <first source line>"``, ``"Ename: evalue"``) of the first cell of an executed
    notebook with an error output; empty strings when there is none. N counts the cells of the
    notebook as written, from 1: the cells papermill adds (injected parameters, error banners)
    are not counted. ``running``: without an error output, the cell papermill marked as running
    (a kernel that died or was stopped mid-cell), as ``("cell N: ... (running)", "")``."""
    try:
        nb = json.loads(executed.read_text())
    except (OSError, ValueError):
        return "", ""
    added = {"injected-parameters", "papermill-error-cell-tag"}
    cells = [c for c in nb.get("cells", []) if not added & set(c.get("metadata", {}).get("tags", []))]

    def first_line(cell):
        src = [ln for ln in "".join(cell.get("source", "")).splitlines() if ln.strip()]
        first = src[0].strip() if src else ""
        return first[:160] + (" ..." if len(src) > 1 else "")

    for n, cell in enumerate(cells, 1):
        for o in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            if o.get("output_type") == "error":
                return f"cell {n}: {first_line(cell)}", f"{o.get('ename')}: {o.get('evalue')}"[:400]
    if running:
        for n, cell in enumerate(cells, 1):
            if cell.get("metadata", {}).get("papermill", {}).get("status") == "running":
                return f"cell {n}: {first_line(cell)} (running)", ""
        # a dead kernel's cell is marked completed: the log says which cell was executing
        n = current_cell(executed.parent / "log.txt")
        every = nb.get("cells", [])
        if n and 0 < n <= len(every) and every[n - 1] in cells:
            return f"cell {cells.index(every[n - 1]) + 1}: {first_line(every[n - 1])} " \
                   "(running)", ""
    return "", ""


_CELL_RE = re.compile(rb"Executing Cell (\d+)-")


def current_cell(log: Path) -> int | None:
    """The cell a running job executes, from the tail of its papermill log (papermill's count:
    the injected parameters cell included)."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            hits = _CELL_RE.findall(f.read())
    except OSError:
        return None
    return int(hits[-1]) if hits else None


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


def _reap(token: str, wait_s: float = 10.0) -> int:
    """Kill every process still carrying this job's ``WORKBENCH_JOB_TOKEN`` (its kernel and the
    kernel's children: jupyter_client starts the kernel in a session of its own, so stopping
    papermill's process group does not reach it) and wait until they are gone, so that nothing
    writes into the job's folder after it is committed. Returns how many were killed. Linux
    (``/proc``); elsewhere a no-op."""
    needle = f"WORKBENCH_JOB_TOKEN={token}".encode()
    proc = Path("/proc")
    if not proc.is_dir():
        return 0

    def carriers():
        found = []
        for d in proc.iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    found.append(int(d.name))
            except OSError:
                continue
        return found

    killed = 0
    deadline = time.time() + wait_s
    while (pids := carriers()) and time.time() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
        for pid in pids:            # reap our own children; others are reaped by their parent
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    return killed


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
    token = uuid.uuid4().hex
    env.update(WORKBENCH_BATCH="1", PYTHONUNBUFFERED="1", WORKBENCH_RUNNER_PID=str(os.getpid()),
               WORKBENCH_JOB_TOKEN=token)
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
                _reap(token)    # a kernel left behind (timeout, killed papermill) dies now
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
    if status in ("died", "timeout") and not cell:     # stopped mid-cell: which one
        cell = error_cell(workdir / f"{slug}.ipynb", running=True)[0]
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


def _rename_paths(path: Path, old: str, new: str) -> None:
    """Replace the path ``old`` by ``new`` in a text file, as written raw and as a JSON string."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return
    changed = text
    for a, b in ((json.dumps(old)[1:-1], json.dumps(new)[1:-1]), (old, new)):
        changed = changed.replace(a, b)
    if changed != text:
        _atomic_write(path, changed)


def commit(result: JobResult, stage: Path, wrote_to: str | os.PathLike | None = None
           ) -> JobResult:
    """Make ``stage`` the job's directory: write ``job.json`` into it, then swap it in.

    The notebook wrote into ``wrote_to`` (default ``stage``; a Dask worker's scratch folder), so
    that path is what its ``metrics.json``, ``params.json``, injected ``out_dir``, printed lines
    and log name; they are rewritten to name the job's final folder, where the files now are
    (re-running the executed notebook in Jupyter then writes there, not into a hidden one)."""
    final = Path(result.job.out)
    wrote = str(wrote_to or stage)
    for name in ("metrics.json", "params.json"):
        path = stage / name
        if path.exists():
            try:
                data = json.loads(path.read_text())
            except ValueError:
                continue
            params = data.get("params", data) if name == "metrics.json" else data
            if isinstance(params, dict) and "out_dir" in params:
                params["out_dir"] = str(final)
                _atomic_write(path, json.dumps(data, indent=2))
    for path in [stage / f"{result.job.slug}.ipynb", stage / "log.txt"]:
        if path.exists():
            _rename_paths(path, wrote, str(final))
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


_running: dict[int, tuple[Job, Path, float]] = {}      # jobs executing now, for the progress line
_running_lock = threading.Lock()


def _n_cells(path: str, cache: dict = {}) -> int:
    if path not in cache:
        try:
            cache[path] = len(read_notebook(Path(path))["cells"])
        except NotebookError:
            cache[path] = 0
    return cache[path]


def job_label(job: Job) -> str:
    """``12-nfi smoke lr=0.1 seed 0``: a job in one line."""
    return " ".join(x for x in (job.slug, job.scale, point_text(job.params), f"seed {job.seed}")
                    if x)


def running_progress(started: set | None = None, write=None) -> str:
    """What the running jobs are doing: ``12-nfi seed 0: cell 5/24``. With ``write``,
    each job seen for the first time is announced with where its live log is."""
    with _running_lock:
        running = list(_running.items())
    parts = []
    for key, (job, stage, _) in running:
        if started is not None and key not in started:
            started.add(key)
            if write is not None:
                write(f"started {job_label(job)}; live log: {stage / 'log.txt'}")
        cell = current_cell(stage / "log.txt")
        total = _n_cells(job.path) + 1               # papermill counts its injected cell
        where = f"cell {cell}/{total}" if cell else "starting its kernel"
        parts.append(f"{job.slug} seed {job.seed}: {where}")
    return "; ".join(parts)


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
    with _running_lock:
        _running[id(job)] = (job, stage, time.time())
    try:
        r = execute(Path(job.path), stage, job.slug, job.run_params(stage), timeout, strict,
                    threads, retries)
    finally:
        with _running_lock:
            _running.pop(id(job), None)
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
    started: set = set()
    shown, last = "", 0.0
    try:
        pending = set(futures)
        while pending and not interrupted.is_set():
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            for fut in done:
                i = futures[fut]
                results[i] = _result_of(fut, jobs[i])
                r = results[i]
                bar.write(f"{r.status}: {job_label(r.job)} ({r.duration_s:.0f} s)")
                bar.update(1)
            if show_progress and time.time() - last > 1.0:     # inside the running jobs
                last = time.time()
                now = running_progress(started, bar.write)
                if now != shown:
                    shown = now
                    bar.set_postfix_str(now[:160], refresh=True)
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
        rows.append((r.job.slug, point_text(r.job.params) or "-", str(r.job.seed), r.status,
                     f"{r.duration_s:.0f}s", f"{held}/{len(r.claims)}" if r.claims else "-",
                     note[:110]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    ok = sum(r.passed for r in results)
    lines.append(f"\n{ok}/{len(results)} jobs passed")
    return "\n".join(lines)
