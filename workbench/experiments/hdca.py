"""The harness of notebook 03 (paper 03, "HDCA: hyperbolic displacement-constrained adaptation
for CLIP class-incremental learning", ``docs/papers/03-hdca.md``).

What the notebook drives around the method (:mod:`workbench.methods.hdca`):

- the class-incremental bed of a family: noisy train and test images, their frozen CLIP
  embeddings, the class text embeddings and a seeded class order cut into sessions
  (:func:`session_splits`, :func:`family_bed`);
- training and evaluation over the sessions: Adam on the current session's adapter factors
  (:func:`train_session`), accuracy and PyCIL's metrics (:func:`accuracy`, :func:`cil_metrics`),
  one class-incremental run with an optional replay buffer (:func:`run_sessions`);
- the two adapter sites (:data:`VARIANTS`): inside the image encoder, a branch beside the MLP
  of its last blocks (the paper's placement; :func:`encoder_inputs` computes the frozen part
  once), or on the frozen output embedding (the earlier variant, kept);
- the comparison: zero-shot CLIP, sequential fine-tuning, LwF (Li & Hoiem 2016, the exemplar-free
  method CLIP class-incremental papers tabulate), the replay adapter (a reference: it stores
  exemplars), HDCA and the compression ablation (:data:`ABLATION`) from one seeded initialisation
  (:func:`new_adapter`, :func:`compare_methods`, :func:`ablation_runs`), the curvature sweep
  (:func:`curvature_sweep`), the ablation with each arm's curvature chosen on a validation split
  of the training images (:func:`selection_bed`, :func:`restrict`, :func:`tuned_ablation`), and
  paired bootstrap intervals of HDCA's gains over the same test images (:func:`item_scores`,
  :func:`paired_gains`);
- the diagnostics of C1 and C2: the trained per-task residuals scaled up and compressed
  (:func:`residual_growth`), and the Poincare head's ranking against the cosine head's on the
  adapted features with the heads' slope ratios (:func:`ranking_agreement`,
  :func:`slope_ratios`);
- the explorer of the curvature: the trained residuals in a plane, re-compressed at any
  curvature, beside the map and the sweep's metrics (:func:`residual_plane`,
  :func:`compression_figure`).

Metrics follow PyCIL (G-U-N/PyCIL, ``trainer.py`` and ``utils/toolkit.py``): average incremental
accuracy = mean of the accuracy curve over sessions (accuracy on all classes seen so far, after
each session), last accuracy = the curve's last point, forgetting = mean over the old tasks of
(best accuracy on that task's classes over sessions - its final accuracy).
"""
from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from matplotlib.patches import Circle

from .. import plots
from ..data import images
from ..diagnostics import paired_bootstrap
from ..methods.hdca import (EncoderHDCA, HDCAAdapter, block_inputs, compress,
                            compression_ratio, cosine_logits, logit_slope, poincare_logits)
from ..models import clip

__all__ = ["ABLATION", "METRICS", "VARIANTS", "EXEMPLAR_FREE", "session_splits",
           "encoder_inputs", "family_bed", "train_session", "accuracy", "cil_metrics",
           "run_sessions", "curvatures", "new_adapter", "compare_methods", "ablation_runs",
           "curvature_sweep", "selection_bed", "restrict", "tuned_ablation", "item_scores", "paired_gains", "beats", "residual_growth",
           "ranking_agreement", "slope_ratios", "residual_plane", "compression_figure"]

# the C4 ablation: which compression stage is on (per-task c, cumulative c) as 0 / 1 factors
ABLATION = {"none": (0, 0), "per-task": (1, 0), "cumulative": (0, 1), "both": (1, 1)}
METRICS = ("avg_incremental", "last", "forgetting")     # PyCIL's three, as in every table
# where the adapter sits: inside the image encoder (the paper's placement) or on its output
VARIANTS = {"encoder": "in-encoder (branch beside the MLP of the last blocks)",
            "output": "output embedding (after the frozen encoder)"}
EXEMPLAR_FREE = ("zero-shot", "seq-ft", "lwf")          # C3's rivals; replay is a reference
CONTINUAL = ("seq-ft", "lwf")      # the rivals that adapt: C3 asks HDCA to forget less than these


# -- the class-incremental bed ------------------------------------------------------------------

