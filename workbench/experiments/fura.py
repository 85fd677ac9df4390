"""The experiments of notebook 16 (FuRA: full-rank adaptation through a block tensor-train with
a frozen spectral core, :mod:`workbench.methods.fura`).

Seven fine-tunes of one zoo LM on the same small task (LoRA, DoRA, Full FT, the frozen-U ``svd``
variant, FuRA, QLoRA, QFuRA), each trained once and cached with its (target, retention)
trajectory, each at its best learning rate from one grid shared by all
(:func:`lr_sweep`, selected on a validation split of the target family); the data they share;
the paired comparisons of per-item target scores (:func:`paired_target`); the checks the claims
read: the reconstruction of eq. (1) at
init, where the learned updates go (share outside span(U), rank), the damage to the pretraining
families (their held-out loss, :func:`retention_nll`), retention at equal target accuracy, the
cost of a training step side by side, and the 4-bit core's grid bound; and the
explorer's block-count trade (:func:`block_trade`, :func:`inside_spectra`,
:func:`blocks_figure`).
"""
from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile

from .. import cache, diagnostics, evaluate, plots, quant, sweep
from ..data import packing, tasks
from ..methods import fura
from ..models import finetune, zoo

__all__ = ["METHODS", "GROUP", "LR", "prepare", "probe_batch", "pretrained_weights",
           "reconstruction", "logit_change", "only_cores_trainable", "TaskData", "task_data",
           "Evaluator", "cached_finetune", "finetune_all", "lr_sweep", "best_lrs", "target_scores",
           "paired_target", "retention_nll", "trajectories", "update",
           "span_table", "rank_table", "retention_at", "equal_target_level", "step_cost",
           "cost_table", "core_within_bound", "qfura_init_error", "qlora_init_error",
           "block_counts", "project_blocks", "block_trade", "inside_spectra", "blocks_figure"]

METHODS = ("lora", "dora", "full", "svd", "fura", "qlora", "qfura")
GROUP = "16-fura"        # cache.folder("16-fura"): the notebook's fine-tunes
# the learning-rate group of each method (a key of the notebook's SIZES)
LR = {"lora": "lr_adapter", "dora": "lr_adapter", "qlora": "lr_adapter", "full": "lr_dense",
      "svd": "lr_dense", "fura": "lr_fura", "qfura": "lr_fura"}


def prepare(model: nn.Module, method: str, rank: int = 8, lora_scale: float = 2.0,
            seed: int = 0, bits: int = 4, group_size: int = 32, by_head: bool = True) -> nn.Module:
    """``model`` (changed in place, or wrapped by peft) ready to fine-tune with ``method``:
    ``lora``/``dora`` (peft, :func:`workbench.models.finetune.lora_model`), ``full`` (every weight
    of the projections), ``svd`` (one block: W = U S V^T, U frozen), ``fura`` (the block
    factorization, eq. 1), ``qlora`` (a ``bits``-bit base + peft LoRA), ``qfura`` (FuRA with
    the frozen core in ``bits`` bits). ``by_head``: FuRA's and QFuRA's ``o_proj`` in one
    block per attention head, as the reference's training script
    (:func:`workbench.methods.fura.head_block_count`)."""
    targets = finetune.TARGETS
    if method in ("lora", "dora"):
        return finetune.lora_model(model, rank, lora_scale, seed, use_dora=method == "dora")
    if method == "qlora":
        fura.quantize_linears(model, targets, bits, group_size)
        return finetune.lora_model(model, rank, lora_scale, seed,
                                   custom_modules={quant.QuantLinear: LoraLinear})
    if method == "full":
        fura.full_finetune(model, targets)
    elif method in ("svd", "fura", "qfura"):
        fura.apply_fura(model, targets, blocks=1 if method == "svd" else None,
                        core_bits=bits if method == "qfura" else None, group_size=group_size,
                        by_head=by_head)
    else:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    return model


# -- section 1: the factorization at init ---------------------------------------------------------

def probe_batch(tok, families, device, n: int = 8, seed: int = 5) -> dict:
    """A padded batch of ``n`` task prompts per family (middle difficulty), on ``device``."""
    prompts = [e.prompt for f in families for e in tasks.generate(f, n, seed, evaluate.MIDDLE[f])]
    batch = packing.pad(packing.encode(tok, prompts), tok.pad_token_id)
    return {k: v.to(device) for k, v in batch.items()}


