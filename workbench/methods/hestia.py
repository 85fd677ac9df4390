"""Hestia: operator-faithful differentiable QAT for ternary LLMs (paper 10, ``docs/papers/10-hestia.md``).

Quantization-aware training (QAT) of ternary weights. Every quantized tensor keeps a latent
full-precision weight ``W``; its forward value lives on the BitNet b1.58 codebook after absmean
normalization,

    gamma = mean |W|,   x = W / gamma,   codebook C = {-1, 0, 1}                        (1)

- **STE baseline** (BitNet b1.58): forward ``gamma * clamp(round(x), -1, 1)`` (the hard quantizer
  ``Q(W)``), backward the identity. Small updates of ``W`` that do not cross a rounding boundary
  (``|x| = 1/2``) leave the forward pass unchanged: the *dead zone*.
- **Hestia**: relax the quantizer itself, not its gradient. Each weight's forward value is the
  Softmax expectation over the same codebook at temperature ``T``,

      p_c(x) = softmax_c(-(x - c)^2 / T),   Q_T(W) = gamma * sum_c c p_c(x)              (2)

  whose gradient is the true derivative of what the forward computed (forward and backward are
  consistent), and ``Q_T -> Q`` as ``T -> 0`` (each weight's softmax tends to the one-hot of its
  nearest codeword). The schedule anneals ``T`` to 0, so the trained network *is* the hard
  ternary network used at inference: no inference-time overhead.
- **Hessian-aware schedules**: an offline Hutch++ estimate (Meyer, Musco, Musco & Woodruff 2021)
  of a Hessian trace ``chi_i = tr(H_i)`` (computed once on the full-precision model, before QAT)
  gives a sensitivity, and each tensor's temperature is scaled by it (:func:`temperature_scales`).
  Which tensors share one trace is the ``granularity`` (:func:`trace_groups`). Every path of the
  public code computes one trace *per tensor*: ``QuantConfig`` and ``configs/*.yaml`` set
  ``calibration_granularity: "tensor"``, and its ``"layer"`` mode keys groups by a counter that
  advances at every linear, so each of its groups is one tensor too. ``"tensor"`` is our default;
  ``"block"`` (one trace per transformer block, the first linear's, shared) is kept as an option.
- **Temperature schedule** (``decay_style``, :class:`Schedule`): ``"cosine"`` (the public default
  and every shipped config) applies the Hessian scale during the constant-temperature phase only
  (the first 20 % of training); the anneal then restarts from the unscaled start temperature.
  ``"hessian"`` (the public code's other style) keeps the scale throughout the anneal.

Conventions follow the public code (hestia2026/Hestia, ``src/hestia/thermo_quantizer.py``,
``thermo_scheduler.py``, ``hessian/calibrator.py``): per-tensor absmean scale that stays in the
autograd graph of the soft path, softmax over ``-(x - c)^2 / T``, a *compress* phase in which the
weight is interpolated from full precision to ``Q_T`` (``pressure`` 0 -> 1), then a cosine anneal of
``T`` to 0, and temperature scales ``exp(-alpha * sigmoid(kappa * z_i))`` from the z-score ``z_i``
of ``log chi_i``. Deliberate differences: our schedule reaches ``T = 0`` exactly at the last
training step (the public cosine stops one step short), so training ends on hard weights; the
calibration loss is the mean over one batch of blocks instead of the sum of ``num_batches``
per-batch Hessian-vector products divided by their number (the same Hessian when the batches are
equal parts of it). The optimizer differs too (:class:`QATConfig`).

Only the linear layers inside the transformer blocks (attention q/k/v/o and MLP gate/up/down) are
ternary; token embeddings, the (tied) LM head and the RMSNorm gains stay in full precision, as is
usual for BitNet-style models.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from scipy import integrate, optimize

from ..diagnostics import hutchinson_trace, hutchpp
from ..quant import absmean_ternary, block_linears
from ..quant import ternary_ste as ste_ternary   # STE baseline: forward Q(W), identity grad

__all__ = ["CODEBOOK", "MODES", "DECAY_STYLES", "absmean_scale", "hard_ternary", "ternary_state",
           "ste_ternary", "soft_ternary", "soft_ternary_reference", "soft_ternary_closed_form",
           "optimal_init_temp", "Schedule", "temperature_scales", "GRANULARITIES",
           "trace_groups", "hessian_traces",
           "TernaryLinear", "ternarize", "ternary_layers", "mode_as", "FlipCounter", "relaxed_gap",
           "directional_check", "QATConfig", "set_schedule", "qat"]

CODEBOOK = (-1.0, 0.0, 1.0)
MODES = ("fp", "ste", "hestia", "hard")
GRANULARITIES = ("tensor", "layer", "block", "component")
DECAY_STYLES = ("cosine", "hessian")


# -- quantizers --------------------------------------------------------------------------------

def absmean_scale(w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``gamma = max(mean|W|, eps)`` (eq. 1), kept in the graph (the soft path differentiates it)."""
    return w.abs().mean().clamp(min=eps)


