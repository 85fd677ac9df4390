"""The harness of notebook 02 (paper 02, "LQZO: low-rank quantized zeroth-order fine-tuning",
``docs/papers/02-lqzo.md``).

What the notebook drives around the method (:mod:`workbench.methods.lqzo`):

- the task: train and held-out problems of a family, a fixed training pool and padded batches
  (:func:`task_data`), what the model's card says of it (:func:`card_note`), the models'
  held-out scores (:func:`heldout_scores`), the task loss (:func:`lm_loss`), its per-problem
  values (:func:`item_losses`; exact matches by ``evaluate.item_scores``) and row subsets
  (:func:`subset`);
- C2: the true (autograd) gradient of the scales (:func:`true_gradient`) and how much of each
  layer's energy sits in its top singular directions, against random matrices of the same shape
  (:func:`energy_top`, :func:`gradient_spectrum`);
- C3-C5: the quality of one gradient estimate per perturbation law, whole model through two
  forward passes (:func:`estimator_quality`, :func:`forward_quality`) and per layer in the
  ``eps -> 0`` limit (:func:`linearized_quality`, :func:`layer_quality`), and what drawing a
  direction costs next to a forward pass (:func:`best_time`, :func:`draw_times`);
- end to end: ZO fine-tuning of the LM's scales, or of every fp weight for fp MeZO
  (:func:`zo_finetune`), and of a small ViT's scales on digits (:func:`vit_experiment`);
- C1's memory: the bytes a ZO step, inference and a backprop step hold, counted the same way
  (:class:`SavedForBackward`, :func:`memory_profile`);
- two methods on the same held-out items: ``diagnostics.paired_bootstrap`` of their per-item
  scores (:func:`paired`);
- the explorer: one layer's gradient spectrum against a rank-``r`` law's estimates
  (:func:`rank_view`, :func:`rank_figure`).
"""
from __future__ import annotations

import copy
import math
import time

import numpy as np
import pandas as pd
import torch

from .. import evaluate
from ..data import classification, packing, tasks
from ..diagnostics import paired_bootstrap
from ..methods.lqzo import (CLIP, MIN_SCALE, Perturbation, directions, flat, near_square,
                            quantize, sample_batch, zo_estimate, zo_step)
from ..models import vit
from ..plots import subplots

__all__ = ["lm_loss", "item_losses", "paired", "subset", "task_data", "card_note",
           "width_losses", "heldout_scores", "true_gradient", "cosine", "energy_top",
           "gradient_spectrum", "estimator_quality", "linearized_quality", "forward_quality",
           "layer_quality", "quality_table", "best_time", "draw_times", "zo_finetune",
           "vit_experiment", "tensor_bytes", "SavedForBackward", "memory_profile",
           "rank_view", "rank_figure"]


# -- the task -----------------------------------------------------------------------------------

