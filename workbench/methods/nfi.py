"""Numerical Feature Inflation (NFI): the Slingshot loss spikes as a finite-precision effect.

Paper 12 (NeurIPS 2026; spec in ``docs/papers/12-nfi.md``). The chain of the argument, and where each
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
   :func:`classifier_mean_norm`, :func:`feature_mean_norm`.
4. *The fix that isolates the cause.* Recompute the correct-class gradient as minus the sum of the
   others: :class:`ZeroSumCrossEntropy`. Training in float64 moves the threshold far out instead.

The training runs that show the drift and the Slingshot spike it ends in (the instrumented
trainer, the spike detector, the growth fits) are the notebook's harness:
:mod:`workbench.experiments.nfi`.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["DTYPES", "DEFAULT_GAPS", "as_dtype", "absorption_threshold", "gap_logits",
           "ce_logit_grad", "gap_sweep", "measured_threshold", "underflow_gap", "gap_resolution",
           "threshold_report", "absorbed_mask", "collapsed_mask", "absorbed_fraction",
           "collapse_fraction", "logit_gaps", "ZeroSumCrossEntropy", "zero_sum_cross_entropy",
           "classifier_mean_norm", "feature_mean_norm"]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16,
          "float32": torch.float32, "float64": torch.float64}
DEFAULT_GAPS = np.arange(0.0, 45.0, 1e-3)       # the sweep: past float64's threshold (36.7)


def as_dtype(dtype) -> torch.dtype:
    """A torch dtype from a name ("float32") or a dtype."""
    return DTYPES[dtype] if isinstance(dtype, str) else dtype


# -- absorption: the threshold, analytic and measured --------------------------------------------
def absorption_threshold(dtype, num_classes: int = 2, pooled: bool = True) -> float:
    """Logit gap beyond which 1 + (C - 1) e^{-g} rounds to exactly 1 in ``dtype``.

    fl(1 + t) = 1 exactly when t <= eps / 2 (half an ulp of 1, ties to even), so with
    t = (C - 1) e^{-g} the threshold is g* = ln(2 / eps) + ln(C - 1) (docs/papers/12-nfi.md,
    "Definitions and departures"): ln(2^24) = 16.64 in float32. That is the bound for a denominator rounded once
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


# -- the two global means ------------------------------------------------------------------------
def classifier_mean_norm(weight: torch.Tensor) -> torch.Tensor:
    """||(1/C) sum_c w_c|| (a 0-d tensor) for a classifier weight of shape (classes, features).
    The softmax is blind to this direction (it adds w_mean . h to every logit), so only a broken
    zero-sum pushes it consistently."""
    return weight.detach().mean(0).norm()


def feature_mean_norm(features: torch.Tensor) -> torch.Tensor:
    """||(1/N) sum_n h_n|| (a 0-d tensor) for penultimate features of shape (samples, features)."""
    return features.detach().mean(0).norm()
