"""The harness of notebook 04 (Hybrid-LoRA for RLVR, ``docs/papers/04-hybrid-lora.md``).

The method (eq. 1-3: group advantages, the GRPO loss, the probe gradient, the Hybrid-LoRA Score,
the module selection and the policies) is :mod:`workbench.methods.hybrid_lora`. Here is what the
notebook drives around it:

- :func:`problems`, :func:`base_rewards`: the bed, train, validation and test problems of one
  family and difficulty, two disjoint probe batches, and where the base policy starts;
- :func:`score_modules`, :func:`eckart_young_check`, :func:`score_grid`: the score (3) of every
  candidate on two probe batches, the selection, the random control, and the checks of C3;
- :class:`GRPOSettings`, :func:`train_grpo`: one GRPO run in TRL's ``GRPOTrainer`` with the
  greedy reward on the validation and test splits, the trainable count, the optimizer state and
  the step times;
- :class:`Runs`: every method on one grid of learning rates (:func:`workbench.sweep.sweep`, each
  run cached), each selected on the validation split; :func:`selected`, :func:`final_table`,
  :func:`paired` (the paired bootstrap intervals of C1, C2 and C4 on the test problems),
  :func:`reward_curves` and :func:`cost_table` (C5);
- :func:`energy_curves`, :func:`scores_at`, :func:`rank_sweep`, :func:`rank_figure`: the
  explorer over the rank r of the score (3): one SVD per probe gradient, then any r's scores,
  selection and agreement of the two probe batches are lookups.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import pandas as pd
import torch
from matplotlib.patches import Rectangle
from datasets import Dataset
from scipy.stats import spearmanr
from transformers import PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from .. import cache, diagnostics, evaluate, plots, sweep
from ..data import tasks
from ..methods import hybrid_lora as H
from ..models import zoo

__all__ = ["GRPOSettings", "problems", "base_rewards", "score_modules", "residual",
           "eckart_young_check", "score_grid", "param_groups", "optimizer_state_bytes",
           "heldout_scores", "heldout_reward", "train_grpo", "matched_rank", "Runs", "selected",
           "grid_metrics",
           "final_table", "paired", "reward_curves", "cost_table", "summary", "layer_of",
           "energy_curves", "scores_at", "rank_sweep", "rank_figure", "GROUP", "KINDS"]

GROUP = "04-hybrid-lora"        # the cache folder of the GRPO runs
KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class GRPOSettings:
    """One GRPO run (TRL ``GRPOConfig`` fields in brackets)."""
    steps: int = 40              # optimizer steps [max_steps]
    prompts: int = 8             # problems per step; each gets ``group`` completions
    group: int = 8               # G, completions per problem [num_generations]
    max_new_tokens: int = 5      # completion length cap [max_completion_length]
    temperature: float = 1.0     # sampling temperature of the rollouts
    lr: float = 1e-3             # AdamW learning rate of dense (fully fine-tuned) weights
    lr_adapter: float = 3e-3     # AdamW learning rate of LoRA / DoRA / PiSSA factors
    epsilon: float = 0.2         # clip range e of eq. (2)
    beta: float = 0.0            # KL coefficient to the reference (0: no reference model)
    num_iterations: int = 1      # updates per rollout batch (> 1 makes the clip bite) [mu]
    level: str = "token"         # "token" (GRPO) or "sequence" (GSPO) importance ratio
    every: int = 10              # evaluate greedy reward on held-out problems every this many steps
    seed: int = 0                # the trainer's seed: prompt order, sampling, LoRA init


# -- the bed ------------------------------------------------------------------------------------

def problems(family: str, difficulty: int, n_eval: int, probe: int, seed: int,
             n_val: int = 0) -> dict:
    """Train and held-out problems (``tasks.problem_split``: disjoint prompts); of the held-out
    ones the first ``n_val`` are the validation split (learning rates are selected on it) and the
    next ``n_eval`` the test split (the verdicts); two disjoint probe batches of ``probe`` train
    problems drawn with ``seed`` (A for the score, B for C3's check)."""
    train, held = tasks.problem_split(family, difficulty)
    if n_val + n_eval > len(held):
        raise ValueError(f"{family} at difficulty {difficulty} has {len(held)} held-out problems, "
                         f"fewer than n_val + n_eval = {n_val + n_eval}")
    order = np.random.default_rng(seed).permutation(len(train))
    return {"train": train, "held_all": held, "val": held[:n_val],
            "held": held[n_val: n_val + n_eval],
            "probe_a": [train[i] for i in order[:probe]],
            "probe_b": [train[i] for i in order[probe: 2 * probe]]}


def base_rewards(model, tok, held: list, group: int, max_new_tokens: int, seed: int,
                 sampled: int = 64) -> dict:
    """Where the base policy starts on the held-out problems: its greedy reward (and per
    problem, ``items``), and on the first ``sampled`` of them its sampled reward and the share
    of groups of ``group`` completions with both a correct and a wrong one (the groups GRPO
    learns from)."""
    items = heldout_scores(model, tok, held)
    roll = H.rollouts(model, tok, held[:sampled], group, max_new_tokens, seed=seed)["rewards"]
    roll = roll.view(-1, group)
    return {"greedy": float(items.mean()), "items": items, "sampled": float(roll.mean()),
            "with_signal": float((roll.std(1) > 0).float().mean())}


# -- the score (3) and C3's checks ---------------------------------------------------------------

def score_modules(model, tok, probe_a: list, probe_b: list, *, group: int, max_new_tokens: int,
                  rank: int, budget: float, seed: int) -> dict:
    """The probe gradients and the score (3) of every candidate on probe batch A (and B, seeded
    ``seed + 1000``), the selection within ``budget``, the random control of the same size, the
    rank correlation of the two batches' scores and the overlap of their selections."""
    grads, stats = H.probe_gradients(model, tok, probe_a, group, max_new_tokens, seed=seed)
    grads_b, _ = H.probe_gradients(model, tok, probe_b, group, max_new_tokens, seed=seed + 1000)
    scores = {n: H.hybrid_score(g, rank) for n, g in grads.items()}
    scores_b = {n: H.hybrid_score(g, rank) for n, g in grads_b.items()}
    names = list(scores)
    chosen = H.select_modules(scores, budget)
    return {"grads": grads, "grads_b": grads_b, "probe_stats": stats, "scores": scores,
            "scores_b": scores_b,
            "names": names, "chosen": chosen, "control": H.random_modules(names, len(chosen), seed),
            "spearman": float(spearmanr([scores[n] for n in names],
                                        [scores_b[n] for n in names]).statistic),
            "overlap": len(set(chosen) & set(H.select_modules(scores_b, budget))) / len(chosen)}


def residual(g: torch.Tensor, basis: torch.Tensor) -> float:
    """Share of ||g||^2 outside the column span of ``basis`` (orthonormal columns)."""
    g = g.double()
    basis = basis.to(g.device, torch.float64)         # a random basis is drawn on the host
    return float((g - basis @ (basis.T @ g)).norm() ** 2 / g.norm() ** 2)


def eckart_young_check(grads: dict, scores: dict, rank: int, seed: int) -> tuple[float, bool]:
    """C3's identity: the largest |score - residual outside the top-``rank`` left singular
    vectors| over the modules (Eckart-Young: (3) is that residual), and whether a random rank-r
    subspace (seeded) misses at least as much for every module."""
    gen = torch.Generator().manual_seed(seed)
    err, rand_worse = 0.0, True
    for n, g in grads.items():
        u = torch.linalg.svd(g.double(), full_matrices=False)[0]
        err = max(err, abs(residual(g, u[:, :rank]) - scores[n]))
        q = torch.linalg.qr(torch.randn(g.shape[0], rank, generator=gen, dtype=torch.float64))[0]
        rand_worse &= residual(g, q) >= scores[n] - 1e-12
    return err, rand_worse


def layer_of(name: str) -> int:
    return int(name.split("layers.")[1].split(".")[0])


def score_grid(scores: dict) -> tuple[np.ndarray, list[str]]:
    """The scores as a (layer, module kind) grid (NaN where a model lacks a kind) and the kinds."""
    kinds = [t for t in KINDS if any(n.endswith(t) for n in scores)]
    heat = np.full((max(layer_of(n) for n in scores) + 1, len(kinds)), np.nan)
    for n, v in scores.items():
        heat[layer_of(n), kinds.index(n.split(".")[-1])] = v
    return heat, kinds


# -- one GRPO run ---------------------------------------------------------------------------------

def param_groups(model, s: GRPOSettings) -> list[dict]:
    """AdamW groups: dense weights at ``s.lr``, adapter factors (LoRA A/B, DoRA magnitudes) at
    ``s.lr_adapter``."""
    dense, adapter = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (adapter if "lora_" in n else dense).append(p)
    return [g for g in ({"params": dense, "lr": s.lr}, {"params": adapter, "lr": s.lr_adapter})
            if g["params"]]


def optimizer_state_bytes(opt) -> int:
    """Bytes of the optimizer's state tensors (AdamW: the two moments of every trained weight)."""
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim() > 0)


