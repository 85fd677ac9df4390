"""The harness of notebook 05: why low rank suffices, the bottleneck rank of frozen-backbone
adaptation (NeurIPS 2026; spec in ``docs/papers/05-lora-bottleneck-rank.md``; the method is
:mod:`workbench.methods.lora_bottleneck_rank`).

What the notebook drives, in its order:

- C1: the trace-norm minimizer's rank over a sample-size sweep on synthetic features of
  bottleneck rank k (:func:`rank_sweep`), cross-checked with cvxpy (:func:`cvxpy_checks`); on
  the frozen zoo LM (:func:`frozen_lm`, :func:`task_examples_batch`), null-space updates against
  random ones (:func:`loss_with`, :func:`invisibility`);
- C2: the attention invariances (:func:`shift_gap`, :func:`constant_key_change`), updates
  learned by proximal gradient on the LM (:func:`learn_updates`), a ``peft`` LoRA baseline
  (:func:`peft_baseline`) and the table of ranks and outside shares (:func:`update_table`);
- C3: ``peft`` LoRA factors with weight decay trained by L-BFGS over a rank sweep
  (:func:`perturbed_problem`, :func:`stationary_ranks`);
- C4: the perturbed minimizers on the original problem (:func:`perturbation_gaps`);
- C5: the spectral bound against measured generalization gaps, on synthetic spectra
  (:func:`spectral_gaps`, :func:`group_spearman`) and over a LoRA rank sweep of the zoo LM
  (:func:`lora_rank_sweep`);
- the explorer: one instance of C1's sweep solved at a chosen n and k, its singular values
  against the bottleneck (:func:`spectra`, :func:`spectra_figure`).
"""
from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import torch
from peft import LoraConfig, get_peft_model

from .. import plots
from ..data import tasks
from ..data.packing import task_batch
from ..diagnostics import erank, srank
from ..methods import lora_bottleneck_rank as br
from ..models import zoo

__all__ = ["check_sizes", "rank_sweep", "cvxpy_checks", "frozen_lm", "attention_names",
           "task_examples_batch", "loss_with", "invisibility", "shift_gap",
           "constant_key_change", "learn_updates", "peft_qv", "peft_baseline", "update_table",
           "per_head_ranks", "perturbed_problem", "stationary_ranks", "perturbation_gaps",
           "spectral_gaps", "group_spearman", "lora_rank_sweep", "prose_metrics", "spectra",
           "spectra_figure"]

NORM = 50.0                 # Frobenius norm of C1's null-space and random LM updates


def check_sizes(S: dict) -> None:
    """Bottleneck ranks must lie between 1 and d - 1 (bounds that depend on the width d)."""
    if S["k"] >= S["d"] or min(S["ks"]) < 1 or max(S["ks"]) >= S["d"]:
        raise ValueError(f"bottleneck ranks must be between 1 and d - 1 = {S['d'] - 1}")


# -- C1: the minimizer's rank and the invisible updates ---------------------------------------------

def rank_sweep(S: dict, g: torch.Generator) -> pd.DataFrame:
    """For every bottleneck rank k in ``S["ks"]`` and sample size n in ``S["ns"]``: features of
    rank k, a full-rank teacher plus noise, the trace-norm minimizer's rank (and its KKT
    residual) against a least-squares fit from a random start, which keeps its invisible part."""
    rows = []
    for kk in S["ks"]:
        for n in S["ns"]:
            x, r, teacher, dhat, info, ls = _instance(S["d"], kk, n, S["lam"], S["pg_steps"], g)
            rows.append({"k": kk, "n": n, "bottleneck": br.bottleneck_rank(x),
                         "rank_minimizer": br.numeric_rank(dhat), "rank_lstsq_random_start":
                         br.numeric_rank(ls), "trivial_bound": min(n, S["d"]), "kkt": info["kkt"],
                         "pg_steps": info["steps"], "teacher_rank": br.numeric_rank(teacher)})
    return pd.DataFrame(rows)