def session_splits(n_classes: int, n_sessions: int, seed: int) -> list[np.ndarray]:
    """A seeded class order cut into ``n_sessions`` equal groups (the class-incremental split)."""
    order = np.random.default_rng([seed, 303]).permutation(n_classes)
    return np.array_split(order, n_sessions)


def encoder_inputs(model, x, n_blocks: int) -> torch.Tensor:
    """The frozen part of the image encoder, computed once: embeddings, pre-LayerNorm, the blocks
    before the last ``n_blocks``, and the adapter-independent part of the first adapted one
    (:func:`~workbench.methods.hdca.block_inputs`), (N, T, 2, d)."""
    vm = model.vision_model
    layers = vm.encoder.layers
    x = torch.as_tensor(x, dtype=torch.float32, device=next(model.parameters()).device)
    with torch.no_grad():
        h = vm.pre_layrnorm(vm.embeddings(pixel_values=clip.pixels(model, x)))
        for layer in layers[: len(layers) - n_blocks]:
            h = layer(h, None)
            h = h[0] if isinstance(h, tuple) else h        # transformers 4.x returned a tuple
        hm = block_inputs(layers[len(layers) - n_blocks], h)
    return hm[:, :1].contiguous() if n_blocks == 1 else hm  # one block: its class-token row only


def family_bed(model, tok, family: str, seed: int, *, noise: float, digits_sessions: int,
               shapes_classes: int, shapes_sessions: int, n_train: int, n_test: int,
               enc_blocks: int = 1) -> dict:
    """One family's bed: frozen CLIP features of noisy train and test images (``f_tr``, ``y_tr``,
    ``f_te``, ``y_te``), the in-encoder adapter's inputs (``h_tr``, ``h_te``, see
    :func:`encoder_inputs`) and frozen parts (``encoder``), class text features ``w``, class
    ``names`` and the session ``splits``. Digits: CLIP's own split under fresh noise. Shapes: a
    seeded subset of the classes, rendered with seeds CLIP never saw."""
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
    vm = model.vision_model
    with torch.no_grad():
        # features on the model's device; labels on the host (they index and feed numpy)
        return {"f_tr": clip.image_features(model, xtr), "y_tr": torch.as_tensor(ytr),
                "f_te": clip.image_features(model, xte), "y_te": torch.as_tensor(yte),
                "h_tr": encoder_inputs(model, xtr, enc_blocks),
                "h_te": encoder_inputs(model, xte, enc_blocks),
                "encoder": (vm.encoder.layers[-enc_blocks:], vm.post_layernorm,
                            model.visual_projection),
                "w": clip.class_features(model, tok, names), "names": names,
                "splits": session_splits(len(names), n_sessions, seed)}


# -- training and evaluation --------------------------------------------------------------------

def _logits(z, w, head, scale, alpha, c_head):
    if head == "cosine":
        return cosine_logits(z, w, scale)
    return poincare_logits(z, w, scale, alpha, c_head)


def _distill(student, teacher, T: float = 2.0):
    """LwF's loss (Li & Hoiem 2016, eq. 3): T^2 KL(softmax(teacher / T) || softmax(student / T))
    over the old classes' logits."""
    return F.kl_div(F.log_softmax(student / T, -1), F.log_softmax(teacher / T, -1),
                    log_target=True, reduction="batchmean") * T * T


def train_session(adapter, f, y, w, head: str = "poincare", scale: float = 36.0,
                  steps: int = 100, lr: float = 1e-2, batch: int = 256, alpha: float = 1.0,
                  c_head: float = 1.0, generator=None, log_every: int = 0, teacher=None,
                  n_old: int = 0, lwf: float = 0.0) -> dict:
    """Adam on the current session's trainable factors, cross-entropy over the classes seen so
    far (text features ``w``, (K, d)) on this session's inputs ``(f, y)`` (plus a replay
    buffer's, for that baseline: the caller concatenates them); with a ``teacher`` (the adapter
    as the session began) plus ``lwf`` times LwF's distillation on the first ``n_old`` classes.
    Returns the loss curve and, every ``log_every`` steps, the mean raw and compressed norms of
    the current session's residual."""
    opt = torch.optim.Adam(adapter.trainable(), lr=lr)
    out = {"loss": [], "raw": [], "compressed": []}
    n = len(f)
    for step in range(steps):
        idx = torch.randperm(n, generator=generator)[:batch] if n > batch else slice(None)
        logits = _logits(adapter(f[idx]), w, head, scale, alpha, c_head)
        loss = F.cross_entropy(logits, y[idx])
        if teacher is not None and n_old:
            with torch.no_grad():
                old = _logits(teacher(f[idx]), w[:n_old], head, scale, alpha, c_head)
            loss = loss + lwf * _distill(logits[:, :n_old], old)
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


