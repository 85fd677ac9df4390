"""A linear layer held as integer codes and per-group scales (what 02 fine-tunes)."""
from __future__ import annotations

import torch
from torch import nn

from .gptq import gptq
from .grid import Quantized, dequantize, rtn

__all__ = ["QuantLinear"]


def _stamp(t: torch.Tensor) -> tuple:
    """What identifies a tensor's current contents: the object (held, so its address is not
    reused), its storage and the version counter that every in-place operation on it (``add_``,
    ``copy_``, optimizer steps) increments."""
    return (t, t.data_ptr(), t._version)


def _same(a: tuple | None, b: tuple) -> bool:
    return a is not None and all(x[0] is y[0] and x[1:] == y[1:] for x, y in zip(a, b))


class QuantLinear(nn.Module):
    """A linear layer whose weight is ``scale * (codes - zero)``, group-wise along inputs.

    ``codes`` and ``zero`` are integer buffers; ``scale`` is an ``nn.Parameter`` so a method can
    train (or perturb) the scales alone while the integer grid stays fixed.

    The dequantized weight is cached and rebuilt only when ``codes``, ``scale`` or ``zero``
    change (a new tensor, or an in-place change of one: each bumps its version counter). While
    autograd records with ``scale.requires_grad``, every forward dequantizes afresh, so the scales
    get their gradient. (An in-place change through ``.data`` bypasses the version counter, so
    call :meth:`invalidate` after one.) ``use_cache = False`` (on the class or one layer)
    turns the cache off.
    """

    use_cache: bool = True

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
        self._cached, self._cache_key = None, None

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int = 128, sym: bool = True,
                    H: torch.Tensor | None = None) -> "QuantLinear":
        """RTN (``H`` None) or GPTQ (``H`` given) of ``linear.weight``."""
        w = linear.weight.detach()
        q = rtn(w, bits, group_size, sym) if H is None else gptq(w, H, bits, group_size, sym)
        return cls(q, linear.bias)

    def quantized(self) -> Quantized:
        """The layer's grid as a :class:`Quantized` (what a GGUF export packs)."""
        return Quantized(self.codes, self.scale.detach(), self.zero, self.bits, self.group_size)

    def dequantized(self) -> torch.Tensor:
        """``scale * (codes - zero)``, (out, in), always freshly computed."""
        return dequantize(self.codes, self.scale, self.zero, self.group_size)

    def invalidate(self) -> None:
        """Drop the cached dequantized weight."""
        self._cached, self._cache_key = None, None

    def cached_weight(self) -> torch.Tensor:
        """The dequantized weight, from the cache when nothing has changed."""
        if not self.use_cache or (torch.is_grad_enabled() and self.scale.requires_grad):
            return self.dequantized()                  # autograd needs this forward's graph
        key = (_stamp(self.codes), _stamp(self.scale), _stamp(self.zero))
        if self._cached is None or not _same(self._cache_key, key):
            with torch.no_grad():
                self._cached = self.dequantized()
            self._cache_key = key
        return self._cached

    def forward(self, x):
        return nn.functional.linear(x, self.cached_weight().to(x.dtype), self.bias)

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}")