def _instance(d: int, k: int, n: int, lam: float, steps: int, g: torch.Generator):
    """One instance of :func:`rank_sweep`: features ``x`` of rank k, a full-rank ``teacher``
    plus noise as targets ``r``, the trace-norm minimizer ``dhat`` (with its prox-grad ``info``)
    and the least-squares fit ``ls`` from a random start (it keeps its invisible part)."""
    x = br.low_rank_features(n, d, k, g)
    teacher = torch.randn(d, d, generator=g, dtype=torch.float64)
    r = x @ teacher.T + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)
    dhat, info = br.prox_grad(br.LeastSquares(x, r, lam=lam), steps=steps)
    start = torch.randn(d, d, generator=g, dtype=torch.float64)
    ls = start - br.project_rows(start, br.row_basis(x)) + torch.linalg.lstsq(x, r).solution.T
    return x, r, teacher, dhat, info, ls


def cvxpy_checks(S: dict, g: torch.Generator) -> list[dict]:
    """An independent solver (cvxpy) on the smallest and the largest instance of the middle k:
    both objectives, their relative gap and cvxpy's rank."""
    checks = []
    for n in (S["ns"][0], S["ns"][-1]):
        x = br.low_rank_features(n, S["d"], S["ks"][1], g)
        r = x @ torch.randn(S["d"], S["d"], generator=g, dtype=torch.float64).T
        pb = br.LeastSquares(x, r, lam=S["lam"])
        dhat, info = br.prox_grad(pb, steps=S["pg_steps"])
        dcvx, obj = br.cvxpy_solve(pb)
        checks.append({"n": n, "prox_grad": info["objective"], "cvxpy": obj,
                       "rel_gap": abs(info["objective"] - obj) / abs(obj),
                       "rank_cvxpy": br.numeric_rank(torch.as_tensor(dcvx), 1e-5)})
    return checks


def frozen_lm(model: str, scale: str, device="cpu"):
    """The zoo LM on ``device``, with eager attention (C2 needs its weights) and every parameter
    frozen. Its features are analysed in float64 on the same device; the synthetic problems of
    C1, C3 and C4 are float64 on the host."""
    lm, tok = zoo.load(model, scale, device=str(device))
    lm.set_attn_implementation("eager")
    for p in lm.parameters():
        p.requires_grad_(False)
    return lm, tok


def attention_names(lm) -> tuple[int, dict]:
    """The last block's index and the module names of its q, k and v projections."""
    last = len(lm.model.layers) - 1
    return last, {p: f"model.layers.{last}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")}


def task_examples_batch(tok, family: str, n: int, seed: int, device=None) -> dict:
    """A packed batch of ``n`` examples of ``family`` at its easiest difficulty (on ``device``)."""
    exs = tasks.generate(family, n, seed=seed, difficulty=tasks.get(family).difficulties[0])
    return task_batch(tok, exs, device)


def loss_with(lm, name: str, delta: torch.Tensor, batch: dict, logits: bool = False):
    """The loss (or the logits at the answer positions) with the update D added to layer
    ``name`` (a forward hook: y = W x + D x)."""
    hooks = br.DeltaHooks(lm, [name])
    try:
        with torch.no_grad():
            hooks.deltas[name].copy_(delta.float())
            if logits:
                return lm(input_ids=batch["input_ids"]).logits[br.loss_positions(batch["labels"])]
            return float(br.lm_loss(lm, batch))
    finally:
        hooks.remove()


def invisibility(lm, names: dict, xf: torch.Tensor, batch: dict, base_loss: float,
                 g: torch.Generator, norm: float = NORM) -> dict:
    """Per projection: how much a random update with D X^T = 0, and a random update, both of
    Frobenius norm ``norm``, move the loss (from ``base_loss``) and the answer logits."""
    base_logits = loss_with(lm, names["q_proj"],
                            torch.zeros_like(lm.get_submodule(names["q_proj"]).weight), batch,
                            logits=True)
    out = {}
    for p, name in names.items():
        width = lm.get_submodule(name).weight.shape[0]
        null = br.null_update(xf, width, g)
        rand = torch.randn(width, xf.shape[1], generator=g, dtype=torch.float64)
        null, rand = null / null.norm() * norm, rand / rand.norm() * norm
        out[p] = {"null_loss_change": abs(loss_with(lm, name, null, batch) - base_loss),
                  "random_loss_change": abs(loss_with(lm, name, rand, batch) - base_loss),
                  "null_logit_change": float((loss_with(lm, name, null, batch, logits=True)
                                              - base_logits).abs().max()),
                  "random_logit_change": float((loss_with(lm, name, rand, batch, logits=True)
                                                - base_logits).abs().max())}
    return out


