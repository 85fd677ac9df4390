"""Few-shot CLIP adaptation, the optimizer's preconditioning (paper 15,
``papers/15-fewshot-clip-optimizers.md``): the harness of notebook 15.

The method (the few-shot classifier and what trains, the second-moment estimator, the first-step
update norm, the budget-matched learning rate) lives in :mod:`workbench.methods.fewshot_optim`.
Here is what the notebook runs with it: the target data (the shapes family's held-out classes
under pixel noise: a query set, a support set per shot count, a larger "full-data" pool), the
second-moment table at initialization (C2), every optimizer and PEFT baseline trained on every
support set (C1, C3, C4), the distance and curvature table at the middle shot count (C5), and the
scalar metrics that the recorded results read.
"""
from __future__ import annotations

import pandas as pd
import torch
import torch.nn.functional as F

from workbench.data import images
from workbench.diagnostics import top_hessian_eigenvalue
from workbench.methods import fewshot_optim as fo
from workbench.progress import progress

__all__ = ["noisy_shapes", "draw_target", "full_pool", "second_moments", "method_plan",
           "accuracy_vs_shots", "middle_shots", "curvature", "gap_closed", "scalar_metrics"]


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


def full_pool(names, n_full: int, noise: float, seed: int):
    """The "full-data" pool of C2: ``n_full`` images a class, larger than any support set."""
    base = 1000 * (seed + 1)
    return noisy_shapes(names, n_full, noise, base + 3, base + 4)


# -- C2: the second moment at initialization -----------------------------------------------------
def second_moments(clf0, support: dict, xf, yf, lr_sgd: float, lr_adam: float):
    """Per shot count: the per-coordinate ratio of the support set's second moment of per-example
    gradients to the full pool's (:func:`fo.second_moment_ratio`), and the first-step update
    norms of SGD and Adam from ``clf0``. Returns ``(ratios, table)``, one table row per shot."""
    v_full = fo.per_example_sq_grads(clf0, xf, yf)
    rows, ratios = {}, {}
    for k, (xs, ys) in support.items():
        ratios[k], rows[k] = fo.second_moment_ratio(fo.per_example_sq_grads(clf0, xs, ys), v_full)
        rows[k]["sgd_step1"] = fo.first_step_update(clf0, xs, ys, "sgd", lr_sgd)
        rows[k]["adam_step1"] = fo.first_step_update(clf0, xs, ys, "adam", lr_adam)
    return ratios, pd.DataFrame(rows).T


# -- C1, C3, C4: every method on every support set -----------------------------------------------
def method_plan(sizes: dict, lr_budget: float) -> list[tuple[str, str, float]]:
    """``(method, what trains, learning rate)``: the full fine-tunes with every optimizer (the
    budget-matched Adam at ``lr_budget``), then the PEFT baselines (trained with AdamW)."""
    return [("sgd", "full", sizes["lr_sgd"]), ("adam", "full", sizes["lr_adam"]),
            ("adamw", "full", sizes["lr_adam"]), ("adam_budget", "full", lr_budget),
            ("adam_numerator", "full", sizes["lr_adam"]), ("shampoo", "full", sizes["lr_shampoo"]),
            ("soap", "full", sizes["lr_soap"])] + [(m, m, sizes["lr_peft"]) for m in fo.PEFT]


def middle_shots(shots) -> int:
    """The middle shot count, where C5 looks at distance and curvature."""
    return shots[len(shots) // 2]


def accuracy_vs_shots(model, tok, names, support: dict, query, grad_full, c2: pd.DataFrame,
                      sizes: dict):
    """Train every method of :func:`method_plan` for ``sizes["steps"]`` full-batch steps on each
    support set, from a fresh copy of CLIP, and score it on the query set. ``adam_numerator``
    starts Adam's first moment at ``grad_full``. Returns one row per (shots, method) (accuracy,
    final loss, distance from init) and the full fine-tunes at the middle shot count (for C5)."""
    xq, yq = query
    rows, states = [], {}
    for k in progress(sizes["shots"], desc="shots"):
        xs, ys = support[k]
        lr_budget = fo.budget_matched_lr(sizes["lr_adam"], c2.loc[k, "adam_step1"],
                                         c2.loc[k, "sgd_step1"])
        for name, mode, lr in method_plan(sizes, lr_budget):
            clf = fo.FewShotClassifier(model, tok, names, mode)
            init = {n: p.detach().clone() for n, p in clf.named_parameters() if p.requires_grad}
            losses = fo.train(clf, xs, ys, name if mode == "full" else "adamw", lr, sizes["steps"],
                              numerator_grad=grad_full if name == "adam_numerator" else None)
            rows.append({"shots": k, "method": name, "lr": lr, "acc": fo.accuracy(clf, xq, yq),
                         "final_loss": losses[-1],
                         "dist_from_init": fo.distance_from_init(clf, init)})
            if mode == "full" and k == middle_shots(sizes["shots"]):
                states[name] = clf
    return pd.DataFrame(rows), states


# -- C5: distance from init and curvature --------------------------------------------------------
def curvature(states: dict, res: pd.DataFrame, xs, ys, shots: int, iters: int,
              seed: int) -> pd.DataFrame:
    """Per full fine-tune at ``shots``: its distance from the pretrained weights, the top
    eigenvalue of the support loss's Hessian (power iteration on Hessian-vector products, seeded)
    and its query accuracy."""
    rows = {}
    for name, clf in states.items():
        clf.eval()
        lam = top_hessian_eigenvalue(lambda: F.cross_entropy(clf(xs), ys),
                                     clf.trainable(), iters=iters,
                                     generator=torch.Generator().manual_seed(seed))
        row = res[(res.shots == shots) & (res.method == name)].iloc[0]
        rows[name] = {"dist_from_init": row.dist_from_init, "top_eig": lam, "acc": row.acc}
    return pd.DataFrame(rows).T


# -- verdict helpers and the recorded metrics ----------------------------------------------------
def gap_closed(acc: pd.DataFrame):
    """C3 per shot count: the gap SGD - Adam, and the share of it that budget-matched Adam and
    numerator-aligned Adam close (NaN where there is no gap)."""
    gap = acc.loc["sgd"] - acc.loc["adam"]
    some = gap.where(gap.abs() > 1e-9)
    return (gap, (acc.loc["adam_budget"] - acc.loc["adam"]) / some,
            (acc.loc["adam_numerator"] - acc.loc["adam"]) / some)


def scalar_metrics(acc: pd.DataFrame, c2: pd.DataFrame, c5: pd.DataFrame) -> dict[str, float]:
    """The tables as flat scalar metrics for the recorded results: ``acc_<method>_<k>shot``,
    ``c2_<stat>_<k>shot`` (with ``adam_over_sgd_step1``) and ``c5_<stat>_<method>``."""
    out = {f"acc_{m}_{k}shot": float(v) for m, row in acc.iterrows() for k, v in row.items()}
    for k, row in c2.iterrows():
        out.update({f"c2_{s}_{k}shot": float(v) for s, v in row.items()})
        out[f"c2_adam_over_sgd_step1_{k}shot"] = float(row.adam_step1 / row.sgd_step1)
    out.update({f"c5_{s}_{m}": float(v) for m, row in c5.iterrows() for s, v in row.items()})
    return out