def lm_loss(model, batch: dict) -> torch.Tensor:
    """Mean next-token cross-entropy on the labelled (answer) tokens."""
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def item_losses(model, batch: dict) -> np.ndarray:
    """Per row, the mean next-token cross-entropy on its labelled (answer) tokens."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels,
                                                ignore_index=-100, reduction="none")
        mask = (labels != -100).double()
        return ((nll.double() * mask).sum(1) / mask.sum(1).clamp(min=1)).cpu().numpy()


# the mean of ``a - b`` over the same items and its 95% interval (the notebook's ``ex.paired``)
paired = paired_bootstrap


def subset(batch: dict, idx) -> dict:
    """The rows ``idx`` of every tensor of a batch."""
    return {k: v[idx] for k, v in batch.items()}


def task_data(tok, family: str, difficulty: int, seed: int, device, n_pool: int = 512,
              n_held: int | None = None) -> dict:
    """The family's disjoint train and held-out problems (``tasks.problem_split``; at most
    ``n_held`` held-out ones, a subset fixed for every seed so that seeds score the same items),
    a training pool of ``n_pool`` problems drawn with replacement from a generator seeded by
    ``seed``, and both as padded batches labelled on the answer (``train``, ``held``)."""
    train_ex, held_ex = tasks.problem_split(family, difficulty)
    if n_held and len(held_ex) > n_held:
        keep = torch.randperm(len(held_ex), generator=torch.Generator().manual_seed(0))[:n_held]
        held_ex = [held_ex[i] for i in sorted(keep.tolist())]
    gen = torch.Generator().manual_seed(seed)
    pool = [train_ex[i] for i in torch.randint(0, len(train_ex), (n_pool,), generator=gen).tolist()]
    return {"train_ex": train_ex, "held_ex": held_ex, "pool": pool,
            "train": packing.task_batch(tok, pool, device),
            "held": packing.task_batch(tok, held_ex, device)}


def card_note(card: dict, family: str) -> str:
    """What the model's card says of ``family`` for the setup cell's line: the zoo card's measured
    accuracy, or, for a checkpoint without one, that there is none (the held-out exact match
    measured below is the number)."""
    acc = (card.get("task_accuracy") or {}).get(family)
    if acc is None:
        return "no card accuracy (a checkpoint without a zoo card; see the held-out exact match)"
    return f"card accuracy {acc:.2f}"


def width_losses(model, data: dict, group_size: int, widths=(4, 3, 2)) -> dict:
    """The held-out task loss of the RTN-quantized ``model`` at each width: where quantization
    damages the bed (and so where recovering from it can be measured)."""
    out = {}
    with torch.no_grad():
        for b in widths:
            out[b] = float(lm_loss(quantize(model, b, group_size)[0], data["held"]))
    return out


def heldout_scores(models: dict, data: dict, tok) -> dict:
    """Per named model, in order: its held-out task loss and its exact match on the held-out
    problems (greedy generation)."""
    out = {}
    with torch.no_grad():
        for name, m in models.items():
            out[name] = (float(lm_loss(m, data["held"])), evaluate.exact_match(m, tok, data["held_ex"]))
    return out


# -- the true gradient and its spectrum (C2) ----------------------------------------------------

def true_gradient(loss_fn, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Autograd gradient of ``loss_fn()`` w.r.t. ``params`` (the reference for comparisons)."""
    with torch.enable_grad():
        loss = loss_fn()
        return [g.detach() for g in torch.autograd.grad(loss, params)]


def cosine(a, b) -> float:
    """Cosine between two lists of tensors, flattened and concatenated."""
    a, b = flat(a), flat(b)
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-300))


def energy_top(sv: torch.Tensor, k: int) -> float:
    """Fraction of ``sum sigma^2`` in the top ``k`` singular values."""
    e = sv.double() ** 2
    return float(e[:k].sum() / e.sum().clamp(min=1e-300))


def _short(name: str) -> str:
    return name.replace("model.layers.", "").replace("self_attn.", "").replace("mlp.", "")


def gradient_spectrum(names, grads, rank: int, seed: int, n_null: int = 200,
                      null_q: float = 0.95) -> list[dict]:
    """Per layer: its singular values (``sv``), the energy in the top ``rank`` and top 1
    directions, the same after the near-square reshape, and the top-``rank`` energy of ``n_null``
    Gaussian matrices of the same shape (a matrix with no structure): their mean
    (``energy_top_r_null``), their ``null_q`` quantile (``energy_top_r_null_q``) and whether the
    gradient lies above it (``beats_null``). The null is drawn once per distinct shape, in order
    of first appearance, from a generator seeded by ``seed + 99``."""
    gnull = torch.Generator().manual_seed(seed + 99)
    nulls = {}
    spec = []
    for n, g in zip(names, grads):
        shape = tuple(g.shape)
        if shape not in nulls:
            nulls[shape] = np.array([
                energy_top(torch.linalg.svdvals(torch.randn(shape, generator=gnull,
                                                            dtype=torch.float64)), rank)
                for _ in range(n_null)])
        null = nulls[shape]
        sv = torch.linalg.svdvals(g.double().cpu())
        a, b = near_square(g.numel())
        e = energy_top(sv, rank)
        q = float(np.quantile(null, null_q))
        spec.append({"layer": _short(n), "shape": shape, "sv": sv.numpy(),
                     "energy_top_r": e, "energy_top1": energy_top(sv, 1),
                     "energy_top_r_reshaped": energy_top(
                         torch.linalg.svdvals(g.double().cpu().reshape(a, b)), rank),
                     "energy_top_r_null": float(null.mean()), "energy_top_r_null_q": q,
                     "beats_null": bool(e > q)})
    return spec


