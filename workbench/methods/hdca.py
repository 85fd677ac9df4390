"""HDCA: hyperbolic displacement-constrained adaptation for CLIP class-incremental learning.

Paper 03 (NeurIPS 2026; spec in ``docs/papers/03-hdca.md``). Forgetting is read as uncontrolled
*displacement* of image features by sequential adapter updates, and is constrained without any
data-derived class memory (no exemplars, prototypes or class statistics; only the class names'
text embeddings, which every CLIP classifier has).

Radial compression (the map every stage uses). For an update u in R^d and curvature c > 0,

    kappa_c(u) = tanh(sqrt(c) ||u||) / (sqrt(c) ||u||) * u                                (1)

the Poincare ball's exponential map at the origin (docs/papers/03-hdca.md, geoopt ``expmap0``): the
direction of u is kept, its magnitude r becomes rho_c(r) = tanh(sqrt(c) r) / sqrt(c), which is
~r for small r (rho_c(r) / r -> 1 as r -> 0), concave, increasing and bounded by 1 / sqrt(c).

Hyperbolic low-rank adapter (per task). Session t adds a low-rank residual u_t(x) = B_t A_t x at
its site; earlier sessions' factors are frozen. Its displacement is compressed per task, and the
sum over sessions once more (cumulative stage), :class:`ResidualStack`:

    R_t(x) = kappa_C( sum_{s <= t} kappa_c(u_s(x)) )                                        (2)

Two sites. Inside the image encoder, the paper's placement (:class:`EncoderHDCA`): a branch
beside the MLP of each of the last ViT blocks, h'' = h' + MLP(LN2(h')) + R_t(LN2(h')) (eq. 2').
On the frozen, L2-normalised output embedding f, the variant kept (:class:`HDCAAdapter`):
z(f) = (f + R_t(f)) / ||f + R_t(f)||. The ablation (C4) switches either kappa off (the identity
in its place).

Poincare distance classifier (parameter-free). Image and class text features, both unit vectors,
are mapped to the ball at one radius by x = expmap0(alpha z), and the logit of class k is

    l_k = -tau * d_c(x, y_k),    d_c(x, y) = 2 / sqrt(c) * artanh(sqrt(c) ||(-x) (+)_c y||)   (3)

with (+)_c Mobius addition. On one sphere of the ball d_c is an increasing function of
||x - y||^2 = 2 r^2 (1 - cos), so for fixed features the class order is the cosine order; the
slope dl/dcos, constant for cosine logits, grows without bound as cos -> 1 (reshaped gradient in
high-similarity regions). tau is not learned: it is set so that the logit range over
cos in [-1, 1] equals the cosine head's (2 * CLIP's logit scale), see :func:`poincare_tau`.

The class-incremental harness (sessions, training, PyCIL's metrics, baselines, the ablation) is
the notebook's: :mod:`workbench.experiments.hdca`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["compress", "compression_ratio", "mobius_add", "poincare_distance", "to_ball",
           "poincare_tau", "cosine_logits", "poincare_logits", "logit_slope", "LowRankAdapter",
           "ResidualStack", "HDCAAdapter", "attend", "block_inputs", "EncoderHDCA"]

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


class ResidualStack(nn.Module):
    """R_t(x) of eq. 2 at one site: the per-session low-rank residuals u_s(x) = B_s A_s x,
    each compressed (c_task), their sum compressed once more (c_cum).

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
        # where new sessions' factors go: follows .to(device), and is no part of the state
        self.register_buffer("_device", torch.zeros(0), persistent=False)

    def new_session(self) -> None:
        """Freeze what earlier sessions learned and (per_session) add a fresh adapter."""
        if self.per_session or not self.adapters:
            for p in self.adapters.parameters():
                p.requires_grad_(False)
            self.adapters.append(LowRankAdapter(self.dim, self.rank).to(self._device.device))

    def residuals(self, f) -> list[torch.Tensor]:
        """The raw per-task residuals u_s(f), one (..., d) tensor per session."""
        return [a(f) for a in self.adapters]

    def displacement(self, f) -> torch.Tensor:
        """R_t(f) of eq. 2: the compressed sum of the compressed per-task residuals."""
        if not self.adapters:
            return torch.zeros_like(f)
        total = sum(compress(u, self.c_task) for u in self.residuals(f))
        return compress(total, self.c_cum)

    def trainable(self):
        return [p for p in self.parameters() if p.requires_grad]


class HDCAAdapter(ResidualStack):
    """The output-embedding variant of eq. 2: z(f) = normalize(f + R_t(f)) on the frozen,
    normalised CLIP image feature f (one site, after the encoder)."""

    def forward(self, f):
        return F.normalize(f + self.displacement(f), dim=-1)


