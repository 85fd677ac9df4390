"""Group-wise grids: round-to-nearest (RTN), BitNet b1.58 absmean ternary with a straight-through
estimator, and which layers a quantizer replaces.

RTN follows the convention of the GPTQ reference (``IST-DASLab/gptq`` ``quant.py``): ``maxq =
2**bits - 1``; symmetric uses ``scale = 2 max|w| / maxq`` and ``zero = (maxq + 1) / 2``, so the
levels are the integers ``-2**(bits-1) .. 2**(bits-1) - 1``; asymmetric uses ``scale = (max -
min) / maxq`` and ``zero = round(-min / scale)``. Groups run along the input dimension of a
``(out, in)`` weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["expand_groups", "levels", "rtn_params", "quantize_codes", "dequantize", "Quantized",
           "rtn", "absmean_ternary", "ternary_quantized", "ste", "ternary_ste", "block_linears",
           "bits_per_weight"]

# -- group-wise RTN ---------------------------------------------------------------------------


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """(out, in) -> (out, in // g, g); ``group_size <= 0`` means one group per row."""
    out, cols = w.shape
    g = cols if group_size <= 0 else group_size
    if cols % g:
        raise ValueError(f"in-features {cols} is not a multiple of group_size {g}")
    return w.reshape(out, cols // g, g)


def expand_groups(t: torch.Tensor, group_size: int, cols: int) -> torch.Tensor:
    """Per-group (..., out, G) values repeated to per-weight (..., out, in) (batches too)."""
    g = cols if group_size <= 0 else group_size
    return t.repeat_interleave(g, dim=-1)


def levels(bits: int, sym: bool = True) -> torch.Tensor:
    """The integer grid ``q - zero``: ``-2**(b-1) .. 2**(b-1)-1`` (symmetric) or ``0 .. 2**b-1``."""
    return torch.arange(-(2 ** (bits - 1)), 2 ** (bits - 1)) if sym else torch.arange(2 ** bits)


def rtn_params(w: torch.Tensor, bits: int, group_size: int = 128, sym: bool = True):
    """Per-group ``(scale, zero)``, each (out, G), as GPTQ's ``Quantizer.find_params``."""
    maxq = 2 ** bits - 1
    wg = _groups(w.to(torch.float64 if w.dtype == torch.float64 else torch.float32), group_size)
    xmin = wg.amin(-1).clamp(max=0)
    xmax = wg.amax(-1).clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    dead = (xmin == 0) & (xmax == 0)
    xmin, xmax = torch.where(dead, -1.0, xmin), torch.where(dead, 1.0, xmax)
    scale = (xmax - xmin) / maxq
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
    return scale, zero


def quantize_codes(w, scale, zero, bits: int, group_size: int) -> torch.Tensor:
    """Integer codes ``clamp(round(w / scale) + zero, 0, maxq)`` (out, in), as int16."""
    cols = w.shape[1]
    s, z = expand_groups(scale, group_size, cols), expand_groups(zero, group_size, cols)
    return torch.clamp(torch.round(w.float() / s) + z, 0, 2 ** bits - 1).to(torch.int16)


def dequantize(codes, scale, zero, group_size: int) -> torch.Tensor:
    """``scale * (codes - zero)``, per group."""
    cols = codes.shape[1]
    return expand_groups(scale, group_size, cols) * (
        codes.float() - expand_groups(zero, group_size, cols))


@dataclass
class Quantized:
    """Integer codes and per-group scale and zero point of one (out, in) weight.

    Groups are runs of ``group_size`` consecutive input columns, unless ``g_idx`` (in,) names
    each column's group (GPTQ with act-order, whose groups follow the processing order).
    """
    codes: torch.Tensor       # (out, in) int16 in [0, 2**bits - 1]
    scale: torch.Tensor       # (out, G)
    zero: torch.Tensor        # (out, G)
    bits: int
    group_size: int
    g_idx: torch.Tensor | None = None

    def per_column(self, t: torch.Tensor) -> torch.Tensor:
        """A per-group (out, G) tensor as per-weight (out, in)."""
        if self.g_idx is not None:
            return t[:, self.g_idx]
        return expand_groups(t, self.group_size, self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        return self.per_column(self.scale) * (self.codes.float() - self.per_column(self.zero))

    def to(self, device) -> "Quantized":
        """The same grid with its tensors on ``device``."""
        g_idx = None if self.g_idx is None else self.g_idx.to(device)
        return Quantized(self.codes.to(device), self.scale.to(device), self.zero.to(device),
                         self.bits, self.group_size, g_idx)

    @property
    def level_index(self) -> torch.Tensor:
        """Codes as signed levels ``codes - zero`` (symmetric grids)."""
        return self.codes.long() - self.per_column(self.zero).long()


def rtn(w: torch.Tensor, bits: int, group_size: int = 128, sym: bool = True) -> Quantized:
    """Round-to-nearest with per-group min-max (or absmax) scales."""
    scale, zero = rtn_params(w, bits, group_size, sym)
    return Quantized(quantize_codes(w, scale, zero, bits, group_size), scale, zero, bits,
                     group_size)


# -- ternary (BitNet b1.58) -------------------------------------------------------------------

def absmean_ternary(w: torch.Tensor, eps: float = 1e-5):
    """BitNet b1.58: ``gamma = mean|W|``, ``q = clamp(round(W / gamma), -1, 1)``; returns (q, gamma)."""
    gamma = w.abs().mean().clamp(min=eps)
    return torch.clamp(torch.round(w / gamma), -1, 1), gamma


def ternary_quantized(w: torch.Tensor, eps: float = 1e-5) -> Quantized:
    """BitNet b1.58's ternary weight as a :class:`Quantized`: levels ``{-1, 0, 1}`` (codes
    ``level + 1``, zero 1) and the one per-tensor ``gamma`` as every row's single group scale, so
    that ``dequantize()`` is ``gamma * q`` exactly and a GGUF export can pack it as TQ1_0/TQ2_0."""
    q, gamma = absmean_ternary(w.detach(), eps)
    out, cols = w.shape
    return Quantized((q + 1).to(torch.int16), gamma.float().expand(out, 1).clone(),
                     torch.ones(out, 1, device=w.device), 2, cols)


def ste(x: torch.Tensor, qx: torch.Tensor) -> torch.Tensor:
    """Straight-through estimator: forward ``qx``, gradient of the identity.

    Written ``qx + (x - x.detach())``: the added term is exactly 0.0, so the forward value is
    ``qx`` bit for bit (BitNet's ``x + (qx - x).detach()`` can be one float32 rounding off).
    """
    return qx.detach() + (x - x.detach())


def ternary_ste(w: torch.Tensor) -> torch.Tensor:
    """Fake-quantized ternary weight ``gamma * q`` with a straight-through gradient."""
    q, gamma = absmean_ternary(w)
    return ste(w, q * gamma)


# -- which layers a quantizer replaces -------------------------------------------------------

def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` layers inside the transformer blocks (attention and MLP projections) of
    a zoo LM, by module name; embeddings and the LM head stay in full precision, as usual."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and (".layers." in n or n.startswith("layers."))}


def bits_per_weight(bits: int, group_size: int, scale_bits: int = 16) -> float:
    """Storage cost of a group-wise grid: ``bits + scale_bits / group_size``."""
    return bits + (scale_bits / group_size if group_size > 0 else 0.0)