# -- the quality of one estimate (C3-C5) --------------------------------------------------------

def estimator_quality(loss_fn, params, p: Perturbation, grad, seeds, eps: float) -> dict:
    """Cosine to the true gradient and normalized squared error ``||g Z - G||^2 / ||G||^2`` of
    two-point estimates, one per seed (2 forward passes each)."""
    G = flat(grad)
    gn2 = float(G @ G)
    cos, err = [], []
    for s in seeds:
        est = flat(zo_estimate(loss_fn, params, p, s, eps))
        cos.append(float(est @ G / (est.norm() * G.norm()).clamp(min=1e-300)))
        err.append(float(((est - G) ** 2).sum()) / gn2)
    return {"cos": cos, "sq_err": err}


def linearized_quality(grad, p: Perturbation, n: int, seed: int) -> dict:
    """The same statistics in the ``eps -> 0`` limit: ``g = <Z, G>`` exactly, no forward
    passes, so ``n`` can be large. ``grad`` is a list of tensors perturbed jointly.

    With ``d = <Z, G>``: cosine ``|d| / (||Z|| ||G||)``, squared error
    ``||d Z - G||^2 / ||G||^2 = (d^2 ||Z||^2 - 2 d^2 + ||G||^2) / ||G||^2``.
    """
    gen = torch.Generator().manual_seed(seed)
    d = torch.zeros(n, dtype=torch.float64)
    z2 = torch.zeros(n, dtype=torch.float64)
    g2 = 0.0
    for t in grad:
        G = t.detach().cpu().double()
        Z = sample_batch(n, G.shape, p, gen).double()
        d += (Z * G).reshape(n, -1).sum(1)
        z2 += (Z ** 2).reshape(n, -1).sum(1)
        g2 += float((G ** 2).sum())
    cos = d.abs() / (z2.sqrt() * math.sqrt(g2))
    err = (d ** 2 * z2 - 2 * d ** 2 + g2) / g2
    return {"cos": cos.tolist(), "sq_err": err.tolist()}


def forward_quality(loss_fn, params, laws: dict, grad, *, n_probe: int, eps: float,
                    seed: int) -> dict:
    """:func:`estimator_quality` of ``n_probe`` two-point estimates per law, on the same batch
    and scales; law ``k`` (in order) uses the probe seeds ``10000 (k + 1) + 97 seed + j``."""
    fwd = {}
    for k, (name, p) in enumerate(laws.items()):
        seeds = [10_000 * (k + 1) + 97 * seed + j for j in range(n_probe)]
        fwd[name] = estimator_quality(loss_fn, params, p, grad, seeds, eps)
    return fwd


