"""The harness of notebook 03 (paper 03, "HDCA: hyperbolic displacement-constrained adaptation
for CLIP class-incremental learning", ``papers/03-hdca.md``).

What the notebook drives around the method (:mod:`workbench.methods.hdca`):

- the class-incremental bed of a family: noisy train and test images, their frozen CLIP
  embeddings, the class text embeddings and a seeded class order cut into sessions
  (:func:`session_splits`, :func:`family_bed`);
- training and evaluation over the sessions: Adam on the current session's adapter factors
  (:func:`train_session`), accuracy and PyCIL's metrics (:func:`accuracy`, :func:`cil_metrics`),
  one class-incremental run with an optional replay buffer (:func:`run_sessions`);
- the comparison: zero-shot CLIP, sequential fine-tuning, the replay adapter, HDCA and the
  compression ablation (:data:`ABLATION`) from one seeded initialisation (:func:`new_adapter`,
  :func:`compare_methods`), and the curvature sweep (:func:`curvature_sweep`);
- the diagnostics of C1 and C2: the trained per-task residuals scaled up and compressed
  (:func:`residual_growth`), and the Poincare head's ranking against the cosine head's on the
  adapted features with the heads' slope ratios (:func:`ranking_agreement`,
  :func:`slope_ratios`).

Metrics follow PyCIL (G-U-N/PyCIL, ``trainer.py`` and ``utils/toolkit.py``): average incremental
accuracy = mean of the accuracy curve over sessions (accuracy on all classes seen so far, after
each session), last accuracy = the curve's last point, forgetting = mean over the old tasks of
(best accuracy on that task's classes over sessions - its final accuracy).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from ..data import images
from ..methods.hdca import (HDCAAdapter, compress, cosine_logits, logit_slope,
                            poincare_logits)
from ..models import clip

__all__ = ["ABLATION", "METRICS", "session_splits", "family_bed", "train_session", "accuracy",
           "cil_metrics", "run_sessions", "new_adapter", "compare_methods", "curvature_sweep",
           "residual_growth", "ranking_agreement", "slope_ratios", "wins"]

# the C4 ablation: which compression stage is on (per-task c, cumulative c) as 0 / 1 factors
ABLATION = {"none": (0, 0), "per-task": (1, 0), "cumulative": (0, 1), "both": (1, 1)}
METRICS = ("avg_incremental", "last", "forgetting")     # PyCIL's three, as in every table


# -- the class-incremental bed ------------------------------------------------------------------

def session_splits(n_classes: int, n_sessions: int, seed: int) -> list[np.ndarray]:
    """A seeded class order cut into ``n_sessions`` equal groups (the class-incremental split)."""
    order = np.random.default_rng([seed, 303]).permutation(n_classes)
    return np.array_split(order, n_sessions)


def family_bed(model, tok, family: str, seed: int, noise: float, digits_sessions: int,
               shapes_classes: int, shapes_sessions: int, n_train: int, n_test: int) -> dict:
    """One family's bed: frozen CLIP features of noisy train and test images (``f_tr``, ``y_tr``,
    ``f_te``, ``y_te``), class text features ``w``, class ``names`` and the session ``splits``.
    Digits: CLIP's own split under fresh noise. Shapes: a seeded subset of the classes, rendered
    with seeds CLIP never saw."""
    base = 1000 * (seed + 1)
    if family == "digits":
        names = list(images.DIGIT_NAMES)
        xtr, ytr, _ = images.digits("train")
        xte, yte, _ = images.digits("test")
        n_sessions = digits_sessions
    else:
        pick = np.random.default_rng([seed, 31]).choice(len(images.SHAPES_CLASSES),
                                                        shapes_classes, replace=False)
        names = [images.SHAPES_CLASSES[i] for i in sorted(pick)]
        xtr, ytr, _ = images.shapes(names, n_train, seed=base + 1)
        xte, yte, _ = images.shapes(names, n_test, seed=base + 2)
        n_sessions = shapes_sessions
    xtr = images.add_noise(xtr, noise, base + 3)
    xte = images.add_noise(xte, noise, base + 4)
    with torch.no_grad():
        return {"f_tr": clip.image_features(model, xtr).cpu(), "y_tr": torch.as_tensor(ytr),
                "f_te": clip.image_features(model, xte).cpu(), "y_te": torch.as_tensor(yte),
                "w": clip.class_features(model, tok, names).cpu(), "names": names,
                "splits": session_splits(len(names), n_sessions, seed)}


# -- training and evaluation --------------------------------------------------------------------

def _logits(z, w, head, scale, alpha, c_head):
    if head == "cosine":
        return cosine_logits(z, w, scale)
    return poincare_logits(z, w, scale, alpha, c_head)


def train_session(adapter: HDCAAdapter, f, y, w, head: str = "poincare", scale: float = 36.0,
                  steps: int = 100, lr: float = 1e-2, batch: int = 256, alpha: float = 1.0,
                  c_head: float = 1.0, generator=None, log_every: int = 0) -> dict:
    """Adam on the current session's trainable factors, cross-entropy over the classes seen so
    far (text features ``w``, (K, d)) on this session's features ``(f, y)`` (plus a replay
    buffer's, for that baseline: the caller concatenates them). Returns the loss curve and, every
    ``log_every`` steps, the mean raw and compressed norms of the current session's residual."""
    params = adapter.trainable()
    opt = torch.optim.Adam(params, lr=lr)
    out = {"loss": [], "raw": [], "compressed": []}
    n = len(f)
    for step in range(steps):
        idx = torch.randperm(n, generator=generator)[:batch] if n > batch else slice(None)
        loss = F.cross_entropy(_logits(adapter(f[idx]), w, head, scale, alpha, c_head), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        out["loss"].append(float(loss.detach()))
        if log_every and step % log_every == 0:
            with torch.no_grad():
                u = adapter.residuals(f[idx])[-1]
                out["raw"].append(float(u.norm(dim=-1).mean()))
                out["compressed"].append(float(compress(u, adapter.c_task).norm(dim=-1).mean()))
    return out


def accuracy(adapter, f, y, w, head="cosine", scale=36.0, alpha=1.0, c_head=1.0) -> float:
    """Top-1 accuracy of the head on the (adapted, unless ``adapter`` is None) features."""
    with torch.no_grad():
        z = adapter(f) if adapter is not None else f
        pred = _logits(z, w, head, scale, alpha, c_head).argmax(-1)
    return float((pred == y).float().mean()) if len(y) else float("nan")


def cil_metrics(acc_table: np.ndarray, curve) -> dict:
    """PyCIL's metrics. ``acc_table[k, t]``: accuracy on task k's classes after session t
    (k <= t); ``curve[t]``: accuracy on all classes seen after session t. Forgetting: mean over
    k < T - 1 of max_t acc_table[k, t] - acc_table[k, T - 1] (PyCIL ``trainer.py``)."""
    a = np.asarray(acc_table, dtype=float)
    T = a.shape[1]
    forg = [np.nanmax(a[k, k:]) - a[k, T - 1] for k in range(T - 1)]
    return {"avg_incremental": float(np.mean(curve)), "last": float(curve[-1]),
            "forgetting": float(np.mean(forg)) if forg else 0.0}


def _displacement(adapter: HDCAAdapter, f_te, t: int) -> dict:
    """Mean norms on the test features after session ``t``: the newest raw and compressed
    residual, the raw sum and the (compressed) total displacement."""
    with torch.no_grad():
        us = adapter.residuals(f_te)
        return {"session": t,
                "task_raw": float(us[-1].norm(dim=-1).mean()),
                "task_compressed": float(compress(us[-1], adapter.c_task).norm(dim=-1).mean()),
                "sum_raw": float(sum(us).norm(dim=-1).mean()),
                "cumulative": float(adapter.displacement(f_te).norm(dim=-1).mean())}


def run_sessions(f_tr, y_tr, f_te, y_te, w, splits, adapter: HDCAAdapter | None,
                 head: str, scale: float, steps: int, lr: float, replay_per_class: int = 0,
                 alpha: float = 1.0, c_head: float = 1.0, seed: int = 0,
                 log_every: int = 0) -> dict:
    """One class-incremental run: for each session, add its classes, train (unless zero-shot),
    evaluate on the test images of every class seen so far. ``replay_per_class`` > 0 keeps that
    many random training features per old class in a buffer (the replay baseline; HDCA keeps
    none). Returns the accuracy table, curve, PyCIL metrics and per-session displacement norms."""
    g = torch.Generator().manual_seed(seed)
    T = len(splits)
    table = np.full((T, T), np.nan)
    curve, disp, logs = [], [], []
    seen: list[int] = []
    buffer: list[torch.Tensor] = []
    for t, cls in enumerate(splits):
        seen += [int(k) for k in cls]
        remap = {k: i for i, k in enumerate(seen)}      # labels index the seen classes' heads
        ws = w[seen]
        tr = torch.as_tensor(np.isin(y_tr.numpy(), cls))
        f_t, y_t = f_tr[tr], y_tr[tr]
        if adapter is not None:
            adapter.new_session()
            if buffer:
                idx = torch.cat(buffer)
                f_t, y_t = torch.cat([f_t, f_tr[idx]]), torch.cat([y_t, y_tr[idx]])
            y_loc = torch.as_tensor([remap[int(k)] for k in y_t])
            logs.append(train_session(adapter, f_t, y_loc, ws, head, scale, steps, lr,
                                      alpha=alpha, c_head=c_head, generator=g,
                                      log_every=log_every))
            if replay_per_class:
                for k in cls:
                    members = torch.nonzero(y_tr == int(k)).flatten()
                    pick = torch.randperm(len(members), generator=g)[:replay_per_class]
                    buffer.append(members[pick])
        te = torch.as_tensor(np.isin(y_te.numpy(), seen))
        y_loc_te = torch.as_tensor([remap[int(k)] for k in y_te[te]])
        curve.append(accuracy(adapter, f_te[te], y_loc_te, ws, head, scale, alpha, c_head))
        for k, old in enumerate(splits[: t + 1]):
            m = torch.as_tensor(np.isin(y_te.numpy(), old))
            yk = torch.as_tensor([remap[int(j)] for j in y_te[m]])
            table[k, t] = accuracy(adapter, f_te[m], yk, ws, head, scale, alpha, c_head)
        if adapter is not None:
            disp.append(_displacement(adapter, f_te, t))
    return {"table": table, "curve": curve, **cil_metrics(table, curve), "displacement": disp,
            "logs": logs}


# -- the comparison -----------------------------------------------------------------------------

def new_adapter(dim: int, rank: int, seed: int, per_session: bool = True, c_task: float = 0.0,
                c_cum: float = 0.0) -> HDCAAdapter:
    """An adapter whose factors start from the same seeded initialisation as every other one
    (torch's global generator is seeded with ``seed`` first)."""
    torch.manual_seed(seed)
    return HDCAAdapter(dim, rank, per_session, c_task, c_cum)


def _session_run(bed: dict, adapter, head: str, S: dict, scale: float, seed: int,
                 replay: int = 0, log_every: int = 0) -> dict:
    return run_sessions(bed["f_tr"], bed["y_tr"], bed["f_te"], bed["y_te"], bed["w"],
                        bed["splits"], adapter, head, scale, S["steps"], S["lr"],
                        replay_per_class=replay, alpha=S["alpha"], c_head=S["c_head"], seed=seed,
                        log_every=log_every)


def compare_methods(bed: dict, S: dict, scale: float, seed: int) -> tuple[dict, dict, HDCAAdapter]:
    """On one family's bed: the baselines (zero-shot CLIP, sequential fine-tuning, the replay
    adapter, all with the cosine head), HDCA (both stages, Poincare head) and the ablation
    (``ABLATION`` stage x head; its ``both``/``poincare`` cell is HDCA's run). ``S`` holds
    ``steps, lr, rank, alpha, c_head, c_task, c_cum, replay_per_class``. Returns the runs by
    method, the ablation runs by ``(stage, head)`` and HDCA's trained adapter."""
    dim = bed["w"].shape[1]
    res = {"zero-shot": _session_run(bed, None, "cosine", S, scale, seed),
           "seq-ft": _session_run(bed, new_adapter(dim, S["rank"], seed, False), "cosine", S,
                                  scale, seed),
           "replay": _session_run(bed, new_adapter(dim, S["rank"], seed, False), "cosine", S,
                                  scale, seed, replay=S["replay_per_class"])}
    hdca_adapter = new_adapter(dim, S["rank"], seed, True, S["c_task"], S["c_cum"])
    res["hdca"] = _session_run(bed, hdca_adapter, "poincare", S, scale, seed, log_every=10)
    abl = {}
    for stage, (a, b) in ABLATION.items():
        for head in ("cosine", "poincare"):
            if stage == "both" and head == "poincare":
                abl[stage, head] = res["hdca"]
                continue
            ad = new_adapter(dim, S["rank"], seed, True, a * S["c_task"], b * S["c_cum"])
            abl[stage, head] = _session_run(bed, ad, head, S, scale, seed)
    return res, abl, hdca_adapter


def curvature_sweep(bed: dict, S: dict, scale: float, seed: int, curvatures) -> pd.DataFrame:
    """HDCA (both stages at ``c_task = c_cum = c``, Poincare head) for each ``c``: PyCIL's
    metrics, one row per curvature."""
    sweep = {}
    for c in curvatures:
        r = _session_run(bed, new_adapter(bed["w"].shape[1], S["rank"], seed, True, c, c),
                         "poincare", S, scale, seed)
        sweep[c] = {k: r[k] for k in METRICS}
    sweep = pd.DataFrame(sweep).T
    sweep.index.name = "c"
    return sweep


def wins(res: dict, baselines) -> dict:
    """Per baseline, whether HDCA beats it on each PyCIL metric (higher accuracies, lower
    forgetting)."""
    h = res["hdca"]
    return {b: {"avg": h["avg_incremental"] > res[b]["avg_incremental"],
                "last": h["last"] > res[b]["last"],
                "forgetting": h["forgetting"] < res[b]["forgetting"]} for b in baselines}


# -- diagnostics (C1, C2) -----------------------------------------------------------------------

def residual_growth(adapter: HDCAAdapter, f, ks) -> tuple[pd.DataFrame, float]:
    """Every trained per-task residual ``u_s(f)`` scaled by ``k`` (``B_s -> k B_s``) and
    compressed with the adapter's per-task curvature: one row per (session, k) with the mean raw
    and compressed norms; and the smallest cosine between ``kappa(u)`` and ``u`` (the direction
    kept)."""
    grow, cos_min = [], 1.0
    with torch.no_grad():
        for s, a in enumerate(adapter.adapters):
            u0 = a(f).double()
            for k in ks:
                u = k * u0
                kc = compress(u, adapter.c_task)
                cos_min = min(cos_min, float(F.cosine_similarity(kc, u, dim=-1).min()))
                grow.append({"session": s, "k": k, "raw": float(u.norm(dim=-1).mean()),
                             "compressed": float(kc.norm(dim=-1).mean())})
    return pd.DataFrame(grow), cos_min


def ranking_agreement(adapter: HDCAAdapter, bed: dict, scale: float, alpha: float,
                      c_head: float) -> dict:
    """On the adapted test features, in float64: the share of images where the Poincare head's
    argmax, and its full class order, equal the cosine head's."""
    with torch.no_grad():
        z = adapter(bed["f_te"]).double()
    w = bed["w"].double()
    lc = cosine_logits(z, w, scale)
    lp = poincare_logits(z, w, scale, alpha, c_head)
    return {"argmax_agree": float((lc.argmax(-1) == lp.argmax(-1)).double().mean()),
            "order_agree": float((lc.argsort(-1) == lp.argsort(-1)).all(-1).double().mean()),
            "n": len(z), "classes": w.shape[0]}


def slope_ratios(scale: float, alpha: float, c_head: float) -> dict:
    """d logit / d cos at cos 0.95 over its value at cos 0, for each head."""
    probe = torch.tensor([0.0, 0.5, 0.9, 0.95], dtype=torch.float64)
    sp = logit_slope(probe, "poincare", scale, alpha, c_head)
    sc = logit_slope(probe, "cosine", scale, alpha, c_head)
    return {"poincare_0.95_over_0": float(sp[-1] / sp[0]), "cosine_0.95_over_0": float(sc[-1] / sc[0])}