def heldout_scores(model, tok, examples: list) -> np.ndarray:
    """Per problem, the verifier's reward of the greedy completion (room for the reference's
    written steps; ``evaluate.item_scores``), in eval mode."""
    was = model.training
    model.eval()
    items = evaluate.item_scores(model, tok, examples, with_steps=True)
    model.train(was)
    return items


def heldout_reward(model, tok, examples: list) -> float:
    """Mean verifier reward of greedy completions on held-out problems."""
    return float(heldout_scores(model, tok, examples).mean())


class _Heldout(TrainerCallback):
    """Greedy reward on each split of ``evals`` (``{name: problems}``) every ``every`` steps
    and at the last step, into ``curve[name][step]``; at the last step also the per-problem
    scores, into ``items[name]``."""

    def __init__(self, tok, evals: dict, every: int, steps: int, curve: dict, items: dict):
        self.tok, self.evals, self.every, self.steps = tok, evals, every, steps
        self.curve, self.items = curve, items

    def on_step_end(self, args, state, control, model=None, **_):
        step = state.global_step
        if step % self.every == 0 or step == self.steps:
            for name, exs in self.evals.items():
                sc = heldout_scores(model, self.tok, exs)
                self.curve.setdefault(name, {})[step] = float(sc.mean())
                if step == self.steps:
                    self.items[name] = sc.tolist()