def hard_ternary(w: torch.Tensor) -> torch.Tensor:
    """The inference quantizer ``Q(W) = gamma * clamp(round(W / gamma), -1, 1)`` (BitNet b1.58)."""
    q, gamma = absmean_ternary(w.detach())
    return q * gamma


def ternary_state(w: torch.Tensor) -> torch.Tensor:
    """The discrete state ``clamp(round(W / gamma), -1, 1)`` of a latent weight, as int8."""
    q, _ = absmean_ternary(w.detach())
    return q.to(torch.int8)


class _Expectation(torch.autograd.Function):
    """``E_T(x) = sum_c c p_c(x)`` for C = {-1, 0, 1}, elementwise, with its exact derivative.

    With ``a, b = (+-2x - 1) / T`` (the logits of +-1 relative to 0's) the softmax of eq. (2) is
    ``p_{+-1} = e^{a|b} / (1 + e^a + e^b)``, so ``E = p_1 - p_{-1}``; the derivative of a softmax
    expectation is a variance, ``dE/dx = Cov_p(c, dl_c/dx) = (2/T) Var_p(c) = (2/T)(p_1 + p_{-1}
    - E^2)``. One fused elementwise pass instead of a softmax over a trailing dimension of 3
    (several times faster on a CPU); :func:`soft_ternary_reference` is the literal formula.
    """

    @staticmethod
    def forward(ctx, x, temp):
        x2 = x * (2 / temp)
        m = (x2.abs() - 1 / temp).clamp_(min=0)           # the largest logit (for stability)
        ea = (x2 - 1 / temp).sub_(m).exp_()                # e^(a - m)
        eb = x2.neg_().sub_(1 / temp).sub_(m).exp_()       # e^(b - m)
        z = m.neg_().exp_().add_(ea).add_(eb)              # e^(-m) + e^(a-m) + e^(b-m)
        p_pm = (ea + eb).div_(z)                           # p_1 + p_-1 = E_p[c^2]
        e = ea.sub_(eb).div_(z)                            # p_1 - p_-1 = E_p[c]
        ctx.save_for_backward(p_pm.sub_(e * e).mul_(2 / temp))   # (2/T) Var_p(c)
        return e

    @staticmethod
    def backward(ctx, grad):
        (de,) = ctx.saved_tensors
        return grad * de, None


def soft_ternary(w: torch.Tensor, temp: float, eps: float = 1e-5) -> torch.Tensor:
    """Hestia's relaxed quantizer ``Q_T(W) = gamma * sum_c c softmax_c(-(x - c)^2 / T)`` (eq. 2).

    ``temp <= 0`` is the limit ``T -> 0``: the hard quantizer ``gamma * q`` with the public
    ``ThermoQuantizer``'s training gradient there, ``W + gamma q - W.detach()``: the identity plus
    the derivative of the live scale ``gamma`` times the (constant) levels ``q``. The STE baseline
    (:func:`ste_ternary`) detaches ``gamma``. ``gamma`` stays in the graph: for ``T > 0`` the
    gradient is the exact derivative of the forward value (the expectation's own derivative is in
    :class:`_Expectation`).
    """
    gamma = absmean_scale(w, eps)
    if temp <= 0:
        q = torch.clamp(torch.round(w.detach() / gamma.detach()), -1, 1)
        return q * gamma + (w - w.detach())
    return gamma * _Expectation.apply(w / gamma, float(temp))


