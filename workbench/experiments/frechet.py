"""The experiments of notebook 13 (model merging as Fréchet averaging; LoRA merging on the
quotient manifold, :mod:`workbench.methods.frechet`).

The LoRA side: held-out prompts of the pool's families, a :class:`Bench` that scores an adapter
slot of the ``PeftModel`` (the answer loss on a mixed batch, exact match per family) and writes
merged factors into a slot, the reparameterization draws of C1 and C2, the identity check, and
``peft``'s own merges as the baselines of C4, and for the explorer the merges with one family
weighted up (:func:`weighted_merges`, :func:`weight_table`). The MLP side (C3, C5): two ReLU MLPs
trained on digits from different inits, their test metrics, the interpolation path and its loss
barrier, the relabelling check, and the flat parameter vector the Fisher merge works on.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from .. import diagnostics as dx
from .. import evaluate
from ..data import packing, tasks
from ..methods import frechet as fr

__all__ = ["train_prompts", "eval_sets", "pool_table", "Bench", "reparam_draws", "identity_errors",
           "add_peft_merges", "score_merges", "paired_intervals", "MERGEABLE_SHARE",
           "mean_merge_kept", "karcher_gap", "mlp_forward", "train_mlp",
           "evaluate_mlp", "interpolation_path", "midpoints", "relabel_change", "flat", "unflat",
           "fisher_errors", "MERGES", "weighted_merges", "weight_table"]

POOL_TRAIN_SEED = 7     # the generator seed the zoo's LoRA pool drew its training prompts with


# -- the LoRA pool and its evaluation -------------------------------------------------------------

def train_prompts(pool, family: str) -> set[str]:
    """The prompts the pool trained adapter ``family`` on, to keep out of the evaluation."""
    ds = tasks.get(family).difficulties
    n = -(-pool.card["size"]["n_train"] // len(ds))
    return {e.prompt for d in ds for e in tasks.generate(family, n, POOL_TRAIN_SEED, d)}


def eval_sets(pool, families, n_eval: int, n_loss: int, seed: int) -> tuple[dict, dict]:
    """Per family, held-out prompts at its middle difficulty that the pool never trained on:
    ``n_eval`` for exact match (seed ``1000 + seed``) and ``n_loss`` for the answer loss
    (seed ``1001 + seed``)."""
    evals, loss_sets = {}, {}
    for f in families:
        seen = train_prompts(pool, f)
        evals[f], _ = evaluate.heldout_examples(f, evaluate.MIDDLE[f], n_eval, exclude=seen,
                                                seed=1000 + seed)
        loss_sets[f], _ = evaluate.heldout_examples(f, evaluate.MIDDLE[f], n_loss, exclude=seen,
                                                    seed=1001 + seed)
    return evals, loss_sets


def pool_table(pool, families) -> pd.DataFrame:
    """Each adapter's own accuracy and the base model's, from the pool's card."""
    return pd.DataFrame({f: {"own accuracy (card)": pool.card["adapters"][f]["own_accuracy"],
                             "base accuracy (card)": pool.card["base_accuracy"][f]}
                         for f in families}).T


