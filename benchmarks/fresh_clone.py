"""A fresh clone, timed as a newcomer meets it: bootstrap, the shipped zoo, then ``make run`` or
``make test`` (targets on the 2-core machine: ``make run`` within 20 minutes, ``.ci/run`` within
25).

The clone is made from this checkout's committed ``HEAD`` (``git clone``: no uncommitted file,
no cache, no ``.venv``) into a temporary folder, and each phase is one ``make`` target, timed from
outside: ``bootstrap`` (``.venv``: CPU torch from the wheel cache, then the package),
``zoo`` (the shipped checkpoints copied into the cache), then ``run`` (19 notebooks at smoke)
or ``test`` (what ``.ci/run`` calls). Nothing else should run meanwhile: the numbers are wall
time. The phases and the load average are printed and written as JSON; after ``run``, each
notebook's seconds and the cache entries it built, copied from the shipped ``data/zoo`` /
``data/smoke`` or found (its ``metrics.json``): a shipped entry whose key moved shows as built.
With ``--write`` what it prints becomes the section ``fresh-clone-run`` (``-test``, ``-zoo``) of
docs/benchmarks.md (``page.py``). Usage, from the repository root:

    python benchmarks/fresh_clone.py --target run --out runs/fresh_clone.json --write
    python benchmarks/fresh_clone.py --target test --write
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import page

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], cwd: Path, log: Path) -> dict:
    """Run ``cmd`` in ``cwd`` (output to ``log``); its wall seconds, exit status, load after."""
    t0 = time.time()
    with log.open("w") as f:
        rc = subprocess.call(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                             env={**os.environ, "WORKBENCH_CACHE": ""})
    return {"cmd": " ".join(cmd), "seconds": round(time.time() - t0, 1), "rc": rc,
            "load_after": os.getloadavg()[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=("run", "test", "zoo"), default="run",
                    help="the last phase: make run (19 notebooks), make test (CI), or stop at zoo")
    ap.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    ap.add_argument("--out", type=Path, help="write the phases as JSON here")
    ap.add_argument("--write", action="store_true", help="make it docs/benchmarks.md's section")
    args = ap.parse_args(argv)
    with page.recorded(f"fresh-clone-{args.target}", args.write):
        return measure(args)


def measure(args) -> int:
    """Clone, time each phase, print the phases as JSON; the largest exit status."""
    where = Path(tempfile.mkdtemp(prefix="workbench-fresh-"))
    clone = where / "clone"
    subprocess.check_call(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)])
    phases = {"load_before": os.getloadavg()[0]}
    phases["bootstrap"] = timed(["make", ".venv/.installed"], clone, where / "bootstrap.log")
    phases["zoo"] = timed(["make", "zoo"], clone, where / "zoo.log")
    if args.target != "zoo":
        phases[args.target] = timed(["make", args.target], clone, where / f"{args.target}.log")
    total = sum(p["seconds"] for p in phases.values() if isinstance(p, dict) and "seconds" in p)
    if args.target == "run":
        phases["notebooks"] = notebooks(clone / "runs" / "main")
    phases["total_minutes"] = round(total / 60, 1)
    print(json.dumps(phases, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(phases, indent=1) + "\n")
    print(f"logs and clone: {where}" if args.keep else f"logs: {where}/*.log", file=sys.stderr)
    if not args.keep:
        subprocess.call(["rm", "-rf", str(clone)])
    return max(p["rc"] for p in phases.values() if isinstance(p, dict) and "rc" in p)


def notebooks(run_dir: Path) -> dict:
    """``{slug: {"seconds", "built": [entries], "copied": n, "there": n}}`` from the run's
    ``metrics.json`` files."""
    out = {}
    for m in sorted(run_dir.glob("*/smoke/seed-*/metrics.json")):
        met = json.loads(m.read_text())
        how = [e["how"] for e in met.get("cache", [])]
        out[met["notebook"]] = {"seconds": met.get("duration_s"),
                                "built": [e["entry"] for e in met.get("cache", [])
                                          if e["how"] == "built"],
                                "copied": how.count("copied"), "there": how.count("there")}
    return out


if __name__ == "__main__":
    sys.exit(main())