def soft_ternary_reference(w: torch.Tensor, temp: float, eps: float = 1e-5) -> torch.Tensor:
    """Eq. (2) written literally (softmax over the codebook axis, autograd for the gradient), as
    the public ``ThermoQuantizer`` does; the reference for tests of :func:`soft_ternary`."""
    gamma = absmean_scale(w, eps)
    x = w / gamma
    c = torch.tensor(CODEBOOK, dtype=w.dtype, device=w.device)
    logits = -(x.unsqueeze(-1) - c) ** 2 / temp          # (..., 3): distance to each codeword
    p = torch.softmax(logits, dim=-1)                      # Gibbs distribution over the codebook
    return gamma * (p @ c)                                 # expectation, back in weight units


def soft_ternary_closed_form(x: torch.Tensor, temp: float) -> torch.Tensor:
    """``sum_c c p_c(x)`` in the public code's closed form ``sinh(2x/T) / (cosh(2x/T) +
    e^(1/T) / 2)`` (``opt_temp_initializer.py``, ``_soft_quant_func``); overflows for small T,
    fine for tests (float64, T >= 0.1)."""
    v = 2 * x / temp
    return torch.sinh(v) / (torch.cosh(v) + 0.5 * math.exp(1 / temp))


def optimal_init_temp(lo: float = 0.1, hi: float = 2.0) -> float:
    """The initial temperature of the public code (``opt_temp_initializer.py``,
    ``OptimalTempInitializer.calculate``): the ``T`` in ``[lo, hi]`` minimising
    ``E[(Q_T(z) - z)^2]`` for ``z ~ N(0, pi/2)`` (a Gaussian weight divided by its absmean has
    variance pi/2), the expectation by adaptive quadrature over ``[-10, 10]`` and the minimum by
    bounded Brent search, as there (``quad``, ``minimize_scalar(method="bounded")``): 0.3509."""
    sd = math.sqrt(math.pi / 2)

    def mse(temp: float) -> float:
        def err2(z):                                       # squared error times the density
            q = math.sinh(2 * z / temp) / (math.cosh(2 * z / temp) + 0.5 * math.exp(1 / temp))
            return (q - z) ** 2 * math.exp(-0.5 * (z / sd) ** 2) / (sd * math.sqrt(2 * math.pi))
        return integrate.quad(err2, -10, 10)[0]

    res = optimize.minimize_scalar(mse, bounds=(lo, hi), method="bounded")
    if not res.success:
        raise RuntimeError(f"the initial temperature search failed: {res.message}")
    return float(res.x)


# -- schedules ---------------------------------------------------------------------------------

@dataclass
class Schedule:
    """Pressure and temperature over ``steps`` QAT steps (``thermo_scheduler.py``).

    compress phase (the first ``compress_ratio`` of the steps): pressure rises linearly from 0 to
    1 (the weight is ``lerp(W, Q_T(W), pressure)``) at the constant temperature ``t0 * scale``;
    anneal phase (the rest): pressure 1 and ``T = t0 * s * (1 + cos(pi u)) / 2``, ``u`` going from
    0 to 1, so the last step has ``T = 0`` exactly (hard weights). ``scale`` is the tensor's
    temperature scale (1 for the global schedule); ``s`` depends on ``decay_style``:
    ``"cosine"`` (the public default) ``s = 1``, so the scale acts in the compress phase only and
    the anneal restarts from ``t0``; ``"hessian"`` ``s = scale``, the scale throughout.
    """
    steps: int
    t0: float
    compress_ratio: float = 0.2
    scale: float = 1.0
    decay_style: str = "cosine"

    def __post_init__(self):
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"decay_style must be one of {DECAY_STYLES}, got {self.decay_style!r}")

    def progress(self, step: int) -> float:
        return (step + 1) / self.steps                     # the last step has progress 1

    def pressure(self, step: int) -> float:
        r = self.progress(step)
        return 1.0 if self.compress_ratio <= 0 or r >= self.compress_ratio else \
            r / self.compress_ratio

    def temperature(self, step: int) -> float:
        r = self.progress(step)
        if r <= self.compress_ratio:
            return self.t0 * self.scale
        u = (r - self.compress_ratio) / (1 - self.compress_ratio)
        s = self.scale if self.decay_style == "hessian" else 1.0
        return max(0.0, self.t0 * s * 0.5 * (1 + math.cos(math.pi * min(u, 1.0))))