@dataclass
class Bench:
    """Scores the adapter slots of a ``PeftModel`` that carries one LoRA per family. The
    **answer loss** is the mean NLL of the reference answers (with their steps where the family
    has them) on a batch mixing every family (``mixed``) or on one family's batch (``own[f]``);
    **exact match** is each family's verifier on greedy completions."""
    model: object
    tok: object
    families: list
    evals: dict
    loss_sets: dict
    with_steps: bool
    mixed: dict = field(init=False)
    own: dict = field(init=False)

    def __post_init__(self):
        mixed = [e for f in self.families for e in self.loss_sets[f]]
        self.mixed = self._batch(mixed)
        self.own = {f: self._batch(self.loss_sets[f]) for f in self.families}

    def _batch(self, examples) -> dict:
        rows = packing.encode(self.tok, [e.prompt for e in examples],
                              [e.completion(self.with_steps) for e in examples])
        dev = next(self.model.parameters()).device
        return {k: v.to(dev) for k, v in packing.pad(rows, self.tok.pad_token_id).items()}

    def loss(self, adapter: str, batch: dict | None = None) -> float:
        """The answer loss of ``adapter`` on ``batch`` (the mixed batch by default)."""
        self.model.set_adapter(adapter)
        with torch.no_grad():
            return float(self.model(**(self.mixed if batch is None else batch)).loss)

    def slot(self, name: str, factors: dict) -> str:
        """Write merged factors into adapter slot ``name`` (created as a rank-r peft adapter)."""
        if name not in self.model.peft_config:
            n = len(self.families)
            self.model.add_weighted_adapter(self.families, [1.0 / n] * n, name,
                                            combination_type="svd")
        fr.set_factors(self.model, name, factors)
        return name

    def item_scores(self, adapter: str) -> dict:
        """Per family, the verifier's score (1 or 0) of ``adapter`` on each of its prompts."""
        self.model.set_adapter(adapter)
        return {f: evaluate.item_scores(self.model, self.tok, self.evals[f], self.with_steps)
                for f in self.families}

    def accuracy(self, adapter: str) -> dict:
        """Exact match of ``adapter`` on each family (the mean of :meth:`item_scores`)."""
        return {f: float(s.mean()) for f, s in self.item_scores(adapter).items()}

    def base_scores(self) -> tuple[float, dict]:
        """The answer loss and the exact match of the base model (adapters disabled)."""
        with self.model.disable_adapter():
            with torch.no_grad():
                loss = float(self.model(**self.mixed).loss)
            acc = {f: evaluate.exact_match(self.model, self.tok, self.evals[f], self.with_steps)
                   for f in self.families}
        return loss, acc


# -- C1, C2: reparameterizations ----------------------------------------------------------------------

def reparam_draws(bench: Bench, sets: list, gen: torch.Generator, n: int, cond: float, iters: int,
                  progress=lambda it, **kw: it) -> pd.DataFrame:
    """``n`` draws; in each, every module of every adapter gets its own random G (condition
    number ``cond``, from ``gen``). Per draw: the largest change of an adapter's own-family loss
    (the function must not move), and the answer loss of the naive, quotient and SVD-of-the-mean
    merges of the reparameterized factors."""
    rows = []
    for k in progress(range(n), desc="reparameterizations"):
        re = [fr.reparameterize(fs, gen, cond) for fs in sets]
        own_change = max(abs(bench.loss(bench.slot("scratch", re[i]), bench.own[f])
                             - bench.loss(f, bench.own[f])) for i, f in enumerate(bench.families))
        naive, _ = fr.merge_modules(re, fr.merge_naive)
        quot, _ = fr.merge_modules(re, fr.merge_quotient, iters=iters)
        svd, _ = fr.merge_modules(re, fr.merge_svd)
        rows.append({"draw": k, "own_loss_change": own_change,
                     "naive": bench.loss(bench.slot("scratch", naive)),
                     "quotient": bench.loss(bench.slot("scratch", quot)),
                     "svd_of_mean": bench.loss(bench.slot("scratch", svd))})
    return pd.DataFrame(rows)


def identity_errors(factors: dict, families, gen: torch.Generator, cond: float,
                    iters: int) -> dict:
    """Per family: the quotient mean of three copies of its adapter, each in its own random
    gauge, against the adapter itself (largest relative error of ΔW = B A over modules)."""
    out = {}
    for f in families:
        copies = [fr.reparameterize(factors[f], gen, cond) for _ in range(3)]
        merged, _ = fr.merge_modules(copies, fr.merge_quotient, iters=iters)
        out[f] = max(float((merged[n][0] @ merged[n][1] - b @ a).norm() / (b @ a).norm())
                     for n, (b, a) in factors[f].items())
    return out