def _predict(adapter, f, w, head="cosine", scale=36.0, alpha=1.0, c_head=1.0):
    """The head's class index for every input (adapted, unless ``adapter`` is None)."""
    with torch.no_grad():
        z = adapter(f) if adapter is not None else f
        return _logits(z, w, head, scale, alpha, c_head).argmax(-1).cpu()


def accuracy(adapter, f, y, w, head="cosine", scale=36.0, alpha=1.0, c_head=1.0) -> float:
    """Top-1 accuracy of the head on the (adapted, unless ``adapter`` is None) inputs."""
    if not len(y):
        return float("nan")
    return float((_predict(adapter, f, w, head, scale, alpha, c_head) == y).float().mean())


def cil_metrics(acc_table: np.ndarray, curve) -> dict:
    """PyCIL's metrics. ``acc_table[k, t]``: accuracy on task k's classes after session t
    (k <= t); ``curve[t]``: accuracy on all classes seen after session t. Forgetting: mean over
    k < T - 1 of max_t acc_table[k, t] - acc_table[k, T - 1] (PyCIL ``trainer.py``)."""
    a = np.asarray(acc_table, dtype=float)
    T = a.shape[1]
    forg = [np.nanmax(a[k, k:]) - a[k, T - 1] for k in range(T - 1)]
    return {"avg_incremental": float(np.mean(curve)), "last": float(curve[-1]),
            "forgetting": float(np.mean(forg)) if forg else 0.0}


def _displacement(adapter, f_te, t: int) -> dict:
    """Mean norms on the test inputs after session ``t``: the newest raw and compressed
    residual, the raw sum and the (compressed) total displacement."""
    with torch.no_grad():
        us = adapter.residuals(f_te)
        return {"session": t,
                "task_raw": float(us[-1].norm(dim=-1).mean()),
                "task_compressed": float(compress(us[-1], adapter.c_task).norm(dim=-1).mean()),
                "sum_raw": float(sum(us).norm(dim=-1).mean()),
                "cumulative": float(adapter.displacement(f_te).norm(dim=-1).mean())}


def _teacher(adapter):
    """A frozen copy of the adapter as the session begins (LwF's old model)."""
    t = copy.deepcopy(adapter)
    for p in t.parameters():
        p.requires_grad_(False)
    return t


def run_sessions(f_tr, y_tr, f_te, y_te, w, splits, adapter, head: str, scale: float,
                 steps: int, lr: float, replay_per_class: int = 0, alpha: float = 1.0,
                 c_head: float = 1.0, seed: int = 0, log_every: int = 0,
                 lwf: float = 0.0) -> dict:
    """One class-incremental run: for each session, add its classes, train (unless zero-shot),
    evaluate on the test images of every class seen so far. ``replay_per_class`` > 0 keeps that
    many random training inputs per old class in a buffer (the replay baseline; HDCA keeps
    none); ``lwf`` > 0 adds LwF's distillation from the adapter as each session began. Returns
    the accuracy table, curve, PyCIL metrics, per-image correctness ``correct[t, i]`` (NaN before
    image i's class is seen) and per-session displacement norms."""
    g = torch.Generator().manual_seed(seed)
    T = len(splits)
    table, correct = np.full((T, T), np.nan), np.full((T, len(y_te)), np.nan)
    curve, disp, logs, seen = [], [], [], []
    buffer: list[torch.Tensor] = []
    for t, cls in enumerate(splits):
        n_old = len(seen)
        seen += [int(k) for k in cls]
        remap = {k: i for i, k in enumerate(seen)}      # labels index the seen classes' heads
        tr = torch.as_tensor(np.isin(y_tr.numpy(), cls))
        f_t, y_t = f_tr[tr], y_tr[tr]
        if adapter is not None:
            teacher = _teacher(adapter) if lwf and n_old else None
            adapter.new_session()
            if buffer:
                idx = torch.cat(buffer)
                f_t, y_t = torch.cat([f_t, f_tr[idx]]), torch.cat([y_t, y_tr[idx]])
            y_loc = torch.as_tensor([remap[int(k)] for k in y_t], device=f_t.device)
            logs.append(train_session(adapter, f_t, y_loc, w[seen], head, scale, steps, lr,
                                      alpha=alpha, c_head=c_head, generator=g,
                                      log_every=log_every, teacher=teacher, n_old=n_old,
                                      lwf=lwf))
            for k in cls if replay_per_class else ():
                members = torch.nonzero(y_tr == int(k)).flatten()
                buffer.append(members[torch.randperm(len(members), generator=g)[:replay_per_class]])
        te = np.isin(y_te.numpy(), seen)
        y_loc_te = torch.as_tensor([remap[int(k)] for k in y_te[te]])
        pred = _predict(adapter, f_te[torch.as_tensor(te)], w[seen], head, scale, alpha, c_head)
        correct[t, te] = (pred == y_loc_te).double().numpy()
        curve.append(float(np.mean(correct[t, te])))
        for k, old in enumerate(splits[: t + 1]):
            table[k, t] = float(np.mean(correct[t, np.isin(y_te.numpy(), old)]))
        if adapter is not None:
            disp.append(_displacement(adapter, f_te, t))
    return {"table": table, "curve": curve, **cil_metrics(table, curve), "correct": correct,
            "displacement": disp, "logs": logs}