def train_grpo(model, tok, train: list, evals: dict, s: GRPOSettings, out_dir) -> dict:
    """GRPO on ``train`` problems with TRL's ``GRPOTrainer`` (eq. 1 and 2: ``loss_type="grpo"``,
    ``scale_rewards="group"``), rewards from the task verifiers; every ``s.every`` steps and at
    the end the greedy reward on each split of ``evals`` (``{name: problems}``, e.g. validation
    and test). Returns the per-step rollout reward, the curves (``curve[name][step]``), the
    final per-problem scores (``items[name]``), the trainable count, the optimizer-state bytes
    and the step times."""
    by_prompt = {tok.bos_token + e.prompt: e for e in train}

    def reward(prompts, completions, **_):
        return [tasks.score(by_prompt[p], c) for p, c in zip(prompts, completions)]

    curve, items = {}, {}
    device = next(model.parameters()).device
    cfg = GRPOConfig(output_dir=str(out_dir), max_steps=s.steps, per_device_train_batch_size=s.prompts * s.group,
                     num_generations=s.group, max_completion_length=s.max_new_tokens,
                     temperature=s.temperature, top_k=0, top_p=1.0, beta=s.beta, epsilon=s.epsilon,
                     num_iterations=s.num_iterations, importance_sampling_level=s.level,
                     loss_type="grpo", scale_rewards="group", learning_rate=s.lr,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                     logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
                     use_cpu=device.type == "cpu", bf16=False, seed=s.seed, data_seed=s.seed,
                     log_completions=False,
                     # TRL turns checkpointing on by default; on a 1M-parameter policy recomputing the
                     # activations only adds ~12% to a step, the gradients are the same
                     activation_checkpointing=False)
    opt = torch.optim.AdamW(param_groups(model, s), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    tok.padding_side = "left"
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": list(by_prompt)}),
                          optimizers=(opt, sched),
                          callbacks=[_Heldout(tok, evals, s.every, s.steps, curve, items)])
    trainer.remove_callback(PrinterCallback)          # the logs stay in the record, not on screen
    t0 = time.time()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {"reward": [float(h["reward"]) for h in logs],
            "clip_region": [float(h.get("clip_ratio/region_mean", 0.0)) for h in logs],
            "step_time": [float(h["step_time"]) for h in logs if "step_time" in h],
            "curve": {n: {int(k): float(v) for k, v in sorted(c.items())} for n, c in curve.items()},
            "items": items, "trainable": H.trainable(model),
            "optimizer_bytes": optimizer_state_bytes(opt),
            "train_seconds": round(time.time() - t0, 2), "settings": asdict(s)}