def temperature_scales(traces: dict[str, float], kappa: float = 1.0, alpha: float = 0.5,
                       eps: float = 1e-3) -> tuple[dict[str, float], dict[str, float]]:
    """Per-tensor temperature scales from Hessian traces (``hessian/calibrator.py``).

        z_i = (log chi_i - mean_j log chi_j) / std_j log chi_j
        s_i = sigmoid(kappa z_i)          (sensitivity in (0, 1))
        scale_i = exp(-alpha s_i)         (in (e^-alpha, 1))

    A *more* sensitive tensor (larger trace) gets a *smaller* scale, i.e. a cooler temperature
    throughout: its relaxed weights stay closer to the hard quantizer, so the soft-to-hard
    transition perturbs the loss less where the loss is most curved; insensitive tensors stay
    hotter and explore longer. A trace estimate below ``eps`` times the largest one (Hutchinson
    can return a negative number for a nearly flat tensor) is floored there before the log (the
    public code floors at an absolute 1e-8, which turns such an estimate into an extreme z).
    Returns ``(scales, sensitivities)``.
    """
    floor = eps * max(abs(v) for v in traces.values())   # a noisy estimate can come out <= 0
    logs = {k: math.log(max(v, floor)) for k, v in traces.items()}
    mu = sum(logs.values()) / len(logs)
    sd = math.sqrt(sum((v - mu) ** 2 for v in logs.values()) / len(logs))
    sens = {k: 1 / (1 + math.exp(-kappa * (v - mu) / (sd + eps))) for k, v in logs.items()}
    return {k: math.exp(-alpha * s) for k, s in sens.items()}, sens


# -- trace groups (the estimators, Hutch++ and Hutchinson, are in workbench.diagnostics) -------------------------------------------------------------------------