def attend(attn: nn.Module, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Multi-head self-attention of a ``transformers`` ``CLIPAttention`` with queries from the
    tokens ``q`` (N, Tq, d) and keys and values from all tokens ``x`` (N, T, d): softmax(Q K^T /
    sqrt(d_head)) V, then the output projection. ``q = x`` is the layer's own attention; ``q =
    x[:, :1]`` is its class-token row, all the last block's pooled output reads."""
    n, tq, d = q.shape
    o = F.scaled_dot_product_attention(_heads(attn.q_proj(q), attn), _heads(attn.k_proj(x), attn),
                                       _heads(attn.v_proj(x), attn), scale=attn.scale)
    return attn.out_proj(o.transpose(1, 2).reshape(n, tq, d))


def _heads(t: torch.Tensor, attn: nn.Module) -> torch.Tensor:
    """(N, T, d) -> (N, heads, T, d_head)."""
    return t.view(t.shape[0], t.shape[1], attn.num_heads, attn.head_dim).transpose(1, 2)


def block_inputs(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The part of the first adapted block that no adapter changes (its branch sits beside the
    MLP, eq. 2'), computed once: per token the block's frozen output h' + MLP(LN2(h')) and the
    branch's input LN2(h'), stacked as (N, T, 2, d), the input of :class:`EncoderHDCA`."""
    x = layer.layer_norm1(h)
    h = h + attend(layer.self_attn, x, x)
    m = layer.layer_norm2(h)
    return torch.stack([h + layer.mlp(m), m], 2)


class EncoderHDCA(nn.Module):
    """The in-encoder variant (the paper's placement): a :class:`ResidualStack` branch parallel
    to the MLP of each of the last vision blocks (AdaptFormer's placement, Chen et al. 2022),

        h' = h + Attn(LN1(h)),    h'' = h' + MLP(LN2(h')) + R_t^(l)(LN2(h'))               (2')

    then CLIP's pooled class token, post-LayerNorm and projection, normalised. The blocks, the
    LayerNorm and the projection stay frozen and outside the state (``_frozen``), which holds only
    the factors. Input: :func:`block_inputs` of the first adapted block, (N, T, 2, d)."""

    def __init__(self, layers, post_ln, proj, rank: int = 8, per_session: bool = True,
                 c_task: float = 0.0, c_cum: float = 0.0):
        super().__init__()
        dim = layers[0].layer_norm2.normalized_shape[0]
        self.sites = nn.ModuleList(ResidualStack(dim, rank, per_session, c_task, c_cum)
                                   for _ in layers)
        self._frozen = (tuple(layers), post_ln, proj)      # a tuple: not registered, not saved
        self.c_task, self.c_cum = c_task, c_cum

    def new_session(self) -> None:
        for s in self.sites:
            s.new_session()

    def _blocks(self, hm):
        """Run the adapted blocks from :func:`block_inputs`; returns the class token and each
        site's branch input on the class token (N, d). The last block computes only the class
        token's row (all the pooled output reads)."""
        layers = self._frozen[0]
        if len(layers) == 1:
            hm = hm[:, :1]                   # one block: only the class token's row is read
        h, m = hm[:, :, 0], hm[:, :, 1]
        h = h + self.sites[0].displacement(m)
        mids = [m[:, 0]]
        for i, (layer, site) in enumerate(zip(layers[1:], self.sites[1:]), 2):
            x = layer.layer_norm1(h)
            q = x[:, :1] if i == len(layers) else x
            h = h[:, : q.shape[1]] + attend(layer.self_attn, q, x)
            m = layer.layer_norm2(h)
            h = h + layer.mlp(m) + site.displacement(m)            # eq. 2': the residual branch
            mids.append(m[:, 0])
        return h[:, 0], mids
    def forward(self, h):
        _, post_ln, proj = self._frozen
        return F.normalize(proj(post_ln(self._blocks(h)[0])), dim=-1)

    def residuals(self, h) -> list[torch.Tensor]:
        """Per session, its raw residual at every site on the class token, (N, sites, d)."""
        _, mids = self._blocks(h)
        per_site = [s.residuals(m) for s, m in zip(self.sites, mids)]
        return [torch.stack(us, 1) for us in zip(*per_site)]

    def displacement(self, h) -> torch.Tensor:
        """Each site's R_t on the class token, (N, sites, d)."""
        _, mids = self._blocks(h)
        return torch.stack([s.displacement(m) for s, m in zip(self.sites, mids)], 1)

    def trainable(self):
        return [p for p in self.parameters() if p.requires_grad]