def layer_quality(laws: dict, grads, n: int, seed: int) -> dict:
    """Per law, :func:`linearized_quality` of each layer alone (``n`` draws, seed
    ``1000 seed + 31 k + layer``), on one scale for every layer: the mean cosine times
    ``sqrt(D)`` (``cos``), ``D E[cos^2]`` (``cos2``, 1 in theory) and the squared error over
    ``D`` (``sq_err``), one entry per layer."""
    layer = {}
    for k, (name, p) in enumerate(laws.items()):
        cs, c2s, es = [], [], []
        for li, g in enumerate(grads):
            r = linearized_quality([g], p, n, seed=seed * 1000 + 31 * k + li)
            cs.append(np.mean(r["cos"]) * np.sqrt(g.numel()))
            c2s.append(np.mean(np.square(r["cos"])) * g.numel())     # D E[cos^2]: 1 in theory
            es.append(np.mean(r["sq_err"]) / g.numel())
        layer[name] = {"cos": np.array(cs), "cos2": np.array(c2s), "sq_err": np.array(es)}
    return layer


def quality_table(fwd: dict, layer: dict, n_scales: int) -> pd.DataFrame:
    """One row per law: the whole-model and per-layer statistics side by side."""
    return pd.DataFrame({
        "fwd cos (mean)": {n: np.mean(v["cos"]) for n, v in fwd.items()},
        "fwd sq err / D": {n: np.mean(v["sq_err"]) / n_scales for n, v in fwd.items()},
        "per-layer cos x sqrt(D)": {n: v["cos"].mean() for n, v in layer.items()},
        "per-layer cos^2 x D": {n: v["cos2"].mean() for n, v in layer.items()},
        "per-layer sq err / D": {n: v["sq_err"].mean() for n, v in layer.items()}})