# -- every method on one learning-rate grid -------------------------------------------------------

def matched_rank(model, names: list[str], chosen: list[str], rank: int) -> tuple[int, int]:
    """Hybrid-LoRA's trainable count (the ``chosen`` modules in full, rank ``rank`` on the other
    candidates ``names``) and the LoRA rank that matches it on every candidate (at least
    ``rank``)."""
    mods = dict(model.named_modules())
    per_rank = sum(m.in_features + m.out_features for n, m in mods.items() if n in set(names))
    hybrid = sum(mods[n].weight.numel() for n in chosen) + rank * sum(
        mods[n].in_features + mods[n].out_features for n in names if n not in chosen)
    return hybrid, max(rank, round(hybrid / per_rank))


@dataclass(kw_only=True)
class Runs:
    """Everything one GRPO run of a method depends on: the policy's start (zoo ``base`` at
    ``zoo_scale`` on ``device``), the problems (``train``, the validation split ``val``, the
    test split ``held``), the settings, each method's LoRA rank and fully fine-tuned modules
    (``ranks``, ``full``), the LoRA scale, and ``adapter_ratio``: adapter factors train at that
    multiple of the dense learning rate (one knob, the dense rate, for every method)."""
    base: str
    zoo_scale: str
    device: str
    tok: object
    family: str
    difficulty: int
    train: list
    val: list
    held: list
    settings: GRPOSettings
    ranks: dict
    full: dict
    lora_scale: float
    adapter_ratio: float = 10.0

    def at(self, lr: float) -> GRPOSettings:
        """The settings at dense learning rate ``lr`` (adapter factors at ``adapter_ratio`` x)."""
        return replace(self.settings, lr=float(lr), lr_adapter=float(lr) * self.adapter_ratio)

    def build(self, method: str, s: GRPOSettings, out) -> dict:
        """Train ``method`` from a fresh copy of the base model with settings ``s``; greedy
        reward on the validation and the test split."""
        m, _ = zoo.load(self.base, self.zoo_scale, device=self.device)
        policy = H.make_policy(m, method, self.ranks[method], self.lora_scale,
                               self.full.get(method, ()), seed=s.seed)
        return train_grpo(policy, self.tok, self.train, {"val": self.val, "test": self.held}, s, out)

    def result(self, method: str, lr: float) -> dict:
        """One GRPO run of ``method`` at dense rate ``lr``: its final validation (``val``, what
        the sweep selects on) and test (``test``) reward beside the whole record."""
        with tempfile.TemporaryDirectory() as out:
            rec = self.build(method, self.at(lr), out)
        return {"val": rec["curve"]["val"][self.settings.steps],
                "test": rec["curve"]["test"][self.settings.steps], **rec}

    def key(self) -> list:
        """The sweep's cache key: the base model's recipe key and everything a run reads but
        the learning rate."""
        return ["v2", zoo.key(self.base, self.zoo_scale), self.base, zoo.zoo_scale(self.zoo_scale),
                self.family, self.difficulty, self.ranks, {m: list(v) for m, v in self.full.items()},
                asdict(replace(self.settings, lr=0.0, lr_adapter=0.0)), self.lora_scale,
                self.adapter_ratio, [e.prompt for e in self.val], [e.prompt for e in self.held]]

    def sweep(self, methods, grid) -> sweep.Sweep:
        """Every method on the same grid of dense learning rates (:func:`workbench.sweep.sweep`,
        each run cached), each selected on its final validation reward."""
        where = cache.folder(GROUP) / f"sweep-{cache.key(*self.key())}"
        return sweep.sweep(self.result, list(methods), sorted(grid), "val", cache_dir=where,
                           desc="GRPO runs")


def selected(sw: sweep.Sweep) -> dict:
    """Each method's run at its selected learning rate (``{method: record}``)."""
    return {m: sw.at_best(m) for m in sw.table["method"].unique()}