def pretrained_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The float64 weight of every projection the fine-tunes train (``finetune.TARGETS``)."""
    names = set(fura.target_linears(model, finetune.TARGETS))
    return {n: m.weight.detach().double().clone() for n, m in model.named_modules() if n in names}


def reconstruction(init: nn.Module, W0: dict, rank: int) -> pd.DataFrame:
    """One row per FuRA layer of ``init``: L S R's relative error against ``W0``, the trainable
    count against the closed form n k (b + 1), and LoRA's r (in + out) at ``rank``."""
    rows = []
    for n, m in init.named_modules():
        if isinstance(m, fura.FuraLinear):
            err = float((m.weight().double() - W0[n]).norm() / W0[n].norm())
            trained = sum(p.numel() for p in m.parameters() if p.requires_grad)
            rows.append({"layer": n, "shape": tuple(W0[n].shape), "blocks n x (k, b)": (m.n, m.k, m.b),
                         "rel_error": err, "trainable": trained,
                         "closed_form": fura.fura_parameters(*W0[n].shape, m.n),
                         "lora_r8": fura.lora_parameters(*W0[n].shape, rank)})
    return pd.DataFrame(rows)


def logit_change(model: nn.Module, other: nn.Module, batch: dict) -> float:
    """The largest absolute difference of the two models' logits on ``batch``."""
    with torch.no_grad():
        return float((other(**batch).logits - model(**batch).logits).abs().max())


def only_cores_trainable(model: nn.Module) -> bool:
    """Whether exactly the FuRA cores ``S`` and ``R`` require gradients."""
    return all(p.requires_grad == n.endswith((".S", ".R")) for n, p in model.named_parameters())


# -- section 2: the data and the seven fine-tunes ----------------------------------------------------

@dataclass
class TaskData:
    """What every fine-tune shares: the training examples and rows, the held-out target prompts
    each checkpoint scores (``target_eval``), the held-out prompts of each pretraining family, a
    validation split of the target family (``val_eval``, disjoint from the training and the
    checkpoint prompts: what the learning rate is selected on; empty when not drawn) and the
    claims' test prompts (``test``, a larger held-out set disjoint from the training and
    validation prompts, scored once on the tuned models; empty when not drawn)."""
    family: str
    train: list
    pairs: list
    target_eval: list
    retain_eval: dict
    val_eval: list = ()
    test: list = ()

    def eval_names(self) -> dict:
        """The evaluation prompts, by name (part of each fine-tune's cache key; the ``test``
        prompts are not: no fine-tune sees them)."""
        out = {"target": [e.prompt for e in self.target_eval],
               "retain": {f: [e.prompt for e in v] for f, v in self.retain_eval.items()}}
        if self.val_eval:
            out["val"] = [e.prompt for e in self.val_eval]
        return out