def best_time(fn, reps: int = 5, rounds: int = 5) -> float:
    """Seconds per call, the best of a few rounds (timeit's convention: least disturbed)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def draw_times(params, rank: int, bag_k: int) -> dict:
    """Seconds to regenerate every layer's direction (what a step does four times), full and
    low-rank, Gaussian and BAG."""
    laws = {"full Gaussian": Perturbation("gaussian"),
            "full BAG": Perturbation("bag", bag_k=bag_k),
            "low-rank Gaussian": Perturbation("gaussian", rank),
            "low-rank BAG": Perturbation("bag", rank, bag_k=bag_k)}
    return {k: best_time(lambda p=p: list(directions(params, p, 0))) for k, p in laws.items()}


# -- end to end ---------------------------------------------------------------------------------

def zo_finetune(model, name: str, p: Perturbation, *, bits: int, group_size: int, data: dict,
                tok, steps: int, batch: int, eval_every: int, lr: float, eps: float, fp_lr: float,
                fp_eps: float, seed: int, progress=None) -> dict:
    """ZO fine-tuning for ``steps``: ``fp MeZO`` moves every weight of a copy of the fp
    ``model`` (``fp_lr``, ``fp_eps``, no safeguards); any other ``name`` moves only the scales of
    a fresh RTN copy at ``bits`` (``lr``, ``eps``, QZO's clip and floor). Batches of ``batch``
    pool rows from a generator seeded by ``seed + 1``; step ``i`` probes with seed
    ``7919 seed + i``. Returns the model, the held-out loss curve (every ``eval_every`` steps),
    the training losses, the count of clipped steps, the final held-out loss and exact match,
    and their per-problem values (``item_loss``, ``item_correct``) for paired comparisons."""
    if name == "fp MeZO":
        m = copy.deepcopy(model)
        params, lr_, eps_, clip, floor = list(m.parameters()), fp_lr, fp_eps, None, None
    else:
        m, sc = quantize(model, bits, group_size)
        params, lr_, eps_, clip, floor = list(sc.values()), lr, eps, CLIP, MIN_SCALE
    g = torch.Generator().manual_seed(seed + 1)
    curve, train_loss, clipped = [], [], 0
    with torch.no_grad():
        curve.append((0, float(lm_loss(m, data["held"]))))
    for step in (progress or (lambda it: it))(range(steps)):
        b = subset(data["train"], torch.randint(0, len(data["pool"]), (batch,), generator=g))
        out = zo_step(lambda: lm_loss(m, b), params, p, 7919 * seed + step, eps_, lr_, clip, floor)
        train_loss.append(out["loss"])
        clipped += out["g"] != out["g_clipped"]
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            with torch.no_grad():
                curve.append((step + 1, float(lm_loss(m, data["held"]))))
    correct = evaluate.item_scores(m, tok, data["held_ex"])
    return {"model": m, "curve": curve, "train_loss": train_loss, "clipped": clipped,
            "acc": float(correct.mean()), "loss": curve[-1][1],
            "item_loss": item_losses(m, data["held"]), "item_correct": correct}


def _train_vit(x, y, steps: int, seed: int, device) -> vit.TinyViT:
    """A TinyViT (initial weights from torch's global generator) trained with Adam (3e-3,
    batches of 64 from a generator seeded by ``seed``)."""
    net = vit.TinyViT().to(device)
    opt = torch.optim.Adam(net.parameters(), 3e-3)
    gv = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (64,), generator=gv).to(device)
        loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net.eval()


def vit_experiment(bits: int, group_size: int, laws: dict, *, train_steps: int, zo_steps: int,
                   lr: float, eps: float, seed: int, device, items: dict | None = None) -> dict:
    """The small ViT on scikit-learn's digits (70% train): trained in fp with backprop, its block
    linears quantized by RTN at ``bits``, then the scales alone fine-tuned with each of ``laws``
    for ``zo_steps`` (batches from a generator seeded by ``seed + 5``, probe seed
    ``31337 seed + step``). Returns the test accuracy of each: fp, RTN, and every law; a dict
    passed as ``items`` receives each law's per-image correctness (for paired comparisons).
    Torch's global generator is seeded with ``seed`` first (the ViT's initial weights)."""
    torch.manual_seed(seed)
    dg = classification.digits(train_frac=0.7, seed=seed)
    xtr, ytr, xte, yte = (t.to(device) for t in (dg.x_train, dg.y_train, dg.x_test, dg.y_test))
    net = _train_vit(xtr, ytr, train_steps, seed, device)
    acc = {"fp": vit.accuracy(net, xte, yte)}
    vq, _ = quantize(net, bits, group_size, vit.block_linears(net))
    acc[f"INT{bits} RTN"] = vit.accuracy(vq, xte, yte)
    for name, p in laws.items():
        vq, vsc = quantize(net, bits, group_size, vit.block_linears(net))
        vparams = list(vsc.values())
        gz = torch.Generator().manual_seed(seed + 5)
        for step in range(zo_steps):
            idx = torch.randint(0, len(xtr), (64,), generator=gz).to(device)
            zo_step(lambda: torch.nn.functional.cross_entropy(vq(xtr[idx]), ytr[idx]), vparams,
                    p, 31337 * seed + step, eps, lr)
        acc[name] = vit.accuracy(vq, xte, yte)
        if items is not None:
            with torch.no_grad():
                items[name] = (vq(xte).argmax(-1) == yte).double().cpu().numpy()
    return acc


# -- memory (C1) --------------------------------------------------------------------------------

def tensor_bytes(ts) -> int:
    """Bytes held by the tensors."""
    return sum(t.numel() * t.element_size() for t in ts)


class SavedForBackward:
    """Counts the bytes autograd saves for backward while active (``saved_tensors_hooks``):
    the activation memory that separates a backprop step from inference."""

    def __init__(self):
        self.bytes = 0
        self.count = 0

    def __enter__(self):
        def pack(t):
            self.bytes += t.numel() * t.element_size()
            self.count += 1
            return t
        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        return False


def _cuda_peak(fn, dev) -> int | None:
    """``torch.cuda.max_memory_allocated`` above the resting allocation while ``fn`` runs (None
    off CUDA, where ``fn`` is not run)."""
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated(dev) - base)


def memory_profile(model, scales: list[torch.Tensor], loss_fn, zo_fn) -> dict:
    """Bytes each kind of step must hold, measured the same way for all three.

    ``state``: parameters and buffers of the model. ``saved``: tensors autograd keeps for
    backward during the step (counted by hooks). ``grads``: gradient buffers of the trained
    tensors (backprop only). On CUDA also ``torch.cuda.max_memory_allocated`` per step.
    """
    state = tensor_bytes(list(model.parameters()) + list(model.buffers()))
    dev = next(model.parameters()).device
    out = {}

    def infer():
        with torch.no_grad():
            loss_fn()

    def backprop():
        loss = loss_fn()
        loss.backward()

    for name, fn, grads in (("inference", infer, 0), ("zo_step", zo_fn, 0),
                            ("backprop", backprop, tensor_bytes(scales))):
        with SavedForBackward() as sv:
            peak = _cuda_peak(fn, dev)
            if peak is None:
                fn()
        out[name] = {"state": state, "saved": sv.bytes, "grads": grads,
                     "total": state + sv.bytes + grads, "cuda_peak_extra": peak}
        for s in scales:
            s.grad = None
    return out


# -- the explorer: the rank of the perturbation against one layer's gradient ------------------

def rank_view(g: torch.Tensor, p: Perturbation, n: int, seed: int) -> dict:
    """One layer's scale gradient ``g`` against the law ``p`` and QZO's full Gaussian: the
    cumulative energy of its singular values as is and after the near-square reshape, and
    :func:`linearized_quality` of ``n`` draws of each law (the same seed), ``D = g.numel()``."""
    G = g.detach().cpu().double()
    a, b = near_square(G.numel())

    def cum(m):
        e = torch.linalg.svdvals(m) ** 2
        return (e.cumsum(0) / e.sum().clamp(min=1e-300)).numpy()
    return {"D": G.numel(), "energy": cum(G), "energy_reshaped": cum(G.reshape(a, b)),
            "law": linearized_quality([G], p, n, seed),
            "qzo": linearized_quality([G], Perturbation("gaussian"), n, seed)}


def rank_figure(view: dict, p: Perturbation, name: str):
    """Left: the share of the gradient's energy in its top ``k`` directions, as is and reshaped,
    the law's rank marked. Right: ``sqrt(D) |cos|`` of each estimate with the gradient, the law
    against QZO, with ``D E[cos^2]`` (1 for any law with ``E[zz^T] = I``) and the squared error
    over ``D``."""
    fig, (a1, a2) = subplots(1, 2, figsize=(12, 3.8))
    for key, label in (("energy", "as is"), ("energy_reshaped", "near-square reshape")):
        e = view[key]
        a1.plot(np.arange(1, len(e) + 1), e, "o-", ms=3, label=f"{label} ({len(e)} values)")
    if p.rank:
        a1.axvline(p.rank, color="k", lw=1, label=f"rank {p.rank}")
    a1.set(xscale="log", xlabel="top k singular directions", ylim=(0, 1.02),
           ylabel="share of ||G||^2", title=f"{name}: scale gradient {view['D']} entries")
    a1.legend(fontsize=7)
    D = view["D"]
    for key, label in (("qzo", "QZO (full Gaussian)"), ("law", p.label)):
        c = np.sqrt(D) * np.array(view[key]["cos"])
        a2.hist(c, bins=40, range=(0, 4), histtype="step", lw=1.6, density=True,
                label=f"{label}: D E[cos^2] {np.mean(c ** 2):.2f}, "
                      f"sq err / D {np.mean(view[key]['sq_err']) / D:.2f}")
    a2.axvline(np.sqrt(2 / np.pi), color="k", ls="--", lw=1, label="Gaussian mean sqrt(2/pi)")
    a2.set(xlabel="sqrt(D) |cos(estimate, gradient)|", ylabel="density",
           title=f"{len(view['law']['cos'])} exact directional-derivative estimates")
    a2.legend(fontsize=7)
    return fig
