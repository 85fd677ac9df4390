"""LQZO: low-rank quantized zeroth-order fine-tuning (paper 02, ``docs/papers/02-lqzo.md``).

A quantized model is fine-tuned without backpropagation. Every block linear layer holds fixed
integer codes and a trainable per-group scale matrix ``S`` (out x G, :class:`~workbench.quant.
QuantLinear`); embeddings, RMSNorms and the (tied) ``lm_head`` stay in full precision and frozen.
The scales move by a two-point (SPSA / MeZO) estimate of the gradient,

    g = (L(S + eps Z) - L(S - eps Z)) / (2 eps),      S <- S - lr * clip(g) * Z          (1)

with the seed trick of MeZO (``princeton-nlp/MeZO`` ``large_models/trainer.py``): ``Z`` is never
stored, it is regenerated from a per-step seed for the +eps, -2 eps, +eps (restore) passes and
once more for the update; both losses are computed under ``torch.no_grad()``. As in QZO
(``maifoundations/QZO``), the directional derivative ``g`` is clipped to ``[-100, 100]`` and
the scales are clamped to ``>= 1e-7`` after each update.

LQZO changes only how ``Z`` is drawn, per layer (:class:`Perturbation`):

- **Low rank**: ``Z = U V^T / sqrt(r)`` with ``U`` (m x r), ``V`` (n x r) i.i.d. from the law;
  entries of ``U V^T`` have variance ``r``, so ``E[vec Z vec Z^T] = I`` (the condition every
  perturbation law must meet for (1) to be unbiased as ``eps -> 0``).
- **Binary-Aggregated Gaussian (BAG)**: each entry of ``U`` and ``V`` is the normalized aggregate
  of ``k`` independent Rademacher signs, ``b = (e_1 + ... + e_k) / sqrt(k)``, ``e_i = +-1``
  (a binomial approximation of a Gaussian). ``E b = 0``, ``E b^2 = 1``, ``E b^4 = 3 - 2/k``
  (Gaussian: 3; Rademacher, ``k = 1``: 1) and ``|b| <= sqrt(k)``: the higher moments are
  bounded. It costs one integer draw per entry (``randint(0, 2^k)`` and a popcount table), the
  same as a Rademacher sign. Why it matters for low rank: ``||Z||^2 = ||u||^2 ||v||^2`` (r = 1)
  fluctuates with ``Var(b^2) = E b^4 - 1``, and the estimator's second moment
  ``E[<Z, G>^2 ||Z||^2]`` grows with it.
- **Isotropy-enhanced estimation**: the scale matrix (out x G, very elongated: G = in / group)
  is reshaped row-major to a near-square ``a x b`` (``a b = out G``, ``a`` the largest divisor
  ``<= sqrt(out G)``) before the factorization, and ``Z`` is reshaped back.

Laws: ``gaussian``, ``rademacher``, ``bag``. Full-dimensional Gaussian ``Z`` on the scales is the
QZO baseline; full-dimensional Gaussian on every fp weight is fp MeZO (the reference ceiling).

The task, the estimator-quality analysis, the fine-tuning runs and the memory count are the
notebook's harness: :mod:`workbench.experiments.lqzo`.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..quant import QuantLinear, block_linears

__all__ = ["LAWS", "CLIP", "MIN_SCALE", "Perturbation", "ladder", "sample_law", "law_moments",
           "near_square", "factor_shape", "sample_direction", "sample_batch", "directions",
           "perturb_", "two_point", "zo_step", "zo_estimate", "quantize", "codes_snapshot", "flat"]

LAWS = ("gaussian", "rademacher", "bag")
CLIP = 100.0          # QZO: directional derivative clipped to [-CLIP, CLIP]
MIN_SCALE = 1e-7      # QZO: scales clamped >= MIN_SCALE


# -- perturbation laws ------------------------------------------------------------------------

@dataclass(frozen=True)
class Perturbation:
    """How ``Z`` is drawn for one parameter tensor.

    ``rank=None`` is a full-dimensional draw from ``law``; ``rank=r`` the low-rank
    ``U V^T / sqrt(r)`` of each 2-D tensor (others stay full), optionally after the near-square
    reshape (``isotropic``). ``bag_k`` is the number of Rademacher signs BAG aggregates.
    """
    law: str = "gaussian"
    rank: int | None = None
    isotropic: bool = False
    bag_k: int = 3

    def __post_init__(self):
        if self.law not in LAWS:
            raise ValueError(f"law must be one of {LAWS}, got {self.law!r}")
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"rank must be >= 1 or None, got {self.rank}")
        if self.bag_k < 1:
            raise ValueError(f"bag_k must be >= 1, got {self.bag_k}")

    @property
    def label(self) -> str:
        if self.rank is None:
            return f"full {self.law}"
        return f"rank-{self.rank} {self.law}" + (" + isotropy" if self.isotropic else "")


#: The methods of the notebook: the QZO baseline and the LQZO ablation ladder.
def ladder(rank: int, bag_k: int = 3) -> dict[str, Perturbation]:
    """QZO (full Gaussian), low-rank only, + BAG, + isotropy (= full LQZO)."""
    return {"QZO (Gaussian)": Perturbation("gaussian"),
            "low-rank": Perturbation("gaussian", rank),
            "low-rank + BAG": Perturbation("bag", rank, bag_k=bag_k),
            "LQZO (+ isotropy)": Perturbation("bag", rank, True, bag_k)}


_POPCOUNT = {}


def sample_law(law: str, shape, generator: torch.Generator, device=None, k: int = 3,
               dtype=torch.float32) -> torch.Tensor:
    """i.i.d. entries with mean 0 and variance 1 from ``law`` (see the module docstring)."""
    device = generator.device if device is None else device
    if law == "gaussian":
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)
    if law == "rademacher":
        return torch.randint(0, 2, shape, generator=generator, device=device).to(dtype) * 2 - 1
    if law == "bag":
        key = (k, device, dtype)
        table = _POPCOUNT.get(key)
        if table is None:
            pop = torch.tensor([bin(i).count("1") for i in range(2 ** k)], device=device)
            table = _POPCOUNT[key] = ((2 * pop - k) / math.sqrt(k)).to(dtype)
        bits = torch.randint(0, 2 ** k, shape, generator=generator, device=device)
        return table[bits]                   # (sum of k signs) / sqrt(k), one draw per entry
    raise ValueError(f"law must be one of {LAWS}, got {law!r}")


def law_moments(law: str, k: int = 3) -> dict[str, float]:
    """Exact mean, variance and fourth moment of one entry of ``law``."""
    m4 = {"gaussian": 3.0, "rademacher": 1.0, "bag": 3.0 - 2.0 / k}[law]
    return {"mean": 0.0, "var": 1.0, "m4": m4}


def near_square(numel: int) -> tuple[int, int]:
    """``(a, b)`` with ``a b = numel`` and ``a <= b`` as close as possible (a the largest divisor
    of ``numel`` not above ``sqrt(numel)``): the isotropy-enhanced shape."""
    a = int(math.isqrt(numel))
    while numel % a:
        a -= 1
    return a, numel // a


def factor_shape(shape, p: Perturbation) -> tuple[int, int]:
    """The matrix shape the low-rank factorization works in."""
    m, n = shape
    return near_square(m * n) if p.isotropic else (m, n)


def sample_direction(shape, p: Perturbation, generator: torch.Generator, device=None,
                     dtype=torch.float32) -> torch.Tensor:
    """One perturbation ``Z`` of ``shape`` with ``E[vec Z vec Z^T] = I``.

    Low rank: ``Z = U V^T / sqrt(r)`` in the (possibly reshaped) factor shape, then reshaped
    back (row-major both ways, so the reshape is a fixed permutation-free relabelling).
    """
    shape = tuple(shape)
    if p.rank is None or len(shape) != 2:
        return sample_law(p.law, shape, generator, device, p.bag_k, dtype)
    m, n = factor_shape(shape, p)
    r = min(p.rank, m, n)
    UV = sample_law(p.law, (m + n, r), generator, device, p.bag_k, dtype)   # one draw: U; V
    U, V = UV[:m], UV[m:]
    return (U @ V.T / math.sqrt(r)).reshape(shape)


def sample_batch(n: int, shape, p: Perturbation, generator: torch.Generator) -> torch.Tensor:
    """``n`` independent draws of :func:`sample_direction` at once, (n, *shape): the same law and
    structure, vectorized for the estimator-quality analysis (the step itself draws one)."""
    shape = tuple(shape)
    dev = generator.device
    if p.rank is None or len(shape) != 2:
        return sample_law(p.law, (n, *shape), generator, dev, p.bag_k)
    m, k = factor_shape(shape, p)
    r = min(p.rank, m, k)
    UV = sample_law(p.law, (n, m + k, r), generator, dev, p.bag_k)
    U, V = UV[:, :m], UV[:, m:]
    return (U @ V.transpose(1, 2) / math.sqrt(r)).reshape(n, *shape)


def directions(params: list[torch.Tensor], p: Perturbation, seed: int):
    """Yield ``Z`` for each tensor of ``params`` in order, regenerated from ``seed`` alone
    (MeZO's seed trick: the same seed gives bit-identical directions, nothing is stored)."""
    dev = params[0].device
    g = torch.Generator(device=dev).manual_seed(int(seed))
    for t in params:
        yield sample_direction(t.shape, p, g, dev, t.dtype)


def perturb_(params: list[torch.Tensor], p: Perturbation, seed: int, alpha: float) -> None:
    """In place ``theta <- theta + alpha Z(seed)``, one layer's ``Z`` alive at a time."""
    with torch.no_grad():
        for t, z in zip(params, directions(params, p, seed)):
            t.add_(z, alpha=alpha)


# -- the zeroth-order step --------------------------------------------------------------------

def two_point(loss_fn, params, p: Perturbation, seed: int, eps: float):
    """MeZO's probe: ``+eps Z``, ``L+``; ``-2 eps Z``, ``L-``; ``+eps Z`` (restored).

    Returns ``(g, L+, L-)`` with ``g = (L+ - L-) / (2 eps)`` (eq. 1), all under ``no_grad``. The
    restore is exact up to float rounding of three in-place additions (not bit-identical).
    """
    with torch.no_grad():
        perturb_(params, p, seed, eps)
        lp = loss_fn()
        perturb_(params, p, seed, -2 * eps)
        lm = loss_fn()
        perturb_(params, p, seed, eps)
    assert lp.grad_fn is None and lm.grad_fn is None and not lp.requires_grad, \
        "a zeroth-order probe built an autograd graph"
    return float(lp - lm) / (2 * eps), float(lp), float(lm)


def zo_step(loss_fn, params, p: Perturbation, seed: int, eps: float, lr: float,
            clip: float | None = CLIP, min_scale: float | None = MIN_SCALE,
            weight_decay: float = 0.0) -> dict:
    """One ZO-SGD step (eq. 1): probe, then ``theta <- theta - lr (g Z + wd theta)`` with ``Z``
    regenerated from ``seed`` a fourth time. ``clip`` and ``min_scale`` are QZO's safeguards
    (use None for fp MeZO on all weights)."""
    g, lp, lm = two_point(loss_fn, params, p, seed, eps)
    g_used = max(-clip, min(clip, g)) if clip is not None else g
    with torch.no_grad():
        for t, z in zip(params, directions(params, p, seed)):
            if weight_decay:
                t.mul_(1 - lr * weight_decay)
            t.add_(z, alpha=-lr * g_used)
            if min_scale is not None:
                t.clamp_(min=min_scale)
    return {"g": g, "g_clipped": g_used, "loss": 0.5 * (lp + lm), "graph_built": False}


def zo_estimate(loss_fn, params, p: Perturbation, seed: int, eps: float) -> list[torch.Tensor]:
    """The gradient estimate ``g Z`` itself (for comparing with the true gradient)."""
    g, _, _ = two_point(loss_fn, params, p, seed, eps)
    return [g * z for z in directions(params, p, seed)]


# -- the quantized model ----------------------------------------------------------------------

def quantize(model: nn.Module, bits: int, group_size: int, layers: dict | None = None):
    """A copy of ``model`` whose block linears are RTN :class:`QuantLinear` (integer codes
    fixed, scales trainable); every other parameter is frozen. Returns ``(qmodel, scales)``
    with ``scales`` the name -> scale ``nn.Parameter`` dict, in a fixed order."""
    q = copy.deepcopy(model)
    names = list((layers or block_linears(model)).keys())
    mods = dict(q.named_modules())
    for name in names:
        parent, attr = name.rsplit(".", 1)
        setattr(mods[parent], attr, QuantLinear.from_linear(mods[name], bits, group_size))
    for prm in q.parameters():
        prm.requires_grad_(False)
    scales = {n: m.scale for n, m in q.named_modules() if isinstance(m, QuantLinear)}
    for s in scales.values():
        s.requires_grad_(True)
    return q, scales


def codes_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every integer code buffer (to check they never move)."""
    return {n: m.codes.clone() for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def flat(ts) -> torch.Tensor:
    """A list of tensors as one flat float64 vector (estimates and gradients compared whole)."""
    return torch.cat([t.reshape(-1).double() for t in ts])