def trace_groups(names: list[str], granularity: str = "tensor") -> dict[str, list[str]]:
    """Which tensors share one trace, as the public ``HessianTraceCalibrator.calibrate`` groups
    them: ``"tensor"`` one group per tensor (``QuantConfig``'s and the shipped configs' setting);
    ``"layer"`` as the public code keys it, ``layer_{counter}`` with a counter that
    ``_convert_model_recursively`` advances at every Linear, so each group is one tensor (the same
    groups as ``"tensor"``); ``"block"`` one per transformer block (the ``layers.<i>`` in the
    name; what ``QuantConfig``'s comment says "layer" means, not what its code does);
    ``"component"`` one per kind of linear (``q_proj`` of every block together). Groups keep the
    order of ``names``; the *first* tensor of a group is the one whose Hessian block is estimated,
    and its trace is given to every tensor of the group (the public code calibrates
    ``modules[0]`` and copies ``final_trace`` to ``_group_modules``).
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    groups: dict[str, list[str]] = {}
    for n in names:
        parts = n.split(".")
        if granularity == "tensor":
            key = n
        elif granularity == "layer":
            key = f"layer_{len(groups)}"                   # the public per-Linear counter
        elif granularity == "block":
            idx = [i for i, p in enumerate(parts[:-1]) if p.isdigit()]
            key = "block " + (".".join(parts[:idx[0] + 1]) if idx else n)
        else:
            mod = parts[:-1] if parts[-1] in ("weight", "bias") else parts
            key = mod[-1]
        groups.setdefault(key, []).append(n)
    return groups


def _block_hvp(grad: torch.Tensor, param: torch.Tensor):
    """``X -> H_ii X`` for one tensor's Hessian block, column by column (one double backprop per
    column, as the public ``_compute_hvp_single_vector``), on float64 ``(numel, k)`` blocks."""
    def matvec(X: torch.Tensor) -> torch.Tensor:
        cols = [torch.autograd.grad(grad, param, x.to(param).view_as(param),
                                    retain_graph=True)[0].reshape(-1).double()
                for x in X.to(param.device).T]
        return torch.stack(cols, 1).cpu()
    return matvec


def hessian_traces(model, names: list[str], batches: torch.Tensor, estimator: str = "hutchpp",
                   granularity: str = "tensor", num_sketch: int = 10, num_query: int = 20,
                   n_samples: int = 16, seed: int = 0) -> dict[str, float]:
    """Offline sensitivities: the trace of the LM loss's Hessian block on ``batches`` per group of
    :func:`trace_groups`, given to every tensor of ``names`` in the group, on the full-precision
    model, once before QAT (``HessianTraceCalibrator.calibrate``).

    ``estimator="hutchpp"`` (the public code's): :func:`hutchpp` of the first tensor's own block
    ``H_ii``, ``2 num_sketch + num_query`` double backprops per group (its defaults 10 and 20).
    ``estimator="hutchinson"`` (ours before, PyHessian's estimator): ``n_samples`` joint
    Rademacher probes serve every tensor at once (``diagnostics.hutchinson_trace(per_tensor=True)``);
    a group then takes its first tensor's estimate.
    """
    if estimator not in ("hutchpp", "hutchinson"):
        raise ValueError(f"estimator must be 'hutchpp' or 'hutchinson', got {estimator!r}")
    groups = trace_groups(names, granularity)
    firsts = [g[0] for g in groups.values()]
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(seed)
    was_training, attn = model.training, model.config._attn_implementation
    model.config._attn_implementation = "eager"   # SDPA kernels have no double backward
    model.eval()
    try:
        loss = model(input_ids=batches, labels=batches).loss
        if estimator == "hutchinson":
            gen_dev = torch.Generator(device=batches.device).manual_seed(seed)
            est = hutchinson_trace(loss, [params[n] for n in names], n_samples, gen_dev,
                                   per_tensor=True)
            value = dict(zip(names, est))
        else:
            grads = torch.autograd.grad(loss, [params[n] for n in firsts], create_graph=True)
            value = {n: hutchpp(_block_hvp(g, params[n]), params[n].numel(), num_sketch,
                                num_query, gen) for n, g in zip(firsts, grads)}
    finally:
        model.train(was_training)
        model.config._attn_implementation = attn
    return {n: value[g[0]] for g in groups.values() for n in g}


# -- the quantized network ---------------------------------------------------------------------

class TernaryLinear(nn.Module):
    """A linear layer with a latent fp weight and a fake-quantized ternary forward.

    ``mode``: ``fp`` (no quantization), ``ste`` (hard forward, identity backward), ``hestia``
    (``lerp(W, Q_T(W), pressure)`` at this layer's ``temp``) or ``hard`` (the inference quantizer,
    used for evaluation).
    """

    def __init__(self, linear: nn.Linear, mode: str = "ste"):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.mode, self.temp, self.pressure = mode, 1.0, 1.0

    def quantized_weight(self) -> torch.Tensor:
        w = self.weight
        if self.mode == "fp":
            return w
        if self.mode == "ste":
            return ste_ternary(w)
        if self.mode == "hard":
            return hard_ternary(w)
        if self.mode == "hestia":
            q = soft_ternary(w, self.temp)
            return q if self.pressure >= 1 else torch.lerp(w, q, self.pressure)
        raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    def forward(self, x):
        return nn.functional.linear(x, self.quantized_weight(), self.bias)

    def extra_repr(self):
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, mode={self.mode}"


def ternarize(model: nn.Module, mode: str = "ste") -> dict[str, TernaryLinear]:
    """Swap every block linear of ``model`` (in place) for a :class:`TernaryLinear`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    out = {}
    for name, lin in block_linears(model).items():
        parent, attr = name.rsplit(".", 1)
        tl = TernaryLinear(lin, mode)
        setattr(model.get_submodule(parent), attr, tl)
        out[name] = tl
    return out


def ternary_layers(model: nn.Module) -> dict[str, TernaryLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, TernaryLinear)}


class mode_as:
    """Context manager: evaluate every :class:`TernaryLinear` of a model in another ``mode``."""

    def __init__(self, model, mode: str):
        self.layers, self.mode, self.saved = ternary_layers(model), mode, {}

    def __enter__(self):
        for n, m in self.layers.items():
            self.saved[n], m.mode = m.mode, self.mode
        return self

    def __exit__(self, *exc):
        for n, m in self.layers.items():
            m.mode = self.saved[n]
        return False


# -- diagnostics -------------------------------------------------------------------------------

class FlipCounter:
    """Counts, per latent weight, changes of its discrete state ``clamp(round(W/gamma), -1, 1)``
    between successive calls of :meth:`update` (dead-zone stagnation, claim C1)."""

    def __init__(self, layers: dict[str, nn.Module]):
        self.layers = layers
        self.state = {n: ternary_state(m.weight) for n, m in layers.items()}
        self.initial = {n: s.clone() for n, s in self.state.items()}
        self.counts = {n: torch.zeros(s.shape, dtype=torch.int32, device=s.device)
                       for n, s in self.state.items()}

    def update(self) -> int:
        """Record the current states; return how many weights flipped since the last call."""
        total = 0
        for n, m in self.layers.items():
            s = ternary_state(m.weight)
            changed = s != self.state[n]
            self.counts[n] += changed.to(torch.int32)
            total += int(changed.sum())
            self.state[n] = s
        return total

    def all_counts(self) -> torch.Tensor:
        return torch.cat([c.flatten() for c in self.counts.values()]).cpu()

    def never_flipped(self) -> float:
        """Fraction of weights whose discrete state never changed at any update."""
        return float((self.all_counts() == 0).float().mean())

    def changed_overall(self) -> float:
        """Fraction of weights whose final state differs from the initial one."""
        n = sum(s.numel() for s in self.state.values())
        return sum(int((self.state[k] != self.initial[k]).sum()) for k in self.state) / n


@torch.no_grad()
def relaxed_gap(layers: dict[str, TernaryLinear]) -> dict[str, float]:
    """How far the relaxed forward weights are from the hard quantizer, over all weights.

    ``max_abs``: max |W_relaxed - Q(W)| in weight units; ``max_rel``: the same divided by each
    tensor's ``gamma`` (codebook units); ``mean_rel``: the mean over weights of the latter.
    """
    mx, mr, tot, n = 0.0, 0.0, 0.0, 0
    for m in layers.values():
        d = (m.quantized_weight() - hard_ternary(m.weight)).abs()
        g = float(absmean_scale(m.weight))
        mx, mr = max(mx, float(d.max())), max(mr, float(d.max()) / g)
        tot += float(d.sum()) / g
        n += d.numel()
    return {"max_abs": mx, "max_rel": mr, "mean_rel": tot / n}


def directional_check(w: torch.Tensor, mode: str, temp: float, eps: float = 1e-6,
                      seed: int = 0) -> dict[str, float]:
    """Is the quantizer's backward the derivative of its forward? (forward-backward consistency)

    In float64, for ``f(W) = <G, quantizer(W)>`` with a random upstream gradient ``G`` and a random
    unit direction ``D``: the autograd directional derivative ``<grad f, D>`` against the central
    finite difference ``(f(W + eps D) - f(W - eps D)) / (2 eps)``. For Hestia they agree; for the
    STE they do not: its forward ``gamma(W) q(W)`` moves only through the scale ``gamma`` (and
    when a weight crosses a boundary), while its backward is the identity.
    """
    g = torch.Generator().manual_seed(seed)
    w64 = w.detach().double().cpu().requires_grad_()
    up = torch.randn(w64.shape, generator=g, dtype=torch.float64)
    d = torch.randn(w64.shape, generator=g, dtype=torch.float64)
    d /= d.norm()
    quant = {"ste": ste_ternary, "hestia": lambda v: soft_ternary(v, temp)}[mode]
    grad, = torch.autograd.grad((up * quant(w64)).sum(), w64)
    analytic = float((grad * d).sum())
    with torch.no_grad():
        fd = float((up * (quant(w64 + eps * d) - quant(w64 - eps * d))).sum()) / (2 * eps)
    return {"autograd": analytic, "finite_difference": fd,
            "rel_error": abs(analytic - fd) / max(abs(analytic), abs(fd), 1e-300)}


# -- training ----------------------------------------------------------------------------------

@dataclass
class QATConfig:
    """Settings shared by every QAT run of a comparison (equal steps, data and optimizer).

    The optimizer is AdamW with betas (0.9, 0.95) as the public example
    (``examples/train_example.sh``), but with no weight decay (there 0.01), no gradient clipping
    (there 1.0) and a cosine decay to 10 % from the first step (there a 5 % warm-up, then constant,
    then a cosine decay to 10 % over the last 10 %, its ``wsd`` style); its rate 5e-5 is for 1B
    models, ours is the scale's.
    """
    steps: int = 150           # optimizer steps
    batch: int = 8             # sequences per step
    lr: float = 5e-4           # AdamW learning rate (cosine decay to 10 %), no weight decay
    log_every: int = 25        # evaluate the hard model every this many steps
    gap_every: int = 5         # Hestia: measure the relaxed-vs-hard gap every this many steps
    t0: float = 0.3509         # Hestia's initial temperature (optimal_init_temp() gives 0.3509)
    compress_ratio: float = 0.2  # Hestia's share of steps with rising pressure
    decay_style: str = "cosine"  # "cosine" (public default) or "hessian": see Schedule


def set_schedule(layers: dict[str, TernaryLinear], schedules: dict[str, Schedule], step: int):
    """Put each layer's pressure and temperature for ``step``."""
    for n, m in layers.items():
        m.pressure = schedules[n].pressure(step)
        m.temp = schedules[n].temperature(step)


def qat(model, data: torch.Tensor, cfg: QATConfig, mode: str, scales: dict | None = None,
        evaluate=None, progress=lambda it, **kw: it) -> dict:
    """Fine-tune ``model`` (already :func:`ternarize`-d) into ternary weights.

    ``mode`` is ``ste`` or ``hestia``; ``scales`` the per-tensor temperature scales (None: one
    global schedule). The batch of step ``t`` is ``data[t * batch : (t + 1) * batch]`` (wrapping),
    the same for every method. Every ``log_every`` steps and at the end, ``evaluate(model)`` scores
    the *hard* ternary model; Hestia runs also log the relaxed-vs-hard gap and the relaxed model's
    score at the current temperature; every ``gap_every`` steps they log the gap alone (weights
    only, no forward pass). Flips are counted at every step. Returns a history dict.
    """
    layers = ternary_layers(model)
    for m in layers.values():
        m.mode = mode
    scheds = {n: Schedule(cfg.steps, cfg.t0, cfg.compress_ratio,
                          (scales or {}).get(n, 1.0), cfg.decay_style) for n in layers}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    lr_at = lambda t: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t / cfg.steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    flips = FlipCounter(layers)
    dev = next(model.parameters()).device
    hist = {"step": [], "hard": [], "relaxed": [], "gap_max_rel": [], "gap_mean_rel": [],
            "temp_mean": [], "flips_per_step": [], "loss": [], "step_s": [],
            "gap_step": [], "gap_max": [], "gap_mean": [], "gap_temp_mean": []}

    def log(step):
        model.eval()
        hist["step"].append(step)
        with mode_as(model, "hard"):
            hist["hard"].append(evaluate(model) if evaluate else float("nan"))
        if mode == "hestia":                   # the relaxed model at its current temperature
            g = relaxed_gap(layers)
            hist["relaxed"].append(evaluate(model) if evaluate else float("nan"))
            hist["gap_max_rel"].append(g["max_rel"])
            hist["gap_mean_rel"].append(g["mean_rel"])
            hist["temp_mean"].append(float(np.mean([m.temp for m in layers.values()])))
        model.train()

    if mode == "hestia":
        set_schedule(layers, scheds, 0)
    log(0)
    n = len(data)
    for t in progress(range(cfg.steps), desc=f"QAT {mode}"):
        if mode == "hestia":
            set_schedule(layers, scheds, t)
        idx = torch.arange(t * cfg.batch, (t + 1) * cfg.batch) % n
        x = data[idx].to(dev)
        t1 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        hist["step_s"].append(time.perf_counter() - t1)
        hist["loss"].append(float(loss.detach()))
        hist["flips_per_step"].append(flips.update())
        if mode == "hestia" and ((t + 1) % cfg.gap_every == 0 or t + 1 == cfg.steps):
            g = relaxed_gap(layers)            # cheap: no forward pass, weights only
            hist["gap_step"].append(t + 1)
            hist["gap_max"].append(g["max_rel"])
            hist["gap_mean"].append(g["mean_rel"])
            hist["gap_temp_mean"].append(float(np.mean([m.temp for m in layers.values()])))
        if (t + 1) % cfg.log_every == 0 or t + 1 == cfg.steps:
            log(t + 1)
    model.eval()
    hist["flips"] = flips
    hist["schedules"] = scheds
    return hist
