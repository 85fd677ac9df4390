"""Runner overhead, measured as a newcomer would: wall time of whole commands.

1. ``workbench run NB`` against plain ``papermill`` on the same notebook and parameters (smoke,
   seed 0), in interleaved pairs whose order alternates, so that load from other processes falls
   on both alike. Target: median ratio <= 1.05.
2. The same batch (NB over several seeds, 2 jobs at a time) with ``--executor dask`` (a local
   cluster it starts itself) against the default process executor. Target: ratio <= 1.10.

For each ``workbench run`` it also splits the wall time into the job itself (``duration_s`` in
job.json: papermill start to end) and the runner's own share (the rest: CLI start, planning,
committing, the report).

Wall time on a shared machine moves with whatever else runs, so each command's process tree is
also watched from outside (``/proc``, every 0.2 s; Linux only): the CPU seconds of the whole
command (its exit ``rusage``, children included), of the notebooks' kernels, and of the rest
(papermill, the runner, and with dask the scheduler, nannies and workers); what each kernel
actually sees (threads, ``OMP/MKL/OPENBLAS_NUM_THREADS``, CPU affinity); and the CPU the rest of
the machine used meanwhile (``others``, in cores: the load the command ran beside). CPU seconds
and thread counts barely move with load; wall time does. With ``--write`` what it prints becomes
the section ``batch-overhead`` of docs/benchmarks.md (``page.py``). Usage (from the repository
root, the zoo cached):

    python benchmarks/batch_overhead.py --notebook 12-nfi --reps 3 --dask-reps 3 --write
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import page

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _stat(pid: int) -> tuple[int, float, int] | None:
    """(parent pid, CPU seconds, threads) of a live process, from /proc/PID/stat."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(f[1]), (int(f[11]) + int(f[12])) / TICK, int(f[17])


def _machine_cpu() -> float:
    """CPU seconds the whole machine has used (all cores, from /proc/stat); nan without it."""
    try:
        f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        return (sum(int(x) for x in f[:8]) - int(f[3]) - int(f[4])) / TICK
    except (OSError, ValueError, IndexError):
        return float("nan")


class Tree:
    """Watches the processes below ``root`` until stopped: the last CPU seconds and the most
    threads seen for each, and for each notebook kernel its thread variables and affinity."""

    def __init__(self, root: int, every: float = 0.2):
        self.root, self.every, self.procs = root, every, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every)

    def sample(self):
        stats = {}
        for d in os.listdir("/proc"):
            if d.isdigit() and (s := _stat(int(d))) is not None:
                stats[int(d)] = s
        below, frontier = [p for p in (self.root,) if p in stats], {self.root}
        while frontier:                 # level by level: a process's parent comes before it
            frontier = {p for p, s in stats.items() if s[0] in frontier} - set(below)
            below += sorted(frontier)
        for pid in below:
            _, cpu, threads = stats[pid]
            p = self.procs.get(pid)
            try:        # read each time: a child seen between fork and exec has its parent's
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if p is None or p["cmd"] != cmd[:80]:
                up = self.procs.get(stats[pid][0], {}).get("kind")
                kind = ("runner" if pid == self.root
                        else "kernel" if "ipykernel" in cmd and up != "kernel"
                        else "papermill" if "papermill" in cmd and up != "papermill"
                        else "worker" if "spawn_main" in cmd else "other")
                p = self.procs[pid] = {"kind": kind, "cpu": 0.0, "threads": 0, "cmd": cmd[:80]}
                if kind == "kernel":
                    try:
                        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ")
                                   .read_bytes().decode(errors="replace").split("\0") if "=" in kv)
                        p["env"] = {v: env.get(v) for v in THREAD_VARS}
                        p["affinity"] = len(os.sched_getaffinity(pid))
                    except OSError:
                        pass
            p["cpu"], p["threads"] = cpu, max(p["threads"], threads)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.procs