# -- the comparison -----------------------------------------------------------------------------

def curvatures(S: dict, variant: str, c_task: float | None = None,
               c_cum: float | None = None) -> tuple[float, float]:
    """The stages' curvatures at a site. ``S``'s are for unit output features (bound 1 / sqrt c);
    inside the encoder the residual stream's tokens have norm ~``enc_norm``, so the curvature is
    divided by its square and the bound is the same fraction of a token."""
    ct = S["c_task"] if c_task is None else c_task
    cc = S["c_cum"] if c_cum is None else c_cum
    k = S["enc_norm"] ** 2 if variant == "encoder" else 1.0
    return ct / k, cc / k


def new_adapter(bed: dict, variant: str, rank: int, seed: int, per_session: bool = True,
                c_task: float = 0.0, c_cum: float = 0.0):
    """An adapter at the ``variant``'s site whose factors start from the same seeded
    initialisation as every other one (torch's global generator is seeded with ``seed``)."""
    torch.manual_seed(seed)
    if variant == "encoder":     # the frozen blocks are the CLIP's, on its device already
        return EncoderHDCA(*bed["encoder"], rank, per_session, c_task, c_cum).to(bed["w"].device)
    return HDCAAdapter(bed["w"].shape[1], rank, per_session, c_task, c_cum).to(bed["w"].device)


def _session_run(bed: dict, variant: str, adapter, head: str, S: dict, scale: float, seed: int,
                 replay: int = 0, log_every: int = 0, lwf: float = 0.0) -> dict:
    key = "h" if variant == "encoder" and adapter is not None else "f"
    return run_sessions(bed[f"{key}_tr"], bed["y_tr"], bed[f"{key}_te"], bed["y_te"], bed["w"],
                        bed["splits"], adapter, head, scale, S["steps"], S["lr"],
                        replay_per_class=replay, alpha=S["alpha"], c_head=S["c_head"], seed=seed,
                        log_every=log_every, lwf=lwf)


def compare_methods(bed: dict, S: dict, scale: float, seed: int, variant: str = "encoder"):
    """On one family's bed, adapters at the ``variant``'s site: the baselines (zero-shot CLIP,
    sequential fine-tuning, LwF and the replay adapter, all cosine head) and HDCA (both stages,
    Poincare head). ``S`` holds ``steps, lr, rank, alpha, c_head, c_task, c_cum, enc_norm,
    replay_per_class, lwf``. Returns the runs by method and HDCA's trained adapter."""
    def plain():
        return new_adapter(bed, variant, S["rank"], seed, False)
    res = {"zero-shot": _session_run(bed, variant, None, "cosine", S, scale, seed),
           "seq-ft": _session_run(bed, variant, plain(), "cosine", S, scale, seed),
           "lwf": _session_run(bed, variant, plain(), "cosine", S, scale, seed, lwf=S["lwf"]),
           "replay": _session_run(bed, variant, plain(), "cosine", S, scale, seed,
                                  replay=S["replay_per_class"])}
    ad = new_adapter(bed, variant, S["rank"], seed, True, *curvatures(S, variant))
    res["hdca"] = _session_run(bed, variant, ad, "poincare", S, scale, seed, log_every=10)
    return res, ad