def grid_metrics(sw: sweep.Sweep) -> dict:
    """The whole grid as scalars for the record: each method's final validation and test
    reward at the i-th rate of the grid (ascending), ``grid_val_<method>_<i>`` and
    ``grid_test_<method>_<i>``, and the rates, ``grid_lr_<i>``."""
    lrs = sorted(sw.table[sw.knob].unique())
    out = {f"grid_lr_{i}": float(v) for i, v in enumerate(lrs)}
    for row in sw.table.itertuples():
        i = lrs.index(getattr(row, sw.knob))
        out.update({f"grid_val_{row.method}_{i}": float(row.val),
                    f"grid_test_{row.method}_{i}": float(row.test)})
    return out


def final_table(best: dict, start: float) -> pd.DataFrame:
    """Per method at its selected rate: the dense learning rate, the final validation and test
    reward, the test gain over the base policy's ``start``, and the trainable count."""
    return pd.DataFrame({m: {"lr": rec["lr"], "val": rec["val"], "test": rec["test"],
                             "gain": rec["test"] - start, "trainable": rec["trainable"]}
                         for m, rec in best.items()}).T.astype(float)


def paired(best: dict, a: str, others) -> pd.DataFrame:
    """``a`` against each of ``others`` on the same test problems, each at its selected rate:
    :func:`workbench.diagnostics.paired_table` of their per-problem rewards (``a`` minus the
    other; ``a`` beats it where ``low > 0``), a row per other."""
    return diagnostics.paired_table({o: (best[a]["items"]["test"], best[o]["items"]["test"])
                                     for o in others})


def reward_curves(best: dict, window: int = 5) -> pd.DataFrame:
    """The rollout reward of each method's selected run, a ``window``-step moving mean, as a
    (step, method) table."""
    return pd.DataFrame({m: pd.Series(rec["reward"], index=range(1, len(rec["reward"]) + 1))
                         .rolling(window, min_periods=1).mean() for m, rec in best.items()})


def cost_table(short: dict) -> pd.DataFrame:
    """C5 from a run per method (``{method: record}``): trainable count, AdamW state, bytes per
    trained weight, median step time, and each as a ratio to Full FT's."""
    cost = pd.DataFrame({m: {"trainable": rec["trainable"],
                             "optimizer_MB": rec["optimizer_bytes"] / 2**20,
                             "bytes_per_trained_weight": rec["optimizer_bytes"] / rec["trainable"],
                             "step_ms": 1000 * float(np.median(rec["step_time"]))}
                         for m, rec in short.items()}).T
    for c in ("trainable", "optimizer_MB", "step_ms"):
        cost[f"{c} / full"] = cost[c] / cost.loc["full", c]
    return cost


def summary(final: pd.DataFrame, c1: dict, c2: dict, c4: pd.DataFrame, cost: pd.DataFrame, *,
            lora_rank: int, ey_error: float, scores: dict) -> dict:
    """The scalars "What we saw" quotes: Full FT's test gain over the base with its interval
    (``c1``), LoRA's gap to Full FT with its interval (``c2``), Hybrid-LoRA's differences to
    the others with their intervals (``c4``), every method's final test reward and selected
    rate, the matched LoRA rank, C3's identity error and largest score, and C5's shares of Full
    FT's parameters and optimizer state with the step times."""
    out = {"lora_rank": int(lora_rank), "c3_ey_error": float(ey_error),
           "c3_score_max": float(max(scores.values()))}
    out.update({f"c1_{k}": float(c1[k]) for k in ("diff", "low", "high")})
    out.update({f"c2_{k}": float(c2[k]) for k in ("diff", "low", "high")})
    out.update({f"c4_{o}_{k}": float(c4.loc[o, k]) for o in c4.index for k in ("diff", "low", "high")})
    out.update({f"final_{m}": float(v) for m, v in final["test"].items()})
    out.update({f"lr_{m}": float(v) for m, v in final["lr"].items()})
    out.update(c5_hybrid_trainable_share=float(cost.loc["hybrid", "trainable / full"]),
               c5_hybrid_optimizer_share=float(cost.loc["hybrid", "optimizer_MB / full"]),
               c5_bytes_per_trained_weight=float(cost.loc["hybrid", "bytes_per_trained_weight"]),
               c5_fastest_step_ms=float(cost["step_ms"].min()),
               c5_slowest_step_ms=float(cost["step_ms"].max()))
    return out


# -- the explorer: the rank r of the score (3) -----------------------------------------------------