def measure(cmd: list[str]) -> dict:
    """Run a whole command: its wall time; its CPU seconds (the command and every descendant,
    from this process's children ``rusage``: one command runs at a time); what the watcher saw;
    and the rest of the machine's CPU meanwhile, in cores (``others``: the load beside it)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    machine0 = _machine_cpu()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    tree = Tree(proc.pid) if Path("/proc/self/stat").exists() else None
    out = proc.communicate()[0]
    t = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = tree.stop() if tree else {}
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{out[-3000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    kernels = [p for p in procs.values() if p["kind"] == "kernel"]
    by_kind = {}
    for p in procs.values():
        by_kind[p["kind"]] = by_kind.get(p["kind"], 0.0) + p["cpu"]
    return {"wall": t, "cpu": cpu, "kernel_cpu": sum(p["cpu"] for p in kernels),
            "kernels": kernels, "by_kind": by_kind,
            "procs": [(p["kind"], p["cpu"], p["cmd"]) for p in procs.values() if p["cpu"] >= 0.1], "others": (_machine_cpu() - machine0 - cpu) / t,
            "load": os.getloadavg()[0]}


def job_seconds(out: Path) -> list[float]:
    return [json.loads(p.read_text())["duration_s"] for p in out.rglob("job.json")
            if not any(part.startswith(".") for part in p.relative_to(out).parts)]


def cell_seconds(out: Path) -> float:
    """Seconds the jobs' cells ran (papermill's per-cell durations in the executed notebooks):
    the rest of a job's time is papermill's start, the kernel's start and the saves."""
    total = 0.0
    for p in out.rglob("job.json"):
        if any(part.startswith(".") for part in p.relative_to(out).parts):
            continue
        nb = json.loads((p.parent / f"{json.loads(p.read_text())['job']['slug']}.ipynb")
                        .read_text())
        total += sum(c.get("metadata", {}).get("papermill", {}).get("duration") or 0.0
                     for c in nb["cells"])
    return total


def numbers(out: Path) -> dict:
    """seed directory -> the "metrics" and "claims" of its metrics.json: what must not move."""
    return {str(p.parent.relative_to(out)): {k: json.loads(p.read_text()).get(k)
                                             for k in ("metrics", "claims")}
            for p in sorted(out.rglob("metrics.json"))
            if not any(part.startswith(".") for part in p.relative_to(out).parts)}


def kernel_view(m: dict) -> str:
    """What the command's kernels saw: threads at most, thread variables, CPUs allowed."""
    ks = m["kernels"]
    if not ks:
        return "kernels not seen"
    envs = {tuple((k.get("env") or {}).get(v) for v in THREAD_VARS) for k in ks}
    return (f"{len(ks)} kernels: {max(k['threads'] for k in ks)} threads at most, "
            f"OMP/MKL/OPENBLAS {' or '.join('/'.join(str(x) for x in e) for e in sorted(envs, key=str))}, "
            f"{' or '.join(str(a) for a in sorted({k.get('affinity') for k in ks}, key=str))} CPUs allowed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--notebook", default="12-nfi", help="a slug, or a notebook's path")
    ap.add_argument("--reps", type=int, default=3, help="pairs for the papermill comparison")
    ap.add_argument("--dask-reps", type=int, default=3, help="pairs for the dask comparison")
    ap.add_argument("--seeds", default="0,1,2,3", help="the batch of the dask comparison")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write every measurement here")
    ap.add_argument("--write", action="store_true", help="make it docs/benchmarks.md's section")
    args = ap.parse_args()
    with page.recorded("batch-overhead", args.write):
        return measure(args)


