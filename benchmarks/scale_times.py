"""Each notebook's measured time a seed at smoke and at mid:
``python benchmarks/scale_times.py --smoke-run DIR [--mid-run DIR] [--readme] [--write]``.

Smoke from a run folder of the default smoke runs (``workbench run --all --out DIR``; the
records' own seconds include first runs that trained their caches); mid from the runs the mid
records were made from (``duration_s`` of seeds 0-2 in ``notebooks/results/mid/``), or from
``--mid-run``. The seconds are the notebook's own (kernel start to ``run.finish()``), zoo in the
cache. For its seconds to be a budget measurement, no more jobs than cores may share the machine:
every mid row runs torch on one thread, so two jobs on 2 cores (``--jobs 2``) each run about as
fast as one alone, while more jobs than cores each run slower.
``--readme`` writes the README notebook table's smoke and mid columns; ``--write`` makes the
table the section ``scale-times`` of docs/benchmarks.md (``page.py``). Budgets: smoke 90 s, mid
15 minutes a seed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import notebooks, plan, results  # noqa: E402

import page  # noqa: E402

BUDGET_S = {"smoke": 90, "mid": 15 * 60}


def times(slug: str, scale: str, run: Path | None = None) -> list[float] | None:
    """The seconds of each seed of ``slug``'s default run at ``scale``: in the run folder
    ``run``, else in its record (None without either)."""
    if run is not None:
        ms = sorted(run.glob(f"{slug}/{scale}/seed-*/metrics.json"))
        return [float(json.loads(m.read_text())["duration_s"]) for m in ms] or None
    p = results.path(slug, scale)
    if not p.is_file():
        return None
    return [float(t) for t in json.loads(p.read_text()).get("duration_s", []) if t is not None]


def cell(ts: list[float] | None, scale: str) -> str:
    if not ts:
        return "-"
    worst = max(ts)
    over = " (over budget)" if worst > BUDGET_S[scale] else ""
    return f"{plan.duration(worst)}{over}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--readme", action="store_true",
                    help="write the README notebook table's smoke and mid columns")
    ap.add_argument("--write", action="store_true", help="make it docs/benchmarks.md's section")
    ap.add_argument("--smoke-run", type=Path, required=True,
                    help="a run folder of the default smoke runs")
    ap.add_argument("--note", default="", help="a sentence on how the runs were made (their load)")
    ap.add_argument("--mid-run", type=Path, default=None,
                    help="a run folder of the default mid runs (default: the mid records)")
    args = ap.parse_args(argv)
    rows = {i.number: {"smoke": times(i.slug, "smoke", args.smoke_run),
                       "mid": times(i.slug, "mid", args.mid_run)} for i in notebooks.discover()}
    slugs = {i.number: i.slug for i in notebooks.discover()}
    with page.recorded("scale-times", args.write, fenced=False):
        print("| notebook | smoke, slowest seed | mid, slowest seed | mid, each seed |")
        print("|----|----|----|----|")
        for no, r in rows.items():
            mids = ", ".join(plan.duration(t) for t in r["mid"]) if r["mid"] else "-"
            print(f"| {slugs[no]} | {cell(r['smoke'], 'smoke')} | {cell(r['mid'], 'mid')} | "
                  f"{mids} |")
        print("\nSeconds inside the notebook, the zoo in the cache; smoke from the run folder "
              f"`{args.smoke_run.name}`, mid from "
              + (f"`{args.mid_run.name}`" if args.mid_run else "the runs of the mid records")
              + ". Budgets: smoke 90 s, mid 15 minutes a seed for one job on 2 cores."
              + (f" {args.note}" if args.note else ""))
    if args.readme:
        for scale, header in (("smoke", "smoke a seed"), ("mid", "mid a seed")):
            page.readme_column(header, {no: cell(r[scale], scale) for no, r in rows.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
