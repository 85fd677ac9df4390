"""FuRA: full-rank adaptation through a block tensor-train with a frozen spectral core.

Paper 16 (NeurIPS 2026; public code: olokevin/FuRA-NIPS, ``fura/btt_layer.py``). A weight
``W`` (out x in) is cut into ``n`` column blocks ``W = [W_1 ... W_n]`` of width ``b = in / n``
and each block is factorized by its SVD,

    W_j = U_j diag(s_j) V_j^T,      W = L S R                                         (1)

with ``L = [U_1 ... U_n]`` (out x n k, the large core), ``S = diag(s_1, ..., s_n)`` (the per-block
singular values) and ``R = blockdiag(V_1^T, ..., V_n^T)`` (n blocks of k x b, the small core),
``k = min(out, b)``. FuRA freezes ``L`` and trains ``S`` and ``R``. Then

- (1) is exact at init, so the adapted model starts as the pretrained one;
- every update of block j is ``U_j (S_j' R_j' - S_j R_j)``: it lies in span(U_j), the block's
  pretrained column space (*spectral preconditioning*, sec. 3 of the paper);
- the update ``[U_1 M_1 ... U_n M_n]`` can have full rank ``min(out, in)``, unlike LoRA's r;
- the trainable count is ``n k (b + 1)`` per layer, about LoRA's at ``b ~ sqrt(in)``.

With one block (``n = 1``) this is the plain full-SVD reparameterization ``W = U S V^T`` with
``U`` frozen: the "spectral preconditioning" variant of the paper's C1, with about as many
trainable parameters as full fine-tuning of the layer. QFuRA stores the frozen core ``L`` in 4
bits (:class:`workbench.quant.QuantLinear`, round-to-nearest per group).

We implement the reference's ``output_one_block`` layout (column blocks, one output block), in
which ``L`` is the large core and ``R`` the small one, as the abstract describes; its
``input_one_block`` and ``square`` layouts are not used here.

Block counts. ``BTTLayer`` (``fura/btt_layer.py``) cuts the input into the closest factor pair
``(n, b)`` (``_closest_factor_pair``), except where ``convert_linear_to_btt`` is called with
``factorize_by_head``: then ``o_proj``'s input is cut by attention head, ``(num_heads,
head_dim)``. The training scripts turn that on by default (``--blocktt_factorize_by_head``,
``default=True``, in ``commonsense/src/finetune_blocktt.py`` and
``qfura_commonsense/src/finetune_qfura.py``). In that function q/k/v get a head-wise *output*
factorization too, which the ``output_one_block`` layout ignores (one output block), so only
``o_proj`` changes. :func:`head_block_count` is that rule; ``apply_fura(..., by_head=True)``
follows the script and is the default, ``by_head=False`` keeps the closest pair everywhere (at ``lm-base``'s width
128 with 4 heads: ``o_proj`` in (4, 32) blocks by head, (8, 16) by the closest pair). The baselines, the cached
fine-tunes and the cost measurement of notebook 16 live in :mod:`workbench.experiments.fura`.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..quant import QuantLinear, rtn

__all__ = ["HEAD_SPLIT", "closest_factor_pair", "head_block_count", "block_svd", "fura_parameters", "lora_parameters", "FuraLinear",
           "target_linears", "apply_fura", "full_finetune", "quantize_linears", "dense_weights",
           "outside_span", "numerical_rank", "trainable"]


def closest_factor_pair(d: int) -> tuple[int, int]:
    """``(n, b)`` with ``n b = d``, ``n <= b`` and ``b - n`` smallest (the reference's default
    block count: ``b ~ sqrt(d)``)."""
    n = max(a for a in range(1, int(math.isqrt(d)) + 1) if d % a == 0)
    return n, d // n


HEAD_SPLIT = ("o_proj",)   # projections whose input the reference cuts by attention head


def head_block_count(name: str, cols: int, num_heads: int | None, by_head: bool = True) -> int:
    """The column-block count of the projection ``name`` with ``cols`` in-features: the number of
    attention heads for ``o_proj`` when ``by_head`` (the reference's ``factorize_by_head`` in
    ``convert_linear_to_btt``, ``fura/btt_layer.py``: input factorization ``(num_heads,
    head_dim)``), else the closest factor pair's ``n``. A head count that cannot be read is
    refused, not replaced by the closest pair: the layer would silently differ from the
    reference's."""
    if by_head and name.split(".")[-1] in HEAD_SPLIT:
        if not num_heads:
            raise ValueError(f"{name}: the reference cuts o_proj by attention head, and this "
                             "model's config has no num_attention_heads; pass by_head=False for "
                             "the closest factor pair")
        if cols % num_heads:
            raise ValueError(f"{name}: {cols} in-features do not split into {num_heads} heads")
        return num_heads
    return closest_factor_pair(cols)[0]


