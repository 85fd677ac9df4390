"""Short lm-base variants: train a variant of the lm-base recipe for a few hundred
steps on one thread and print its card's middle-difficulty scores and in-context column.

    python benchmarks/lm_base_variant.py --steps 600 --context-share 0.5 --out /tmp/run
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from workbench.models import recipes
from workbench.models.training import train_and_save


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--context-share", type=float, default=0.5)
    ap.add_argument("--max-shots", type=int, default=4)
    ap.add_argument("--tasks", default=None, help="comma-separated train tasks")
    ap.add_argument("--weights", default=None, help="comma-separated weights")
    ap.add_argument("--task-fraction", type=float, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--d-model", type=int, default=None)
    ap.add_argument("--eval", type=int, default=40)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    r = recipes.RECIPES["lm-base"]
    kw = dict(context_share=a.context_share, max_shots=a.max_shots, icl_shots=4)
    if a.tasks:
        kw["train_tasks"] = tuple(a.tasks.split(","))
        kw["task_weights"] = tuple(float(w) for w in a.weights.split(",")) if a.weights else None
    if a.task_fraction is not None:
        kw["task_fraction"] = a.task_fraction
    size = replace(r.smoke, steps=a.steps, ctx=a.ctx, eval_examples=a.eval,
                   warmup=max(30, a.steps // 20))
    if a.lr:
        size = replace(size, lr=a.lr)
    if a.layers:
        size = replace(size, n_layers=a.layers)
    if a.d_model:
        size = replace(size, d_model=a.d_model, d_ff=3 * a.d_model)
    r = replace(r, smoke=size, **kw)
    t0 = time.time()
    card = train_and_save(r, "smoke", Path(a.out))
    mid = card["task_accuracy_middle"]
    print(f"built in {time.time() - t0:.0f}s (train+card), ppl {card['heldout_ppl']:.1f}")
    print("middle:", json.dumps(mid))
    if "in_context" in card:
        for f, v in card["in_context"]["accuracy"].items():
            print(f"  icl {f:13s} 0-shot {v['0']:.2f}  4-shot {v['4']:.2f}  gain {v['gain']:+.2f}")


if __name__ == "__main__":
    main()
