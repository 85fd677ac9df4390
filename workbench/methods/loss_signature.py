"""Predicting reasoning-data quality from low-rank loss signatures (paper 18,
``docs/papers/18-loss-signature-curation.md``).

The paper's view: a pretrained LM, briefly adapted to the traces (a short ``peft`` LoRA run), sits
in a low-rank, anisotropic loss basin. Probe the basin with a fixed set of random low-rank weight
perturbations ``W + sigma * Delta_j`` (:func:`low_rank_directions`), ``Delta_j = U_j V_j^T``
scaled to ``||W||_F``, at several scales ``sigma``, and read each trace's loss on only a small
fraction of its tokens (:func:`subsample_mask`). A trace's **loss signature** is the array
``L[j, s]`` of those losses (:func:`signatures`). Two uses:

- **difficulty**: the mean curve ``sigma -> mean_j L[j, sigma]`` rises from the basin floor and
  bends over as the perturbation swamps the model; the loss at the curve's **inflection point**
  (where the discrete second derivative changes sign, :func:`inflection`) is the difficulty
  proxy;
- **diversity**: signatures cluster by the trace's latent category (``sklearn`` k-means,
  NMI against the categories, :func:`cluster_nmi`); a subset is picked round-robin across clusters,
  hardest first in each (:func:`select_subset`).

A teacher-selection criterion from the same signatures (:func:`teacher_scores`): the teacher whose
traces sit lowest in the basin (smallest mean inflection loss) writes the most learnable traces.

The trace pool, its teachers, the generate-then-filter baseline and the downstream students
are the notebook's harness: :mod:`workbench.experiments.loss_signature`.
"""
from __future__ import annotations

import numpy as np
import torch
from sklearn.cluster import KMeans
from sklearn.metrics import normalized_mutual_info_score as nmi

from ..data import packing
from ..models.finetune import TARGETS

__all__ = ["subsample_mask", "perturbed_layers", "low_rank_directions", "token_losses",
           "masked_losses", "length_batches", "signatures", "inflection", "inflection_losses",
           "signature_features", "kmeans_clusters", "cluster_nmi", "select_subset",
           "teacher_scores"]


# -- token sub-sampling and perturbations -----------------------------------------------------

def subsample_mask(labels, fraction: float, seed: int, min_tokens: int = 1):
    """A boolean mask of the positions whose loss is read: per row, ``max(min_tokens,
    round(fraction * n))`` of its ``n`` labelled positions (labels != -100), drawn without
    replacement from a generator seeded by ``seed`` (the same rows give the same mask)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros_like(labels, dtype=torch.bool)
    for i in range(labels.shape[0]):
        pos = (labels[i] != -100).nonzero().flatten()
        k = min(len(pos), max(min_tokens, int(round(fraction * len(pos)))))
        mask[i, pos[torch.randperm(len(pos), generator=g)[:k]]] = True
    return mask


def perturbed_layers(model) -> dict:
    """The block linears a perturbation moves (every attention and MLP projection), by name."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in TARGETS}


def low_rank_directions(model, n_dirs: int, rank: int, seed: int) -> list[dict]:
    """``n_dirs`` fixed random directions, each a rank-``rank`` matrix ``U V^T`` (Gaussian
    factors) per perturbed layer, scaled to that layer's ``||W||_F`` (so ``sigma`` is a relative
    size). Deterministic for a seed."""
    g = torch.Generator().manual_seed(seed)
    dirs = []
    for _ in range(n_dirs):
        d = {}
        for name, m in sorted(perturbed_layers(model).items()):
            w = m.weight
            u = torch.randn(w.shape[0], rank, generator=g, dtype=torch.float64)
            v = torch.randn(w.shape[1], rank, generator=g, dtype=torch.float64)
            delta = (u @ v.T).to(w.device)       # drawn on the host: the same on every device
            d[name] = (delta * (w.detach().double().norm() / delta.norm())).to(w.dtype)
        dirs.append(d)
    return dirs