def ablation_runs(bed: dict, S: dict, scale: float, seed: int, hdca_run: dict,
                  variant: str = "encoder") -> dict:
    """C4's ablation (``ABLATION`` stage x head) at the ``variant``'s site, by ``(stage, head)``;
    its ``both``/``poincare`` cell is HDCA's run ``hdca_run``."""
    ct, cc = curvatures(S, variant)
    abl = {}
    for stage, (a, b) in ABLATION.items():
        for head in ("cosine", "poincare"):
            if stage == "both" and head == "poincare":
                abl[stage, head] = hdca_run
                continue
            ad = new_adapter(bed, variant, S["rank"], seed, True, a * ct, b * cc)
            abl[stage, head] = _session_run(bed, variant, ad, head, S, scale, seed)
    return abl


def curvature_sweep(bed: dict, S: dict, scale: float, seed: int, cs, variant: str = "encoder",
                    done: dict | None = None) -> pd.DataFrame:
    """HDCA (both stages at ``c_task = c_cum = c``, in :func:`curvatures`' units, Poincare head)
    for each ``c``: PyCIL's metrics, one row per curvature. ``done``: runs already made, by c."""
    sweep = {}
    for c in cs:
        r = (done or {}).get(c)
        if r is None:
            ad = new_adapter(bed, variant, S["rank"], seed, True, *curvatures(S, variant, c, c))
            r = _session_run(bed, variant, ad, "poincare", S, scale, seed)
        sweep[c] = {k: r[k] for k in METRICS}
    sweep = pd.DataFrame(sweep).T
    sweep.index.name = "c"
    return sweep


def selection_bed(bed: dict, frac: float, seed: int) -> dict:
    """``bed`` with a seeded ``frac`` of each class's training images held out for selection:
    the adapters train on the rest, and the "test" rows are the held-out images (the first
    ``n_val``) followed by the test images, so one run scores both (:func:`restrict`)."""
    g = np.random.default_rng([seed, 707])
    y = bed["y_tr"].numpy()
    val = np.zeros(len(y), bool)
    for k in np.unique(y):
        idx = np.flatnonzero(y == k)
        val[g.choice(idx, max(1, int(round(frac * len(idx)))), replace=False)] = True
    keep, held = torch.as_tensor(~val), torch.as_tensor(val)
    out = dict(bed)
    for key in ("f", "h") if "h_tr" in bed else ("f",):
        out[f"{key}_tr"] = bed[f"{key}_tr"][keep.to(bed[f"{key}_tr"].device)]
        out[f"{key}_te"] = torch.cat([bed[f"{key}_tr"][held.to(bed[f"{key}_tr"].device)],
                                      bed[f"{key}_te"]])
    out["y_tr"], out["y_te"] = bed["y_tr"][keep], torch.cat([bed["y_tr"][held], bed["y_te"]])
    out["n_val"] = int(val.sum())
    return out


def restrict(run: dict, cols: np.ndarray, y: np.ndarray, splits) -> dict:
    """A run of :func:`run_sessions` scored on the images ``cols`` only (labels ``y`` of all its
    images): ``correct``, the accuracy table, the curve and PyCIL's metrics of that subset."""
    c = run["correct"][:, cols]
    y = np.asarray(y)[cols]
    T = len(splits)
    table = np.full((T, T), np.nan)
    for t in range(T):
        for k in range(t + 1):
            table[k, t] = float(np.mean(c[t, np.isin(y, splits[k])]))
    curve = [float(np.nanmean(c[t])) for t in range(T)]
    return {"table": table, "curve": curve, **cil_metrics(table, curve), "correct": c}