# -- C4: the merges at rank r ---------------------------------------------------------------------

def add_peft_merges(model, families, ta_lambda: float, ties_density: float) -> list[str]:
    """``peft``'s own merges as adapter slots: ``naive`` (``linear`` with weights 1/N², the mean
    of the Bs times the mean of the As), ``svd_of_mean``, ``task_arithmetic`` (λ Σ ΔW_i, truncated),
    ``ties`` (``ties_svd``) and ``cat_mean`` (exact, rank N r). Returns their names."""
    n = len(families)
    w = [1.0 / n] * n
    model.add_weighted_adapter(families, [1.0 / n ** 2] * n, "naive", combination_type="linear")
    model.add_weighted_adapter(families, w, "svd_of_mean", combination_type="svd")
    model.add_weighted_adapter(families, [ta_lambda] * n, "task_arithmetic", combination_type="svd")
    model.add_weighted_adapter(families, [1.0] * n, "ties", combination_type="ties_svd",
                               density=ties_density)
    model.add_weighted_adapter(families, w, "cat_mean", combination_type="cat")
    return ["naive", "svd_of_mean", "task_arithmetic", "ties", "cat_mean"]


def score_merges(bench: Bench, adapters,
                 progress=lambda it, **kw: it) -> tuple[pd.DataFrame, dict]:
    """Exact match per family, their mean (``multi_task``) and the answer loss of the base model
    and of every adapter slot in ``adapters`` (a family's own slot shows as "adapter f alone"),
    and per slot its per-item scores over every family's prompts, in family order (the same
    items for every slot, for :func:`paired_intervals`)."""
    acc, losses, items = {}, {}, {}
    losses["base"], acc["base"] = bench.base_scores()
    for m in progress(adapters, desc="scoring merges"):
        per = bench.item_scores(m)
        acc[m], losses[m] = {f: float(s.mean()) for f, s in per.items()}, bench.loss(m)
        items[m] = np.concatenate([per[f] for f in bench.families])
    table = pd.DataFrame(acc).T
    table["multi_task"] = table[bench.families].mean(1)
    table["answer_loss"] = pd.Series(losses)
    table.index = [f"adapter {i} alone" if i in bench.families else i for i in table.index]
    return table, items


def paired_intervals(items: dict, ours: str, rivals, seed: int = 0) -> pd.DataFrame:
    """``ours`` minus each rival on the same items: the mean difference of per-item exact match
    with its 95 % paired bootstrap interval (:func:`workbench.diagnostics.paired_bootstrap`,
    columns diff, low, high, n_items, n_seeds; a row per rival). Ours beats a rival when low > 0."""
    return dx.paired_table({r: (items[ours], items[r]) for r in rivals}, seed=seed)


MERGEABLE_SHARE = 0.5    # the gate: the exact mean of the deltas keeps this share of every skill


def mean_merge_kept(table: pd.DataFrame, families, merge: str = "cat_mean") -> dict:
    """Per family f, the share of its adapter's gain that ``merge`` (by default the exact mean
    of the deltas, rank N r) keeps on f: ``(merge - base) / (adapter f alone - base)`` in
    :func:`score_merges`' table (None where the adapter does not gain). The mergeability gate:
    a rank-r merge approximates that mean, so where it keeps less than
    :data:`MERGEABLE_SHARE` of a skill, no merge at weights 1/N has a good merge to find."""
    out = {}
    for f in families:
        base, own = table.loc["base", f], table.loc[f"adapter {f} alone", f]
        out[f] = float((table.loc[merge, f] - base) / (own - base)) if own != base else None
    return out


def karcher_gap(hist: dict, k: int) -> float:
    """The largest, over modules, of the Karcher objective's excess over its final value after
    ``k`` iterations, relative to its start (0 where a module stopped before ``k``)."""
    gaps = [(h[min(k, len(h) - 1)] - min(h)) / h[0] for h in map(np.asarray, hist.values())]
    return float(max(gaps))


