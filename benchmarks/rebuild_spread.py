"""How far a rebuild of a zoo recipe lands from its shipped card: CPU code paths and build seeds.

The zoo's training is not bit-reproducible across CPUs: torch picks its kernels by the CPU's
vector width (``ATEN_CPU_CAPABILITY``: default, avx2, avx512) and MKL picks its own
(``MKL_CBWR``), and each rounds sums in its own order. A rebuild on another machine is therefore
a different model of the same recipe. This script measures how different, so that
``tests/test_shipped.py`` can hold a rebuild to the spread that real rebuilds show rather than
to one machine's digits.

Each build runs in its own process (the code path is chosen when torch loads) into a scratch
cache; the real cache is not touched. The build seeds other than the recipe's own stand in for
the larger changes another CPU can make over 400 steps (a different rounding early on moves the
run as a different seed does).

    python benchmarks/rebuild_spread.py [--recipe lm-tiny] [--seeds 0 1 2]
        [--paths native avx2 default cbwr default+cbwr] [--write]

Prints one row per build (held-out perplexity, each family's exact match) and, against the
shipped card, the largest relative perplexity gap and the largest absolute accuracy gap, over
the code paths at the recipe's seed and over all builds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import page

PATHS = {                      # name -> the environment that selects the code path
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "default": {"ATEN_CPU_CAPABILITY": "default"},
    "cbwr": {"MKL_CBWR": "COMPATIBLE"},
    "default+cbwr": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"},
}

BUILD = """
import json, sys
from dataclasses import replace
from workbench.models import zoo
name, seed = sys.argv[1], int(sys.argv[2])
r = zoo.recipe(name)
given = r if seed == r.seed else replace(r, seed=seed)
path, _ = zoo.ensure(name, "smoke", given=given, force=True)
card = json.loads((path / "card.json").read_text())
import torch
card["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
print("CARD " + json.dumps(card))
"""


def build(recipe: str, seed: int, path: str, scratch: Path) -> dict:
    env = dict(os.environ, WORKBENCH_CACHE=str(scratch / f"{path}-{seed}"), WORKBENCH_PROGRESS="0",
               **PATHS[path])
    out = subprocess.run([sys.executable, "-c", BUILD, recipe, str(seed)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(next(l for l in out.splitlines() if l.startswith("CARD "))[5:])


def gaps(card: dict, want: dict) -> tuple[float, float]:
    """(relative perplexity gap, largest absolute exact-match gap over the card's families)."""
    ppl = abs(card["heldout_ppl"] - want["heldout_ppl"]) / want["heldout_ppl"]
    acc = max(abs(card["task_accuracy"][f] - a) for f, a in want["task_accuracy"].items())
    return ppl, acc


def mean_acc(card: dict) -> float:
    """Exact match averaged over the card's families: steadier than any one family, since a
    family near the edge of what the model has learned swings most between rebuilds."""
    acc = card["task_accuracy"]
    return sum(acc.values()) / len(acc)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="lm-tiny")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--json", default=None, help="also write every build's card here")
    ap.add_argument("--from-json", default=None, metavar="FILE",
                    help="build nothing: report the builds a --json run saved")
    ap.add_argument("--write", action="store_true", help="make it docs/benchmarks.md's section")
    a = ap.parse_args()
    from workbench import cache
    from workbench.models import shipped
    rel, _ = shipped.entries()[a.recipe]
    want = json.loads((cache.shipped_root() / rel / "card.json").read_text())
    with page.recorded("rebuild-spread", write=a.write, fenced=False):
        if a.from_json:
            saved = json.loads(Path(a.from_json).read_text())
            builds = [(r["path"], r["seed"], r["card"]) for r in saved]
        else:
            builds = measure(a)
        report(builds, want)
    if a.json and not a.from_json:
        Path(a.json).write_text(json.dumps(
            [{"path": p, "seed": s, "card": c} for p, s, c in builds], indent=1))


def measure(a) -> list[tuple[str, int, dict]]:
    """Build the recipe once per seed and code path; (path, seed, card) per build."""
    builds = []
    with tempfile.TemporaryDirectory(prefix="rebuild_spread-") as tmp:
        for seed in a.seeds:
            for path in a.paths:
                builds.append((path, seed, build(a.recipe, seed, path, Path(tmp))))
                print(f"built {a.recipe}: {path}, seed {seed}", file=sys.stderr, flush=True)
    return builds


def report(builds, want: dict) -> None:
    """One row per build against the shipped card, then the largest gaps: over the code paths
    at the recipe's own seed, and over every build."""
    print(f"| code path (torch's kernels) | seed | held-out ppl | vs shipped | mean exact match "
          f"| largest family gap |\n|---|---|---|---|---|---|")
    rows = []
    for path, seed, card in builds:
        ppl, acc = gaps(card, want)
        mean_gap = abs(mean_acc(card) - mean_acc(want))
        rows.append({"seed": seed, "ppl": ppl, "acc": acc, "mean": mean_gap})
        print(f"| {path} ({card['cpu_capability']}) | {seed} | {card['heldout_ppl']:.2f} | "
              f"{card['heldout_ppl'] / want['heldout_ppl'] - 1:+.1%} | {mean_acc(card):.3f} | "
              f"{acc:.2f} |")
    print(f"| shipped card | {want['recipe'].get('seed', 0)} | {want['heldout_ppl']:.2f} | | "
          f"{mean_acc(want):.3f} | |\n")
    for seed in sorted({s for _, s, _ in builds}):
        cards = [c for _, s, c in builds if s == seed]
        own_seed = seed == want["recipe"].get("seed", 0)
        if own_seed:
            cards.append(want)                 # the shipped build: one more path at its seed
        ppl = [c["heldout_ppl"] for c in cards]
        acc = [mean_acc(c) for c in cards]
        print(f"Seed {seed}, {len(cards)} builds{' with the shipped card' if own_seed else ''}: "
              f"perplexity spans {max(ppl) / min(ppl) - 1:.1%}, mean exact match "
              f"{max(acc) - min(acc):.3f}.\n")
    own = [r for r in rows if r["seed"] == want["recipe"].get("seed", 0)]
    for label, rs in (("Code paths at the recipe's seed", own), ("All builds", rows)):
        if rs:
            print(f"{label} ({len(rs)}): perplexity within {max(r['ppl'] for r in rs):.1%} of "
                  f"the shipped card, mean exact match within {max(r['mean'] for r in rs):.3f}, "
                  f"each family's within {max(r['acc'] for r in rs):.2f}.\n")


if __name__ == "__main__":
    main()