def task_data(tok, family: str, *, n_train: int, n_eval: int, n_retain: int, retain_families,
              seed: int, with_steps: bool, n_val: int = 0, n_test: int = 0) -> TaskData:
    """``n_train`` examples of ``family`` spread over its difficulties (seed ``100 + seed``),
    encoded; ``n_eval`` held-out target prompts at the middle difficulty that are not training
    prompts (seed ``999 + seed``); ``n_retain`` held-out prompts per pretraining family (seed
    ``998 + seed``); ``n_val`` validation prompts of the target family at the same difficulty,
    neither training nor checkpoint prompts (seed ``997 + seed``); ``n_test`` test prompts at
    the same difficulty, neither training nor validation prompts (seed ``996 + seed``)."""
    ds = tasks.get(family).difficulties
    per = -(-n_train // len(ds))
    train = [e for d in ds for e in tasks.generate(family, per, 100 + seed, d)][:n_train]
    pairs = packing.encode(tok, [e.prompt for e in train], [e.completion(with_steps) for e in train])
    target_eval, _ = evaluate.heldout_examples(family, evaluate.MIDDLE[family], n_eval,
                                               {e.prompt for e in train}, seed=999 + seed)
    retain_eval = {f: evaluate.heldout_examples(f, evaluate.MIDDLE[f], n_retain, seed=998 + seed)[0]
                   for f in retain_families}
    seen = {e.prompt for e in train} | {e.prompt for e in target_eval}
    val_eval = evaluate.heldout_examples(family, evaluate.MIDDLE[family], n_val, seen,
                                         seed=997 + seed)[0] if n_val else []
    test = evaluate.heldout_examples(family, evaluate.MIDDLE[family], n_test,
                                     {e.prompt for e in [*train, *val_eval]},
                                     seed=996 + seed)[0] if n_test else []
    return TaskData(family, train, pairs, target_eval, retain_eval, val_eval, test)


@dataclass
class Evaluator:
    """Exact match (greedy, the verifiers) on the target family and on each pretraining family,
    ``retention``, their mean over the pretraining families, and ``val_target`` on the
    validation split when the data has one."""
    tok: object
    data: TaskData
    with_steps: bool

    def __call__(self, model) -> dict:
        out = {"target": evaluate.exact_match(model, self.tok, self.data.target_eval, self.with_steps)}
        out.update({f"retain_{f}": evaluate.exact_match(model, self.tok, e, self.with_steps)
                     for f, e in self.data.retain_eval.items()})
        out["retention"] = float(np.mean([out[f"retain_{f}"] for f in self.data.retain_eval]))
        if self.data.val_eval:
            out["val_target"] = evaluate.exact_match(model, self.tok, self.data.val_eval,
                                                     self.with_steps)
        return out


def cached_finetune(base: str, zoo_scale: str, method: str, pairs, settings: dict, evaluator,
                    every: int, device: str = "cpu"):
    """Fine-tune zoo model ``base`` with ``method`` on ``pairs`` (``packing.encode`` rows) once,
    evaluating ``evaluator(model) -> dict`` every ``every`` steps, and cache the trainable
    tensors and that trajectory (``cache.build``, keyed by the base model's key, the
    rows and ``settings``: lr, steps, batch, seed, rank, lora_scale, bits, group_size, and
    whatever names the evaluation; ``by_head`` when present). Returns ``(model, info)``: the tuned model in eval mode and
    ``{"trajectory": [...], "train_seconds", "cached"}``."""
    key = cache.key(zoo.key(base, zoo_scale), method, pairs, settings)
    path = cache.folder(GROUP) / f"{method}-{zoo.label(base)}-{zoo.zoo_scale(zoo_scale)}-{key}"
    cached = cache.is_built(path)
    s = settings

    def fresh():
        m, _ = zoo.load(base, zoo_scale, device=device)
        # settings without by_head (a key without it) name the closest-pair layout
        return prepare(m, method, s["rank"], s["lora_scale"], s["seed"], s["bits"], s["group_size"],
                       s.get("by_head", False))

    def build(tmp):
        model, traj = fresh(), []

        def checkpoint(step, loss):
            if step % every == 0 or step == s["steps"]:
                model.eval()
                traj.append({"step": step, "loss": loss, **evaluator(model)})

        t0 = time.time()
        finetune.train_steps(model, pairs, s["steps"], s["batch"], s["lr"], s["seed"],
                             s["pad_id"], callback=checkpoint)
        state = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
        torch.save(state, tmp / "trainable.pt")
        return {"trajectory": traj, "train_seconds": round(time.time() - t0, 2),
                "settings": {k: v for k, v in s.items() if k != "eval"}}

    cache.build(path, build)
    model = fresh()
    state = torch.load(path / "trainable.pt")
    missing = set(state) - {n for n, _ in model.named_parameters()}
    if missing:
        raise RuntimeError(f"cached {method} fine-tune names unknown tensors: {sorted(missing)[:3]}")
    model.load_state_dict(state, strict=False)
    info = json.loads((path / "done.json").read_text())
    return model.eval(), {**copy.deepcopy(info), "cached": cached, "path": str(path)}


def _settings(S: dict, lr: float, seed: int, pad_id: int, names: dict) -> dict:
    """One fine-tune's settings (its cache key): ``lr``, the loop's sizes from ``S``, the
    evaluation prompts, and ``by_head`` when ``S`` sets it."""
    out = {"lr": lr, "steps": S["steps"], "batch": S["batch"], "seed": seed, "rank": S["rank"],
           "lora_scale": S["lora_scale"], "bits": S["bits"], "group_size": S["group_size"],
           "pad_id": pad_id, "eval": names, "every": S["every"]}
    return {**out, "by_head": S["by_head"]} if "by_head" in S else out


def finetune_all(base: str, zoo_scale: str, data: TaskData, S: dict, *, seed: int, evaluator,
                 pad_id: int, device: str, progress=lambda it, **kw: it, lrs: dict | None = None):
    """Every method of :data:`METHODS` on ``data`` (the same rows, loop and seed; the learning
    rate ``lrs[method]``, or without ``lrs`` that of its :data:`LR` group in ``S``), through
    :func:`cached_finetune`. Returns ``(tuned, info)``, both by method."""
    names = data.eval_names()
    tuned, info = {}, {}
    for meth in progress(METHODS, desc="fine-tunes"):
        lr = S[LR[meth]] if lrs is None else lrs[meth]
        tuned[meth], info[meth] = cached_finetune(base, zoo_scale, meth, data.pairs,
                                                  _settings(S, lr, seed, pad_id, names),
                                                  evaluator, S["every"], device)
    return tuned, info


def lr_sweep(base: str, zoo_scale: str, data: TaskData, S: dict, *, seed: int, evaluator,
             pad_id: int, device: str, grid, methods=METHODS) -> sweep.Sweep:
    """Every method on the same learning-rate ``grid`` (:func:`workbench.sweep.sweep`), each
    fine-tune through :func:`cached_finetune` and its final checkpoint's metrics kept in the
    sweep's cache; each method's rate is selected on ``val_target`` (the validation split,
    never the test prompts; ties to the lower rate)."""
    names = data.eval_names()
    if "val" not in names:
        raise ValueError("lr_sweep selects on a validation split: draw one (task_data n_val)")

    def run(method, lr):
        _, info = cached_finetune(base, zoo_scale, method, data.pairs,
                                  _settings(S, lr, seed, pad_id, names), evaluator, S["every"],
                                  device)
        return {**info["trajectory"][-1], "train_seconds": info["train_seconds"]}

    where = cache.folder(GROUP) / ("sweep-" + cache.key(
        zoo.key(base, zoo_scale), data.pairs, _settings(S, None, seed, pad_id, names)))
    return sweep.sweep(run, list(methods), sorted(grid), "val_target", cache_dir=where,
                       desc="learning-rate sweep")


def best_lrs(sw: sweep.Sweep) -> dict:
    """Each method's selected learning rate."""
    return {m: float(sw.at_best(m)["lr"]) for m in sw.table["method"].unique()}


def target_scores(tuned: dict, tok, data: TaskData, with_steps: bool) -> dict:
    """Per method, the exact match of each test prompt (``data.test``; the checkpoint prompts
    ``target_eval`` when no test set was drawn): the items every paired comparison shares."""
    items = data.test or data.target_eval
    return {m: evaluate.item_scores(model, tok, items, with_steps) for m, model in tuned.items()}


def paired_target(scores: dict, a: str, others) -> dict:
    """``a`` against each of ``others`` on the same test prompts (per-item scores from
    :func:`target_scores`): the paired bootstrap (:func:`workbench.diagnostics.paired_bootstrap`),
    ``{other: {"diff", "low", "high", ...}}`` (``a`` minus ``other``)."""
    return {m: diagnostics.paired_bootstrap(scores[a], scores[m]) for m in others}


@torch.no_grad()
def retention_nll(model, tok, data: TaskData, with_steps: bool, batch: int = 64) -> np.ndarray:
    """Per held-out prompt of the pretraining families (``data.retain_eval``, family after
    family), the mean negative log-likelihood in nats per token of its reference completion
    under ``model`` (the completion's tokens and ``<eos>``, the labels of
    :func:`workbench.data.packing.encode`): the pretraining objective on held-out pretraining
    prompts, so a fine-tune's damage to what pretraining learned, continuous where exact match
    has already dropped to zero. The items a paired comparison of two models shares."""
    examples = [e for v in data.retain_eval.values() for e in v]
    pairs = packing.encode(tok, [e.prompt for e in examples],
                           [e.completion(with_steps) for e in examples])
    device = next(model.parameters()).device
    model.eval()
    out = []
    for i in range(0, len(pairs), batch):
        b = packing.pad(pairs[i:i + batch], tok.pad_token_id)
        logits = model(input_ids=b["input_ids"].to(device)).logits[:, :-1].float()
        target = b["labels"][:, 1:].to(device)
        keep = target != packing.IGNORE
        nll = F.cross_entropy(logits.transpose(1, 2), target.clamp_min(0), reduction="none")
        out.append(((nll * keep).sum(1) / keep.sum(1)).cpu().numpy())
    return np.concatenate(out) if out else np.zeros(0)


def trajectories(info: dict) -> pd.DataFrame:
    """Every checkpoint of every method, one row each, with a ``method`` column."""
    return pd.concat({m: pd.DataFrame(info[m]["trajectory"]) for m in METHODS},
                     names=["method", "i"]).reset_index(0)


# -- section 3: where the updates go ----------------------------------------------------------------

def update(model0: nn.Module, tuned: nn.Module, method: str, names,
           by_head: bool = True) -> dict[str, torch.Tensor]:
    """Tuned minus initial dense weight of every projection in ``names`` (peft prefixes the
    names). The initial weight is the method's own at step 0: W for the adapters and Full FT,
    L S R as stored in float32 for FuRA and ``svd``, so the difference is the update and not the
    rounding of (1) (``by_head``: the blocks FuRA was prepared with, :func:`prepare`)."""
    start = prepare(copy.deepcopy(model0), method, by_head=by_head) if method in ("svd", "fura") \
        else model0
    ref = fura.dense_weights(start, names)
    mods = {n.removeprefix("base_model.model."): n for n, _ in tuned.named_modules()}
    dw = fura.dense_weights(tuned, [mods[k] for k in names])
    return {k: dw[mods[k]] - ref[k] for k in names}


def span_table(D: dict, W0: dict, init: nn.Module, tall) -> pd.DataFrame:
    """The share of each update outside the pretrained column space, per tall projection:
    span(U) of the whole W for ``svd`` and Full FT, span(U_j) of each column block (FuRA's
    blocks, from ``init``) for FuRA, Full FT and LoRA."""
    U1 = {n: fura.block_svd(W0[n], 1)[0] for n in tall}
    Ub = {n: fura.block_svd(W0[n], m.n)[0] for n, m in init.named_modules()
          if isinstance(m, fura.FuraLinear) and n in tall}
    return pd.DataFrame({
        "svd (U of W frozen)": {n: fura.outside_span(D["svd"][n], U1[n]) for n in tall},
        "full FT, vs span(U)": {n: fura.outside_span(D["full"][n], U1[n]) for n in tall},
        "FuRA (per block Uⱼ)": {n: fura.outside_span(D["fura"][n], Ub[n]) for n in tall},
        "full FT, vs span(Uⱼ)": {n: fura.outside_span(D["full"][n], Ub[n]) for n in tall},
        "LoRA, vs span(Uⱼ)": {n: fura.outside_span(D["lora"][n], Ub[n]) for n in tall}})


def rank_table(D: dict, W0: dict) -> pd.DataFrame:
    """The numerical rank of each method's update per projection, and the full rank."""
    names = list(W0)
    ranks = pd.DataFrame({m: {n: fura.numerical_rank(D[m][n]) for n in names} for m in D})
    ranks["full rank"] = [min(W0[n].shape) for n in names]
    return ranks


# -- section 4: retention at equal target accuracy ---------------------------------------------------

def retention_at(traj: pd.DataFrame, method: str, tau: float) -> float | None:
    """Retention at ``method``'s first checkpoint whose target accuracy reaches ``tau``
    (None: never)."""
    t = traj[(traj.method == method) & (traj.target >= tau - 1e-9)]
    return None if t.empty else float(t.retention.iloc[0])


def equal_target_level(traj: pd.DataFrame, a: str, b: str) -> float:
    """The target accuracy both methods reach: the lower of their best."""
    return float(min(traj[traj.method == a].target.max(), traj[traj.method == b].target.max()))


# -- section 5: cost of a training step ----------------------------------------------------------------

def _peak_cpu_bytes(step) -> int:
    """The peak of the running sum of the allocations and frees ``torch.profiler`` records over
    one call of ``step``."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    ev = sorted((e for e in prof.events() if e.cpu_memory_usage), key=lambda e: e.time_range.start)
    run, peak = 0, 0
    for e in ev:
        run += e.cpu_memory_usage
        peak = max(peak, run)
    return peak


def step_cost(model, batch: dict, steps: int = 5, warmup: int = 2) -> dict:
    """Median wall ms of one AdamW step (forward, backward, update) on ``batch``, and the peak
    memory that step allocates beyond what is live before it: ``torch.cuda`` peak statistics on
    a GPU, else the running sum of the allocations and frees that ``torch.profiler`` records
    (``profile_memory``) over one step, from a state where the optimizer's moments exist. The
    weights themselves are counted apart (``weight_mb``: every parameter and buffer)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.0)               # lr 0: the cost, not the update
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    model.train()

    def step():
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(1000 * (time.perf_counter() - t0))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        peak = _peak_cpu_bytes(step)
    state = sum(t.numel() * t.element_size() for s in opt.state.values()
                for t in s.values() if torch.is_tensor(t))
    weights = sum(t.numel() * t.element_size() for t in
                  list(model.parameters()) + list(model.buffers()))
    model.eval()
    return {"step_ms": float(sorted(times)[len(times) // 2]), "peak_step_mb": peak / 2 ** 20,
            "optimizer_mb": state / 2 ** 20, "weight_mb": weights / 2 ** 20,
            "trainable": sum(p.numel() for p in params)}


def cost_table(tuned: dict, pairs, batch: int, pad_id: int, steps: int) -> pd.DataFrame:
    """:func:`step_cost` of every method on the same padded batch of the first ``batch`` rows
    of ``pairs``, one after another, with the ratios to LoRA."""
    batch = packing.pad(pairs[:batch], pad_id)
    cost = pd.DataFrame({m: step_cost(tuned[m], batch, steps=steps) for m in METHODS}).T
    for c in ("trainable", "step_ms", "peak_step_mb"):
        cost[f"{c} / LoRA"] = cost[c] / cost.loc["lora", c]
    return cost


# -- section 6: the 4-bit core ------------------------------------------------------------------------

def core_within_bound(model: nn.Module, W0: dict) -> bool:
    """Whether every dequantized entry of every QFuRA core lies within half a grid step of the
    float core L it quantizes (round-to-nearest's bound)."""
    ok = True
    for n, m in model.named_modules():
        if isinstance(m, fura.FuraLinear):
            Lf = fura.block_svd(W0[n], m.n)[0].reshape(W0[n].shape[0], -1).float()
            step = m.core.quantized().per_column(m.core.scale.detach())
            ok &= bool(((m.core.dequantized() - Lf).abs() <= step / 2 + 1e-6).all())
    return ok


def qfura_init_error(model0: nn.Module, W0: dict, bits: int, group_size: int,
                     by_head: bool = True) -> dict:
    """Per layer: the relative error of deq(L) S R against W at init (``by_head``:
    :func:`prepare`)."""
    q_init = prepare(copy.deepcopy(model0), "qfura", bits=bits, group_size=group_size,
                     by_head=by_head)
    return {n: float((m.weight().double() - W0[n]).norm() / W0[n].norm())
            for n, m in q_init.named_modules() if isinstance(m, fura.FuraLinear)}


def qlora_init_error(W0: dict, bits: int, group_size: int) -> dict:
    """Per layer: the relative error of QLoRA's deq(W) against W."""
    return {n: float((quant.rtn(w.float(), bits, group_size).dequantize().double() - w).norm()
                     / w.norm()) for n, w in W0.items()}


# -- the explorer: the block count n of eq. (1) ----------------------------------------------------

def block_counts(cols: int) -> list[int]:
    """Every block count ``n`` that divides the in-features (1: the plain SVD; ``cols``: blocks
    of width 1, only singular values left)."""
    return [n for n in range(1, cols + 1) if cols % n == 0]


def project_blocks(delta: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """``[U_1 U_1^T dW_1 ... U_n U_n^T dW_n]``: the part of an update that FuRA with the blocks
    of ``U`` (out, n, k) can express, each column block kept in its pretrained column space."""
    out, n, _ = U.shape
    d = delta.reshape(out, n, -1).permute(1, 0, 2)
    u = U.permute(1, 0, 2)
    return (u @ (u.transpose(1, 2) @ d)).permute(1, 0, 2).reshape(delta.shape)


def block_trade(w0: torch.Tensor, updates: dict, rank: int) -> pd.DataFrame:
    """For every block count ``n`` of one projection (pretrained weight ``w0``): the block width
    b, k = min(out, b), FuRA's trainable count n k (b + 1) against LoRA's r (in + out) and the
    dense count, and the share of each learned update in ``updates`` (method -> dW) outside the
    blocks' column spans span(U_j), what FuRA with n blocks could not express."""
    out, cols = w0.shape
    rows = []
    for n in block_counts(cols):
        U = fura.block_svd(w0, n)[0]
        rows.append({"blocks": n, "width b": cols // n, "k": min(out, cols // n),
                     "FuRA trainable": fura.fura_parameters(out, cols, n),
                     "LoRA trainable": fura.lora_parameters(out, cols, rank),
                     "dense": out * cols,
                     **{f"outside, {m}": fura.outside_span(d.to(U), U)
                        for m, d in updates.items()}})
    return pd.DataFrame(rows).set_index("blocks")


def inside_spectra(w0: torch.Tensor, delta: torch.Tensor) -> dict:
    """The singular values of an update ``delta`` (key ``"dW"``) and of its part inside the
    blocks' column spans for every block count n (key n, :func:`project_blocks`), computed
    once so that moving the block count only redraws. Computed where ``w0`` is (the model's
    device), returned on the host."""
    delta = delta.to(w0)
    out = {"dW": torch.linalg.svdvals(delta).cpu().numpy()}
    for n in block_counts(w0.shape[1]):
        out[n] = torch.linalg.svdvals(project_blocks(delta, fura.block_svd(w0, n)[0])).cpu().numpy()
    return out


def blocks_figure(trade: pd.DataFrame, spectra: dict, n: int, rank: int, layer: str,
                  method: str = "full"):
    """Left: trainable parameters and the share of the learned updates outside span(U_j)
    against the block count, ``n`` marked. Right: the singular values of one method's update
    and of its part inside the ``n`` blocks' spans (``spectra``, :func:`inside_spectra`),
    against LoRA's rank."""
    fig, (a, b) = plots.subplots(1, 2, figsize=(12, 4))
    x = trade.index.to_numpy()
    for i, c in enumerate(["FuRA trainable", "LoRA trainable", "dense"]):
        a.loglog(x, trade[c], "o-" if i == 0 else "--", color=plots.PALETTE[i], label=c, base=2)
    a.axvline(n, color="k", lw=1, ls=":")
    a.set(xlabel="block count n (log)", ylabel="trainable parameters of the layer",
          title=f"{layer}: n = {n}, width b = {trade.loc[n, 'width b']}, k = {trade.loc[n, 'k']}")
    a.legend(fontsize=7, loc="lower left")
    t = a.twinx()
    for i, c in enumerate(c for c in trade.columns if c.startswith("outside")):
        t.semilogx(x, trade[c], "s-", ms=3, color=plots.PALETTE[3 + i], label=c, base=2)
    t.set(ylabel="share of the update outside span(Uⱼ)", ylim=(0, 1))
    t.legend(fontsize=7, loc="center right")
    for ax in (a, t):                   # plain tick labels: mathtext ones cost a third of a redraw
        ax.xaxis.set_major_locator(FixedLocator(x))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
    a.yaxis.set_major_formatter(ScalarFormatter())
    a.yaxis.set_minor_locator(NullLocator())
    top = max(float(spectra["dW"][0]), 1e-300)
    for i, (lab, sv) in enumerate([(f"{method} ΔW", spectra["dW"]),
                                   (f"its part FuRA (n = {n}) can express", spectra[n])]):
        b.semilogy(np.arange(1, len(sv) + 1), np.maximum(sv / top, 1e-17),
                   color=plots.PALETTE[i], label=lab)
    b.axvline(rank, color="k", ls=":", lw=1, label=f"LoRA rank r = {rank}")
    b.set(xlabel="singular value index", ylabel="σᵢ / σ₁ of the full ΔW",
          title="Rank of the update inside the blocks' column spaces")
    b.legend(fontsize=7)
    return fig