# -- C2: attention ------------------------------------------------------------------------------

def shift_gap(feats: dict, g: torch.Generator) -> float:
    """Softmax row-shift invariance on the real attention: the log-weights are the scores up to a
    row constant; shift every row by a random constant."""
    return br.softmax_shift_gap(torch.log(feats["attn"].clamp_min(1e-300)),
                                10 * torch.randn(feats["attn"].shape[:-1], generator=g,
                                                 dtype=torch.float64).to(feats["attn"].device))


def constant_key_change(lm, k_name: str, batch: dict, g: torch.Generator) -> dict:
    """The loss change of a key update that adds the same vector to every key of one sequence,
    in the block without its rotary embedding and with it."""
    one = {kk: v[:1] for kk, v in batch.items()}
    dk_const = br.constant_key_update(br.block_features(lm, one), one["labels"], generator=g) * 10
    hook = br.no_rope(lm)
    try:
        nope_one = float(br.lm_loss(lm, one))
        out = {"no_rope": abs(loss_with(lm, k_name, dk_const, one) - nope_one)}
    finally:
        hook.remove()
    out["rope"] = abs(loss_with(lm, k_name, dk_const, one) - float(br.lm_loss(lm, one)))
    return out


def learn_updates(lm, batch: dict, names: dict, S: dict, head_dim: int, progress=None):
    """Proximal-gradient updates of the last block (:func:`learn_update`): query, value under the
    whole and the per-head trace norm, key with rotary, then key in the block without it (and
    that block's subspaces). Returns ``(learned, bases_nope)``, learned[label] = (D, losses)."""
    def learn(name, block=None):
        bar = None if progress is None else (lambda it: progress(it, desc=name.split(".")[-1]))
        return br.learn_update(lm, batch, name, lam=S["lm_lam"], steps=S["lm_steps"],
                               lr=S["lm_lr"], block=block, progress=bar)

    learned = {"query": learn(names["q_proj"]), "value (whole trace norm)": learn(names["v_proj"]),
               "value (per-head trace norm)": learn(names["v_proj"], block=head_dim),
               "key (rotary)": learn(names["k_proj"])}
    hook = br.no_rope(lm)
    try:
        bases_nope = br.attention_bases(br.block_features(lm, batch), batch["labels"])
        learned["key (no rotary)"] = learn(names["k_proj"])
    finally:
        hook.remove()
    return learned, bases_nope


def peft_qv(lm, rank: int, layer: int):
    """A deep copy of ``lm`` with a ``peft`` LoRA (alpha = r) on one block's q and v."""
    return get_peft_model(copy.deepcopy(lm), LoraConfig(r=rank, lora_alpha=rank,
                                                        target_modules=["q_proj", "v_proj"],
                                                        layers_to_transform=[layer],
                                                        lora_dropout=0.0))