def token_losses(model, batch: dict):
    """Next-token cross-entropy at every position, ``(B, T)``: entry ``t`` is the loss of token
    ``t`` given the ones before it (0 at ``t = 0``), so a label-aligned mask selects it."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["input_ids"][:, 1:],
                                                reduction="none")
    return torch.nn.functional.pad(nll, (1, 0))


def masked_losses(model, batch: dict, mask) -> "np.ndarray":
    """Per row, the mean next-token cross-entropy over the positions in ``mask`` (label
    positions, as in ``labels``)."""
    return _reduce(token_losses(model, batch), mask)


def _reduce(nll, mask) -> "np.ndarray":
    m = mask.float()
    return ((nll * m).sum(1) / m.sum(1).clamp_min(1)).cpu().numpy()


def length_batches(pairs: list, size: int, pad_id: int, device=None) -> tuple[list[dict], "np.ndarray"]:
    """``(ids, labels)`` pairs padded into batches of similar length (sorted by length, so little
    compute goes to padding); returns the batches and ``order``, the pair index of each row in
    batch order (``out[order] = rows`` puts per-row results back in pair order)."""
    order = np.argsort([len(p[0]) for p in pairs], kind="stable")
    batches = []
    for i in range(0, len(order), size):
        b = packing.pad([pairs[j] for j in order[i: i + size]], pad_id)
        batches.append({k: v.to(device) for k, v in b.items()} if device is not None else b)
    return batches, order


def signatures(model, batches: list[dict], masks, dirs: list[dict], scales: list[float]):
    """The loss signatures, ``(n_traces, n_dirs, n_scales)``: each trace's masked loss with every
    perturbed layer at ``W + sigma * Delta_j`` (weights restored after each). ``masks`` is one
    mask per batch, or a dict of such lists (several token samples read from the same forward
    passes), which gives a dict of signatures."""
    named = masks if isinstance(masks, dict) else {"": masks}
    layers = perturbed_layers(model)
    n = sum(len(b["input_ids"]) for b in batches)
    out = {k: np.zeros((n, len(dirs), len(scales))) for k in named}
    for j, d in enumerate(dirs):
        for s, sigma in enumerate(scales):
            saved = {name: layers[name].weight.detach().clone() for name in d}
            try:
                with torch.no_grad():
                    for name, delta in d.items():
                        layers[name].weight.add_(sigma * delta.to(layers[name].weight.device))
                row = 0
                for i, b in enumerate(batches):
                    nll = token_losses(model, b)
                    for k, ms in named.items():
                        out[k][row: row + len(nll), j, s] = _reduce(nll, ms[i])
                    row += len(nll)
            finally:
                with torch.no_grad():
                    for name, w in saved.items():
                        layers[name].weight.copy_(w)
    return out if isinstance(masks, dict) else out[""]


# -- difficulty: the inflection point ---------------------------------------------------------

def inflection(x, y) -> tuple[float, float]:
    """The inflection point of a sampled curve ``y(x)``: the first sign change of the discrete
    second derivative from positive (convex, rising) to non-positive (bending over), located by
    linear interpolation between the grid points where it is measured; returns ``(x*, y(x*))``
    with ``y`` interpolated linearly. A curve with no such change gives the point of steepest
    rise (the midpoint of the largest first difference)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3 or np.any(np.diff(x) <= 0):
        raise ValueError("need at least 3 increasing x values")
    d1 = np.diff(y) / np.diff(x)
    xm = (x[1:] + x[:-1]) / 2                          # where d1 is measured
    d2 = np.diff(d1) / np.diff(xm)
    xs = x[1:-1]                                       # where d2 is measured (approximately)
    for i in range(len(d2) - 1):
        if d2[i] > 0 >= d2[i + 1]:
            t = d2[i] / (d2[i] - d2[i + 1])
            xi = xs[i] + t * (xs[i + 1] - xs[i])
            return float(xi), float(np.interp(xi, x, y))
    i = int(np.argmax(d1))
    return float(xm[i]), float(np.interp(xm[i], x, y))


def inflection_losses(sig, scales) -> "np.ndarray":
    """Per trace, the loss at the inflection point of its mean (over directions) curve."""
    curves = np.asarray(sig).mean(1)
    return np.array([inflection(scales, c)[1] for c in curves])


# -- diversity: clusters ----------------------------------------------------------------------

def signature_features(sig) -> "np.ndarray":
    """Log-losses flattened over (direction, scale), standardized per feature: what is clustered."""
    f = np.log(np.asarray(sig).reshape(len(sig), -1) + 1e-9)
    return (f - f.mean(0)) / (f.std(0) + 1e-9)


def kmeans_clusters(features, n_clusters: int, seed: int) -> "np.ndarray":
    """The k-means (``sklearn``, 10 starts) cluster of each signature: the diversity groups."""
    return KMeans(n_clusters, n_init=10, random_state=seed).fit_predict(features)


def cluster_nmi(features, categories, n_clusters: int, seed: int,
                n_perm: int = 200) -> dict:
    """:func:`kmeans_clusters` on the features, NMI of the clusters against the categories
    (``sklearn.metrics.normalized_mutual_info_score``), and the same NMI for randomly permuted
    categories (chance: its mean and 99th percentile)."""
    labels = kmeans_clusters(features, n_clusters, seed)
    cats = np.asarray(categories)
    rng = np.random.default_rng(seed)
    chance = np.array([nmi(rng.permutation(cats), labels) for _ in range(n_perm)])
    return {"nmi": float(nmi(cats, labels)), "chance_mean": float(chance.mean()),
            "chance_p99": float(np.quantile(chance, 0.99)), "clusters": labels}


def select_subset(scores, clusters, m: int) -> list[int]:
    """``m`` indices, round-robin over the clusters (diversity), the highest ``scores``
    (predicted difficulty) first within each cluster; a cluster that runs out is skipped."""
    scores, clusters = np.asarray(scores), np.asarray(clusters)
    queues = {c: sorted(np.flatnonzero(clusters == c), key=lambda i: -scores[i])
              for c in np.unique(clusters)}
    out: list[int] = []
    while len(out) < min(m, len(scores)):
        for c in list(queues):
            if queues[c] and len(out) < m:
                out.append(int(queues[c].pop(0)))
    return out


def teacher_scores(pred, teachers) -> dict:
    """The teacher-selection criterion: per teacher, the mean predicted difficulty (inflection
    loss) of its traces; the lowest sits deepest in the basin and is picked."""
    pred, teachers = np.asarray(pred), np.asarray(teachers)
    return {t: float(pred[teachers == t].mean()) for t in dict.fromkeys(teachers.tolist())}