def tuned_ablation(bed: dict, S: dict, scale: float, seed: int, grid, head: str,
                   variant: str = "encoder", frac: float = 0.2) -> dict:
    """C4 with each arm at its own curvature, chosen on validation (:func:`selection_bed`: a
    held-out ``frac`` of the training images, never the test images) by average incremental
    accuracy over ``grid`` (in :func:`curvatures`' units): "per-task" picks ``c_task``; "both"
    keeps that ``c_task`` and picks ``c_cum`` (never 0). Per arm: the chosen curvatures, its
    validation and test runs (:func:`restrict`); and every grid point's validation accuracy."""
    sel = selection_bed(bed, frac, seed)
    y, n_val = sel["y_te"].numpy(), sel["n_val"]
    cols = {"val": np.arange(n_val), "test": np.arange(n_val, len(y))}

    def arm(ct, cc):
        ad = new_adapter(sel, variant, S["rank"], seed, True, *curvatures(S, variant, ct, cc))
        r = _session_run(sel, variant, ad, head, S, scale, seed)
        return {part: restrict(r, c, y, sel["splits"]) for part, c in cols.items()}

    def best(runs):                     # the first grid point on a tie
        return max(runs, key=lambda c: runs[c]["val"]["avg_incremental"])

    per = {c: arm(c, 0.0) for c in grid}
    ct = best(per)
    both = {c: arm(ct, c) for c in grid}
    cc = best(both)
    return {"per-task": {"c_task": ct, "c_cum": 0.0, **per[ct]},
            "both": {"c_task": ct, "c_cum": cc, **both[cc]},
            "val_avg": {"per-task": {c: r["val"]["avg_incremental"] for c, r in per.items()},
                        "both": {c: r["val"]["avg_incremental"] for c, r in both.items()}},
            "n_val": n_val}


def item_scores(run: dict) -> dict:
    """Per test image, scores whose mean is each PyCIL metric (higher is better): ``avg``:
    sum_t correct[t, i] / (T n_t) * N over the sessions that saw i's class (n_t images seen);
    ``last``: correct[T - 1, i]; ``retention``: minus forgetting, i's task k < T - 1 scoring
    (correct[T - 1, i] - correct[t*_k, i]) N / ((T - 1) n_k) with t*_k the task's best session
    as measured, 0 in the last task."""
    c, table = run["correct"], run["table"]
    T, N = c.shape
    seen = ~np.isnan(c)
    avg = np.nansum(c / seen.sum(1, keepdims=True), 0) * N / T
    first = seen.argmax(0)                           # the session that brought i's class
    ret = np.zeros(N)
    for k in range(T - 1):
        m = first == k
        if not m.any():
            continue
        best = k + int(np.nanargmax(table[k, k:]))
        ret[m] = (c[T - 1, m] - c[best, m]) * N / ((T - 1) * m.sum())
    return {"avg": avg, "last": c[T - 1], "retention": ret}


def beats(gains: dict) -> dict:
    """Per baseline and metric of :func:`paired_gains`, whether the interval lies above 0."""
    return {b: {m: bool(g["low"] > 0) for m, g in per.items()} for b, per in gains.items()}


def paired_gains(res: dict, baselines, method: str = "hdca", seed: int = 0) -> dict:
    """Per baseline and metric, :func:`~workbench.diagnostics.paired_bootstrap` of ``method``'s
    per-image scores minus the baseline's on the same test images (``low > 0``: it wins)."""
    a = item_scores(res[method])
    out = {}
    for b in baselines:
        s = item_scores(res[b])
        out[b] = {m: paired_bootstrap(a[m], s[m], seed=seed) for m in a}
    return out


# -- diagnostics (C1, C2) -----------------------------------------------------------------------

def residual_growth(adapter, f, ks) -> tuple[pd.DataFrame, float]:
    """Every trained per-task residual ``u_s`` on the inputs ``f`` scaled by ``k`` (``B_s -> k
    B_s``) and compressed with the adapter's per-task curvature: one row per (session, k) with
    the mean raw and compressed norms; and the smallest cosine between ``kappa(u)`` and ``u``
    (the direction kept)."""
    grow, cos_min = [], 1.0
    with torch.no_grad():
        for s, u0 in enumerate(adapter.residuals(f)):
            u0 = u0.double()
            for k in ks:
                u = k * u0
                kc = compress(u, adapter.c_task)
                cos_min = min(cos_min, float(F.cosine_similarity(kc, u, dim=-1).min()))
                grow.append({"session": s, "k": k, "raw": float(u.norm(dim=-1).mean()),
                             "compressed": float(kc.norm(dim=-1).mean())})
    return pd.DataFrame(grow), cos_min


def ranking_agreement(z, w, scale: float, alpha: float, c_head: float) -> dict:
    """On adapted features ``z``, in float64: the share of images where the Poincare head's
    argmax, and its full class order, equal the cosine head's."""
    z, w = z.detach().double(), w.double()
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


