"""What fewer training steps cost a zoo backbone (build time against quality).

Builds each named recipe at each step count into a scratch directory (the cache is not touched)
and prints its build seconds, held-out perplexity, and exact match at the middle difficulty of
every trained family, beside the cached build at the recipe's own steps when there is one.
Run two at a time on a 2-core machine to see the times `zoo build --all` sees.

    python benchmarks/zoo_steps.py lm-base --steps 3000 3500 [--out /tmp/zoo_steps]

The cosine schedule follows the step count, so a shorter run also decays sooner.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recipes", nargs="+", help="zoo recipe names, e.g. lm-instruct")
    ap.add_argument("--steps", type=int, nargs="+", required=True)
    ap.add_argument("--out", default=None, help="scratch directory (default: a temporary one)")
    a = ap.parse_args()
    os.environ.setdefault("WORKBENCH_PROGRESS", "0")
    from workbench.models import zoo
    from workbench.models import training
    out = Path(a.out or tempfile.mkdtemp(prefix="zoo_steps-"))
    for name in a.recipes:
        r = zoo.recipe(name)
        cached = zoo.model_dir(name) / "card.json"
        rows = []
        if cached.exists():
            rows.append((r.smoke.steps, json.loads(cached.read_text())))
        for steps in a.steps:
            rs = replace(r, smoke=replace(r.smoke, steps=steps))
            rows.append((steps, training.train_and_save(rs, "smoke", out / f"{name}-{steps}")))
        for steps, c in rows:
            mid = c["task_accuracy_middle"]
            fams = ", ".join(f"{f} {mid[f]:.2f}" for f in r.train_tasks)
            print(f"{name} steps {steps}: {c['build_seconds']:.0f} s, ppl {c['heldout_ppl']:.1f}, "
                  f"{fams}")


if __name__ == "__main__":
    main()
