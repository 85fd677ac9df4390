"""Few-shot CLIP adaptation, the optimizer's preconditioning (paper 15,
``docs/papers/15-fewshot-clip-optimizers.md``): the harness of notebook 15.

The method (the few-shot classifier and what trains, the second-moment estimator, the first-step
update norm, the budget-matched learning rate) lives in :mod:`workbench.methods.fewshot_optim`.
Here is what the notebook runs with it: the target data (the shapes family's held-out classes
under pixel noise: a test set, a support set per shot count, a validation split that selects
learning rates, a larger "full-data" pool), the second-moment table at initialization (C2), every
optimizer and PEFT baseline trained on every support set over one shared learning-rate grid
(:func:`workbench.sweep.sweep`, cached per run) and judged at the rate its validation accuracy
selects (C1, C3, C4), paired bootstrap intervals of the test-accuracy differences, the distance
and curvature table at the middle shot count (C5), the scalar metrics the recorded results
read, and for the explorer every run's accuracies at one rate of the grid.
"""
from __future__ import annotations

import inspect
import math

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from workbench import cache, plots
from workbench.data import images
from workbench.diagnostics import paired_bootstrap, top_hessian_eigenvalue
from workbench.methods import fewshot_optim as fo
from workbench.sweep import Sweep, sweep

__all__ = ["SLUG", "FULL", "METHODS", "PAIRS", "noisy_shapes", "draw_target", "validation_split",
           "full_pool", "second_moments", "plan", "budget_ratio", "fit", "score", "sweep_shots",
           "middle_shots", "best_peft", "selected", "compare", "comparisons", "curvature",
           "gap_closed", "scalar_metrics", "rate_table", "rate_figure"]

SLUG = "15-fewshot-clip-optimizers"
FULL = ("sgd", "adam", "adamw", "adam_budget", "adam_numerator", "shampoo", "soap")
METHODS = FULL + fo.PEFT


# -- the target: held-out classes under noise ----------------------------------------------------
def noisy_shapes(names, n_per_class: int, noise: float, render_seed: int, noise_seed: int):
    """``n_per_class`` rendered images of each class in ``names`` with pixel noise: ``(x, y)``."""
    x, y, _ = images.shapes(names, n_per_class, seed=render_seed)
    return images.add_noise(x, noise, noise_seed), torch.as_tensor(y)


def draw_target(names, shots, n_query: int, noise: float, seed: int):
    """The query set and one support set per shot count, drawn from ``seed`` (each with its own
    render and noise seeds, so the query set is disjoint from every support set):
    ``((xq, yq), {k: (xs, ys)})``."""
    base = 1000 * (seed + 1)
    query = noisy_shapes(names, n_query, noise, base + 1, base + 2)
    support = {k: noisy_shapes(names, k, noise, base + 10 + k, base + 20 + k) for k in shots}
    return query, support


def validation_split(names, n_val: int, noise: float, seed: int):
    """The validation split that selects every method's learning rate: ``n_val`` more labelled
    images a class, drawn like the support sets (its own render and noise seeds: disjoint from
    every support set and from the test images, which no selection ever reads)."""
    base = 1000 * (seed + 1)
    return noisy_shapes(names, n_val, noise, base + 5, base + 6)


def full_pool(names, n_full: int, noise: float, seed: int):
    """The "full-data" pool of C2: ``n_full`` images a class, larger than any support set."""
    base = 1000 * (seed + 1)
    return noisy_shapes(names, n_full, noise, base + 3, base + 4)


# -- C2: the second moment at initialization -----------------------------------------------------
def second_moments(clf0, support: dict, xf, yf, lr: float):
    """Per shot count: the per-coordinate ratio of the support set's second moment of per-example
    gradients to the full pool's (:func:`fo.second_moment_ratio`), and the first-step update
    norms of SGD and Adam from ``clf0`` at one learning rate ``lr`` (both are linear in it, so
    their ratio holds at every rate). Returns ``(ratios, table)``, one table row per shot."""
    v_full = fo.per_example_sq_grads(clf0, xf, yf)
    rows, ratios = {}, {}
    for k, (xs, ys) in support.items():
        ratios[k], rows[k] = fo.second_moment_ratio(fo.per_example_sq_grads(clf0, xs, ys), v_full)
        rows[k]["sgd_step1"] = fo.first_step_update(clf0, xs, ys, "sgd", lr)
        rows[k]["adam_step1"] = fo.first_step_update(clf0, xs, ys, "adam", lr)
    return ratios, pd.DataFrame(rows).T