def measure(args) -> int:
    """The two comparisons, pair by pair, printed as they go."""
    py = sys.executable
    nb = Path(args.notebook) if args.notebook.endswith(".ipynb") else \
        ROOT / "notebooks" / f"{args.notebook}.ipynb"
    tmp = Path(tempfile.mkdtemp(prefix="wb-bench-"))
    rows, pairs = [], []
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start")
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
            t = {name: measure(cmd)["wall"] for name, cmd in order}
            (job,) = job_seconds(wb_out)
            rows.append((t["papermill"], t["workbench"], job))
            print(f"   pair {rep}: papermill {t['papermill']:.1f} s, workbench run "
                  f"{t['workbench']:.1f} s (job {job:.1f} s, runner {t['workbench'] - job:.1f} s)"
                  f", ratio {t['workbench'] / t['papermill']:.3f}", flush=True)
        if rows:
            pm_med = statistics.median(r[0] for r in rows)
            wb_med = statistics.median(r[1] for r in rows)
            print(f"   median: papermill {pm_med:.1f} s, workbench run {wb_med:.1f} s, ratio of "
                  f"medians {wb_med / pm_med:.3f}, median ratio "
                  f"{statistics.median(r[1] / r[0] for r in rows):.3f}, runner's own share "
                  f"{statistics.median(r[1] - r[2] for r in rows):.2f} s (target ratio <= 1.05)")

        print(f"2. {args.notebook} seeds {args.seeds}, {args.jobs} jobs: --executor dask vs "
              f"process ({args.dask_reps} pairs)")
        for rep in range(args.dask_reps):
            t = {}
            order = ["process", "dask"] if rep % 2 == 0 else ["dask", "process"]
            for ex in order:
                out = tmp / f"{ex}-{rep}"
                m = measure([py, "-m", "workbench.cli", "run", args.notebook, "--seeds",
                             args.seeds, "--jobs", str(args.jobs), "--executor", ex,
                             "--out", str(out)])
                m["jobs"] = sum(job_seconds(out))
                m["cells"] = cell_seconds(out)
                t[ex] = m
                kinds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(m["by_kind"].items())
                                  if v >= 0.05)
                print(f"   pair {rep} {ex:>7}: {m['wall']:.1f} s wall, jobs {m['jobs']:.1f} s "
                      f"summed (cells {m['cells']:.1f} s, start and saves "
                      f"{m['jobs'] - m['cells']:.1f} s), in which the kernels got {m['kernel_cpu'] / m['jobs']:.2f} "
                      f"cores each; CPU {m['cpu']:.1f} s ({kinds}); beside it "
                      f"{m['others']:.2f} cores of other work; {kernel_view(m)}", flush=True)
            t["ratio"] = t["dask"]["wall"] / t["process"]["wall"]
            same = numbers(tmp / f"process-{rep}") == numbers(tmp / f"dask-{rep}")
            t["same_numbers"] = same
            print(f"   pair {rep}: ratio {t['ratio']:.3f}; metrics and claims "
                  f"{'identical' if same else 'DIFFER'} between the executors", flush=True)
            pairs.append(t)
        if pairs:
            med = lambda f: statistics.median(f(p) for p in pairs)
            print(f"   medians: wall process {med(lambda p: p['process']['wall']):.1f} s, dask "
                  f"{med(lambda p: p['dask']['wall']):.1f} s, ratio {med(lambda p: p['ratio']):.3f}"
                  f" (target <= 1.10); CPU process {med(lambda p: p['process']['cpu']):.1f} s, "
                  f"dask {med(lambda p: p['dask']['cpu']):.1f} s, ratio "
                  f"{med(lambda p: p['dask']['cpu'] / p['process']['cpu']):.3f}; kernel CPU process "
                  f"{med(lambda p: p['process']['kernel_cpu']):.1f} s, dask "
                  f"{med(lambda p: p['dask']['kernel_cpu']):.1f} s; rest process "
                  f"{med(lambda p: p['process']['cpu'] - p['process']['kernel_cpu']):.1f} s, dask "
                  f"{med(lambda p: p['dask']['cpu'] - p['dask']['kernel_cpu']):.1f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if args.json:
            args.json.write_text(json.dumps({"papermill": rows, "dask": pairs}, indent=1,
                                            default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