# -- C3, C5: MLPs on digits ---------------------------------------------------------------------------

def mlp_forward(layers, x):
    """A ReLU MLP given as ``[(W, b), ...]``."""
    for i, (w, b) in enumerate(layers):
        x = x @ w.T + b
        if i < len(layers) - 1:
            x = torch.relu(x)
    return x


def train_mlp(task, hidden: int, steps: int, init_seed: int, lr: float = 3e-3) -> list:
    """A 64 → hidden → hidden → 10 ReLU MLP (He init from ``init_seed``) trained full batch
    with Adam on ``task``; its layers in float64."""
    g = torch.Generator().manual_seed(init_seed)
    sizes = [64, hidden, hidden, 10]
    layers = [(torch.randn(o, i, generator=g) * (2 / i) ** 0.5, torch.zeros(o))
              for i, o in zip(sizes, sizes[1:])]
    params = [t.requires_grad_() for wb in layers for t in wb]
    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        lossv = F.cross_entropy(mlp_forward(layers, task.x_train), task.y_train)
        opt.zero_grad()
        lossv.backward()
        opt.step()
    return [(w.detach().double(), b.detach().double()) for w, b in layers]


def evaluate_mlp(task, layers) -> tuple[float, float]:
    """Test cross-entropy and test accuracy of the MLP ``layers`` on ``task``."""
    with torch.no_grad():
        out = mlp_forward(layers, task.x_test.double())
        return (float(F.cross_entropy(out, task.y_test)),
                float((out.argmax(1) == task.y_test).float().mean()))


def interpolation_path(task, a, b, b_aligned, n_alpha: int) -> pd.DataFrame:
    """Test loss along (1 - α) a + α b, naive and with b aligned to a, at ``n_alpha`` points;
    ``*_excess``: the excess over the straight line between the endpoint losses (its maximum
    is the loss barrier)."""
    alphas = np.linspace(0, 1, n_alpha)
    path = pd.DataFrame([{"alpha": t, "naive": evaluate_mlp(task, fr.interpolate(a, b, t))[0],
                          "aligned": evaluate_mlp(task, fr.interpolate(a, b_aligned, t))[0]}
                         for t in alphas])
    for m in ("naive", "aligned"):
        ends = (1 - path.alpha) * path[m].iloc[0] + path.alpha * path[m].iloc[-1]
        path[f"{m}_excess"] = path[m] - ends
    return path


def midpoints(task, a, b, b_aligned) -> dict:
    """(test loss, test accuracy) of the naive and the aligned midpoint and of both models."""
    return {"naive": evaluate_mlp(task, fr.interpolate(a, b, 0.5)),
            "aligned": evaluate_mlp(task, fr.interpolate(a, b_aligned, 0.5)),
            "model_a": evaluate_mlp(task, a), "model_b": evaluate_mlp(task, b)}


def relabel_change(task, a, b, mid: dict, hidden: int, seed: int) -> dict:
    """How much a random relabelling of b's hidden units (numpy generator ``seed``) moves the
    midpoint's test loss: the naive average moves, weight matching undoes it (the merge is a
    function on the quotient)."""
    g = np.random.default_rng(seed)
    shuffled = fr.permute_mlp(b, [g.permutation(hidden) for _ in range(2)])
    realigned = fr.permute_mlp(shuffled, fr.weight_matching(a, shuffled))
    return {"naive": abs(evaluate_mlp(task, fr.interpolate(a, shuffled, 0.5))[0] - mid["naive"][0]),
            "aligned": abs(evaluate_mlp(task, fr.interpolate(a, realigned, 0.5))[0]
                           - mid["aligned"][0])}


def flat(layers) -> torch.Tensor:
    """The MLP's parameters as one vector ``cat(W_0, b_0, W_1, ...)``."""
    return torch.cat([t.reshape(-1) for wb in layers for t in wb])


