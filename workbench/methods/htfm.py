"""Heavy-Tailed Flow Matching via Random Clocks (HTFM).

Paper 08 (NeurIPS 2026; spec in ``docs/papers/08-htfm.md``). The source of a flow is a Gaussian run on
a random clock: a nondecreasing path tau(s), s in [0, 1], tau(0) = 0, and

    x0 | tau ~ N(0, tau(1) I)                                   (clock-conditioned source)
    x0 = sqrt(tau(1)) z,  z ~ N(0, I)                           (Gaussian scale mixture)

so marginalizing the clock gives a Gaussian scale mixture:

- constant clock tau(s) = c s: x0 ~ N(0, c I)                                 (Gaussian)
- inverse-gamma clock, tau(1) ~ InvGamma(nu / 2, scale nu / 2): x0_j ~ t_nu    (Student-t)
- positive (alpha / 2)-stable subordinator, E exp(-lam tau(1)) = exp(-lam^(alpha/2)):
  x0_j ~ symmetric alpha-stable with scale 2^(-1/2)                         (sub-Gaussian stable)

Flow matching then runs on the standard conditional path (docs/papers/08-htfm.md;
torchcfm's ``ConditionalFlowMatcher``):

    x_t = (1 - t) x0 + t x1,   u_t = x1 - x0                    (conditional path and target)
    min E || v(x_t, t, phi(tau)) - u_t ||^2                     (FM loss, clock-conditioned)

The velocity field sees the clock through phi, the truncated log-signature (levels 1 and 2) of the
time-augmented clock path s -> (s, tau(s)): level 1 is the increment (1, tau(1)), level 2 the Levy
area 1/2 int (s dtau - tau ds), which says *when* the clock ran fast. In this construction the
source depends on the path only through tau(1); the area is the paper's extra path feature, kept so
that its correctness and cost (C2) are tested on the object the paper uses.

This is the abstract's construction as stated: conditionally on the clock (and a data point x1)
the probability path x_t ~ N(t x1, (1 - t)^2 tau(1) I) is Gaussian, marginally the source is a
Gaussian scale mixture, and the vector field v(x, t, phi(tau)) is clock-conditioned through the
depth-2 log-signature of the clock path (phi drops the constant time increment 1 and applies
asinh coordinate-wise: both invertible, no information lost; ``tests/test_htfm.py`` checks phi
against a hand computation). What the abstract leaves open, and we do not build, is a flow whose
*schedule* follows the clock path (then the path's shape, not only tau(1), would enter the
conditional flow).

Baselines: Gaussian flow matching (constant clock, no features) and a fixed Student-t source
(inverse-gamma clock, no features): same network body, same steps, same Euler NFE grid.

The metrics (sliced Wasserstein, rare-mode coverage, high quantiles, the Hill estimator) and the
experiments of the notebook live in :mod:`workbench.experiments.htfm`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats
from torch import nn

try:                        # esig: the reference log-signature (optional, the test extra)
    import esig
except ImportError:
    esig = None

__all__ = ["CLOCKS", "positive_stable", "Clock", "time_augmented", "sample_source", "logsig_keys",
           "log_signature", "clock_features", "VelocityMLP", "fm_pair", "Method", "methods_for",
           "train_fm", "integrate", "sample"]

CLOCKS = ("constant", "inverse_gamma", "stable")


# -- clock laws -----------------------------------------------------------------------------------
def positive_stable(beta: float, size, generator: torch.Generator | None = None,
                    dtype=torch.float64) -> torch.Tensor:
    """Positive beta-stable samples, 0 < beta <= 1, with Laplace transform exp(-lam^beta).

    Chambers-Mallows-Stuck (1976) for a totally skewed stable S(beta, 1, 1, 0) (Samorodnitsky-Taqqu
    parameterization, scipy's S1): with U ~ Uniform(-pi/2, pi/2), W ~ Exp(1),
    B = arctan(tan(pi beta / 2)) / beta = pi / 2 (for beta < 1), S = (1 + tan^2(pi beta / 2))^(1 / (2 beta)),
    X = S sin(beta (U + B)) / cos(U)^(1/beta) * (cos(U - beta (U + B)) / W)^((1 - beta) / beta).
    That X has Laplace transform exp(-lam^beta / cos(pi beta / 2)), so the result is
    X cos(pi beta / 2)^(1/beta). beta = 1 is the constant 1 (the Gaussian end of the family).
    """
    if not 0 < beta <= 1:
        raise ValueError(f"a positive stable law needs 0 < beta <= 1, got {beta}")
    if beta == 1:
        return torch.ones(size, dtype=dtype)
    u = (torch.rand(size, generator=generator, dtype=dtype) - 0.5) * math.pi
    w = -torch.log1p(-torch.rand(size, generator=generator, dtype=dtype))   # Exp(1), never 0
    b = beta * math.pi / 2                                         # beta B, B = arctan(tan(pi beta/2)) / beta
    s = (1 + math.tan(math.pi * beta / 2) ** 2) ** (1 / (2 * beta))
    x = (s * torch.sin(beta * u + b) / torch.cos(u) ** (1 / beta)
         * (torch.cos(u - beta * u - b) / w) ** ((1 - beta) / beta))
    return x * math.cos(math.pi * beta / 2) ** (1 / beta)


@dataclass(frozen=True)
class Clock:
    """A clock law: ``kind`` in CLOCKS and its tail parameter.

    ``param`` is the marginal tail index: ignored for "constant" (the scale is ``scale``), nu for
    "inverse_gamma" (Student-t with nu degrees of freedom), alpha in (0, 2] for "stable"
    (alpha = 2 is the Gaussian end). ``scale`` multiplies the whole clock.
    """
    kind: str = "constant"
    param: float = 2.0
    scale: float = 1.0

    def __post_init__(self):
        if self.kind not in CLOCKS:
            raise ValueError(f"clock kind must be one of {CLOCKS}, got {self.kind!r}")
        if self.kind == "stable" and not 0 < self.param <= 2:
            raise ValueError(f"a stable clock needs 0 < alpha <= 2, got {self.param}")
        if self.kind == "inverse_gamma" and self.param <= 0:
            raise ValueError(f"an inverse-gamma clock needs nu > 0, got {self.param}")

    @property
    def tail_index(self) -> float:
        """The tail index of the marginal source: P(|x0_j| > r) ~ r^(-index)."""
        return {"constant": math.inf, "inverse_gamma": self.param,
                "stable": self.param if self.param < 2 else math.inf}[self.kind]

    def sample_paths(self, n: int, steps: int = 16,
                     generator: torch.Generator | None = None) -> torch.Tensor:
        """(n, steps + 1) clock values tau(k / steps), tau(0) = 0, nondecreasing.

        stable: i.i.d. increments (1/steps)^(1/beta) S_k, beta = alpha / 2, a subordinator on the
        grid (self-similarity makes tau(1) exactly positive beta-stable). inverse_gamma: the
        terminal value V ~ InvGamma(nu/2, nu/2) spread over the grid by a gamma bridge
        (Dirichlet(1, ..., 1) proportions), so tau(1) = V exactly. constant: tau(s) = s.
        """
        if self.kind == "constant" or (self.kind == "stable" and self.param == 2):
            inc = torch.full((n, steps), 1.0 / steps, dtype=torch.float64)
        elif self.kind == "stable":
            beta = self.param / 2
            inc = positive_stable(beta, (n, steps), generator) * (1.0 / steps) ** (1 / beta)
        else:
            nu = self.param
            shape = torch.full((n,), nu / 2, dtype=torch.float64)
            g = torch._standard_gamma(shape, generator=generator)          # Gamma(nu/2, 1)
            v = (nu / 2) / g                                                # InvGamma(nu/2, nu/2)
            e = -torch.log1p(-torch.rand(n, steps, generator=generator, dtype=torch.float64))
            inc = v[:, None] * e / e.sum(1, keepdim=True)                   # gamma bridge
        tau = torch.cat([torch.zeros(n, 1, dtype=torch.float64), inc.cumsum(1)], 1)
        return self.scale * tau

    def terminal_law(self):
        """scipy's law of tau(1) (the KS reference); None for the constant clock."""
        if self.kind == "inverse_gamma":
            return stats.invgamma(self.param / 2, scale=self.scale * self.param / 2)
        if self.kind == "stable" and self.param < 2:
            beta = self.param / 2
            return stats.levy_stable(beta, 1.0, scale=self.scale * math.cos(math.pi * beta / 2)
                                     ** (1 / beta))
        return None

    def marginal_law(self):
        """scipy's law of one coordinate of x0 = sqrt(tau(1)) z (the KS reference of C1)."""
        if self.kind == "inverse_gamma":
            return stats.t(self.param, scale=math.sqrt(self.scale))
        if self.kind == "stable" and self.param < 2:
            # E exp(i u sqrt(A) z) = exp(-(u^2 / 2)^(alpha/2)): SaS with scale 2^(-1/2)
            return stats.levy_stable(self.param, 0.0, scale=math.sqrt(self.scale / 2))
        return stats.norm(scale=math.sqrt(self.scale))


def time_augmented(tau: torch.Tensor) -> torch.Tensor:
    """The path s -> (s, tau(s)) on the clock's grid: (n, steps + 1) -> (n, steps + 1, 2)."""
    s = torch.linspace(0, 1, tau.shape[1], dtype=tau.dtype).expand_as(tau)
    return torch.stack([s, tau], -1)


def sample_source(clock: Clock, n: int, dim: int, steps: int = 16,
                  generator: torch.Generator | None = None):
    """Source samples x0 = sqrt(tau(1)) z (float64), with the clock paths that made them."""
    tau = clock.sample_paths(n, steps, generator)
    z = torch.randn(n, dim, generator=generator, dtype=torch.float64)
    return tau[:, -1:].sqrt() * z, tau


# -- the truncated log-signature --------------------------------------------------------------
def logsig_keys(d: int) -> list[str]:
    """Names of the level-1 and level-2 coordinates in esig's Lyndon basis order:
    "1", ..., "d", then "[i,j]" for i < j."""
    return [str(i + 1) for i in range(d)] + [f"[{i + 1},{j + 1}]" for i in range(d)
                                              for j in range(i + 1, d)]


def log_signature(path: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """Depth-2 log-signature of piecewise-linear paths (batch, points, d) -> (batch, d + d(d-1)/2).

    Level 1 is the increment X_N - X_0. Level 2, in the Lyndon basis [i, j] (i < j), is the Levy
    area A_ij = 1/2 int (X_i - X_i(0)) dX_j - (X_j - X_j(0)) dX_i. A straight segment has no area,
    so by Chen's identity the area of a polyline is the sum over segments k of
    1/2 (Y_{k-1,i} dX_{k,j} - Y_{k-1,j} dX_{k,i}) with Y = X - X_0 (the shoelace formula):
    O(points d^2), vectorized over the batch. ``backend="esig"`` computes the same with the esig
    library, one path at a time (the reference; slow for a batch).
    """
    if path.ndim != 3 or path.shape[1] < 2:
        raise ValueError(f"path must be (batch, points >= 2, d), got {tuple(path.shape)}")
    d = path.shape[-1]
    if backend == "esig":
        if esig is None:
            raise ImportError("backend='esig' needs the esig package (the reference this "
                              "notebook checks against): pip install esig, or install the "
                              "workbench's test extra") from None
        arr = path.detach().cpu().double().numpy()
        out = np.stack([esig.stream2logsig(p, 2) for p in arr])
        return torch.as_tensor(out[:, 1:] if out.shape[1] > d + d * (d - 1) // 2 else out,
                               dtype=path.dtype)
    if backend != "torch":
        raise ValueError(f"backend must be 'torch' or 'esig', got {backend!r}")
    dx = path[:, 1:] - path[:, :-1]                       # segment increments
    y = path[:, :-1] - path[:, :1]                        # position before each segment, from X_0
    level1 = path[:, -1] - path[:, 0]
    i, j = torch.triu_indices(d, d, 1)
    area = 0.5 * (y[..., i] * dx[..., j] - y[..., j] * dx[..., i]).sum(1)
    return torch.cat([level1, area], 1)


def clock_features(tau: torch.Tensor) -> torch.Tensor:
    """phi(tau): the log-signature of (s, tau(s)) without its constant time increment, squashed
    by asinh so that heavy-tailed clock values (tau(1) ~ 1e6 for a stable clock) stay in a range a
    network can read (asinh is monotone, so no information is lost): (n, 2) = (tau(1), area).

    The same formula as :func:`log_signature` written for the time-augmented scalar clock, so that
    no (n, points, 2) path is built: with s_k = k / K, area = 1/2 sum_k (s_{k-1} dtau_k - tau_{k-1} / K).
    """
    steps = tau.shape[1] - 1
    s = torch.arange(steps, dtype=tau.dtype) / steps
    area = 0.5 * (tau.diff(dim=1) @ s - tau[:, :-1].sum(1) / steps)
    return torch.asinh(torch.stack([tau[:, -1] - tau[:, 0], area], 1))


# -- the velocity field, training and sampling ------------------------------------------------
class VelocityMLP(nn.Module):
    """v(x, t, phi): an MLP on [x, t, phi]; ``cond_dim=0`` is the unconditioned baseline network
    (the same body, only the input width differs by the feature count)."""

    def __init__(self, dim: int, cond_dim: int = 0, hidden: int = 128, depth: int = 3):
        super().__init__()
        layers, width = [], dim + 1 + cond_dim
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.SiLU()]
            width = hidden
        self.net = nn.Sequential(*layers, nn.Linear(width, dim))
        self.dim, self.cond_dim = dim, cond_dim

    def forward(self, x, t, cond=None):
        parts = [x, t.expand(len(x), 1)]
        if self.cond_dim:
            parts.append(cond)
        return self.net(torch.cat(parts, 1))


def fm_pair(x0: torch.Tensor, x1: torch.Tensor, t: torch.Tensor):
    """The conditional path and its target: x_t = (1 - t) x0 + t x1, u = x1 - x0."""
    return (1 - t) * x0 + t * x1, x1 - x0


@dataclass
class Method:
    """A flow-matching variant: its training clock and whether the network sees phi(tau)."""
    name: str
    clock: Clock
    conditioned: bool


def methods_for(alpha: float) -> dict[str, Method]:
    """The three models compared, all given the same tail parameter ``alpha`` (estimated from the
    training data): Gaussian FM, a fixed Student-t source (nu = alpha), HTFM (stable clock)."""
    return {"gaussian": Method("gaussian", Clock("constant"), False),
            "student_t": Method("student_t", Clock("inverse_gamma", alpha), False),
            "htfm": Method("htfm", Clock("stable", alpha), True)}


def train_fm(data: torch.Tensor, method: Method, steps: int = 1500, batch: int = 256,
             lr: float = 2e-3, hidden: int = 128, depth: int = 3, clock_steps: int = 16,
             clip: float = 1.0, generator: torch.Generator | None = None, device="cpu",
             progress=None):
    """Train v by the FM loss on minibatches of ``data`` (n, dim) with fresh sources each step.

    Adam, cosine learning-rate decay, gradient-norm clipping at ``clip`` (the targets x1 - x0
    have infinite variance when source or data do). Returns (model, losses).
    """
    dim = data.shape[1]
    model = VelocityMLP(dim, 2 if method.conditioned else 0, hidden, depth).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    it = range(steps) if progress is None else progress(range(steps), desc=method.name)
    losses = []
    for _ in it:
        idx = torch.randint(len(data), (batch,), generator=generator)
        x1 = data[idx].to(device)
        x0, tau = sample_source(method.clock, batch, dim, clock_steps, generator)
        t = torch.rand(batch, 1, generator=generator)
        xt, u = fm_pair(x0.float().to(device), x1, t.to(device))
        cond = clock_features(tau).float().to(device) if method.conditioned else None
        loss = (model(xt, t.to(device), cond) - u).pow(2).sum(1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return model, np.array(losses)


@torch.no_grad()
def integrate(model: VelocityMLP, x0: torch.Tensor, tau: torch.Tensor, nfe: int, device="cpu"):
    """Euler integration of dx/dt = v(x, t, phi(tau)) from t = 0 to 1 in ``nfe`` steps, from the
    sources ``x0`` and the clock paths ``tau`` that made them (phi unused by an unconditioned
    model)."""
    x = x0.float().to(device)
    cond = clock_features(tau).float().to(device) if model.cond_dim else None
    for k in range(nfe):
        t = torch.full((1, 1), k / nfe, device=device)
        x = x + model(x, t, cond) / nfe
    return x.cpu()


@torch.no_grad()
def sample(model: VelocityMLP, clock: Clock, n: int, nfe: int, clock_steps: int = 16,
           generator: torch.Generator | None = None, device="cpu", chunk: int = 50_000):
    """:func:`integrate` from ``n`` fresh sources of ``clock`` (which need not be the training
    clock: C4's tail control), in chunks."""
    out = []
    for start in range(0, n, chunk):
        x0, tau = sample_source(clock, min(chunk, n - start), model.dim, clock_steps, generator)
        out.append(integrate(model, x0, tau, nfe, device))
    return torch.cat(out)