def block_svd(w: torch.Tensor, n: int):
    """Eq. (1): the SVD of each of the ``n`` column blocks of ``w`` (out x in).

    Returns ``(L, S, R)``: ``L`` (out, n, k) the left singular vectors of every block, ``S``
    (n, k) their singular values, ``R`` (n, k, b) the right singular vectors (rows of V_j^T),
    ``k = min(out, b)``; ``W_j = L[:, j] diag(S[j]) R[j]``."""
    out, cols = w.shape
    if cols % n:
        raise ValueError(f"in-features {cols} is not a multiple of the block count {n}")
    b = cols // n
    blocks = w.reshape(out, n, b).permute(1, 0, 2)                 # (n, out, b)
    u, s, vh = torch.linalg.svd(blocks, full_matrices=False)       # (n, out, k), (n, k), (n, k, b)
    return u.permute(1, 0, 2).contiguous(), s.contiguous(), vh.contiguous()


def fura_parameters(out: int, cols: int, n: int) -> int:
    """Closed-form trainable count of one FuRA layer: ``n k b`` (R) ``+ n k`` (S)."""
    b = cols // n
    k = min(out, b)
    return n * k * b + n * k


def lora_parameters(out: int, cols: int, r: int, dora: bool = False) -> int:
    """``r (in + out)`` (A and B), plus the ``out`` magnitudes of DoRA."""
    return r * (cols + out) + (out if dora else 0)


class FuraLinear(nn.Module):
    """A linear layer held as ``W = L S R`` (eq. 1): ``L`` frozen, ``S`` and ``R`` trained.

    ``forward(x)`` computes ``L (S * (R x))`` block by block, never the dense ``W``: first each
    input block through its small core (``bmm``-sized, n k b multiply-adds a token), then one
    dense (n k -> out) product with ``L``, the same size as the original layer's. ``core`` is
    that frozen (n k -> out) map: an ``nn.Linear`` or, for QFuRA, a 4-bit ``QuantLinear``.
    """

    def __init__(self, L: torch.Tensor, S: torch.Tensor, R: torch.Tensor,
                 bias: torch.Tensor | None = None, core_bits: int | None = None,
                 group_size: int = 32):
        super().__init__()
        out, n, k = L.shape
        self.n, self.k, self.b = n, k, R.shape[-1]
        self.in_features, self.out_features = n * self.b, out
        flat = L.reshape(out, n * k)
        if core_bits is None:
            core = nn.Linear(n * k, out, bias=False, dtype=L.dtype, device=L.device)
            core.weight.data.copy_(flat)
        else:                                   # QFuRA: the frozen core in core_bits bits
            core = QuantLinear(rtn(flat, core_bits, group_size))
        for p in core.parameters():
            p.requires_grad_(False)
        self.core = core
        self.S = nn.Parameter(S.clone())        # per-block singular values, trained
        self.R = nn.Parameter(R.clone())        # the small core, trained
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, n: int | None = None, core_bits: int | None = None,
                    group_size: int = 32) -> "FuraLinear":
        """Factorize ``linear.weight`` with ``n`` column blocks (None: :func:`closest_factor_pair`).
        The SVD runs in float64, so the float32 layer reproduces ``W`` to rounding."""
        w = linear.weight.detach()
        n = closest_factor_pair(w.shape[1])[0] if n is None else n
        L, S, R = block_svd(w.double(), n)
        m = cls(L.to(w.dtype), S.to(w.dtype), R.to(w.dtype), linear.bias, core_bits, group_size)
        return m.to(w.device)

    def core_weight(self) -> torch.Tensor:
        """``L`` as (out, n, k), dequantized when it is held in 4 bits."""
        w = self.core.dequantized() if isinstance(self.core, QuantLinear) else self.core.weight
        return w.reshape(self.out_features, self.n, self.k)

    def weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense ``W = L S R`` (out, in) this layer computes (in ``dtype``, e.g. float64 so
        that a small update is not buried under float32 rounding)."""
        cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
        w = torch.einsum("onk,nk,nkb->onb", cast(self.core_weight()), cast(self.S), cast(self.R))
        return w.reshape(self.out_features, self.in_features)

    def forward(self, x):
        xb = x.reshape(-1, self.n, self.b).transpose(0, 1)           # (n, T, b)
        z = torch.bmm(xb, self.R.transpose(1, 2)) * self.S[:, None]  # (n, T, k): S_j R_j x_j
        y = self.core(z.transpose(0, 1).reshape(-1, self.n * self.k))  # L z, (T, out)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        q = f", core {self.core.bits}-bit" if isinstance(self.core, QuantLinear) else ""
        return (f"in={self.in_features}, out={self.out_features}, blocks={self.n} x "
                f"(k={self.k}, b={self.b}){q}")


def _replace(model: nn.Module, names, make) -> list[str]:
    mods = dict(model.named_modules())
    for name in names:
        parent, _, attr = name.rpartition(".")
        setattr(mods[parent], attr, make(mods[name]))     # mods[""] is the model itself
    return list(names)


def target_linears(model: nn.Module, targets) -> list[str]:
    """Names of the ``nn.Linear`` modules whose last name part is in ``targets``."""
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n.split(".")[-1] in set(targets)]


def apply_fura(model: nn.Module, targets, blocks: int | None = None,
               core_bits: int | None = None, group_size: int = 32,
               by_head: bool = True) -> list[str]:
    """Replace every target linear of ``model`` in place by a :class:`FuraLinear` and freeze
    everything but the ``S`` and ``R`` cores. ``blocks``: column blocks per layer (None: the
    closest factor pair, and with ``by_head``, the default as in the reference's training
    scripts, one block per attention head for ``o_proj`` (:func:`head_block_count`, heads read
    from ``model.config.num_attention_heads``, refused when absent); 1: the full-SVD, frozen-U
    variant). Returns the replaced names."""
    for p in model.parameters():
        p.requires_grad_(False)
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    names = target_linears(model, targets)
    mods = dict(model.named_modules())
    count = {id(mods[n]): head_block_count(n, mods[n].in_features, heads, by_head)
             if blocks is None else min(blocks, mods[n].in_features) for n in names}
    return _replace(model, names, lambda m: FuraLinear.from_linear(m, count[id(m)], core_bits,
                                                                   group_size))


def full_finetune(model: nn.Module, targets) -> list[str]:
    """Full fine-tuning of the same layers: every weight of the target linears trains, the rest
    (embeddings, norms) is frozen, as for the adapters. Returns the names."""
    for p in model.parameters():
        p.requires_grad_(False)
    names = target_linears(model, targets)
    mods = dict(model.named_modules())
    for n in names:
        mods[n].weight.requires_grad_(True)
    return names


def quantize_linears(model: nn.Module, targets, bits: int = 4, group_size: int = 32) -> list[str]:
    """QLoRA's base: every target linear as a frozen ``bits``-bit :class:`QuantLinear` (RTN per
    group of ``group_size`` inputs), in place. ``bitsandbytes``' NF4 needs CUDA; this is the
    project's own quantizer, on any device."""
    names = target_linears(model, targets)
    _replace(model, names, lambda m: QuantLinear.from_linear(m, bits, group_size))
    for p in model.parameters():
        p.requires_grad_(False)
    return names