def energy_curves(grads: dict) -> dict:
    """Per module, the share of its gradient's energy the best rank-i update holds, for
    i = 0 .. min(shape) (Eckart-Young: the top-i singular values' squares over all of them), so
    the score (3) at rank r is ``1 - curve[r]``; one SVD per module."""
    out = {}
    for n, g in grads.items():
        s2 = torch.linalg.svdvals(g.double()).cpu().numpy() ** 2
        out[n] = np.concatenate([[0.0], np.cumsum(s2) / max(s2.sum(), 1e-300)])
    return out


def scores_at(curves: dict, rank: int) -> dict:
    """The score (3) of every module at ``rank`` (0 past a module's smaller side)."""
    return {n: float(max(0.0, 1.0 - c[min(rank, len(c) - 1)])) for n, c in curves.items()}


def rank_sweep(curves_a: dict, curves_b: dict, ranks, budget: float) -> pd.DataFrame:
    """Per rank: the Spearman correlation of the two probe batches' scores, the overlap of
    their selections within ``budget``, the largest score on batch A and A's selection."""
    rows, names = [], list(curves_a)
    for r in ranks:
        a, b = scores_at(curves_a, r), scores_at(curves_b, r)
        chosen = H.select_modules(a, budget)
        rows.append({"rank": int(r), "chosen": chosen, "max_score": max(a.values()),
                     "spearman": float(spearmanr([a[n] for n in names],
                                                 [b[n] for n in names]).statistic),
                     "overlap": len(set(chosen) & set(H.select_modules(b, budget))) / len(chosen)})
    return pd.DataFrame(rows)


def _heatmap(ax, fig, scores: dict, chosen: list, trained: list, rank: int) -> None:
    """The scores as a (layer, kind) heatmap; red boxes: ``chosen``, dashed white: ``trained``."""
    heat, kinds = score_grid(scores)
    im = ax.imshow(heat, cmap="viridis", aspect="auto")
    for names, style in ((trained, dict(ec="white", ls="--", lw=1.5)),
                         (chosen, dict(ec="red", lw=2.5))):
        for n in names:
            ax.add_patch(Rectangle((kinds.index(n.split(".")[-1]) - 0.5, layer_of(n) - 0.5), 1, 1,
                                   fill=False, **style))
    ax.set_xticks(range(len(kinds)), kinds, rotation=30)
    ax.set_yticks(range(len(heat)), [f"layer {i}" for i in range(len(heat))])
    ax.grid(False)
    ax.set_title(f"score (3) at r = {rank}; red: full modules, dashed: trained", fontsize=9)
    fig.colorbar(im, ax=ax, label="score")


def rank_figure(curves: dict, sweep: pd.DataFrame, rank: int, budget: float,
                trained: list, trained_rank: int):
    """The explorer's picture at ``rank``: the score heatmap with its selection (and the one the
    runs trained, at ``trained_rank``), every module's missed energy against the rank with the
    selection in red, and the two probe batches' agreement across ranks."""
    scores = scores_at(curves, rank)
    chosen = H.select_modules(scores, budget)
    fig, (ax, bx, cx) = plots.subplots(1, 3, figsize=(15, 3.9))
    _heatmap(ax, fig, scores, chosen, trained, rank)
    top = int(sweep["rank"].max())
    for n, c in curves.items():
        red = n in chosen
        bx.plot(range(1, top + 1), np.maximum(1 - c[1:top + 1], 1e-6), color="#d1495b" if red else
                "0.6", lw=2 if red else 0.8, zorder=3 if red else 1)
    bx.axvline(rank, color="k", ls=":", lw=1)
    bx.set(yscale="log", xlabel="rank r", ylabel="energy a rank-r update misses",
           title=f"every module's score (3); red: the {len(chosen)} chosen at r = {rank}")
    cx.plot(sweep["rank"], sweep["spearman"], "o-", ms=3, color=plots.PALETTE[0],
            label="Spearman, batch A vs B")
    cx.plot(sweep["rank"], sweep["overlap"], "s-", ms=3, color=plots.PALETTE[2],
            label=f"top-{len(chosen)} overlap, A vs B")
    cx.axvline(rank, color="k", ls=":", lw=1)
    cx.axvline(trained_rank, color=plots.PALETTE[1], ls="--", lw=1,
               label=f"trained r = {trained_rank}")
    cx.set(xlabel="rank r", ylim=(-0.05, 1.05), title="Is the ranking the modules' or the batch's?")
    cx.legend(fontsize=7)
    return fig