# -- the explorer: the curvature against the compression map -------------------------------------
def residual_plane(adapter, f, n_max: int = 200) -> dict:
    """The trained raw per-task residuals of ``adapter`` on the first ``n_max`` inputs of ``f``
    (every site) as float64 rows ``raw``, the ``session`` of each row, and ``basis``: the rows' two
    leading right singular vectors, uncentred, so the origin stays zero displacement and a
    projection is never longer than its residual."""
    with torch.no_grad():
        us = [u[:n_max].reshape(-1, u.shape[-1]).double() for u in adapter.residuals(f[:n_max])]
    raw = torch.cat(us).cpu()
    return {"raw": raw.numpy(), "basis": torch.linalg.svd(raw, full_matrices=False)[2][:2].numpy(),
            "session": np.concatenate([np.full(len(u), s) for s, u in enumerate(us)])}


def _plane_panel(ax, plane: dict, c: float, n_lines: int = 40) -> None:
    """The residuals projected on the plane, raw (faint) and compressed at ``c`` (solid), a few
    joined by their radial move, and the bound 1 / sqrt(c) as a circle."""
    raw = plane["raw"] @ plane["basis"].T
    ratio = compression_ratio(np.linalg.norm(plane["raw"], axis=1), c).numpy()[:, None]
    for i in np.linspace(0, len(raw) - 1, n_lines).astype(int):
        ax.plot(*np.stack([raw[i], ratio[i] * raw[i]]).T, color="0.75", lw=0.5)
    for s in np.unique(plane["session"]):
        m, col = plane["session"] == s, plots.PALETTE[s % len(plots.PALETTE)]
        ax.plot(*raw[m].T, ".", ms=3, alpha=0.25, color=col)
        ax.plot(*(ratio[m] * raw[m]).T, ".", ms=4, color=col, label=f"session {s + 1}")
    ax.add_patch(Circle((0, 0), 1 / np.sqrt(c), fill=False, ls="--", color="k"))
    ax.set_aspect("equal", "datalim")
    ax.set(xlabel="residual on singular direction 1", ylabel="on direction 2")


def _map_panel(ax, plane: dict, c: float) -> None:
    """rho_c(r) against r (log-log), with every residual as a point on it."""
    norms = np.linalg.norm(plane["raw"], axis=1)
    r = np.logspace(np.log10(norms.min()) - 2, np.log10(norms.max()) + 0.5, 200)
    ax.plot(r, r, "k:", lw=0.8, label="identity")
    ax.plot(r, compression_ratio(r, c).numpy() * r, color=plots.PALETTE[0], label="rho_c(r)")
    ax.axhline(1 / np.sqrt(c), color="k", ls="--", lw=0.8, label="1 / sqrt(c)")
    ax.plot(norms, compression_ratio(norms, c).numpy() * norms, ".", ms=4,
            color=plots.PALETTE[1], label="trained residuals")
    ax.set(xscale="log", yscale="log", xlabel="raw residual norm r",
           ylabel="compressed norm", title="the map, and where the residuals sit on it")
    ax.legend(fontsize=7)


def compression_figure(plane: dict, c: float, sweep: pd.DataFrame, units: float = 1.0):
    """The explorer's picture at curvature ``c`` (unit-feature units; the residuals live in units
    where it is ``c / units``, ``enc_norm**2`` in the encoder): the trained residuals compressed
    in a plane, the map rho_c, and the metrics of HDCA trained at each curvature of ``sweep``
    (:func:`curvature_sweep`) with a line at ``c``."""
    fig, axes = plots.subplots(1, 3, figsize=(15, 4.2))
    _plane_panel(axes[0], plane, c / units)
    axes[0].set_title(f"kappa_c at c = {c:g}: trained residuals, raw (faint) and compressed",
                      fontsize=9)
    axes[0].legend(fontsize=7, markerscale=2)
    _map_panel(axes[1], plane, c / units)
    for i, k in enumerate(METRICS):
        axes[2].plot(sweep.index, sweep[k], "o-", color=plots.PALETTE[i], label=k)
    axes[2].axvline(c, color="k", lw=1.0)
    axes[2].set(xscale="log", xlabel="curvature c", ylabel="accuracy / forgetting",
                title="HDCA trained at each c (the sweep)")
    axes[2].legend(fontsize=7)
    return fig