# -- C1, C3, C4: every method over one learning-rate grid, on every support set ------------------
def plan(method: str, value: float, budget_ratio: float) -> tuple[str, str, float]:
    """``(optimizer, what trains, learning rate)`` of ``method`` at the grid value ``value``.
    The full fine-tunes train the image tower and head with their optimizer at ``value``, except
    budget-matched Adam, whose rate ``value * budget_ratio`` (SGD's over Adam's first-step norm,
    :func:`fo.budget_matched_lr`) makes its first step as long as SGD's at ``value``; the PEFT
    baselines train their parameters with AdamW."""
    if method in fo.PEFT:
        return "adamw", method, value
    if method == "adam_budget":
        return "adam", "full", fo.budget_matched_lr(value, 1.0, budget_ratio)
    return method, "full", value


def budget_ratio(c2: pd.DataFrame, k: int) -> float:
    """SGD's over Adam's first-step norm at ``k`` shots (from :func:`second_moments`)."""
    return float(c2.loc[k, "sgd_step1"] / c2.loc[k, "adam_step1"])


def fit(model, tok, names, method: str, value: float, support, steps: int, budget_ratio: float,
        grad_full=None):
    """A fresh copy of CLIP trained by ``method`` at grid value ``value`` for ``steps``
    full-batch steps on ``support`` (``adam_numerator`` seeds Adam's first moment with
    ``grad_full``): ``(classifier, losses, initial trainable weights)``."""
    optimizer, mode, lr = plan(method, value, budget_ratio)
    clf = fo.FewShotClassifier(model, tok, names, mode)
    init = {n: p.detach().clone() for n, p in clf.named_parameters() if p.requires_grad}
    losses = fo.train(clf, *support, optimizer, lr, steps,
                      numerator_grad=grad_full if method == "adam_numerator" else None)
    return clf, losses, init


def score(clf, losses, init, val, test) -> dict:
    """What one run records: validation accuracy (the selection metric; NaN for a diverged run,
    which :func:`workbench.sweep.sweep` then never selects), test accuracy and the per-image test
    outcomes (for paired comparisons), the last loss, the steps taken and the distance from the
    pretrained weights."""
    right = fo.correct(clf, *test)
    diverged = not math.isfinite(losses[-1])
    return {"val_acc": math.nan if diverged else fo.accuracy(clf, *val),
            "test_acc": float(right.float().mean()), "test_correct": right.int().tolist(),
            "final_loss": losses[-1], "steps_run": sum(map(math.isfinite, losses)),
            "diverged": diverged, "dist_from_init": fo.distance_from_init(clf, init)}


def sweep_shots(model, tok, names, support: dict, val, test, *, grad_full, c2: pd.DataFrame,
                sizes: dict, seed: int, keep: dict | None = None) -> dict[int, Sweep]:
    """Per shot count, :func:`workbench.sweep.sweep` of every method in :data:`METHODS` over
    ``sizes["lrs"]``, selected on validation accuracy, each run cached under a key of everything
    it depends on (the data's seed and sizes, the CLIP, the code of this harness and the
    method). ``keep`` collects the full fine-tunes trained at the middle shot count (for C5)."""
    code = [inspect.getsource(f) for f in (fo, plan, fit, score)]
    out = {}
    for k, sup in support.items():
        ratio = budget_ratio(c2, k)
        spec = [SLUG, model.zoo_card["key"], list(names), seed, k, ratio, code,
                {n: sizes[n] for n in ("steps", "n_query", "n_val", "n_full", "noise")}]

        def run(method, value, k=k, sup=sup, ratio=ratio):
            clf, losses, init = fit(model, tok, names, method, value, sup, sizes["steps"], ratio,
                                    grad_full)
            if keep is not None and method in FULL and k == middle_shots(list(support)):
                keep[method, value] = clf
            return score(clf, losses, init, val, test)
        out[k] = sweep(run, METHODS, sizes["lrs"], select="val_acc", knob="lr",
                       cache_dir=cache.folder(SLUG) / cache.key(*spec), desc=f"{k}-shot")
    return out


