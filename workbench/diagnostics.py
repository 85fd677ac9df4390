"""Representation and optimisation diagnostics shared by the notebooks.

- tau-dormant neurons (Sokar et al. 2023, "The Dormant Neuron Phenomenon in Deep RL", eq. 1)
- inactive units by activity (a unit's spread across states), which also sees saturated tanh units
- effective rank: srank (Kumar et al. 2021) and the entropy form (Roy & Vetterli 2007)
- norm / mean trackers over training
- singular-component ablation of a weight matrix, with an equal-norm random control
- Hutchinson estimate of the Hessian trace (Hutchinson 1989; as in PyHessian)
- Spearman rank correlation with a paired bootstrap interval (scipy.stats)

All functions take torch tensors (numpy arrays where noted) and never train anything.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import pandas as pd
import torch
from scipy import stats

__all__ = ["dormant_scores", "dormant_fraction", "activity_scores", "inactive_fraction",
           "saturated_units", "saturated_fraction", "singular_values", "srank", "erank",
           "global_norm", "Tracker",
           "growth_rate", "ablate_singular", "ablate_random", "hutchinson_trace", "rademacher",
           "hutchpp", "hutchinson", "spearman_ci",
           "paired_bootstrap", "paired_table", "top_hessian_eigenvalue"]


# -- dormant neurons ---------------------------------------------------------------------------
def dormant_scores(activations: torch.Tensor) -> torch.Tensor:
    """Per-unit score s_i = E_x|h_i(x)| / ((1/H) sum_k E_x|h_k(x)|)  (Sokar et al. 2023, eq. 1,
    the tau-dormant score of ReDo). It measures a unit's level, not its variation: a saturated
    tanh unit scores high. :func:`activity_scores` sees both dead and saturated units.

    ``activations`` is (batch, units) or (batch, units, *spatial); spatial positions are averaged
    like the batch (as in dopamine's ``redo/weight_recyclers.py``). The denominator gets +1e-9.
    """
    a = activations.detach().abs().float()
    if a.dim() > 2:
        a = a.transpose(0, 1).reshape(a.shape[1], -1).T    # (batch*spatial, units)
    per_unit = a.mean(dim=0)
    return per_unit / (per_unit.mean() + 1e-9)


def dormant_fraction(activations: torch.Tensor, tau: float = 0.0) -> float:
    """Fraction of units whose score is <= tau. tau=0 counts exactly-dead units (dopamine's
    default); 0.025 or 0.1 are the usual non-zero choices (timoklein/redo)."""
    return float((dormant_scores(activations) <= tau).float().mean())


def _units_last(activations: torch.Tensor) -> torch.Tensor:
    """(batch, units, *spatial) -> (batch, positions, units); (batch, units) -> (batch, 1, units)."""
    a = activations.detach().float()
    if a.dim() < 2:
        raise ValueError(f"need activations of shape (batch, units) or (batch, channels, *spatial), "
                         f"got shape {tuple(a.shape)}")
    return a.reshape(a.shape[0], a.shape[1], -1).transpose(1, 2)


def activity_scores(activations: torch.Tensor, eps: float = 1e-9) -> torch.Tensor:
    """Per-unit activity a_i = sd_x h_i(x) / ((1/H) sum_k sd_x h_k(x) + eps).

    A unit is *inactive* when its output barely varies across states, whatever its level: a dead
    ReLU unit (always 0) and a saturated tanh unit (always about +-1) both have sd ~ 0, while the
    tau-dormant score of :func:`dormant_scores` (Sokar et al. 2023, eq. 1, mean |h|) sees only the
    first, since a saturated tanh unit's |h| is large. Both pass nothing about the state on: the
    outgoing weights of a constant unit act as a fixed bias downstream (paper 09's argument).

    ``activations`` is (batch, units) or (batch, channels, *spatial). For feature maps the spread
    is taken across the batch at each position and then averaged over positions, so a channel
    that draws the same spatial pattern for every state counts as constant (it carries no state
    information either). The standard deviation is the population one (``unbiased=False``);
    ``eps`` keeps an all-constant layer at 0 instead of NaN.
    """
    a = _units_last(activations)
    if a.shape[0] < 2:
        raise ValueError("activity needs a batch of at least 2 states to measure a spread")
    sd = a.std(dim=0, unbiased=False).mean(dim=0)          # (units,): spread across states
    return sd / (sd.mean() + eps)


def inactive_fraction(activations: torch.Tensor, tau: float = 0.1) -> float:
    """Fraction of units whose :func:`activity_scores` is <= tau (dead or saturated units).

    tau = 0.1: the unit varies less than a tenth as much as the layer's average unit. For tanh
    this is where saturation sets in: the slope 1 - tanh(z)^2 is 0.1 at |z| = 1.82, where
    |tanh z| = 0.95, so to first order a unit whose pre-activations sit there, with the spread of
    a typical unit of the layer sitting around 0, scores 0.1, and 0.95 is also the |mean| cut-off of
    :func:`saturated_fraction`. It is the same number as the usual non-zero tau of the
    tau-dormant score (``dormant_fraction(h, 0.1)``), which is reported beside it.
    """
    return float((activity_scores(activations) <= tau).float().mean())


def saturated_units(activations: torch.Tensor, mean_thresh: float = 0.95,
                    std_thresh: float = 0.05) -> torch.Tensor:
    """Which tanh units act as a constant: |mean| >= mean_thresh and std <= std_thresh across
    inputs (their outgoing weights then add a fixed bias downstream); one bool per unit."""
    a = activations.detach().float()
    a = a.reshape(a.shape[0], a.shape[1], -1).transpose(1, 2).reshape(-1, a.shape[1]) \
        if a.dim() > 2 else a
    return (a.mean(0).abs() >= mean_thresh) & (a.std(0) <= std_thresh)


def saturated_fraction(activations: torch.Tensor, mean_thresh: float = 0.95,
                       std_thresh: float = 0.05) -> float:
    """Fraction of tanh units that act as a constant (:func:`saturated_units`)."""
    return float(saturated_units(activations, mean_thresh, std_thresh).float().mean())


# -- effective rank ----------------------------------------------------------------------------
def singular_values(x) -> torch.Tensor:
    """Singular values of a 2-D matrix (torch or numpy), in float64, descending."""
    x = torch.as_tensor(x).detach().double()
    if x.dim() != 2:
        raise ValueError(f"need a 2-D matrix, got shape {tuple(x.shape)}")
    return torch.linalg.svdvals(x)


def srank(x, delta: float = 0.01, *, is_sv: bool = False) -> int:
    """srank_delta = min{k : sum_{i<=k} sigma_i >= (1 - delta) sum_i sigma_i}
    (Kumar et al. 2021, "Implicit Under-Parameterization", sec. 3; delta = 0.01).

    ``x`` is a feature matrix (samples x units) or, with ``is_sv=True``, its singular values.
    """
    sv = torch.as_tensor(x, dtype=torch.float64) if is_sv else singular_values(x)
    sv = torch.sort(sv.abs(), descending=True).values
    total = sv.sum()
    if total <= 0:
        return 0
    cum = torch.cumsum(sv, 0) / total
    # a small tolerance keeps exactly-reached thresholds (e.g. a flat spectrum) from rounding up
    return int(torch.searchsorted(cum, torch.tensor(1 - delta - 1e-12, dtype=cum.dtype)).item()) + 1


def erank(x, *, is_sv: bool = False) -> float:
    """Entropy effective rank exp(H(p)), p_i = sigma_i / sum_j sigma_j (Roy & Vetterli 2007, eq. 2).

    Unlike srank it weighs a long flat tail of small singular values, so the two can differ a lot.
    """
    sv = torch.as_tensor(x, dtype=torch.float64).abs() if is_sv else singular_values(x)
    total = sv.sum()
    if total <= 0:
        return 0.0
    p = sv / total
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


# -- norm and mean tracking --------------------------------------------------------------------
def global_norm(tensors) -> float:
    """sqrt(sum of squared entries) over parameters or tensors."""
    return float(torch.sqrt(sum((t.detach().double() ** 2).sum() for t in tensors)))


class Tracker:
    """Collects scalar series over training: ``tr.log(step, loss=..., norm=...)``, then
    ``tr.frame()`` for a pandas table or ``tr[name]`` for a numpy array."""

    def __init__(self):
        self.steps: list[int] = []
        self.series: dict[str, list[float]] = defaultdict(list)

    def log(self, step: int, **values) -> None:
        self.steps.append(int(step))
        for k, v in values.items():
            self.series[k].append(float(v))

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self.series[name])

    def __contains__(self, name: str) -> bool:
        return name in self.series

    def frame(self):
        return pd.DataFrame({"step": self.steps, **self.series})


def growth_rate(steps, values) -> tuple[float, float]:
    """Fit log(values) = a + r * step by least squares; return (r, R^2). Exponential growth is a
    straight line on a log axis, so r > 0 with R^2 near 1 means exponential growth."""
    s, v = np.asarray(steps, float), np.asarray(values, float)
    keep = np.isfinite(v) & (v > 0)
    s, y = s[keep], np.log(v[keep])
    if len(s) < 3:
        return float("nan"), float("nan")
    r, a = np.polyfit(s, y, 1)
    resid = y - (a + r * s)
    ss = ((y - y.mean()) ** 2).sum()
    return float(r), float(1 - (resid ** 2).sum() / ss) if ss > 0 else float("nan")


# -- singular-component ablation ---------------------------------------------------------------
def ablate_singular(w: torch.Tensor, k=0) -> torch.Tensor:
    """W minus its k-th singular component(s): W - sum_k s_k u_k v_k^T (k an int or a list)."""
    u, s, vh = torch.linalg.svd(w.detach(), full_matrices=False)
    ks = [k] if isinstance(k, int) else list(k)
    removed = sum(s[i] * torch.outer(u[:, i], vh[i]) for i in ks)
    return w.detach() - removed


def ablate_random(w: torch.Tensor, k=0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Control for :func:`ablate_singular`: subtract a random rank-one matrix with the same
    Frobenius norm as the removed component(s) (s_k), direction u, v uniform on the sphere."""
    s = torch.linalg.svdvals(w.detach())
    ks = [k] if isinstance(k, int) else list(k)
    out = w.detach().clone()
    for i in ks:                        # drawn on the host: the same directions on every device
        u = torch.randn(w.shape[0], generator=generator, dtype=w.dtype).to(w.device)
        v = torch.randn(w.shape[1], generator=generator, dtype=w.dtype).to(w.device)
        out = out - s[i] * torch.outer(u / u.norm(), v / v.norm())
    return out


# -- curvature ---------------------------------------------------------------------------------
def hutchinson_trace(loss: torch.Tensor, params, n_samples: int = 8,
                     generator: torch.Generator | None = None, per_tensor: bool = False):
    """tr(H) ~ mean_v v^T H v, v Rademacher, H v by double backprop (Hutchinson 1989; PyHessian
    ``hessian.trace``). ``loss`` must have been computed with a graph through ``params``.

    ``per_tensor=True`` returns one estimate per tensor of ``params``, of the trace of its
    diagonal Hessian block, ``tr(H_ii) = E[v_i^T (H v)_i]`` (the other blocks' probes are
    independent with mean 0): the same probes and double backprops serve every tensor, instead of
    one graph per tensor.
    """
    params = list(params)
    if per_tensor and not all(p.requires_grad for p in params):
        raise ValueError("per_tensor=True needs every tensor in params to require grad")
    params = [p for p in params if p.requires_grad]
    grads = torch.autograd.grad(loss, params, create_graph=True)
    est = [0.0] * len(params)
    for _ in range(n_samples):
        vs = [torch.randint(0, 2, p.shape, generator=generator, device=p.device).to(p.dtype) * 2 - 1
              for p in params]
        hv = torch.autograd.grad(grads, params, grad_outputs=vs, retain_graph=True)
        for i, (h, v) in enumerate(zip(hv, vs)):
            est[i] += float((h * v).sum())
    est = [e / n_samples for e in est]
    return est if per_tensor else sum(est)


# -- rank correlation --------------------------------------------------------------------------
# -- trace estimators on a matrix-free operator (Hestia's calibrator, paper 10) -----------------
def rademacher(n: int, k: int, generator: torch.Generator, dtype=torch.float64,
               device=None) -> torch.Tensor:
    """An ``(n, k)`` matrix of independent +-1 entries."""
    return torch.randint(0, 2, (n, k), generator=generator, device=device).to(dtype) * 2 - 1


def hutchpp(matvec, n: int, num_sketch: int, num_query: int,
            generator: torch.Generator) -> float:
    """Hutch++ (Meyer, Musco, Musco & Woodruff 2021, Algorithm 1) of a symmetric ``n x n`` operator
    given by ``matvec(X) = A X`` on ``(n, k)`` float64 blocks; ``2 num_sketch + num_query`` matvecs.

        S Rademacher (n x k),  Q = orth(A S),  G Rademacher (n x m),  P = I - Q Q^T
        tr(A) ~ tr(Q^T A Q) + tr(G^T P A P G) / m

    The exact trace of ``A`` on the sketched subspace plus a Hutchinson estimate of the rest, so
    it is exact when ``rank A <= num_sketch``, and its variance falls much faster with the matvec
    count than Hutchinson's when the spectrum decays. The phases follow the public
    ``HutchPlusPlusState`` (hestia2026/Hestia, ``hessian/hutchpp.py``): the sketch is capped at ``n``, and a sketch
    of ``n`` columns returns the subspace trace alone (then exact).
    """
    k = min(num_sketch, n)
    Q, _ = torch.linalg.qr(matvec(rademacher(n, k, generator)))     # phase 1: range of A S
    low = float((Q * matvec(Q)).sum())                               # phase 2: tr(Q^T A Q)
    if k >= n or num_query <= 0:
        return low
    G = rademacher(n, num_query, generator)                          # phase 3: the residual
    Z = matvec(G - Q @ (Q.T @ G))                                    # A P G
    Z = Z - Q @ (Q.T @ Z)                                            # P A P G
    return low + float((G * Z).sum()) / num_query


def hutchinson(matvec, n: int, num: int, generator: torch.Generator) -> float:
    """Hutchinson's estimate ``mean_j g_j^T A g_j`` over ``num`` Rademacher ``g_j`` (``num``
    matvecs): the baseline Hutch++ improves on."""
    G = rademacher(n, num, generator)
    return float((G * matvec(G)).sum()) / num



def spearman_ci(x, y, n_resamples: int = 1000, confidence: float = 0.95, seed: int = 0) -> dict:
    """Spearman's rho of paired ``x, y`` (``scipy.stats.spearmanr``) and its percentile
    bootstrap interval: pairs resampled with replacement, re-ranked per resample
    (``scipy.stats.rankdata``, ties averaged), Pearson of the ranks, all resamples at once.

    Returns ``{"rho", "low", "high", "n"}``; all NaN when either side is constant."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"x and y must be 1-D of one length, got {x.shape} and {y.shape}")
    nan = float("nan")
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return {"rho": nan, "low": nan, "high": nan, "n": len(x)}
    rho = float(stats.spearmanr(x, y).statistic)
    idx = np.random.default_rng(seed).integers(0, len(x), (n_resamples, len(x)))
    rx, ry = stats.rankdata(x[idx], axis=1), stats.rankdata(y[idx], axis=1)
    rx, ry = rx - rx.mean(1, keepdims=True), ry - ry.mean(1, keepdims=True)
    den = np.sqrt((rx ** 2).sum(1) * (ry ** 2).sum(1))
    boot = (rx * ry).sum(1)[den > 0] / den[den > 0]        # a constant resample has no rho
    a = (1 - confidence) / 2
    return {"rho": rho, "low": float(np.quantile(boot, a)), "high": float(np.quantile(boot, 1 - a)),
            "n": len(x)}


def paired_bootstrap(a, b, n_resamples: int = 2000, confidence: float = 0.95,
                     seed: int = 0) -> dict:
    """The mean difference ``a - b`` of two methods scored on the same items, with a percentile
    bootstrap interval that keeps the pairing (Efron & Tibshirani 1993, ch. 13).

    ``a`` and ``b`` are per-item scores of one shape: 1-D (items) or 2-D (seeds x items, the
    same items for every seed). 1-D: items resampled with replacement. 2-D: seeds and items are
    crossed factors, so each resample draws seeds and, once for all of them, items (the same
    item is the same question on every seed): the interval carries the spread between seeds as
    well as between items, and repeating one seed does not narrow it. A claim "a beats b" holds
    when ``low > 0``.

    Returns ``{"diff", "low", "high", "n_items", "n_seeds"}``."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim not in (1, 2) or a.size == 0:
        raise ValueError(f"a and b must be per-item scores of one 1-D or 2-D shape, got "
                         f"{a.shape} and {b.shape}")
    d = (a - b).reshape(-1, a.shape[-1])                  # seeds x items
    rng = np.random.default_rng(seed)
    n_seeds, n_items = d.shape
    seeds = rng.integers(0, n_seeds, (n_resamples, n_seeds)) if n_seeds > 1 else \
        np.zeros((n_resamples, 1), dtype=int)
    items = rng.integers(0, n_items, (n_resamples, 1, n_items))
    boot = d[seeds[..., None], items].mean(axis=(1, 2))
    q = (1 - confidence) / 2
    return {"diff": float(d.mean()), "low": float(np.quantile(boot, q)),
            "high": float(np.quantile(boot, 1 - q)), "n_items": n_items, "n_seeds": n_seeds}


# -- top Hessian eigenvalue --------------------------------------------------------------------
def paired_table(pairs: dict, seed: int = 0) -> pd.DataFrame:
    """:func:`paired_bootstrap` of each named pair ``{name: (a, b)}``, a row per name (columns
    diff, low, high, n_items, n_seeds): ``a`` beats ``b`` where low > 0."""
    return pd.DataFrame({n: paired_bootstrap(a, b, seed=seed) for n, (a, b) in pairs.items()}
                        ).T.astype({"n_items": int, "n_seeds": int})


def top_hessian_eigenvalue(loss_fn, params, iters: int = 20, tol: float = 1e-4,
                           generator: torch.Generator | None = None) -> float:
    """The largest-magnitude eigenvalue of the Hessian of ``loss_fn()`` w.r.t. ``params`` by power
    iteration on Hessian-vector products (double backprop; PyHessian ``hessian.eigenvalues``).
    ``loss_fn`` is called once and must build a graph through ``params``."""
    params = [p for p in params if p.requires_grad]
    grads = torch.autograd.grad(loss_fn(), params, create_graph=True)
    v = [torch.randn(p.shape, generator=generator).to(p) for p in params]
    norm = torch.sqrt(sum((x * x).sum() for x in v))
    v = [x / norm for x in v]
    eig = 0.0
    for _ in range(iters):
        hv = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True)
        new = float(sum((h * x).sum() for h, x in zip(hv, v)))      # Rayleigh quotient
        norm = torch.sqrt(sum((h * h).sum() for h in hv))
        v = [h / (norm + 1e-12) for h in hv]
        if abs(new - eig) <= tol * max(1.0, abs(new)):
            eig = new
            break
        eig = new
    return eig
