"""The GPU check: notebooks run on a device, their measured time against ``workbench plan``'s
estimate, and what the device audit found: ``python benchmarks/gpu_check.py [--device cuda|cpu]
[--smoke NN,..] [--full NN,..] [--out DIR] [--write]`` (``make gpu-check``; ``make gpu-check
DEVICE=cpu`` on a machine without CUDA).

On CUDA (the default where torch sees one) every notebook runs at smoke with ``-p device cuda``,
then two at full (07 and 13, the shortest full runs by the estimate); a tensor left on the host
next to a CUDA one stops its run there, which the table reports as a failure with its cell. On the
CPU (``--device cpu``) a small notebook (13) runs at smoke under the device audit
(``WORKBENCH_DEVICE_AUDIT=1``, placement.py: the run's device is the sentinel ``cpu:0``, so a
forgotten ``.to(run.device)`` shows as a finding), and the comparison is against the plan's CPU
figure, its FLOPs at one thread's measured rate (a lower bound: fixed per-step costs come on top).
Every job is its own ``workbench run`` process; the table has, per job: the notebook, its scale,
the measured seconds (``metrics.json``'s ``duration_s``), the estimate, their ratio, and the
device audit's findings (``device_audit.json``: a count by kind and the first site).
``--write`` makes the table section ``gpu-check`` of docs/benchmarks.md (``page.py``).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench import notebooks, plan  # noqa: E402

import page  # noqa: E402

FULL = ("07", "13")            # the two shortest full runs by the estimate (README's table)
CPU_SMOKE = ("13",)            # the CPU fallback in `make test`: one small smoke notebook under the
#                                audit (tests/test_placement.py runs 07 and 13 so already)


def default_device() -> str:
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def jobs(device: str, smoke: list[str] | None, full: list[str] | None) -> list[tuple[str, str]]:
    """``(notebook number, scale)`` of every job: the smoke ones, then the full ones."""
    every = [i.slug[:2] for i in notebooks.discover()]
    if smoke is None:
        smoke = every if device == "cuda" else list(CPU_SMOKE)
    if full is None:
        full = list(FULL) if device == "cuda" else []
    return [(n, "smoke") for n in smoke] + [(n, "full") for n in full]


def findings(audit: list[dict] | None) -> str:
    """The device audit's findings in a table cell: a count by kind and the first site."""
    if audit is None:
        return "no audit (CUDA: a misplaced tensor fails the run)"
    if not audit:
        return "none"
    kinds = collections.Counter(v["kind"] for v in audit)
    first = audit[0].get("where", "").replace("|", "/")
    return ", ".join(f"{k} x{c}" for k, c in sorted(kinds.items())) + f" (first: {first})"


def run_one(number: str, scale: str, device: str, out: Path, timeout: int) -> dict:
    """One ``workbench run`` of ``number`` at ``scale`` on ``device`` under the audit; its row."""
    info = notebooks.resolve(number)
    slug = info.slug
    est = plan.estimate(slug, info.path, scale)
    if device == "cuda":
        estimate_s, what = est.seconds, "H100"
    else:
        estimate_s, what = est.cpu_seconds(plan.cpu_rate()[0]), "CPU FLOPs"
    env = {**os.environ, "WORKBENCH_DEVICE_AUDIT": "1"}
    folder = out / f"{slug}-{scale}"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "run", number, "--scale", scale,
                           "-p", "device", device, "--jobs", "1", "--out", str(folder),
                           "--timeout", str(timeout)], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    wall = time.time() - t0
    metrics = next(folder.rglob("metrics.json"), None)
    audit = next(folder.rglob("device_audit.json"), None)
    row = {"notebook": slug, "scale": scale, "device": device, "ok": proc.returncode == 0,
           "measured_s": json.loads(metrics.read_text())["duration_s"] if metrics else wall,
           "estimate_s": estimate_s, "estimate_of": what,
           "audit": json.loads(audit.read_text()) if audit else None}
    if not row["ok"]:
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        row["error"] = " ".join(tail[-2:])[:200] if tail else f"exit {proc.returncode}"
    return row


def table(rows: list[dict]) -> str:
    lines = ["| notebook | scale | device | status | measured | estimate | measured / estimate "
             "| device audit |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["measured_s"] / r["estimate_s"] if r["estimate_s"] else float("nan")
        status = "ok" if r["ok"] else f"failed: {r.get('error', '')}".replace("|", "/")
        lines.append(f"| {r['notebook']} | {r['scale']} | {r['device']} | {status} | "
                     f"{r['measured_s']:.1f} s | {r['estimate_s']:.1f} s ({r['estimate_of']}) | "
                     f"{ratio:.2f} | {findings(r['audit'] if r['device'] == 'cpu' else None)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default=None, choices=("cuda", "cpu"),
                    help="cuda where torch sees one, else cpu")
    ap.add_argument("--smoke", default=None, help="notebook numbers at smoke (comma list)")
    ap.add_argument("--full", default=None, help="notebook numbers at full (comma list)")
    ap.add_argument("--out", default=None, help="run folder (default: a temporary one)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per job")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--write", action="store_true", help="make it docs/benchmarks.md's section")
    args = ap.parse_args(argv)
    device = args.device or default_device()
    if device == "cuda" and default_device() != "cuda":
        print("gpu_check: no CUDA device; run it with --device cpu", file=sys.stderr)
        return 2
    split = (lambda s: None if s is None else [x for x in s.split(",") if x])
    todo = jobs(device, split(args.smoke), split(args.full))
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    rows = []
    for number, scale in todo:
        rows.append(run_one(number, scale, device, out, args.timeout))
        r = rows[-1]
        print(f"{r['notebook']} {scale}: {'ok' if r['ok'] else 'FAILED'} in "
              f"{r['measured_s']:.1f} s", file=sys.stderr)
    with page.recorded("gpu-check", args.write, fenced=False):
        print(table(rows))
        print(f"\nEstimates: `workbench plan` ({plan.assumptions()}); on the CPU, the plan's "
              f"FLOPs at {plan.cpu_rate()[1]}, a lower bound.")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    bad = [r for r in rows if not r["ok"] or (r["device"] == "cpu" and r["audit"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
