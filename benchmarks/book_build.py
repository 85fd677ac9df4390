"""How long ``make book`` takes on top of an existing run: ``workbench book RUN_DIR`` timed as a
reader runs it, a cold build (empty ``--out``) and then a rebuild with nothing changed.

Each build is its own ``workbench book`` process (CLI start, the sources, Sphinx with ``--jobs``
processes); wall time and the CPU seconds of the process and its children (``rusage``) are
printed, with the machine's load beside it (``/proc/loadavg``): on a shared machine the wall time
moves with load, the CPU seconds barely. Target: at most 2 minutes on 2 cores. With ``--write``
what it prints becomes the section ``book-build`` of docs/benchmarks.md (``page.py``).
Usage (from the repository root; RUN_DIR a ``workbench run --all`` output, or a folder of
symlinks to notebook folders of several runs)::

    python benchmarks/book_build.py runs/main --reps 2 --write
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import page

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall s, CPU s of the children) of one command, which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--reps", type=int, default=1, help="cold builds (each followed by a rebuild)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="make it docs/benchmarks.md's section")
    a = ap.parse_args()
    with page.recorded("book-build", a.write):
        return measure(a)


def measure(a) -> int:
    """Time ``a.reps`` cold builds, each followed by a rebuild; print one line each."""
    n = sum(1 for p in Path(a.run_dir).iterdir() if p.is_dir() and p.name[:2].isdigit())
    cmd = [sys.executable, "-m", "workbench.cli", "book", a.run_dir, "--jobs", str(a.jobs)]
    print(f"{n} notebook folders in {a.run_dir}; {os.cpu_count()} cores; --jobs {a.jobs}")
    for rep in range(a.reps):
        out = Path(tempfile.mkdtemp(prefix="book-bench-"))
        try:
            for kind in ("cold", "rebuild"):
                load = Path("/proc/loadavg").read_text().split()[0]
                wall, cpu = timed(cmd + ["--out", str(out)])
                print(f"rep {rep} {kind:8s} wall {wall:6.1f} s  cpu {cpu:6.1f} s  load {load}")
        finally:
            shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