def middle_shots(shots) -> int:
    """The middle shot count, where C5 looks at distance and curvature."""
    return shots[len(shots) // 2]


def best_peft(sw: Sweep) -> str:
    """The PEFT baseline with the highest validation accuracy at its selected rate (the first
    on a tie): the one SGD is compared with, chosen without the test images."""
    def val(m):
        v = sw.at_best(m)["val_acc"]
        return v if math.isfinite(v) else -1.0
    return max(fo.PEFT, key=lambda m: (val(m), -fo.PEFT.index(m)))


def selected(sweeps: dict[int, Sweep]) -> pd.DataFrame:
    """One row per (shots, method) at its selected rate: the grid value, validation and test
    accuracy, last loss and distance from init."""
    rows = [{"shots": k, **{c: v for c, v in sw.at_best(m).items() if c != "test_correct"}}
            for k, sw in sweeps.items() for m in METHODS]
    return pd.DataFrame(rows)


def compare(sw: Sweep, a: str, b: str, seed: int = 0) -> dict:
    """:func:`paired_bootstrap` of ``a`` minus ``b``, each at its selected rate, over the same
    test images: ``{"diff", "low", "high", ...}``."""
    return paired_bootstrap(sw.at_best(a)["test_correct"], sw.at_best(b)["test_correct"],
                            seed=seed)


PAIRS = (("sgd", "peft"), ("sgd", "adam"), ("sgd", "adamw"), ("adam_budget", "adam"),
         ("sgd", "adam_budget"), ("sgd", "adam_numerator"), ("sgd", "shampoo"), ("sgd", "soap"))


def comparisons(sweeps: dict[int, Sweep], pairs=PAIRS) -> pd.DataFrame:
    """Per shot count and pair ``(a, b)``, the paired test-accuracy difference ``a - b`` with its
    95% interval (``"peft"`` stands for :func:`best_peft`); indexed by ``(a, b, shots)``."""
    rows = []
    for k, sw in sweeps.items():
        for a, b in pairs:
            name = {"peft": best_peft(sw)}
            d = compare(sw, name.get(a, a), name.get(b, b))
            rows.append({"a": a, "b": b, "shots": k, "vs": name.get(b, b),
                         **{s: d[s] for s in ("diff", "low", "high")}})
    return pd.DataFrame(rows).set_index(["a", "b", "shots"]).sort_index()


# -- C5: distance from init and curvature --------------------------------------------------------
def curvature(keep: dict, sw: Sweep, refit, xs, ys, iters: int, seed: int) -> pd.DataFrame:
    """Per full fine-tune at its selected rate (from ``keep``, or ``refit(method, value)`` when
    the sweep read it from the cache): its distance from the pretrained weights, the top
    eigenvalue of the support loss's Hessian (power iteration, seeded) and its test accuracy."""
    rows = {}
    for name in FULL:
        best = sw.at_best(name)
        clf = keep.get((name, best["lr"]))
        clf = refit(name, best["lr"]) if clf is None else clf
        clf.eval()
        ys_ = torch.as_tensor(ys, device=next(clf.parameters()).device)
        lam = top_hessian_eigenvalue(lambda: F.cross_entropy(clf(xs), ys_),
                                     clf.trainable(), iters=iters,
                                     generator=torch.Generator().manual_seed(seed))
        rows[name] = {"dist_from_init": best["dist_from_init"], "top_eig": lam,
                      "acc": best["test_acc"]}
    return pd.DataFrame(rows).T


# -- verdict helpers and the recorded metrics ----------------------------------------------------
def gap_closed(acc: pd.DataFrame):
    """C3 per shot count: the gap SGD - Adam, and the share of it that budget-matched Adam and
    numerator-aligned Adam close (NaN where there is no gap)."""
    gap = acc.loc["sgd"] - acc.loc["adam"]
    some = gap.where(gap.abs() > 1e-9)
    return (gap, (acc.loc["adam_budget"] - acc.loc["adam"]) / some,
            (acc.loc["adam_numerator"] - acc.loc["adam"]) / some)


def scalar_metrics(sel: pd.DataFrame, cmp: pd.DataFrame, c2: pd.DataFrame,
                   c5: pd.DataFrame) -> dict[str, float]:
    """The tables as flat scalar metrics for the recorded results: ``acc_<method>_<k>shot``
    (test accuracy at the selected rate), ``lr_<method>_<k>shot`` (the selected grid value),
    ``d_<a>_<b>_<k>shot`` with ``_low`` and ``_high`` (paired differences), ``c2_<stat>_<k>shot``
    (with ``adam_over_sgd_step1``) and ``c5_<stat>_<method>``."""
    out = {}
    for r in sel.itertuples():
        out[f"acc_{r.method}_{r.shots}shot"] = float(r.test_acc)
        out[f"lr_{r.method}_{r.shots}shot"] = float(r.lr)
    for (a, b, k), r in cmp.iterrows():
        out.update({f"d_{a}_{b}_{k}shot{s}": float(r[c]) for s, c in
                    (("", "diff"), ("_low", "low"), ("_high", "high"))})
    for k, row in c2.iterrows():
        out.update({f"c2_{s}_{k}shot": float(v) for s, v in row.items()})
        out[f"c2_adam_over_sgd_step1_{k}shot"] = float(row.adam_step1 / row.sgd_step1)
    out.update({f"c5_{s}_{m}": float(v) for m, row in c5.iterrows() for s, v in row.items()})
    return out


# -- the explorer: every method at one learning rate ------------------------------------------

def rate_table(sweeps: dict[int, Sweep]) -> pd.DataFrame:
    """Every run of every sweep: ``shots, method, lr`` (the grid value), validation and test
    accuracy, distance from init, and ``selected`` (the rate validation picked for that method)."""
    rows = []
    for k, sw in sweeps.items():
        picked = {m: sw.at_best(m)["lr"] for m in sw.table["method"].unique()}
        for r in sw.table.itertuples():
            rows.append({"shots": k, "method": r.method, "lr": r.lr, "val_acc": r.val_acc,
                         "test_acc": r.test_acc, "dist_from_init": r.dist_from_init,
                         "selected": r.lr == picked[r.method]})
    return pd.DataFrame(rows)


def rate_figure(table: pd.DataFrame, shots: int, lr: float, zero_shot: float, chance: float):
    """Left: validation accuracy over the grid at ``shots``, a line per method (PEFT dashed),
    ``lr`` marked. Right: each method's validation and test accuracy at ``lr``, with its test
    accuracy at its selected rate as a ring."""
    t = table[table["shots"] == shots]
    fig, (a1, a2) = plots.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1, 1.4]})
    for i, (m, g) in enumerate(t.groupby("method", sort=False)):
        a1.plot(g["lr"], g["val_acc"], marker="s" if m in fo.PEFT else "o",
                ls="--" if m in fo.PEFT else "-", color=plots.PALETTE[i % len(plots.PALETTE)],
                label=m)
    a1.axvline(lr, color="k", lw=1)
    a1.set(xscale="log", xlabel="learning rate (grid value)", ylabel="validation accuracy",
           title=f"{shots}-shot: validation accuracy over the grid")
    a1.legend(fontsize=6, ncol=2)
    at, best = t[t["lr"] == lr].set_index("method"), t[t["selected"]].set_index("method")
    x = np.arange(len(at))
    a2.bar(x - 0.2, at["val_acc"].fillna(0), 0.4, label=f"validation at lr {lr:g}")
    a2.bar(x + 0.2, at["test_acc"], 0.4, label=f"test at lr {lr:g}")
    a2.plot(x + 0.2, best.loc[at.index, "test_acc"], "o", ms=9, mfc="none", mec="k",
            label="test at its selected rate")
    a2.axhline(zero_shot, color="k", ls=":", lw=1, label="zero-shot")
    a2.axhline(chance, color="0.5", ls="--", lw=1, label="chance")
    a2.set_xticks(x, at.index, rotation=30, fontsize=7)
    a2.set(ylabel="accuracy", ylim=(0, 1.25 * max(t["test_acc"].max(), zero_shot)),
           title=f"{shots}-shot, every method at lr {lr:g}")
    a2.legend(fontsize=7, ncol=3, loc="upper left")
    return fig
