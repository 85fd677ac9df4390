"""HDCA: hyperbolic displacement-constrained adaptation for CLIP class-incremental learning.

Paper 03 (NeurIPS 2026; spec in ``papers/03-hdca.md``). Forgetting is read as uncontrolled
*displacement* of image features by sequential adapter updates, and is constrained without any
data-derived class memory (no exemplars, prototypes or class statistics; only the class names'
text embeddings, which every CLIP classifier has).

Radial compression (the map every stage uses). For an update u in R^d and curvature c > 0,

    kappa_c(u) = tanh(sqrt(c) ||u||) / (sqrt(c) ||u||) * u                                (1)

the Poincare ball's exponential map at the origin (REFERENCES.md, geoopt ``expmap0``): the
direction of u is kept, its magnitude r becomes rho_c(r) = tanh(sqrt(c) r) / sqrt(c), which is
~r for small r (rho_c(r) / r -> 1 as r -> 0), concave, increasing and bounded by 1 / sqrt(c).

Hyperbolic low-rank adapter (per task). Session t adds a low-rank residual u_t(f) = B_t A_t f on
the frozen, L2-normalised CLIP image feature f; earlier sessions' factors are frozen. Its
displacement is compressed per task, and the sum over sessions once more (cumulative stage):

    R_t(f) = kappa_C( sum_{s <= t} kappa_c(u_s(f)) ),     z(f) = (f + R_t(f)) / ||f + R_t(f)||  (2)

The ablation (C4) switches either kappa off (the identity in its place).

Poincare distance classifier (parameter-free). Image and class text features, both unit vectors,
are mapped to the ball at one radius by x = expmap0(alpha z), and the logit of class k is

    l_k = -tau * d_c(x, y_k),    d_c(x, y) = 2 / sqrt(c) * artanh(sqrt(c) ||(-x) (+)_c y||)   (3)

with (+)_c Mobius addition. On one sphere of the ball d_c is an increasing function of
||x - y||^2 = 2 r^2 (1 - cos), so for fixed features the class order is the cosine order; the
slope dl/dcos, constant for cosine logits, grows without bound as cos -> 1 (reshaped gradient in
high-similarity regions). tau is not learned: it is set so that the logit range over
cos in [-1, 1] equals the cosine head's (2 * CLIP's logit scale), see :func:`poincare_tau`.

Metrics (:func:`cil_metrics`) follow PyCIL (G-U-N/PyCIL, ``trainer.py`` and ``utils/toolkit.py``):
average incremental accuracy = mean of the accuracy curve over sessions (accuracy on all classes
seen so far, after each session), last accuracy = the curve's last point, forgetting = mean over
the old tasks of (best accuracy on that task's classes over sessions - its final accuracy).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["compress", "compression_ratio", "mobius_add", "poincare_distance", "to_ball",
           "poincare_tau", "cosine_logits", "poincare_logits", "logit_slope", "LowRankAdapter",
           "HDCAAdapter", "train_session", "accuracy", "cil_metrics", "run_sessions",
           "session_splits", "ABLATION"]

_EPS = 1e-15


# -- the radial compression (eq. 1) -------------------------------------------------------------

def compress(u: torch.Tensor, c: float = 1.0, dim: int = -1) -> torch.Tensor:
    """kappa_c(u) = tanh(sqrt(c) ||u||) / (sqrt(c) ||u||) u (eq. 1): same direction, magnitude
    tanh(sqrt(c) r) / sqrt(c) < min(r, 1 / sqrt(c)). ``c <= 0`` or None: the identity."""
    if not c or c <= 0:
        return u
    sc = math.sqrt(c)
    r = u.norm(dim=dim, keepdim=True).clamp_min(_EPS)
    return torch.tanh(sc * r) / (sc * r) * u


def compression_ratio(r, c: float = 1.0):
    """||kappa_c(u)|| / ||u|| as a function of r = ||u||: tanh(sqrt(c) r) / (sqrt(c) r), 1 at 0."""
    r = torch.as_tensor(r, dtype=torch.float64)
    sc = math.sqrt(c)
    return torch.where(r > 0, torch.tanh(sc * r) / (sc * r).clamp_min(_EPS), torch.ones_like(r))


# -- the Poincare ball (eq. 3) ------------------------------------------------------------------

def mobius_add(x: torch.Tensor, y: torch.Tensor, c: float = 1.0) -> torch.Tensor:
    """Mobius addition on the ball of curvature -c (geoopt ``stereographic/math.py``):
    ((1 + 2c<x,y> + c|y|^2) x + (1 - c|x|^2) y) / (1 + 2c<x,y> + c^2 |x|^2 |y|^2)."""
    xy = (x * y).sum(-1, keepdim=True)
    x2 = (x * x).sum(-1, keepdim=True)
    y2 = (y * y).sum(-1, keepdim=True)
    num = (1 + 2 * c * xy + c * y2) * x + (1 - c * x2) * y
    return num / (1 + 2 * c * xy + c ** 2 * x2 * y2).clamp_min(_EPS)


def poincare_distance(x: torch.Tensor, y: torch.Tensor, c: float = 1.0) -> torch.Tensor:
    """d_c(x, y) = 2 / sqrt(c) artanh(sqrt(c) ||(-x) (+)_c y||), broadcast over leading dims."""
    sc = math.sqrt(c)
    n = mobius_add(-x, y, c).norm(dim=-1).clamp_min(_EPS)
    # artanh's argument stays below 1 inside the ball; the clamp guards float32 round-off
    return 2 / sc * torch.atanh((sc * n).clamp(max=1 - 1e-7))


def to_ball(z: torch.Tensor, alpha: float = 1.0, c: float = 1.0) -> torch.Tensor:
    """expmap0(alpha z): unit features onto the sphere of radius tanh(sqrt(c) alpha) / sqrt(c)."""
    return compress(alpha * z, c)


def poincare_tau(logit_scale: float, alpha: float = 1.0, c: float = 1.0) -> float:
    """The fixed temperature of eq. 3: the logit range over cos in [-1, 1] (distance 0 to the
    antipode's) equals the cosine head's 2 * logit_scale. Not a trained parameter."""
    r = math.tanh(math.sqrt(c) * alpha) / math.sqrt(c)
    x = torch.tensor([[r, 0.0]], dtype=torch.float64)
    d_max = float(poincare_distance(x, -x, c))
    return 2 * logit_scale / d_max


def cosine_logits(z: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """CLIP's head: scale * cos(z, w_k), (N, K)."""
    return scale * F.normalize(z, dim=-1) @ F.normalize(w, dim=-1).T


def poincare_logits(z: torch.Tensor, w: torch.Tensor, scale: float, alpha: float = 1.0,
                    c: float = 1.0) -> torch.Tensor:
    """The parameter-free Poincare distance classifier (eq. 3): -tau d_c(x, y_k), (N, K)."""
    x = to_ball(F.normalize(z, dim=-1), alpha, c)[:, None, :]
    y = to_ball(F.normalize(w, dim=-1), alpha, c)[None, :, :]
    return -poincare_tau(scale, alpha, c) * poincare_distance(x, y, c)


def logit_slope(cos, head: str, scale: float, alpha: float = 1.0, c: float = 1.0):
    """d logit / d cos at the given cosines, by autograd on a 2-d pair at that angle (the
    gradient the classifier passes back to the features' similarity)."""
    cos = torch.as_tensor(cos, dtype=torch.float64).clone().requires_grad_(True)
    z = torch.stack([cos, torch.sqrt((1 - cos ** 2).clamp_min(0))], -1)
    w = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    if head == "cosine":
        logit = scale * (z @ w.T)[:, 0]
    else:
        x, y = to_ball(z, alpha, c), to_ball(w, alpha, c)
        logit = -poincare_tau(scale, alpha, c) * poincare_distance(x, y, c)
    (g,) = torch.autograd.grad(logit.sum(), cos)
    return g.detach()


# -- adapters (eq. 2) ---------------------------------------------------------------------------

class LowRankAdapter(nn.Module):
    """u(f) = B A f, rank r; B starts at zero so the adapter starts as the identity map."""

    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.A = nn.Parameter(torch.randn(rank, dim) / math.sqrt(dim))
        self.B = nn.Parameter(torch.zeros(dim, rank))

    def forward(self, f):
        return f @ self.A.T @ self.B.T


class HDCAAdapter(nn.Module):
    """The adapted image feature z(f) of eq. 2 over sessions.

    ``per_session``: a new low-rank adapter per session, earlier ones frozen (HDCA and its
    ablation); False: one adapter trained on through every session (sequential fine-tuning).
    ``c_task`` / ``c_cum``: curvature of the per-task / cumulative compression (0: off).
    The state holds only adapter factors: no exemplars, prototypes or class statistics.
    """

    def __init__(self, dim: int, rank: int = 8, per_session: bool = True, c_task: float = 0.0,
                 c_cum: float = 0.0):
        super().__init__()
        self.dim, self.rank, self.per_session = dim, rank, per_session
        self.c_task, self.c_cum = c_task, c_cum
        self.adapters = nn.ModuleList()

    def new_session(self) -> None:
        """Freeze what earlier sessions learned and (per_session) add a fresh adapter."""
        if self.per_session or not self.adapters:
            for p in self.adapters.parameters():
                p.requires_grad_(False)
            self.adapters.append(LowRankAdapter(self.dim, self.rank))

    def residuals(self, f) -> list[torch.Tensor]:
        """The raw per-task residuals u_s(f), one (N, d) tensor per session."""
        return [a(f) for a in self.adapters]

    def displacement(self, f) -> torch.Tensor:
        """R_t(f) of eq. 2: the compressed sum of the compressed per-task residuals."""
        if not self.adapters:
            return torch.zeros_like(f)
        total = sum(compress(u, self.c_task) for u in self.residuals(f))
        return compress(total, self.c_cum)

    def forward(self, f):
        return F.normalize(f + self.displacement(f), dim=-1)

    def trainable(self):
        return [p for p in self.parameters() if p.requires_grad]


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
    with torch.no_grad():
        z = adapter(f) if adapter is not None else f
        pred = _logits(z, w, head, scale, alpha, c_head).argmax(-1)
    return float((pred == y).float().mean()) if len(y) else float("nan")


def session_splits(n_classes: int, n_sessions: int, seed: int) -> list[np.ndarray]:
    """A seeded class order cut into ``n_sessions`` equal groups (the class-incremental split)."""
    order = np.random.default_rng([seed, 303]).permutation(n_classes)
    return np.array_split(order, n_sessions)


def cil_metrics(acc_table: np.ndarray, curve) -> dict:
    """PyCIL's metrics. ``acc_table[k, t]``: accuracy on task k's classes after session t
    (k <= t); ``curve[t]``: accuracy on all classes seen after session t. Forgetting: mean over
    k < T - 1 of max_t acc_table[k, t] - acc_table[k, T - 1] (PyCIL ``trainer.py``)."""
    a = np.asarray(acc_table, dtype=float)
    T = a.shape[1]
    forg = [np.nanmax(a[k, k:]) - a[k, T - 1] for k in range(T - 1)]
    return {"avg_incremental": float(np.mean(curve)), "last": float(curve[-1]),
            "forgetting": float(np.mean(forg)) if forg else 0.0}


# the C4 ablation: which compression stage is on (per-task c, cumulative c) as 0 / 1 factors
ABLATION = {"none": (0, 0), "per-task": (1, 0), "cumulative": (0, 1), "both": (1, 1)}


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
            with torch.no_grad():
                us = adapter.residuals(f_te)
                disp.append({"session": t,
                             "task_raw": float(us[-1].norm(dim=-1).mean()),
                             "task_compressed": float(compress(us[-1], adapter.c_task)
                                                      .norm(dim=-1).mean()),
                             "sum_raw": float(sum(us).norm(dim=-1).mean()),
                             "cumulative": float(adapter.displacement(f_te).norm(dim=-1).mean())})
    return {"table": table, "curve": curve, **cil_metrics(table, curve), "displacement": disp,
            "logs": logs}
