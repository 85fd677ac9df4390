"""Numerical Feature Inflation (NFI): the Slingshot loss spikes as a finite-precision effect.

Paper 12 (NeurIPS 2026; spec in ``papers/12-nfi.md``). The chain of the argument, and where each
link lives here:

1. *Absorption.* With the correct-class logit ahead of the others by a gap g, the softmax
   denominator is 1 + (C - 1) e^{-g} (after the max shift). Once (C - 1) e^{-g} drops below half an
   ulp of 1 it rounds to exactly 1, p_y to exactly 1 and the correct-class gradient p_y - 1 to
   exactly 0, while the other classes keep p_c ~ e^{-g} > 0. :func:`absorption_threshold`,
   :func:`gap_sweep`, :func:`measured_threshold`.
2. *Broken zero-sum.* In exact arithmetic the logit gradient of every sample sums to zero over
   classes; absorbed samples sum to (C - 1) e^{-g} > 0 instead. :func:`absorbed_mask`,
   :func:`collapsed_mask` (Prieto et al. 2025's "softmax collapse").
3. *Drift and feedback.* All classifier rows then move against the feature mean, and the features
   against the classifier mean: the two global means feed each other and grow exponentially.
   :func:`classifier_mean_norm`, :func:`feature_mean_norm`, :func:`train`.
4. *The fix that isolates the cause.* Recompute the correct-class gradient as minus the sum of the
   others: :class:`ZeroSumCrossEntropy`. Training in float64 moves the threshold far out instead.
5. *Slingshot.* The drift ends in a loss spike that brings gradients back: :func:`detect_spikes`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import get_total_norm

from workbench.data.classification import Task
from workbench.diagnostics import Tracker, growth_rate

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16,
          "float32": torch.float32, "float64": torch.float64}
VARIANTS = ("float32", "float64", "zero_sum")   # zero_sum: float32 with ZeroSumCrossEntropy
DEFAULT_GAPS = np.arange(0.0, 45.0, 1e-3)       # the sweep: past float64's threshold (36.7)


def as_dtype(dtype) -> torch.dtype:
    """A torch dtype from a name ("float32") or a dtype."""
    return DTYPES[dtype] if isinstance(dtype, str) else dtype


# -- absorption: the threshold, analytic and measured --------------------------------------------
def absorption_threshold(dtype, num_classes: int = 2, pooled: bool = True) -> float:
    """Logit gap beyond which 1 + (C - 1) e^{-g} rounds to exactly 1 in ``dtype``.

    fl(1 + t) = 1 exactly when t <= eps / 2 (half an ulp of 1, ties to even), so with
    t = (C - 1) e^{-g} the threshold is g* = ln(2 / eps) + ln(C - 1) (REFERENCES.md, "Softmax
    absorption"): ln(2^24) = 16.64 in float32. That is the bound for a denominator rounded once
    (``pooled``: the tiny terms are added to each other before they meet the 1). A kernel that adds
    each tiny term to the running 1 on its own absorbs from ln(2 / eps) on (``pooled=False``);
    real reduction orders sit in between, which :func:`gap_sweep` measures.
    """
    eps = torch.finfo(as_dtype(dtype)).eps
    return math.log(2 / eps) + (math.log(num_classes - 1) if pooled else 0.0)


def gap_logits(gaps, num_classes: int = 2, dtype=torch.float32) -> torch.Tensor:
    """Rows [0, -g, ..., -g], one per gap: class 0 is correct and leads every other by g."""
    g = torch.as_tensor(gaps, dtype=torch.float64)
    z = torch.zeros(len(g), num_classes, dtype=torch.float64)
    z[:, 1:] = -g[:, None]
    return z.to(as_dtype(dtype))


def ce_logit_grad(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """d(sum_n CE_n) / d logits as autograd computes it in the logits' dtype: p - onehot(y) per row,
    rounded the way training rounds it (PyTorch's fused log-softmax backward)."""
    z = logits.detach().clone().requires_grad_(True)
    F.cross_entropy(z, targets, reduction="sum").backward()
    return z.grad


def gap_sweep(dtype, num_classes: int = 2, gaps=None, device="cpu") -> dict[str, np.ndarray]:
    """The numerics experiment (C1): sweep the gap, take the true cross-entropy gradient.

    Returns arrays over the sweep: ``gap`` (as representable in ``dtype``), ``grad_y`` (the
    correct-class gradient p_y - 1), ``grad_other`` (one wrong class's p_c), ``grad_sum`` (the
    row sum over classes, added in float64 so that its own rounding hides nothing: 0 up to
    rounding while the zero-sum holds) and
    ``collapsed`` (Prieto et al.'s sum(exp(z - max z)) == 1).
    """
    z = gap_logits(DEFAULT_GAPS if gaps is None else gaps, num_classes, dtype).to(device)
    y = torch.zeros(len(z), dtype=torch.long, device=z.device)
    g = ce_logit_grad(z, y)
    out = {"gap": z[:, 0] - z[:, 1], "grad_y": g[:, 0], "grad_other": g[:, 1],
           "grad_sum": g.double().sum(1), "collapsed": collapsed_mask(z)}
    return {k: v.cpu().double().numpy() if k != "collapsed" else v.cpu().numpy()
            for k, v in out.items()}


def _persistent_from(gap: np.ndarray, mask: np.ndarray) -> float:
    """The smallest swept gap from which ``mask`` holds to the end of the sweep (NaN if it never
    holds at the end)."""
    if not mask[-1]:
        return float("nan")
    misses = np.flatnonzero(~mask)
    return float(gap[misses[-1] + 1 if len(misses) else 0])


def measured_threshold(sweep: dict[str, np.ndarray], key: str = "grad_y") -> float:
    """The smallest swept gap from which the correct-class gradient stays exactly 0 (C1's measured
    threshold). ``key="collapsed"`` gives the same for Prieto et al.'s collapse test instead."""
    mask = sweep[key] == 0 if key.startswith("grad") else sweep[key].astype(bool)
    return _persistent_from(sweep["gap"], mask)


def underflow_gap(sweep: dict[str, np.ndarray]) -> float:
    """The smallest swept gap from which the wrong classes' gradient is exactly 0 too: there the
    broken-zero-sum window ends, because e^{-g} itself underflows (NaN if not in the sweep)."""
    return _persistent_from(sweep["gap"], sweep["grad_other"] == 0)


def gap_resolution(dtype, gap: float) -> float:
    """Spacing of ``dtype`` near ``gap``: how finely a logit gap can be set at all (bfloat16 steps
    by 1/32 near 5.5), so the tolerance for comparing a measured threshold with the analytic one."""
    return torch.finfo(as_dtype(dtype)).eps * 2.0 ** math.floor(math.log2(gap))


def threshold_report(dtype, num_classes: int = 2, gaps=None, device="cpu") -> dict:
    """One row of the numerics table (C1): analytic bounds, measured thresholds, and whether the
    measurement agrees. For C = 2 the measured threshold must match ln(2 / eps) within the gap
    resolution; for C > 2 it must lie between the unpooled and pooled bounds (the kernel's
    summation order decides where). ``broken_zero_sum``: from the threshold until e^{-g}
    underflows, every swept row has grad_y == 0 but a non-zero wrong-class gradient and row sum."""
    gaps = DEFAULT_GAPS if gaps is None else np.asarray(gaps, float)
    sw = gap_sweep(dtype, num_classes, gaps, device)
    hi = absorption_threshold(dtype, num_classes)
    lo = absorption_threshold(dtype, num_classes, pooled=False)
    got, under = measured_threshold(sw), underflow_gap(sw)
    tol = gap_resolution(dtype, hi) + float(np.max(np.diff(gaps), initial=0.0))
    inside = (sw["gap"] >= got) & ~(sw["gap"] >= under)   # NaN underflow: to the sweep's end
    return {"dtype": str(as_dtype(dtype)).replace("torch.", ""), "classes": num_classes,
            "eps": torch.finfo(as_dtype(dtype)).eps, "analytic": hi, "analytic_unpooled": lo,
            "measured": got, "collapse_from": measured_threshold(sw, "collapsed"),
            "underflow_from": under, "tolerance": tol,
            "matches": bool(lo - tol <= got <= hi + tol),
            "broken_zero_sum": bool(inside.any() and (sw["grad_y"][inside] == 0).all()
                                    and (sw["grad_other"][inside] != 0).all()
                                    and (sw["grad_sum"][inside] != 0).all())}


# -- absorbed samples in a batch -----------------------------------------------------------------
def absorbed_mask(grad: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Samples whose correct-class logit gradient is exactly 0 (``grad`` is d loss / d logits)."""
    return grad.gather(1, targets[:, None]).squeeze(1) == 0


def collapsed_mask(logits: torch.Tensor) -> torch.Tensor:
    """Prieto et al. 2025's softmax collapse: sum_c exp(z_c - max z) == 1 exactly, in the logits'
    dtype (EIFY/grokking-at-the-edge-of-numerical-stability, ``logger.py``)."""
    z = logits.detach()
    return torch.exp(z - z.amax(1, keepdim=True)).sum(1) == 1


def absorbed_fraction(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of the batch whose cross-entropy gradient at the correct class is exactly 0."""
    return float(absorbed_mask(ce_logit_grad(logits, targets), targets).double().mean())


def collapse_fraction(logits: torch.Tensor) -> float:
    """Fraction of the batch in softmax collapse (Prieto et al. 2025)."""
    return float(collapsed_mask(logits).double().mean())


def logit_gaps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per sample z_y - max_{c != y} z_c: the margin that absorption is measured against."""
    z = logits.detach()
    zy = z.gather(1, targets[:, None]).squeeze(1)
    others = z.scatter(1, targets[:, None], float("-inf"))
    return zy - others.amax(1)


# -- the zero-sum-preserving cross-entropy -------------------------------------------------------
class ZeroSumCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy whose backward restores the zero-sum over classes.

    The wrong-class gradients p_c / N are kept; the correct-class one, p_y - 1 in exact arithmetic,
    is recomputed as -sum_{c != y} p_c / N, which cannot be absorbed while any p_c > 0. Scaling
    happens before the sum, so g_y + (sum of the others) is exactly 0 in the working dtype.
    """

    @staticmethod
    def forward(ctx, logits, targets):
        ctx.save_for_backward(torch.softmax(logits, dim=1), targets)
        return F.cross_entropy(logits, targets)

    @staticmethod
    def backward(ctx, grad_out):
        p, y = ctx.saved_tensors
        g = p * (grad_out / p.shape[0])                # wrong classes: p_c / N, as in the usual CE
        g.scatter_(1, y[:, None], 0.0)
        g.scatter_(1, y[:, None], -g.sum(1, keepdim=True))   # correct class: minus the others' sum
        return g, None


def zero_sum_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy`` (mean) with the zero-sum-preserving backward of
    :class:`ZeroSumCrossEntropy`."""
    return ZeroSumCrossEntropy.apply(logits, targets)


# -- the two global means, and how they grow -----------------------------------------------------
def classifier_mean_norm(weight: torch.Tensor) -> torch.Tensor:
    """||(1/C) sum_c w_c|| (a 0-d tensor) for a classifier weight of shape (classes, features).
    The softmax is blind to this direction (it adds w_mean . h to every logit), so only a broken
    zero-sum pushes it consistently."""
    return weight.detach().mean(0).norm()


def feature_mean_norm(features: torch.Tensor) -> torch.Tensor:
    """||(1/N) sum_n h_n|| (a 0-d tensor) for penultimate features of shape (samples, features)."""
    return features.detach().mean(0).norm()


def growth_fit(steps, values) -> dict[str, float]:
    """How a tracked norm grew over a window: ``factor`` (last / first), ``rate`` and ``r2`` of the
    exponential fit (:func:`workbench.diagnostics.growth_rate`, a line on a log axis) and
    ``linear_r2``, the R^2 of a straight line on a linear axis, for comparison."""
    s, v = np.asarray(steps, float), np.asarray(values, float)
    rate, r2 = growth_rate(s, v)
    lin_r2 = float(np.corrcoef(s, v)[0, 1] ** 2) if len(s) > 2 and v.std() > 0 else float("nan")
    return {"factor": float(v[-1] / v[0]), "rate": rate, "r2": r2, "linear_r2": lin_r2}


def inflation_window(absorbed, spikes=(), level: float = 0.5) -> tuple[int, int] | None:
    """Steps [start, end) where absorbed samples dominate: from the first step with an absorbed
    fraction >= ``level`` up to the first spike after it (or the end); None if never reached."""
    absorbed = np.asarray(absorbed)
    hit = np.flatnonzero(absorbed >= level)
    if not len(hit):
        return None
    start = int(hit[0])
    later = [int(k) for k in spikes if k > start]
    return start, (later[0] if later else len(absorbed))


# -- loss spikes ---------------------------------------------------------------------------------
def detect_spikes(loss, window: int = 50, min_rise: float = 2.0, min_loss: float = 1e-3,
                  floor: float = 1e-12) -> np.ndarray:
    """Indices of loss spikes: the peak of each run of steps where the loss is at least
    ``min_rise`` decades above its minimum over the preceding ``window`` steps and at least
    ``min_loss``. Zeros (a fully absorbed float32 loss is exactly 0) count as ``floor``.

    Flagged steps closer than ``window`` merge into one spike, so a ragged spike counts once.
    """
    raw = np.asarray(loss, float)
    y = np.log10(np.maximum(np.nan_to_num(raw, nan=floor), floor))
    if len(y) < 2:
        return np.zeros(0, int)
    padded = np.concatenate([np.full(window - 1, np.inf), y[:-1]])
    base = np.lib.stride_tricks.sliding_window_view(padded, window).min(1)   # [t-1]: min y[t-w:t]
    flagged = np.flatnonzero((y[1:] - base >= min_rise) & (raw[1:] >= min_loss)) + 1
    if not len(flagged):
        return np.zeros(0, int)
    runs = np.split(flagged, np.flatnonzero(np.diff(flagged) > window) + 1)
    return np.asarray([r[0] + int(np.argmax(y[r[0]:r[-1] + 1])) for r in runs], int)


# -- model and trainer ---------------------------------------------------------------------------
class MLP(nn.Module):
    """ReLU MLP without biases (as in Prieto et al.'s grokking MLP); ``forward`` returns
    (logits, penultimate features) so the feature mean is tracked without a second pass."""

    def __init__(self, d_in: int, hidden: int, depth: int, num_classes: int):
        super().__init__()
        dims = [d_in] + [hidden] * depth
        self.body = nn.Sequential(*[m for i in range(depth) for m in
                                    (nn.Linear(dims[i], dims[i + 1], bias=False), nn.ReLU())])
        self.head = nn.Linear(hidden, num_classes, bias=False)

    def forward(self, x):
        h = self.body(x)
        return self.head(h), h


@dataclass
class TrainConfig:
    """Settings of one training run (full batch, Adam, no weight decay, no regularizer)."""
    steps: int = 1500           # optimizer steps (= epochs: full batch)
    lr: float = 1e-2            # Adam learning rate; large, so the fit and the gap growth are fast
    hidden: int = 64            # width of each hidden layer
    depth: int = 2              # hidden layers
    beta2: float = 0.98         # Adam beta2 (beta1 = 0.9), as in Prieto et al.
    adam_eps: float = 1e-8      # Adam epsilon (PyTorch's default)
    eval_every: int = 1         # test accuracy every this many steps (NaN in between)
    fused_adam: bool = True     # Adam's fused kernel (CPU, CUDA): the same update, fewer ops


TRACKED = ("loss", "train_acc", "test_acc", "absorbed", "collapse", "gap_max", "gap_min",
           "cls_mean", "feat_mean", "cls_mean_grad", "grad_norm", "param_norm")


def init_model(task: Task, cfg: TrainConfig, seed: int) -> dict:
    """The initial weights every variant starts from: one float32 MLP drawn from ``seed``."""
    torch.manual_seed(seed)
    return MLP(task.x_train.shape[1], cfg.hidden, cfg.depth, task.num_classes).state_dict()


def train(task: Task, cfg: TrainConfig, variant: str = "float32", init: dict | None = None,
          seed: int = 0, device="cpu", progress=None) -> Tracker:
    """Train one variant full batch; track at every step, from the step's own forward/backward:

    ``loss``, ``train_acc``, ``test_acc``; ``absorbed`` (fraction of training samples whose
    correct-class gradient, as used in the update, is exactly 0) and ``collapse`` (Prieto et al.);
    ``gap_max``, ``gap_min`` (of z_y - max_{c != y} z_c); ``cls_mean``, ``feat_mean`` (the two
    global means); ``cls_mean_grad`` (||mean_c grad w_c||, ~0 while zero-sum holds);
    ``grad_norm`` and ``param_norm`` (over all parameters). Everything is measured before the
    step's update.

    ``variant``: "float32", "float64" (model and data in float64) or "zero_sum" (float32 with
    :class:`ZeroSumCrossEntropy`). Pass the same ``init`` (see :func:`init_model`) to compare
    variants from identical weights: the float32 values are exact in float64.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    dtype = torch.float64 if variant == "float64" else torch.float32
    loss_fn = zero_sum_cross_entropy if variant == "zero_sum" else F.cross_entropy
    model = MLP(task.x_train.shape[1], cfg.hidden, cfg.depth, task.num_classes)
    model.load_state_dict(init if init is not None else init_model(task, cfg, seed))
    model.to(device=device, dtype=dtype)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=cfg.lr, betas=(0.9, cfg.beta2), eps=cfg.adam_eps,
                           weight_decay=0.0, fused=cfg.fused_adam)
    x, y = task.x_train.to(device, dtype), task.y_train.to(device)
    xt, yt = task.x_test.to(device, dtype), task.y_test.to(device)
    nan = torch.tensor(float("nan"), dtype=dtype, device=device)
    tr = Tracker()
    steps = range(cfg.steps) if progress is None else progress(range(cfg.steps))
    for step in steps:
        logits, feats = model(x)
        logits.retain_grad()
        loss = loss_fn(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():             # all from this step's tensors, one device sync
            gap_min, gap_max = torch.aminmax(logit_gaps(logits, y))
            test_acc = ((model(xt)[0].argmax(1) == yt).to(dtype).mean()
                        if step % cfg.eval_every == 0 or step == cfg.steps - 1 else nan)
            row = torch.stack([
                loss.detach(), (logits.argmax(1) == y).to(dtype).mean(), test_acc,
                absorbed_mask(logits.grad, y).to(dtype).mean(),
                collapsed_mask(logits).to(dtype).mean(), gap_max, gap_min,
                classifier_mean_norm(model.head.weight), feature_mean_norm(feats),
                model.head.weight.grad.mean(0).norm(),
                get_total_norm([p.grad for p in params]), get_total_norm(params)])
            tr.log(step, **dict(zip(TRACKED, row.tolist())))
        opt.step()
    return tr