# -- what an update is -------------------------------------------------------------------------

def dense_weights(model: nn.Module, names) -> dict[str, torch.Tensor]:
    """The dense weight of each named layer, whatever holds it (nn.Linear, FuRA, a peft LoRA or
    DoRA layer), detached, combined in float64 (so that tuned minus pretrained is the update,
    not float32 rounding)."""
    mods = dict(model.named_modules())
    out = {}
    for n in names:
        m = mods[n]
        if isinstance(m, FuraLinear):
            w = m.weight(torch.float64)
        elif hasattr(m, "get_delta_weight"):            # peft LoRA / DoRA layer
            base = m.get_base_layer()
            w0 = base.dequantized() if isinstance(base, QuantLinear) else base.weight
            w = w0.double() + m.get_delta_weight(m.active_adapters[0]).double()
            if m.use_dora.get(m.active_adapters[0]):
                mag = m.lora_magnitude_vector[m.active_adapters[0]].weight.double()
                w = mag[:, None] * w / w.norm(dim=1, keepdim=True)   # DoRA: m * V / ||V||_c
        elif isinstance(m, QuantLinear):
            w = m.dequantized()
        else:
            w = m.weight
        out[n] = w.detach().double()
    return out


def outside_span(delta: torch.Tensor, U: torch.Tensor) -> float:
    """``||(I - P_j) dW_j|| / ||dW||`` summed over blocks: the share of an update that leaves
    each block's pretrained column space span(U_j) (``U`` (out, n, k) orthonormal columns per
    block, :func:`block_svd`). 0 for FuRA's frozen-L updates by construction."""
    out, n, k = U.shape
    d = delta.reshape(out, n, -1).permute(1, 0, 2)                 # (n, out, b)
    u = U.permute(1, 0, 2)                                         # (n, out, k)
    resid = d - u @ (u.transpose(1, 2) @ d)
    return float(resid.norm() / delta.norm().clamp_min(1e-300))


def numerical_rank(delta: torch.Tensor, rtol: float = 1e-6) -> int:
    """The number of singular values above ``rtol`` times the largest (float64)."""
    s = torch.linalg.svdvals(delta.double())
    return int((s > rtol * s[0]).sum()) if s[0] > 0 else 0


def trainable(model: nn.Module) -> int:
    """The number of trainable parameters of ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
