"""Compare two run folders: which metrics and verdicts differ, job by job.

``workbench compare BEFORE AFTER [--tol 0]`` (or ``python -m workbench.compare``) reads every
``metrics.json`` under both folders (``<slug>/<params>/seed-N/``), pairs the jobs, and prints each
metric whose value differs by more than ``--tol`` (relative) and each claim whose verdict differs,
then one summary line; exit status 1 when anything differs. Timings (``duration_s``, names ending
``_s``, ``seconds``, ``_time``, and whatever a run names in its ``clock`` lists: ``run.clock``,
a claim's ``clock=``) are left out: they measure the machine, not the experiment. A metric that
only the second run records is listed as added, not as a difference (a refactor may record more
numbers for its prose; it may not move one). A refactor that must not move a number is checked with
``--tol 0``.

Torch-free.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

__all__ = ["load_runs", "is_timing", "diff_metrics", "added_metrics", "compare",
           "add_arguments", "run", "main"]

TIMING_SUFFIXES = ("_s", "_seconds", "seconds", "_time", "_sec", "_ms")
TIMING_WORDS = ("seconds", "_ms", "wall", "cost_ratio", "speedup", "time_", "timing", "latency",
                "throughput", "step_s", "step_ratio", "(s)", "_over_forward")   # wall-clock costs


def load_runs(root: Path) -> dict[str, dict]:
    """``{"<slug>/<params>/seed-N": metrics.json}`` under ``root`` (hidden staging folders out)."""
    root = Path(root)
    out = {}
    for p in sorted(root.glob("*/*/seed-*/metrics.json")):
        rel = p.parent.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        out[str(rel)] = json.loads(p.read_text())
    return out


def is_timing(name: str) -> bool:
    """A wall-clock measure: any dotted part of the name ends like a time (``train_s``,
    ``step_ms``) or names a cost ratio or speed-up measured on the clock."""
    parts = name.lower().split(".")
    return any(p.endswith(TIMING_SUFFIXES) or any(w in p for w in TIMING_WORDS) for p in parts)


def _flat(d, prefix=""):
    """Nested dicts and lists of metrics as ``a.b.0`` -> scalar."""
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(d, (list, tuple)):
        for i, v in enumerate(d):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], d


def _differs(a, b, tol: float) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or not all(
            isinstance(x, (int, float)) for x in (a, b)):
        return a != b
    if math.isnan(a) and math.isnan(b):
        return False
    if tol == 0:
        return a != b
    return abs(a - b) > tol * max(abs(a), abs(b), 1e-12)


def _clocked(name: str, clock: set) -> bool:
    """A timing by its name, or one a run named in its ``clock`` list (``run.clock``, a claim's
    ``clock=``): the list of either run counts, so a run that names a measure for the first time
    is compared with one from before it did."""
    return is_timing(name) or name.split(".")[0] in clock


def diff_metrics(before: dict, after: dict, tol: float = 0.0) -> list[str]:
    """Lines naming every metric, claim verdict or claim evidence that differs."""
    lines = []
    clock = set(before.get("clock", [])) | set(after.get("clock", []))
    ma = {k: v for k, v in _flat(before.get("metrics", {})) if not _clocked(k, clock)}
    mb = {k: v for k, v in _flat(after.get("metrics", {})) if not _clocked(k, clock)}
    for k in sorted(set(ma) | set(mb)):
        if k not in ma:
            continue                                  # added: counted by added_metrics
        if k not in mb:
            lines.append(f"metric {k}: missing after")
        elif _differs(ma[k], mb[k], tol):
            lines.append(f"metric {k}: {ma[k]!r} -> {mb[k]!r}")
    ca = {c["id"]: c for c in before.get("claims", [])}
    cb = {c["id"]: c for c in after.get("claims", [])}
    for cid in sorted(set(ca) | set(cb)):
        if cid not in ca or cid not in cb:
            lines.append(f"claim {cid}: {'missing before' if cid not in ca else 'missing after'}")
            continue
        if ca[cid].get("holds") != cb[cid].get("holds"):
            lines.append(f"claim {cid}: holds {ca[cid].get('holds')} -> {cb[cid].get('holds')}")
        held = set(ca[cid].get("clock", [])) | set(cb[cid].get("clock", []))
        ea = {k: v for k, v in _flat(ca[cid].get("evidence", {})) if not _clocked(k, held)}
        eb = {k: v for k, v in _flat(cb[cid].get("evidence", {})) if not _clocked(k, held)}
        for k in sorted(set(ea) | set(eb)):
            if k not in ea or k not in eb or _differs(ea[k], eb[k], tol):
                lines.append(f"claim {cid} evidence {k}: {ea.get(k, '(none)')!r} -> "
                             f"{eb.get(k, '(none)')!r}")
    return lines


def added_metrics(before: dict, after: dict) -> list[str]:
    """Metrics only ``after`` records (new numbers, not moved ones)."""
    ma = {k for k, _ in _flat(before.get("metrics", {}))}
    clock = set(after.get("clock", []))
    return sorted(k for k, _ in _flat(after.get("metrics", {}))
                  if k not in ma and not _clocked(k, clock))


def compare(before: Path, after: Path, tol: float = 0.0, only=None) -> dict:
    """The two folders, job by job: ``differences`` (``job: line``), ``compared`` (jobs in both),
    ``added`` (metrics only ``after`` records) and ``unpaired`` (jobs only one folder holds)."""
    a, b = load_runs(before), load_runs(after)
    keep = (lambda j: not only or j.split("/")[0] in only)               # noqa: E731
    jobs = [j for j in sorted(set(a) & set(b)) if keep(j)]
    return {"differences": [f"{j}: {line}" for j in jobs for line in diff_metrics(a[j], b[j], tol)],
            "compared": len(jobs),
            "added": sum(len(added_metrics(a[j], b[j])) for j in jobs),
            "unpaired": [f"{j}: only in {'before' if j in a else 'after'}"
                         for j in sorted(set(a) ^ set(b)) if keep(j)]}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The command's arguments, for ``workbench compare`` and ``python -m workbench.compare``."""
    ap.add_argument("before", type=Path, help="run folder (as written by workbench run --out)")
    ap.add_argument("after", type=Path)
    ap.add_argument("--tol", type=float, default=0.0, help="relative tolerance (default 0: exact)")
    ap.add_argument("--only", nargs="*", help="notebook slugs to compare (default: all in both)")


def run(args) -> int:
    """Print the differences of the parsed ``args`` (:func:`add_arguments`); 1 when any, 2 when
    a folder is missing, else 0."""
    for d in (args.before, args.after):
        if not d.is_dir():
            print(f"error: {d} is not a run folder", file=sys.stderr)
            return 2
    c = compare(args.before, args.after, args.tol, args.only)
    print("\n".join(c["differences"] + [f"(not compared) {u}" for u in c["unpaired"]]))
    print(f"{c['compared']} jobs compared, {len(c['differences'])} differences"
          + (f" (tol {args.tol})" if args.tol else " (exact)")
          + f"; {c['added']} metrics recorded only after (added, not moved)")
    return 1 if c["differences"] else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.compare",
                                 description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