def peft_baseline(lm, batch: dict, layer: int, steps: int, seed: int, rank: int = 8):
    """``peft`` LoRA on the last block's q and v, AdamW without weight decay or trace norm, from
    peft's init (A Kaiming, B = 0): ``({"q_proj": D_q, "v_proj": D_v}, final loss)``."""
    torch.manual_seed(seed)
    peft_lm = peft_qv(lm, rank, layer)
    opt = torch.optim.AdamW([p for p in peft_lm.parameters() if p.requires_grad], lr=1e-2,
                            weight_decay=0.0)
    for _ in range(steps):
        loss = br.lm_loss(peft_lm, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {kk.split(".")[-1]: v.double() for kk, v in br.lora_delta(peft_lm).items()}, \
        float(loss.detach())


def update_table(learned: dict, bases: dict, bases_nope: dict, lora_d: dict,
                 lora_loss: float) -> pd.DataFrame:
    """One row per learned update: its rank, the tighter bound and the generic one, its share
    outside the predicted subspace, its loss at start and end; the ``peft`` rows last."""
    ranks, dh = bases["ranks"], bases["ranks"]["head_dim"]

    def row(label, subspace, bound, energy):
        dmat, losses = learned[label]
        return {"update": label, "learned_rank": br.numeric_rank(dmat), "bound": bound,
                "generic_bound": min(ranks["generic"], *dmat.shape), "outside_energy": energy,
                "loss_start": losses[0], "loss_end": losses[-1], "subspace": subspace}

    d = {k: v[0] for k, v in learned.items()}
    tab = [row("query", "X at S", ranks["query"], br.outside_energy(d["query"], bases["query"])),
           row("value (whole trace norm)", "sum_h A_h X at S", ranks["value"],
               br.outside_energy(d["value (whole trace norm)"], bases["value"])),
           row("value (per-head trace norm)", "A_h X at S, per head",
               min(ranks["value"], sum(min(dh, r) for r in ranks["value_per_head"])),
               br.value_outside_energy(d["value (per-head trace norm)"], bases["value_heads"])),
           row("key (no rotary)", "centered X_F", bases_nope["ranks"]["key"],
               br.outside_energy(d["key (no rotary)"], bases_nope["key"])),
           row("key (rotary)", "centered X_F (not implied)", ranks["key"],
               br.outside_energy(d["key (rotary)"], bases["key"]))]
    for p, label, space, basis in (("q_proj", "query", "X at S", "query"),
                                   ("v_proj", "value", "sum_h A_h X at S", "value")):
        tab.append({"update": f"peft LoRA r=8, {label}", "learned_rank": br.numeric_rank(lora_d[p]),
                    "bound": ranks[basis], "generic_bound": ranks["generic"],
                    "outside_energy": br.outside_energy(lora_d[p], bases[basis]),
                    "loss_end": lora_loss, "subspace": space})
    return pd.DataFrame(tab).set_index("update")


def per_head_ranks(d: torch.Tensor, head_dim: int, heads: int) -> list[int]:
    """The numeric rank of each head's rows of a value update."""
    return [br.numeric_rank(d[h * head_dim:(h + 1) * head_dim]) for h in range(heads)]


# -- C3 and C4: factorized LoRA and the perturbed problem ----------------------------------------

def perturbed_problem(S: dict, g: torch.Generator, seed: int):
    """C3's instance: 4d samples of features of bottleneck rank k, a full-rank teacher plus noise,
    and the generic PSD perturbation P: ``(x, r, P, problem)``, the problem perturbed by eps."""
    x3 = br.low_rank_features(4 * S["d"], S["d"], S["k"], g)
    r3 = x3 @ torch.randn(S["d"], S["d"], generator=g, dtype=torch.float64).T \
        + 0.3 * torch.randn(4 * S["d"], S["d"], generator=g, dtype=torch.float64)
    p = br.psd_perturbation(S["d"], seed)
    return x3, r3, p, br.LeastSquares(x3, r3, lam=S["lam"], eps=S["eps"], p=p)


def stationary_ranks(problem, k: int, inits: int, seed: int, convex_objective: float,
                     progress=None) -> pd.DataFrame:
    """LoRA ranks r = 1..2k, ``inits`` initializations each: the rank of B A at the L-BFGS
    stationary point, its gradient norm, objective and gap to the convex minimum."""
    rows = []
    ranks = range(1, 2 * k + 1)
    for r in (ranks if progress is None else progress(ranks, desc="LoRA ranks")):
        for s in range(inits):
            dl, il = br.train_lora(problem, r, seed=1000 * seed + s)
            rows.append({"lora_rank": r, "init": s, "rank_BA": br.numeric_rank(dl),
                         "grad_norm": il["grad_norm"], "objective": il["objective"],
                         "gap_to_convex": il["objective"] - convex_objective})
    return pd.DataFrame(rows)


def perturbation_gaps(x, r, p, *, lam: float, eps_grid, d0: torch.Tensor, f0: float,
                      steps: int) -> pd.DataFrame:
    """For each eps: the perturbed minimizer's gap on the original problem F_0, the bound
    eps/2 tr(D_0 P D_0^T), its rank and KKT residual."""
    rows = []
    for eps in eps_grid:
        pe = br.LeastSquares(x, r, lam=lam, eps=eps, p=p)
        de, ie = br.prox_grad(pe, steps=steps)
        rows.append({"eps": eps, "gap": pe.objective(de, eps=0.0) - f0,
                     "bound": br.perturbation_gap_bound(pe, d0, eps), "rank": br.numeric_rank(de),
                     "kkt": ie["kkt"]})
    return pd.DataFrame(rows)


# -- C5: the spectral bound and measured generalization gaps ---------------------------------------

def spectral_gaps(S: dict, g: torch.Generator) -> pd.DataFrame:
    """Synthetic features x ~ N(0, Sigma), eigenvalues ~ i^-decay normalized to a shared trace
    (d) or a shared top eigenvalue (1), a rank-3 teacher plus noise; for each lam the measured
    gap (test minus train MSE, 2000 test samples), the spectral bound and the rank."""
    rows, d5 = [], S["d"]
    for norm in ("trace", "top"):
        for decay in S["gen_decays"]:
            ev = torch.arange(1, d5 + 1, dtype=torch.float64) ** (-decay)
            ev = ev * d5 / ev.sum() if norm == "trace" else ev / ev.max()
            rot = torch.linalg.qr(torch.randn(d5, d5, generator=g, dtype=torch.float64))[0]
            root = rot * ev.sqrt()
            teacher = torch.randn(d5, 3, generator=g, dtype=torch.float64) @ torch.randn(
                3, d5, generator=g, dtype=torch.float64) / 3
            xtr, ytr = _draw(S["gen_n"], root, teacher, g)
            xte, yte = _draw(2000, root, teacher, g)
            for lam in S["gen_lams"]:
                dhat, _ = br.prox_grad(br.LeastSquares(xtr, ytr, lam=lam), steps=S["pg_steps"])
                rows.append({"norm": norm, "decay": decay, "lam": lam,
                             "gap": _mse(dhat, xte, yte) - _mse(dhat, xtr, ytr),
                             "bound": br.spectral_complexity(xtr, d5, br.trace_norm(dhat)),
                             "rank": br.numeric_rank(dhat)})
    return pd.DataFrame(rows)


def _draw(n: int, root: torch.Tensor, teacher: torch.Tensor, g: torch.Generator):
    xx = torch.randn(n, root.shape[0], generator=g, dtype=torch.float64) @ root.T
    return xx, xx @ teacher.T + 0.5 * torch.randn(n, root.shape[0], generator=g,
                                                  dtype=torch.float64)


def _mse(d: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(((x @ d.T - y) ** 2).sum(1).mean())


def group_spearman(c5s: pd.DataFrame) -> dict:
    """Spearman(bound, gap) within each normalization, and within each (normalization, decay)."""
    rho = {f"{nm}": br.spearman(sub.bound, sub.gap) for nm, sub in c5s.groupby("norm")}
    rho.update({f"{nm}, decay {dc:g}": br.spearman(sub.bound, sub.gap)
                for (nm, dc), sub in c5s.groupby(["norm", "decay"])})
    return rho


def lora_rank_sweep(lm, tok, family: str, layer: int, S: dict, seed: int, progress=None):
    """``peft`` LoRA on the last block's q and v at each rank of ``S["lora_ranks"]`` (AdamW,
    weight decay 0.01), fit on a few problems of ``family`` and scored on disjoint ones: the gap
    (held-out minus train loss) against the spectral bound summed over q and v, with the
    effective ranks of the value update D and of D X^T logged over training. Returns
    ``(table, traces, base_gap)``, base_gap the frozen model's own gap."""
    train_pool, test_pool = tasks.problem_split(family, tasks.get(family).difficulties[0])
    rs_ = np.random.default_rng(seed)
    tr_ex = [train_pool[i] for i in rs_.permutation(len(train_pool))[:S["lora_train"]]]
    te_ex = [test_pool[i] for i in rs_.permutation(len(test_pool))[:S["lora_test"]]]
    btr, bte = task_batch(tok, tr_ex, lm.device), task_batch(tok, te_ex, lm.device)
    ftr = br.block_features(lm, btr)
    xtr_lm = ftr["x"][br.feeding_positions(btr["labels"])]
    rows, traces = [], {}
    ranks = S["lora_ranks"] if progress is None else progress(S["lora_ranks"], desc="LoRA rank sweep")
    for r in ranks:
        torch.manual_seed(seed)
        pm = peft_qv(lm, r, layer)
        traces[r] = _fit_logging_ranks(pm, btr, xtr_lm, S["lora_steps"])
        with torch.no_grad():
            l_tr, l_te = float(br.lm_loss(pm, btr)), float(br.lm_loss(pm, bte))
        ds = br.lora_delta(pm)
        rows.append({"lora_rank": r, "train_loss": l_tr, "test_loss": l_te, "gap": l_te - l_tr,
                     "bound": sum(br.spectral_complexity(xtr_lm, v.shape[0], br.trace_norm(v))
                                  for v in ds.values()),
                     "rank_D_q": br.numeric_rank(ds[[kk for kk in ds if "q_proj" in kk][0]], 1e-4)})
    with torch.no_grad():
        base_gap = float(br.lm_loss(lm, bte)) - float(br.lm_loss(lm, btr))
    return pd.DataFrame(rows), traces, base_gap


def _fit_logging_ranks(pm, batch: dict, x: torch.Tensor, steps: int) -> pd.DataFrame:
    """AdamW (lr 1e-2, weight decay 0.01) on ``pm``'s LoRA factors, logging the effective and
    stable ranks of the value update D and of D X^T about twelve times."""
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2,
                            weight_decay=0.01)
    log = []
    for step in range(steps):
        loss = br.lm_loss(pm, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % max(1, steps // 12) == 0 or step == steps - 1:
            dv = {kk.split(".")[-1]: v.double() for kk, v in br.lora_delta(pm).items()}["v_proj"]
            log.append({"step": step, "erank_D": erank(dv), "erank_DX": erank(x @ dv.T),
                        "srank_D": srank(dv), "srank_DX": srank(x @ dv.T)})
    return pd.DataFrame(log)


# -- what "What we saw" quotes -----------------------------------------------------------------

def prose_metrics(*, c1: pd.DataFrame, checks: list[dict], invis: dict, real: dict, shift: float,
                  const_key: dict, c2: pd.DataFrame, inside: list[str], c4: pd.DataFrame,
                  rho_groups: dict, c5l: pd.DataFrame, traces: dict) -> dict:
    """Scalars "What we saw" quotes, from the tables the claims are judged on: C1's
    least-squares rank, cvxpy gap, LM token count and logit changes; C2's gaps, outside shares,
    bounds and learned ranks; C4's gap at the largest eps; C5's Spearman per normalization
    and the smallest within one spectrum, the LM gap's range and the value update's final effective ranks per r."""
    out = {"c1_max_rank_lstsq": int(c1.rank_lstsq_random_start.max()),
           "c1_max_cvxpy_rel_gap": max(c["rel_gap"] for c in checks),
           "c1_lm_tokens": real["tokens"], "c1_lm_width": real["width"],
           "c1_max_null_logit_change": max(v["null_logit_change"] for v in invis.values()),
           "c1_min_random_logit_change": min(v["random_logit_change"] for v in invis.values()),
           "c1_max_random_logit_change": max(v["random_logit_change"] for v in invis.values()),
           "c2_shift_gap": shift, "c2_constant_key_norope_change": const_key["no_rope"],
           "c2_max_inside_outside": float(c2.loc[inside, "outside_energy"].max()),
           "c2_lora_value_outside": float(c2.loc["peft LoRA r=8, value", "outside_energy"]),
           "c4_gap_largest_eps": float(c4.gap.iloc[0])}
    for label, key in (("query", "query"), ("value (whole trace norm)", "value_whole"),
                       ("value (per-head trace norm)", "value_head"), ("key (no rotary)", "key")):
        out[f"c2_{key}_bound"] = int(c2.loc[label, "bound"])
        out[f"c2_{key}_learned_rank"] = int(c2.loc[label, "learned_rank"])
    out.update({f"c5_spearman_{k}": v for k, v in rho_groups.items() if "," not in k})
    out["c5_spearman_within_min"] = min(v for k, v in rho_groups.items() if "," in k)
    out.update({"c5_lm_gap_min": float(c5l.gap.min()), "c5_lm_gap_max": float(c5l.gap.max())})
    out.update({f"c5_final_erank_D_r{r}": float(t.erank_D.iloc[-1]) for r, t in traces.items()})
    return out


# -- the explorer: the minimizer's spectrum against the bottleneck --------------------------------

def spectra(d: int, k: int, n: int, lam: float, steps: int, seed: int) -> dict:
    """One instance of C1's sweep (:func:`rank_sweep`'s draw), from a generator seeded by
    ``seed``, ``k`` and ``n`` alone (the same picture at every visit): the singular values of
    the features, of the trace-norm minimizer and of the least-squares fit from a random start,
    and their numeric ranks."""
    g = torch.Generator().manual_seed(100003 * seed + 1009 * k + n)
    x, _, _, dhat, info, ls = _instance(d, k, n, lam, steps, g)
    out = {name: torch.linalg.svdvals(m).numpy() for name, m in
           (("features", x), ("minimizer", dhat), ("least squares", ls))}
    return {**out, "rank_minimizer": br.numeric_rank(dhat), "rank_lstsq": br.numeric_rank(ls),
            "kkt": info["kkt"]}


def spectra_figure(sp: dict, k: int, n: int, d: int, c1: pd.DataFrame):
    """Left: the normalized singular values of :func:`spectra` (the minimizer's stop at the
    bottleneck rank ``k``, not at min(n, d)). Right: C1's ranks against n for this k
    (``c1`` from :func:`rank_sweep`), the explored n marked."""
    fig, (ax, bx) = plots.subplots(1, 2, figsize=(11, 3.8))
    for i, name in enumerate(["minimizer", "least squares", "features"]):
        sv = sp[name]
        ax.semilogy(np.arange(1, len(sv) + 1), np.maximum(sv / max(sv[0], 1e-300), 1e-17), "o-",
                    ms=3, color=plots.PALETTE[i], label=name)
    ax.axvline(k + 0.5, color="k", ls=":", label=f"bottleneck rank k = {k}")
    ax.axvline(min(n, d) + 0.5, color="k", ls="--", lw=1, label=f"min(n, d) = {min(n, d)}")
    ax.set(xlabel="index i", ylabel="σ_i / σ_1", ylim=(1e-17, 3), title=f"n = {n}, k = {k}: "
           f"minimizer rank {sp['rank_minimizer']}, least squares {sp['rank_lstsq']}")
    ax.legend(fontsize=7, loc="center right")
    sub = c1[c1.k == k]
    bx.plot(sub.n, sub.rank_minimizer, "o-", color=plots.PALETTE[0], label="trace-norm minimizer")
    bx.plot(sub.n, sub.rank_lstsq_random_start, "s:", color=plots.PALETTE[1], label="least squares")
    bx.plot(sub.n, np.minimum(sub.n, d), "k--", lw=1, label="min(n, d)")
    bx.axhline(k, color="k", ls=":", lw=1)
    bx.axvline(n, color="grey", lw=6, alpha=0.3)
    bx.set(xscale="log", xlabel="samples n", ylabel="rank", ylim=(0, d + 1),
           title=f"C1's sweep at k = {k} (grey: this n)")
    bx.legend(fontsize=7)
    return fig