def unflat(vec: torch.Tensor, like) -> list:
    """The inverse of :func:`flat`, shaped like the layers ``like``."""
    out, i = [], 0
    for w, b in like:
        out.append((vec[i: i + w.numel()].view_as(w), vec[i + w.numel(): i + w.numel() + b.numel()]))
        i += w.numel() + b.numel()
    return out


def fisher_errors(closed: torch.Tensor, numeric: torch.Tensor, fishers, eps: float = 1e-6):
    """The relative error of ``numeric`` against ``closed`` in the norm of the merged metric
    (the mean Fisher, floored by ``eps`` as in the merge), and the largest absolute error
    relative to the largest entry."""
    metric = sum(fishers) / len(fishers) + eps
    err = float((((closed - numeric) ** 2 * metric).sum() / (closed ** 2 * metric).sum()).sqrt())
    maxabs = float((closed - numeric).abs().max() / closed.abs().max())
    return err, maxabs


# -- the explorer: the merge weights -------------------------------------------------------------

# the explorer's merges: name -> (their row in score_merges' table, the per-module merge)
MERGES = {"quotient Fréchet": ("quotient", fr.merge_quotient),
          "naive factor average": ("naive", fr.merge_naive),
          "SVD of the mean": ("svd_of_mean", fr.merge_svd)}


def weighted_merges(bench: Bench, sets: list, weights, iters: int) -> pd.DataFrame:
    """Every merge of :data:`MERGES` with weight ``w`` on one family and ``(1 - w) / (N - 1)`` on
    each other, for each family and each ``w`` in ``weights``: exact match per family and the
    answer loss (a row per ``family`` weighted up, ``weight on family`` and ``method``)."""
    rows, n = [], len(bench.families)
    for i, f in enumerate(bench.families):
        for w in weights:
            ws = [w if j == i else (1 - w) / (n - 1) for j in range(n)]
            for name, (_, how) in MERGES.items():
                kw = {"iters": iters} if how is fr.merge_quotient else {}
                slot = bench.slot("explore", fr.merge_modules(sets, how, weights=ws, **kw)[0])
                rows.append({"family": f, "weight on family": float(w), "method": name,
                             **bench.accuracy(slot), "answer_loss": bench.loss(slot)})
    return pd.DataFrame(rows)


def weight_table(weighted: pd.DataFrame, c4: pd.DataFrame, families: list) -> pd.DataFrame:
    """:func:`weighted_merges` with the two ends :func:`score_merges` already scored (equal
    weights 1/N, and weight 1: the family's adapter alone, which every merge returns), in long
    form: per ``family`` weighted up, ``weight on family``, ``method`` (the merge) and
    ``measure`` (exact match on that family, on the others, on all; the answer loss) a ``value``."""
    ends = []
    for f in families:
        for name, (row, _) in MERGES.items():
            for w, at in ((1 / len(families), row), (1.0, f"adapter {f} alone")):
                ends.append({"family": f, "weight on family": w, "method": name,
                             **c4.loc[at, [*families, "answer_loss"]].to_dict()})
    wide = pd.concat([weighted, pd.DataFrame(ends)], ignore_index=True)
    em = wide[families].to_numpy(float)
    own = np.array([families.index(f) for f in wide.family])
    wide["exact match, family"] = em[np.arange(len(wide)), own]
    wide["exact match, others"] = (em.sum(1) - em[np.arange(len(wide)), own]) / (len(families) - 1)
    wide["exact match, all"] = em.mean(1)
    wide["answer loss"] = wide.answer_loss
    measures = [c for c in wide.columns if c.startswith(("exact match", "answer loss"))]
    rank = {k: i for i, k in enumerate([*measures, *families, *MERGES])}   # the order declared
    return (wide.melt(id_vars=["family", "weight on family", "method"], value_vars=measures,
                      var_name="measure", value_name="value")
            .sort_values(["measure", "family", "method", "weight on family"],
                         key=lambda c: c if c.name == "weight on family" else c.map(rank))
            .reset_index(drop=True))
