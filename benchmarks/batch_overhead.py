"""Runner overhead, measured as a newcomer would: wall time of whole commands.

1. ``workbench run NB`` against plain ``papermill`` on the same notebook and parameters (smoke,
   seed 0), in interleaved pairs whose order alternates, so that load from other processes falls
   on both alike. Target: median ratio <= 1.05.
2. The same batch (NB over several seeds, 2 jobs at a time) with ``--executor dask`` (a local
   cluster it starts itself) against the default process executor. Target: ratio <= 1.10.

For each ``workbench run`` it also splits the wall time into the job itself (``duration_s`` in
job.json: papermill start to end) and the runner's own share (the rest: CLI start, planning,
committing, the report). Usage (from the repository root, the zoo cached):

    python benchmarks/batch_overhead.py --notebook 12-nfi --reps 3 --dask-reps 1
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    t = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout[-2000:]}"
                 f"{done.stderr[-2000:]}")
    return t


def job_seconds(out: Path) -> list[float]:
    return [json.loads(p.read_text())["duration_s"] for p in out.rglob("job.json")
            if not any(part.startswith(".") for part in p.relative_to(out).parts)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--notebook", default="12-nfi")
    ap.add_argument("--reps", type=int, default=3, help="pairs for the papermill comparison")
    ap.add_argument("--dask-reps", type=int, default=1, help="pairs for the dask comparison")
    ap.add_argument("--seeds", default="0,1,2,3", help="the batch of the dask comparison")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    py = sys.executable
    nb = ROOT / "notebooks" / f"{args.notebook}.ipynb"
    tmp = Path(tempfile.mkdtemp(prefix="wb-bench-"))
    rows = []
    try:
        print(f"1. workbench run {args.notebook} vs papermill ({args.reps} pairs)")
        for rep in range(args.reps):
            pm_out, wb_out = tmp / f"pm-{rep}", tmp / f"wb-{rep}"
            pm_out.mkdir()
            pm = [py, "-m", "papermill", str(nb), str(pm_out / "out.ipynb"), "-p", "out_dir",
                  str(pm_out), "--no-progress-bar"]
            wb = [py, "-m", "workbench.cli", "run", args.notebook, "--jobs", "1", "--out",
                  str(wb_out)]
            order = [("papermill", pm), ("workbench", wb)]
            if rep % 2:
                order.reverse()
            t = {name: wall(cmd) for name, cmd in order}
            (job,) = job_seconds(wb_out)
            rows.append((t["papermill"], t["workbench"], job))
            print(f"   pair {rep}: papermill {t['papermill']:.1f} s, workbench run "
                  f"{t['workbench']:.1f} s (job {job:.1f} s, runner {t['workbench'] - job:.1f} s)"
                  f", ratio {t['workbench'] / t['papermill']:.3f}", flush=True)
        pm_med = statistics.median(r[0] for r in rows) if rows else float("nan")
        wb_med = statistics.median(r[1] for r in rows) if rows else float("nan")
        print(f"   median: papermill {pm_med:.1f} s, workbench run {wb_med:.1f} s, ratio of "
              f"medians {wb_med / pm_med:.3f}, median ratio "
              f"{statistics.median([r[1] / r[0] for r in rows] or [float('nan')]):.3f}, "
              f"runner's own share "
              f"{statistics.median([r[1] - r[2] for r in rows] or [float('nan')]):.2f} s "
              "(target ratio <= 1.05)")

        print(f"2. {args.notebook} seeds {args.seeds}, {args.jobs} jobs: --executor dask vs "
              f"process ({args.dask_reps} pairs)")
        pairs = []
        for rep in range(args.dask_reps):
            t = {}
            order = ["process", "dask"] if rep % 2 == 0 else ["dask", "process"]
            for ex in order:
                out = tmp / f"{ex}-{rep}"
                t[ex] = wall([py, "-m", "workbench.cli", "run", args.notebook, "--seeds",
                              args.seeds, "--jobs", str(args.jobs), "--executor", ex,
                              "--out", str(out)])
                t[ex + " jobs"] = sum(job_seconds(out))
            pairs.append(t)
            print(f"   pair {rep}: process {t['process']:.1f} s (jobs {t['process jobs']:.1f} "
                  f"s summed), dask {t['dask']:.1f} s (jobs {t['dask jobs']:.1f} s summed), "
                  f"ratio {t['dask'] / t['process']:.3f}", flush=True)
        if pairs:
            print(f"   median ratio "
                  f"{statistics.median(p['dask'] / p['process'] for p in pairs):.3f}"
                  " (target <= 1.10)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
