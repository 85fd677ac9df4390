"""A linear layer held as integer codes and per-group scales (what 02 fine-tunes)."""
from __future__ import annotations

import torch
from torch import nn

from .gptq import gptq
from .grid import Quantized, dequantize, rtn

class QuantLinear(nn.Module):
    """A linear layer whose weight is ``scale * (codes - zero)``, group-wise along inputs.

    ``codes`` and ``zero`` are integer buffers; ``scale`` is an ``nn.Parameter`` so a method can
    train (or perturb) the scales alone while the integer grid stays fixed.
    """

    def __init__(self, q: Quantized, bias: torch.Tensor | None = None):
        super().__init__()
        if q.g_idx is not None:
            raise ValueError("QuantLinear holds groups of consecutive inputs; GPTQ with "
                             "actorder and groups gives scattered groups: pass "
                             "static_groups=True (the reference's option for this)")
        self.bits, self.group_size = q.bits, q.group_size
        self.out_features, self.in_features = q.codes.shape
        self.register_buffer("codes", q.codes.to(torch.int16))
        self.register_buffer("zero", q.zero.float())
        self.scale = nn.Parameter(q.scale.float().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int = 128, sym: bool = True,
                    H: torch.Tensor | None = None) -> "QuantLinear":
        """RTN (``H`` None) or GPTQ (``H`` given) of ``linear.weight``."""
        w = linear.weight.detach()
        q = rtn(w, bits, group_size, sym) if H is None else gptq(w, H, bits, group_size, sym)
        return cls(q, linear.bias)

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.codes, self.scale, self.zero, self.group_size)

    def forward(self, x):
        return nn.functional.linear(x, self.dequantized().to(x.dtype), self.bias)

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}")
