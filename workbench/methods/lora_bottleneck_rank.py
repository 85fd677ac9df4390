"""Why low rank suffices: the bottleneck rank of frozen-backbone adaptation (paper 05,
``docs/papers/05-lora-bottleneck-rank.md``).

With the backbone frozen, an adapted linear layer ``y = (W + D) x`` is seen by the loss only
through ``D X^T`` for the frozen input features ``X`` (n x d_in, one row per token):

    L(W + D) = l((W + D) X^T)  depends on D only through D P_X,   P_X = projector on rowspace(X)   (1)

``||D P_X||_* <= ||D||_*`` (P_X is a contraction), so the trace-norm problem

    min_D  f(D) + lam ||D||_*,     f(D) = l(D X^T) (+ eps/2 tr(D P D^T))                           (2)

has a global minimizer with ``rank <= rank(X)``, the *bottleneck rank*, whatever n is. More: at
any stationary point ``-grad f(D) / lam`` is a subgradient of the trace norm, so D's right
singular vectors lie in ``rowspace(grad f) <= rowspace(X)`` (:func:`kkt_residual` checks this).

Attention adds two invariances (Sec. "multi-head attention"):

- the row-wise softmax ignores a constant added to each score row (:func:`softmax_shift_gap`), so
  a key update that is the same at every position is invisible: keys are seen only through the
  per-sequence *centered* features ``X_c`` (:func:`centered`), one rank fewer per sequence;
- a value update of head h reaches the loss only through ``A_h X`` (attention weighting) and
  the frozen output projection; in the last block, only the rows at loss positions count.

:func:`attention_bases` turns the frozen features, attention weights and loss positions into the
subspaces each update must lie in, and :func:`outside_energy` measures how much of a learned
update is outside.

For the factorized LoRA objective ``f(B A) + lam/2 (||A||^2 + ||B||^2)`` (weight decay; its
minimum over factorizations of D is ``lam ||D||_*``) with a tiny generic PSD perturbation
``eps/2 tr(D P D^T)`` (:func:`psd_perturbation`), stationary points are rank-deficient once the
LoRA rank exceeds the bottleneck-set threshold; minimizers of the perturbed problem are within
``eps/2 tr(D0 P D0^T)`` of the original optimum (:func:`perturbation_gap_bound`).

The generalization term (:func:`spectral_complexity`) is a Chevet-type bound on the Rademacher
complexity of the trace-norm ball over the frozen features: ``tau (sqrt(d_out ||S||_op) +
sqrt(tr S)) / sqrt(n)``, ``S = X^T X / n``.

Solvers: proximal gradient with singular-value soft-thresholding (:func:`svt`,
:func:`prox_grad`, FISTA with restarts), checked against ``cvxpy`` (:func:`cvxpy_solve`).
LoRA baselines use ``peft`` (:func:`peft_linear`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import cvxpy as cp
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn

from .. import placement

__all__ = ["RTOL", "numeric_rank", "row_basis", "bottleneck_rank", "project_rows",
           "outside_energy", "null_update", "centered", "softmax_shift_gap", "trace_norm", "svt",
           "psd_perturbation", "LeastSquares", "prox_grad", "kkt_residual", "cvxpy_solve",
           "perturbation_gap_bound", "low_rank_features", "peft_linear", "lora_delta",
           "train_lora", "spectral_complexity", "spearman", "loss_positions",
           "feeding_positions", "block_features", "attention_bases", "value_outside_energy",
           "DeltaHooks", "no_rope", "lm_loss", "block_svt", "learn_update",
           "constant_key_update"]

RTOL = 1e-6          # numeric rank: singular values above RTOL * sigma_max (float64 SVD)


# -- ranks and subspaces ----------------------------------------------------------------------

def numeric_rank(m, rtol: float = RTOL) -> int:
    """Number of singular values above ``rtol * sigma_max`` (0 for a zero matrix)."""
    s = torch.linalg.svdvals(torch.as_tensor(m).detach().double())
    if s.numel() == 0 or s[0] <= 0:
        return 0
    return int((s > rtol * s[0]).sum())


def row_basis(x, rtol: float = RTOL) -> torch.Tensor:
    """Orthonormal basis (d x r, float64) of the span of the rows of ``x`` (n x d)."""
    x = torch.as_tensor(x).detach().double()
    if x.dim() != 2:
        raise ValueError(f"need a 2-D feature matrix (tokens x dim), got shape {tuple(x.shape)}")
    _, s, vh = torch.linalg.svd(x, full_matrices=False)
    r = int((s > rtol * s[0]).sum()) if s.numel() and s[0] > 0 else 0
    return vh[:r].T


def bottleneck_rank(x, rtol: float = RTOL) -> int:
    """rank(X): the bound (1) on the rank of what the loss can see of an update D (D X^T)."""
    return numeric_rank(x, rtol)


def project_rows(d: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """D P: D with its rows projected on span(basis). By (1), D P X^T = D X^T."""
    b = basis.to(d.dtype)
    return d @ b @ b.T


def outside_energy(d: torch.Tensor, basis: torch.Tensor) -> float:
    """||D (I - P)||_F / ||D||_F: the share of an update outside the subspace it must lie in."""
    d = torch.as_tensor(d).detach().double()
    n = d.norm()
    return float((d - project_rows(d, basis.double())).norm() / n) if n > 0 else 0.0


def null_update(x, d_out: int, generator: torch.Generator | None = None,
                rtol: float = RTOL) -> torch.Tensor:
    """A random D (d_out x d_in) with D X^T = 0: by (1) the loss cannot see it."""
    x = torch.as_tensor(x).detach().double()
    g = torch.randn(d_out, x.shape[1], generator=generator, dtype=torch.float64).to(x.device)
    return g - project_rows(g, row_basis(x, rtol))


def centered(x: torch.Tensor, groups) -> torch.Tensor:
    """Rows of ``x`` minus the mean of their group (one group per sequence).

    A key update constant across a sequence's positions adds a constant to each score row, which
    the softmax ignores; what keys can show the loss is ``D X_c^T`` (Sec. attention).
    """
    x = torch.as_tensor(x).double()
    groups = torch.as_tensor(groups)
    out = x.clone()
    for g in torch.unique(groups):
        m = groups == g
        out[m] = x[m] - x[m].mean(0, keepdim=True)
    return out


def softmax_shift_gap(scores: torch.Tensor, shift: torch.Tensor) -> float:
    """max |softmax(S + c 1^T) - softmax(S)| over rows: row-wise softmax is shift invariant."""
    return float((torch.softmax(scores + shift[..., None], -1) - torch.softmax(scores, -1))
                 .abs().max())


# -- the trace-norm problem (2) -----------------------------------------------------------------

def trace_norm(d) -> float:
    return float(torch.linalg.svdvals(torch.as_tensor(d).double()).sum())


def svt(m: torch.Tensor, tau: float) -> torch.Tensor:
    """Singular-value soft-thresholding U max(S - tau, 0) V^T: the prox of tau ||.||_*
    (Cai, Candes and Shen 2010). Keeps the row space of m (so iterates stay in (1)'s span)."""
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    return (u * (s - tau).clamp_min(0)) @ vh


def psd_perturbation(d: int, seed: int = 0) -> torch.Tensor:
    """A generic PSD matrix P (d x d, ||P||_op = 1): Wishart G G^T / d, G Gaussian; full rank
    with probability one, so eps/2 tr(D P D^T) makes (2) strictly convex."""
    g = torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    p = g @ g.T / d
    return p / torch.linalg.matrix_norm(p, 2)


@dataclass
class LeastSquares:
    """f(D) = 1/(2n) ||X D^T - R||_F^2 + eps/2 tr(D P D^T) on frozen features X (n x d_in),
    targets R (n x d_out); with ``lam`` the problem (2)."""
    x: torch.Tensor
    r: torch.Tensor
    lam: float
    eps: float = 0.0
    p: torch.Tensor | None = None

    def __post_init__(self):
        self.x, self.r = self.x.double(), self.r.double()
        if self.x.shape[0] != self.r.shape[0]:
            raise ValueError(f"X has {self.x.shape[0]} rows but R has {self.r.shape[0]}")
        if self.eps and self.p is None:
            raise ValueError("eps > 0 needs the PSD matrix p (psd_perturbation(d_in))")
        n = self.x.shape[0]
        self.gram, self.xr = self.x.T @ self.x / n, self.r.T @ self.x / n

    @property
    def shape(self):
        return self.r.shape[1], self.x.shape[1]

    def smooth(self, d: torch.Tensor) -> float:
        val = 0.5 * float(((self.x @ d.T - self.r) ** 2).sum()) / self.x.shape[0]
        if self.eps:
            val += 0.5 * self.eps * float(torch.trace(d @ self.p @ d.T))
        return val

    def grad(self, d: torch.Tensor) -> torch.Tensor:
        g = d @ self.gram - self.xr                       # (1/n) (D X^T - R^T) X
        return g + self.eps * d @ self.p if self.eps else g

    def lipschitz(self) -> float:
        return float(torch.linalg.matrix_norm(self.gram, 2)) + self.eps

    def objective(self, d: torch.Tensor, eps: float | None = None) -> float:
        """f + lam ||D||_*; ``eps=0`` evaluates the unperturbed objective at the same D."""
        e = self.eps if eps is None else eps
        base = 0.5 * float(((self.x @ d.T - self.r) ** 2).sum()) / self.x.shape[0]
        if e:
            base += 0.5 * e * float(torch.trace(d @ self.p @ d.T))
        return base + self.lam * trace_norm(d)


def prox_grad(problem: LeastSquares, steps: int = 2000, tol: float = 1e-12,
              d0: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Accelerated proximal gradient (FISTA, adaptive restart) on (2): step 1/L, prox = SVT.

    Stops when the relative change of D falls below ``tol``. Returns (D, info)."""
    lr = 1.0 / problem.lipschitz()
    d = torch.zeros(problem.shape, dtype=torch.float64) if d0 is None else d0.double().clone()
    y, t, prev = d.clone(), 1.0, math.inf

    def step(z):
        """The prox step from z and the objective there (one SVD: the trace norm of the result is
        the sum of the thresholded singular values)."""
        u, s, vh = torch.linalg.svd(z - lr * problem.grad(z), full_matrices=False)
        s = (s - lr * problem.lam).clamp_min(0)
        out = (u * s) @ vh
        return out, problem.smooth(out) + problem.lam * float(s.sum())

    it = 0
    for it in range(1, steps + 1):
        d_new, obj = step(y)
        if obj > prev:                                   # restart the momentum (O'Donoghue-Candes)
            t = 1.0
            d_new, obj = step(d)
        t_new = 0.5 * (1 + math.sqrt(1 + 4 * t * t))
        y = d_new + (t - 1) / t_new * (d_new - d)
        change = float((d_new - d).norm() / max(float(d_new.norm()), 1e-30))
        d, t, prev = d_new, t_new, obj
        if change < tol:
            break
    return d, {"steps": it, "objective": problem.objective(d), "kkt": kkt_residual(problem, d)}


def kkt_residual(problem: LeastSquares, d: torch.Tensor, rtol: float = 1e-8) -> float:
    """Distance from optimality of (2): G = -grad f(D)/lam must be a subgradient of ||.||_*,
    i.e. U^T G V = I on D's support and ||G||_op <= 1 off it. Returns the worst violation."""
    g = -problem.grad(d) / problem.lam
    u, s, vh = torch.linalg.svd(d, full_matrices=False)
    k = int((s > rtol * max(float(s[0]), 1e-300)).sum()) if s.numel() else 0
    eye = lambda n: torch.eye(n, dtype=g.dtype, device=g.device)    # noqa: E731
    on = float((u[:, :k].T @ g @ vh[:k].T - eye(k)).abs().max()) if k else 0.0
    pu = eye(g.shape[0]) - u[:, :k] @ u[:, :k].T
    pv = eye(g.shape[1]) - vh[:k].T @ vh[:k]
    off = max(float(torch.linalg.matrix_norm(pu @ g @ pv, 2)) - 1.0, 0.0)
    return max(on, off)


def cvxpy_solve(problem: LeastSquares) -> tuple[np.ndarray, float]:
    """The same problem (2) through ``cvxpy`` (an independent conic solver): (D, objective)."""
    x, r = problem.x.numpy(), problem.r.numpy()
    dvar = cp.Variable(problem.shape)
    obj = 0.5 / x.shape[0] * cp.sum_squares(x @ dvar.T - r) + problem.lam * cp.normNuc(dvar)
    if problem.eps:
        root = np.linalg.cholesky(problem.p.numpy() + 1e-12 * np.eye(problem.p.shape[0]))
        obj = obj + 0.5 * problem.eps * cp.sum_squares(dvar @ root)
    prob = cp.Problem(cp.Minimize(obj))
    solver = "CLARABEL" if "CLARABEL" in cp.installed_solvers() else None
    prob.solve(solver=solver)
    return dvar.value, float(prob.value)


def perturbation_gap_bound(problem: LeastSquares, d0: torch.Tensor, eps: float) -> float:
    """F_0(D_eps) - F_0(D_0) <= eps/2 tr(D_0 P D_0^T), D_eps the minimizer of the eps-perturbed
    problem (F_0(D_eps) <= F_eps(D_eps) <= F_eps(D_0)): the near-optimality of C4."""
    return 0.5 * eps * float(torch.trace(d0.double() @ problem.p @ d0.double().T))


def low_rank_features(n: int, d: int, k: int, generator: torch.Generator,
                      decay: float = 0.0) -> torch.Tensor:
    """n x d features spanning a random k-dimensional subspace (bottleneck rank k), with
    singular values decaying like i^-decay inside it."""
    basis = torch.linalg.qr(torch.randn(d, k, generator=generator, dtype=torch.float64))[0]
    coef = torch.randn(n, k, generator=generator, dtype=torch.float64)
    coef = coef * torch.arange(1, k + 1, dtype=torch.float64) ** (-decay)
    return coef @ basis.T


# -- factorized LoRA with weight decay (peft) -----------------------------------------------------

class _Linear(nn.Module):
    """A frozen linear layer that peft wraps (its base weight is zero: the update is all)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out, bias=False)
        nn.init.zeros_(self.lin.weight)

    def forward(self, x):
        return self.lin(x)


def peft_linear(d_in: int, d_out: int, rank: int, seed: int = 0) -> nn.Module:
    """A ``peft`` LoRA model of one linear layer: D = B A * (alpha / r) with alpha = r, so the
    scaling is 1 and weight decay lam/2 (||A||^2 + ||B||^2) is the variational trace norm."""
    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=rank, target_modules=["lin"], lora_dropout=0.0,
                     bias="none")
    return get_peft_model(_Linear(d_in, d_out), cfg).double()


def lora_delta(model: nn.Module) -> torch.Tensor:
    """The dense update B A * scaling of every peft LoRA layer in ``model``, summed per name."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer) and "default" in m.lora_A:
            out[name] = (m.lora_B["default"].weight @ m.lora_A["default"].weight
                         * m.scaling["default"]).detach()
    return out


@placement.on_host
def train_lora(problem: LeastSquares, rank: int, seed: int = 0, max_iter: int = 200,
               tol: float = 1e-8) -> tuple[torch.Tensor, dict]:
    """Minimize f(B A) + lam/2 (||A||^2 + ||B||^2) over peft's LoRA factors with L-BFGS (strong
    Wolfe line search) from peft's init (A Kaiming-uniform, B = 0). Returns (D, info), info with
    the final gradient norm (a stationary point has 0). On the host in float64, by design (a
    synthetic problem of a few dozen dimensions)."""
    d_out, d_in = problem.shape
    model = peft_linear(d_in, d_out, rank, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.LBFGS(params, lr=1.0, max_iter=max_iter, tolerance_grad=tol,
                            tolerance_change=1e-16, history_size=50,
                            line_search_fn="strong_wolfe")
    x = problem.x

    def objective():
        pred = model(x)                                           # (n, d_out) = X D^T
        f = 0.5 * ((pred - problem.r) ** 2).sum() / x.shape[0]
        if problem.eps:
            d = next(iter(_lora_dense(model)))
            f = f + 0.5 * problem.eps * torch.trace(d @ problem.p @ d.T)
        return f + 0.5 * problem.lam * sum((p ** 2).sum() for p in params)

    def closure():
        opt.zero_grad()
        val = objective()
        val.backward()
        return val

    for _ in range(5):                        # L-BFGS restarts until the gradient vanishes
        opt.step(closure)
        closure()
        gnorm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in params))
        if gnorm < 1e-6:
            break
    d = next(iter(lora_delta(model).values()))
    return d, {"grad_norm": gnorm, "objective": problem.objective(d),
               "penalty": float(objective().detach())}


def _lora_dense(model):
    for m in model.modules():
        if isinstance(m, LoraLayer) and "default" in m.lora_A:
            yield m.lora_B["default"].weight @ m.lora_A["default"].weight * m.scaling["default"]


# -- generalization --------------------------------------------------------------------------

def spectral_complexity(x, d_out: int, tau: float) -> float:
    """tau (sqrt(d_out ||S||_op) + sqrt(tr S)) / sqrt(n), S = X^T X / n: a Chevet-type bound on
    E sup_{||D||_* <= tau} <D, G X / n>, the Rademacher complexity of the trace-norm ball on the
    frozen features; the generalization gap is at most 2 rho times it for a rho-Lipschitz loss."""
    x = torch.as_tensor(x).double()
    n = x.shape[0]
    ev = torch.linalg.eigvalsh(x.T @ x / n).clamp_min(0)
    return float(tau * (math.sqrt(d_out * float(ev.max())) + math.sqrt(float(ev.sum())))
                 / math.sqrt(n))


def spearman(a, b) -> float:
    """Spearman rank correlation (ties get the mean rank)."""
    return float(pd.Series(a).rank().corr(pd.Series(b).rank()))


# -- the frozen zoo LM: features, attention, learned updates ----------------------------------

def loss_positions(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) mask of positions whose logits enter the loss (HF shifts: logit i predicts i+1)."""
    s = torch.zeros_like(labels, dtype=torch.bool)
    s[:, :-1] = labels[:, 1:] != -100
    return s


def feeding_positions(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) mask of positions at or before a row's last loss position (causal attention: the
    rest cannot reach the loss)."""
    s = loss_positions(labels)
    idx = torch.arange(labels.shape[1], device=labels.device)
    last = torch.where(s.any(1), (s * idx).max(1).values, torch.full_like(s[:, 0], -1,
                                                                          dtype=torch.long))
    return idx[None, :] <= last[:, None]


@torch.no_grad()
def block_features(model, batch: dict, layer: int = -1) -> dict:
    """The frozen features of block ``layer``'s attention: its input X (the normed hidden states,
    B x T x d), the attention weights A (B x H x T x T) and the query/key projections.

    Needs eager attention (``model.set_attn_implementation("eager")``) for the weights."""
    attn = model.model.layers[layer].self_attn
    got = {}
    hook = attn.q_proj.register_forward_pre_hook(lambda m, a: got.__setitem__("x", a[0]))
    try:
        out = model(input_ids=batch["input_ids"], output_attentions=True)
    finally:
        hook.remove()
    if out.attentions is None or out.attentions[layer] is None:
        raise RuntimeError("attention weights missing: call model.set_attn_implementation('eager')")
    cfg, wo = model.config, attn.o_proj.weight.detach().double()
    heads = cfg.num_attention_heads
    return {"x": got["x"].double(), "attn": out.attentions[layer].double(), "wo": wo,
            "heads": heads, "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
            "head_dim": wo.shape[1] // heads, "k_out": attn.k_proj.weight.shape[0]}


def attention_bases(feats: dict, labels: torch.Tensor, rtol: float = RTOL) -> dict:
    """The subspaces the loss can see an update of the last block's q/k/v through, and ranks.

    - generic (1): rowspace of X at the feeding positions F;
    - query: rowspace of X at the loss positions S (a query only moves its own row's output);
    - key: rowspace of the per-sequence centered X_F (softmax row-shift invariance; exact for
      position-independent keys, not under a rotary embedding, which turns a constant key shift
      into a position-dependent one);
    - value, head h: rowspace of (A_h X) at S (attention weighting; under grouped-query
      attention, the sum of those of the query heads that share key-value head h), its rank
      capped by the frozen output projection block's rank: the bound for a per-head regularizer
      (sum_h ||D_h||_*) or plain gradient steps. The whole-matrix trace norm's prox mixes the
      heads' rows, so its minimizer's rows lie in the sum of these spaces ("value").
    """
    x, a = feats["x"], feats["attn"]
    s, f = loss_positions(labels), feeding_positions(labels)
    seq = torch.arange(x.shape[0], device=f.device)[:, None].expand_as(f)
    xf = x[f]
    out = {"generic": row_basis(xf, rtol), "query": row_basis(x[s], rtol),
           "key": row_basis(centered(xf, seq[f]), rtol)}
    heads = feats["heads"]
    dh = feats.get("head_dim", feats["wo"].shape[1] // heads)
    kv = feats.get("kv_heads", heads)
    zs = [(a[:, h] @ x)[s] for h in range(heads)]               # (|S|, d): sum_j A_ij x_j
    # a value head is read by its group of query heads (grouped-query attention: heads / kv)
    group = heads // kv
    out["value_heads"] = [row_basis(torch.cat(zs[g * group:(g + 1) * group]), rtol)
                          for g in range(kv)]
    out["value"] = row_basis(torch.cat(zs), rtol)
    out["ranks"] = {"generic": out["generic"].shape[1], "query": out["query"].shape[1],
                    "key": out["key"].shape[1], "value": out["value"].shape[1],
                    "value_per_head": [b.shape[1] for b in out["value_heads"]],
                    "o_proj_block": [numeric_rank(feats["wo"][:, h * dh:(h + 1) * dh])
                                     for h in range(heads)],
                    "loss_positions": int(s.sum()), "feeding_positions": int(f.sum()),
                    "sequences": int(x.shape[0]), "head_dim": dh}
    return out


def value_outside_energy(d: torch.Tensor, bases: list[torch.Tensor]) -> float:
    """outside_energy of a value update, head by head (rows h*dh:(h+1)*dh against basis h)."""
    dh = d.shape[0] // len(bases)
    d = d.double()
    tot = d.norm()
    out = sum(float((d[h * dh:(h + 1) * dh] - project_rows(d[h * dh:(h + 1) * dh], b)).norm())
              ** 2 for h, b in enumerate(bases))
    return math.sqrt(out) / float(tot) if tot > 0 else 0.0


class DeltaHooks:
    """Add a dense update D to named linear layers through forward hooks: y = W x + D x."""

    def __init__(self, model, names, dtype=torch.float32):
        self.mods = dict(model.named_modules())
        self.deltas = {n: torch.zeros_like(self.mods[n].weight, dtype=dtype, requires_grad=True)
                       for n in names}
        self.handles = [self.mods[n].register_forward_hook(self._hook(n)) for n in names]

    def _hook(self, name):
        def fn(mod, inp, out):
            return out + F.linear(inp[0], self.deltas[name].to(out.dtype))
        return fn

    def remove(self):
        for h in self.handles:
            h.remove()


def no_rope(model, layer: int = -1):
    """Switch off the rotary embedding in one block (cos = 1, sin = 0): a position-independent
    frozen block with the same weights and features, where the key row-shift argument is exact.
    Returns the hook handle (``.remove()`` restores the model)."""
    def pre(mod, args, kwargs):
        cos, sin = kwargs["position_embeddings"]
        kwargs["position_embeddings"] = (torch.ones_like(cos), torch.zeros_like(sin))
        return args, kwargs
    return model.model.layers[layer].register_forward_pre_hook(pre, with_kwargs=True)


def lm_loss(model, batch: dict) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def block_svt(m: torch.Tensor, tau: float, block: int | None = None) -> torch.Tensor:
    """SVT of the whole matrix, or of each ``block`` rows (one attention head each): the prox of
    tau sum_h ||D_h||_*."""
    if block is None:
        return svt(m, tau)
    return torch.cat([svt(m[i:i + block], tau) for i in range(0, m.shape[0], block)])


def learn_update(model, batch: dict, name: str, lam: float, steps: int, lr: float,
                 block: int | None = None, progress=None) -> tuple[torch.Tensor, list[float]]:
    """Proximal gradient on (2) for one frozen LM layer: D <- SVT(D - lr grad, lr lam), from 0,
    with heavy-ball momentum (still a combination of gradients, so D stays in their span).
    ``block`` = head dim regularizes each head's rows separately (:func:`block_svt`).

    Returns the learned D (float64) and the loss curve."""
    hooks = DeltaHooks(model, [name])
    d = hooks.deltas[name]
    mom = torch.zeros_like(d)
    losses = []
    it = range(steps) if progress is None else progress(range(steps))
    try:
        for _ in it:
            loss = lm_loss(model, batch)
            (g,) = torch.autograd.grad(loss, d)
            mom = 0.9 * mom + g
            with torch.no_grad():
                d.copy_(block_svt(d - lr * mom, lr * lam, block))
            losses.append(float(loss.detach()))
    finally:
        hooks.remove()
    return d.detach().double(), losses


def constant_key_update(feats: dict, labels: torch.Tensor, row: int = 0,
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """A key update D_k that adds the same random vector c to every key of sequence ``row``:
    D_k x_j = c for all feeding j, built as c v^T / (v . x_j) with v orthogonal to the centered
    features (so v . x_j is the same for every j). Under a position-independent block the
    softmax cannot see it."""
    x = feats["x"][row][feeding_positions(labels)[row]]
    xc = x - x.mean(0, keepdim=True)
    b = row_basis(xc)
    mean = x.mean(0)
    v = mean - b @ (b.T @ mean)                          # the part of the mean outside span(X_c)
    c = torch.randn(feats.get("k_out", feats["wo"].shape[1]), generator=generator,
                    dtype=torch.float64).to(feats["wo"].device)
    return torch.outer(c, v) / float(v @ mean)
