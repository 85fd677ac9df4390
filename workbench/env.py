"""Where the workbench runs: the checkout, the cache, and whether anyone is watching.

The small facts that the runtime, the progress bars, the notebook discovery and the CLI all need.
It imports nothing from the package, so every other module can depend on it (one-way arrows).
"""
from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

__all__ = ["project_root", "cache_dir", "git_info", "strict_mode", "interactive", "batch_mode",
           "in_ipython", "torch_threads"]


def project_root() -> Path:
    """The checkout that holds ``pyproject.toml`` and ``notebooks/`` (or ``$WORKBENCH_HOME``)."""
    if os.environ.get("WORKBENCH_HOME"):
        return Path(os.environ["WORKBENCH_HOME"]).resolve()
    here = Path(__file__).resolve().parents[1]
    if (here / "notebooks").is_dir():
        return here
    return Path.cwd()


def cache_dir() -> Path:
    """Where built backbones and generated data live: ``$WORKBENCH_CACHE`` or ``data/cache``."""
    path = Path(os.environ.get("WORKBENCH_CACHE") or project_root() / "data" / "cache")
    path.mkdir(parents=True, exist_ok=True)
    return path


def git_info(root: Path | None = None) -> dict:
    """The commit checked out at ``root`` (default the checkout) and whether it is ``dirty``:
    whether a tracked file differs from that commit. Untracked files (scratch, run folders) do
    not count; a result is reproduced from the commit plus its tracked edits. ``None`` for both
    where git or the repository is missing. What ``env.json`` and the run's ``plan.json`` hold."""
    def git(*args):
        out = subprocess.run(["git", *args], cwd=root or project_root(), capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    try:
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": None if commit is None or dirty is None else bool(dirty)}


def strict_mode() -> bool:
    """``WORKBENCH_STRICT=1`` (the test suite sets it): a robust claim that fails raises."""
    return os.environ.get("WORKBENCH_STRICT", "").lower() in ("1", "true", "yes")


def batch_mode() -> bool:
    """Run by CI or by ``workbench run`` (which sets ``WORKBENCH_BATCH``): logs, not screens."""
    return bool(os.environ.get("CI") or os.environ.get("WORKBENCH_BATCH"))


def runner_job() -> bool:
    """A job of ``workbench run`` (the runner sets ``WORKBENCH_BATCH``): its executed notebook is
    kept, and the book (``workbench book``) reads it."""
    return bool(os.environ.get("WORKBENCH_BATCH"))


def in_ipython() -> bool:
    """Running inside an IPython kernel or shell (Jupyter, papermill, nbval), watched or not."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def interactive() -> bool:
    """True in a live Jupyter session, False under papermill, nbval, CI or a plain script."""
    if batch_mode() or strict_mode():
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and shell.__class__.__name__ == "ZMQInteractiveShell" \
        and not _parent_is_papermill()


def _parent_is_papermill() -> bool:
    """A kernel started by papermill or nbval (no one is watching it) rather than by a person."""
    try:
        cmd = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b"papermill" in cmd or b"pytest" in cmd


@contextmanager
def torch_threads(n: int):
    """torch runs on ``n`` CPU threads inside the block and on the caller's count after it. The
    zoo's builds pin theirs: on a shared 2-core CPU, OpenMP threads waiting for each other beside
    a second build made steps up to 10x slower, and some builds' weights depend on the count."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)
