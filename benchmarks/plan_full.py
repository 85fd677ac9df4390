"""Every notebook's estimated cost at full scale on one H100 (workbench/plan.py), as a markdown
table: ``python benchmarks/plan_full.py [--scale full] [--json OUT] [--readme] [--write]``.
``--readme`` rewrites the last column of the README's notebook table; ``--write`` makes the table
the section ``plan-full`` of docs/benchmarks.md (``page.py``).

Estimates from each notebook's SIZES row and its zoo models' configs at a stated utilisation,
not measurements (no GPU was at hand when the table was written). The zoo builds a notebook
would start when the cache lacks them are listed beside it: each builds once, then every
notebook that uses it reads the cache.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import notebooks, plan  # noqa: E402

import page  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--scale", default="full", choices=("smoke", "mid", "full"))
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--readme", action="store_true",
                    help="rewrite the README's notebook table with the estimates' column")
    ap.add_argument("--write", action="store_true", help="make it docs/benchmarks.md's section")
    args = ap.parse_args(argv)
    rows = [plan.estimate(i.slug, i.path, args.scale).row() for i in notebooks.discover()]
    with page.recorded(f"plan-{args.scale}", args.write, fenced=False):
        print(plan.table(rows))
        over = [r["notebook"] for r in rows if r["h100_s"] > plan.BUDGET_S]
        print(f"\nAssumed: {plan.assumptions()}. Over the 10-minute budget: "
              f"{', '.join(over) or 'none'}.")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.readme:
        readme_table(rows)
    return 0


def readme_table(rows: list[dict]) -> None:
    """The README notebook table's column of these estimates (:func:`page.readme_column`)."""
    page.readme_column("full on one H100 (est.)", {
        r["notebook"][:2]: f"{plan.duration(r['h100_s'])}, {r['peak_gib']:.1f} GiB" for r in rows})


if __name__ == "__main__":
    sys.exit(main())
