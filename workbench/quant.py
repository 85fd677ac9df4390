"""Quantization primitives shared by notebooks 02, 10 and 14.

- Group-wise round-to-nearest (RTN), symmetric or asymmetric, in the convention of the GPTQ
  reference (``IST-DASLab/gptq`` ``quant.py``): ``maxq = 2**bits - 1``; symmetric uses
  ``scale = 2 max|w| / maxq`` and ``zero = (maxq + 1) / 2``, so the levels are the integers
  ``-2**(bits-1) .. 2**(bits-1) - 1``; asymmetric uses ``scale = (max - min) / maxq`` and
  ``zero = round(-min / scale)``. Groups run along the input dimension of a ``(out, in)`` weight.
- BitNet b1.58 absmean ternary quantizer with a straight-through estimator.
- :class:`QuantLinear`: integer codes, per-group scales (an ``nn.Parameter``, so zeroth-order or
  gradient methods can move the scales alone) and zero points as separate tensors.
- GPTQ (Frantar et al., 2023, Alg. 1): ``H = 2/N X X^T``, dead columns, damping
  ``0.01 mean(diag H)``, the upper Cholesky factor of ``H^-1``, lazy block updates, groups whose
  quantizer is re-fit at each group start. With ``H = I`` it is exactly RTN.
- GGUF export/import through the ``gguf`` package. gguf-py quantizes in numpy only Q4_0, Q4_1,
  Q5_0, Q5_1, Q8_0, TQ1_0, TQ2_0 and BF16 (K-quants are dequantize-only there), so those plus F32
  and F16 are what :func:`write_gguf` can write from floats; :func:`pack_q4_0`, :func:`pack_q8_0`
  and :func:`pack_tq2_0` write given integer codes and scales bit-exactly (what a method that
  chooses its own codes, like GSQ, needs). The K-quant writer is ours: :func:`pack_q3_k` (Q3_K,
  symmetric 3-bit levels, 6-bit scales per 16 weights, fp16 scale per 256) with an RTN quantizer
  :func:`q3_k_params`; gguf-py's dequantizer reads it back bit-exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

# -- group-wise RTN ---------------------------------------------------------------------------


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """(out, in) -> (out, in // g, g); ``group_size <= 0`` means one group per row."""
    out, cols = w.shape
    g = cols if group_size <= 0 else group_size
    if cols % g:
        raise ValueError(f"in-features {cols} is not a multiple of group_size {g}")
    return w.reshape(out, cols // g, g)


def expand_groups(t: torch.Tensor, group_size: int, cols: int) -> torch.Tensor:
    """Per-group (out, G) values repeated to per-weight (out, in)."""
    g = cols if group_size <= 0 else group_size
    return t.repeat_interleave(g, dim=1)


def levels(bits: int, sym: bool = True) -> torch.Tensor:
    """The integer grid ``q - zero``: ``-2**(b-1) .. 2**(b-1)-1`` (symmetric) or ``0 .. 2**b-1``."""
    return torch.arange(-(2 ** (bits - 1)), 2 ** (bits - 1)) if sym else torch.arange(2 ** bits)


def rtn_params(w: torch.Tensor, bits: int, group_size: int = 128, sym: bool = True):
    """Per-group ``(scale, zero)``, each (out, G), as GPTQ's ``Quantizer.find_params``."""
    maxq = 2 ** bits - 1
    wg = _groups(w.float(), group_size)
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
    """Integer codes and per-group scale and zero point of one (out, in) weight."""
    codes: torch.Tensor       # (out, in) int16 in [0, 2**bits - 1]
    scale: torch.Tensor       # (out, G)
    zero: torch.Tensor        # (out, G)
    bits: int
    group_size: int

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.codes, self.scale, self.zero, self.group_size)

    @property
    def level_index(self) -> torch.Tensor:
        """Codes as signed levels ``codes - zero`` (symmetric grids)."""
        return self.codes.long() - expand_groups(self.zero, self.group_size,
                                                 self.codes.shape[1]).long()


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


# -- QuantLinear ------------------------------------------------------------------------------

class QuantLinear(nn.Module):
    """A linear layer whose weight is ``scale * (codes - zero)``, group-wise along inputs.

    ``codes`` and ``zero`` are integer buffers; ``scale`` is an ``nn.Parameter`` so a method can
    train (or perturb) the scales alone while the integer grid stays fixed.
    """

    def __init__(self, q: Quantized, bias: torch.Tensor | None = None):
        super().__init__()
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


# -- GPTQ -------------------------------------------------------------------------------------

def gptq(w: torch.Tensor, H: torch.Tensor, bits: int, group_size: int = 128, sym: bool = True,
         blocksize: int = 128, percdamp: float = 0.01, actorder: bool = False) -> Quantized:
    """GPTQ (Frantar et al. 2023, Algorithm 1) of one (out, in) weight given ``H = 2/N X X^T``.

    Columns are quantized one at a time; the error of column ``i``, divided by ``[H^-1]_ii``
    (the Cholesky factor's diagonal), is spread over the not-yet-quantized columns through row
    ``i`` of the upper Cholesky factor of ``H^-1`` (eq. 3 with the Cholesky reformulation of
    Sec. 3.3). Updates inside a block of ``blocksize`` columns are immediate; the rest of the
    matrix is updated lazily once per block. With groups, the quantizer (scale, zero) is re-fit
    on the current (already error-corrected) weights at each group start.
    """
    W = w.detach().clone().float()
    rows, cols = W.shape
    H = H.detach().clone().double()
    dead = torch.diag(H) == 0                       # inputs that never fire
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = None
    if actorder:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    damp = percdamp * torch.mean(torch.diag(H))
    H += damp * torch.eye(cols, dtype=H.dtype, device=H.device)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Hinv = Hinv.float()
    g = cols if group_size <= 0 else group_size
    dev = W.device
    codes = torch.zeros(rows, cols, dtype=torch.int16, device=dev)
    scales = torch.zeros(rows, cols // g, device=dev)
    zeros = torch.zeros(rows, cols // g, device=dev)
    scale = zero = None
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1, Err1 = W[:, i1:i2].clone(), torch.zeros(rows, i2 - i1, device=dev)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:                        # re-fit the quantizer for this group
                cur = torch.cat([W1[:, i:], W[:, i2:]], 1)[:, :g]
                s, z = rtn_params(cur, bits, -1, sym)
                scale, zero = s[:, 0], z[:, 0]
                scales[:, col // g], zeros[:, col // g] = scale, zero
            w_col = W1[:, i]
            c = torch.clamp(torch.round(w_col / scale) + zero, 0, 2 ** bits - 1)
            q_col = scale * (c - zero)
            codes[:, col] = c.to(torch.int16)
            err = (w_col - q_col) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]        # lazy batch update of later columns
    if perm is not None:
        if group_size > 0:
            raise NotImplementedError("actorder with groups needs static groups; not implemented")
        codes = codes[:, torch.argsort(perm)]
    return Quantized(codes, scales, zeros, bits, group_size)


class HessianCollector:
    """Accumulates ``H = 2/N sum_x x x^T`` of the inputs of chosen linear layers via hooks."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.H = {n: None for n in modules}
        self.n = {n: 0 for n in modules}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name):
        def hook(mod, inputs, output):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
            if self.H[name] is None:
                self.H[name] = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64,
                                           device=x.device)
            self.H[name] += 2 * x.T @ x
            self.n[name] += x.shape[0]
        return hook

    def hessians(self) -> dict[str, torch.Tensor]:
        return {n: (h / max(self.n[n], 1)).float() for n, h in self.H.items()}

    def remove(self):
        for h in self.handles:
            h.remove()


def collect_hessians(model: nn.Module, modules: dict[str, nn.Module], batches,
                     batch_size: int = 16) -> dict[str, torch.Tensor]:
    """Run ``batches`` (B, T) through ``model`` and return each module's input Hessian."""
    col = HessianCollector(modules)
    try:
        with torch.no_grad():
            dev = next(model.parameters()).device
            for i in range(0, len(batches), batch_size):
                model(input_ids=batches[i: i + batch_size].to(dev))
    finally:
        col.remove()
    return col.hessians()


def output_error(w: torch.Tensor, wq: torch.Tensor, H: torch.Tensor) -> float:
    """Layer-wise reconstruction error ``tr((Wq - W) H (Wq - W)^T)`` (= 2/N ||(Wq - W) X||^2)."""
    d = (wq - w).double()
    return float(torch.einsum("oi,ij,oj->", d, H.double(), d))


# -- GGUF -------------------------------------------------------------------------------------

GGUF_WRITABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0")


def _qt(name: str):
    import gguf
    return gguf.GGMLQuantizationType[name]


def pack_q4_0(levels: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q4_0 blocks from signed levels in [-8, 7] (rows, in) and fp16 scales (rows, in // 32).

    Block layout (ggml ``block_q4_0``): fp16 ``d``, then 16 bytes; byte ``j`` holds element
    ``j`` in its low nibble and element ``j + 16`` in its high nibble, each stored as level + 8.
    The value of an element is ``d * level``.
    """
    rows, cols = levels.shape
    q = (levels.astype(np.int16) + 8).astype(np.uint8).reshape(rows, cols // 32, 2, 16)
    qs = q[..., 0, :] | (q[..., 1, :] << np.uint8(4))
    dd = d.astype(np.float16).reshape(rows, cols // 32, 1).view(np.uint8)
    return np.concatenate([dd, qs], axis=-1).reshape(rows, cols // 32 * 18)


def unpack_q4_0(raw: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_q4_0`: (levels int8, d float16)."""
    b = raw.reshape(-1, cols // 32, 18)
    d = b[..., :2].copy().view(np.float16)[..., 0]
    qs = b[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8) - 8
    return q.reshape(-1, cols), d


def pack_q8_0(levels: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q8_0 blocks from levels in [-127, 127] (rows, in) and fp16 scales (rows, in // 32)."""
    rows, cols = levels.shape
    q = levels.astype(np.int8).reshape(rows, cols // 32, 32).view(np.uint8)
    dd = d.astype(np.float16).reshape(rows, cols // 32, 1).view(np.uint8)
    return np.concatenate([dd, q], axis=-1).reshape(rows, cols // 32 * 34)


def pack_tq2_0(levels: np.ndarray, d: np.ndarray) -> np.ndarray:
    """TQ2_0 blocks from ternary levels (rows, in) and fp16 scales (rows, in // 256)."""
    rows, cols = levels.shape
    q = (levels.astype(np.int8) + 1).astype(np.uint8).reshape(rows * cols // 256, 2, 4, 32)
    q = q << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qs = (q[:, :, 0] | q[:, :, 1] | q[:, :, 2] | q[:, :, 3]).reshape(-1, 64)
    dd = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return np.concatenate([qs, dd], axis=-1).reshape(rows, cols // 256 * 66)


QK_K = 256          # weights per K-quant super-block (gguf ``constants.QK_K``)


def pack_q3_k(levels: np.ndarray, sub_scales: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q3_K blocks (ggml ``block_q3_K``, 110 bytes per 256 weights) from signed levels in
    [-4, 3] (rows, in), signed 6-bit sub-block scales in [-32, 31] (rows, in // 16) and fp16
    super-block scales (rows, in // 256). Weight ``= d * sub_scale * level``: a symmetric scalar
    grid with groups of 16 whose scales are themselves quantized.

    gguf-py only *dequantizes* K-quants, so this writer is ours; the layout follows its
    ``Q3_K.dequantize_blocks``: ``hmask`` (32 B, bit ``e // 32`` of byte ``e % 32`` set when
    element ``e``'s level is >= 0), ``qs`` (64 B, the low two bits of ``level mod 4``: element
    ``e`` at byte ``32 (e // 128) + e % 32``, shift ``2 ((e % 128) // 32)``), 12 bytes of 6-bit
    scales stored as ``scale + 32`` (low nibbles in bytes 0-7, ``j`` and ``j + 8`` sharing a byte;
    the two high bits in bytes 8-11, shift ``2 (j // 4)`` of byte ``8 + j % 4``), then fp16 ``d``.
    """
    rows, cols = levels.shape
    if cols % QK_K:
        raise ValueError(f"Q3_K needs in-features divisible by {QK_K}, got {cols}")
    nb = rows * cols // QK_K
    q = levels.astype(np.int16).reshape(nb, QK_K)
    if q.min() < -4 or q.max() > 3:
        raise ValueError("Q3_K levels must lie in [-4, 3]")
    sc = sub_scales.astype(np.int16).reshape(nb, 16)
    if sc.min() < -32 or sc.max() > 31:
        raise ValueError("Q3_K sub-block scales must lie in [-32, 31]")
    e = np.arange(QK_K)
    hbit = (q >= 0).astype(np.uint8) << (e // 32).astype(np.uint8)
    hmask = np.zeros((nb, 32), np.uint8)
    np.bitwise_or.at(hmask, (slice(None), e % 32), hbit)
    low = (q & 3).astype(np.uint8) << (2 * ((e % 128) // 32)).astype(np.uint8)
    qs = np.zeros((nb, 64), np.uint8)
    np.bitwise_or.at(qs, (slice(None), 32 * (e // 128) + e % 32), low)
    u = (sc + 32).astype(np.uint8)
    j = np.arange(16)
    lo = np.zeros((nb, 8), np.uint8)
    np.bitwise_or.at(lo, (slice(None), j % 8), (u & 0x0F) << (4 * (j // 8)).astype(np.uint8))
    hi = np.zeros((nb, 4), np.uint8)
    np.bitwise_or.at(hi, (slice(None), j % 4), ((u >> 4) & 0x03) << (2 * (j // 4)).astype(np.uint8))
    dd = d.astype(np.float16).reshape(nb, 1).view(np.uint8)
    return np.concatenate([hmask, qs, lo, hi, dd], axis=1).reshape(rows, cols // QK_K * 110)


def q3_k_params(w: np.ndarray, sub_scale: np.ndarray | None = None):
    """Round-to-nearest Q3_K of a float (rows, in) weight: ``(levels, sub_scales, d)``.

    Sub-block scales start from ``sub_scale`` (rows, in // 16; default ``max|w| / 4`` per 16
    weights), are quantized to 6 bits against ``d = max |scale| / 31`` per 256, and the levels are
    then rounded on the grid those quantized scales give. (llama.cpp's ``quantize_row_q3_K``
    searches each sub-block scale for least squared error instead; this is the plain RTN version,
    and :func:`pack_q3_k` writes whichever codes it is given.)
    """
    rows, cols = w.shape
    if cols % QK_K:
        raise ValueError(f"Q3_K needs in-features divisible by {QK_K}, got {cols}")
    wb = w.astype(np.float32).reshape(rows, cols // 16, 16)
    s = np.abs(wb).max(-1) / 4 if sub_scale is None else np.asarray(sub_scale, np.float32)
    sb = s.reshape(rows, cols // QK_K, 16)
    d = (np.abs(sb).max(-1) / 31).astype(np.float16)
    d32 = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(sb, d32, out=np.zeros_like(sb), where=d32 > 0)), -32, 31)
    eff = (d32 * sc).reshape(rows, cols // 16, 1)
    lv = np.clip(np.round(np.divide(wb, eff, out=np.zeros_like(wb), where=eff != 0)), -4, 3)
    return lv.reshape(rows, cols).astype(np.int8), sc.reshape(rows, cols // 16).astype(np.int8), d


def gguf_quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """gguf-py's own numpy quantizer (one of :data:`GGUF_WRITABLE`), or ours for Q3_K (RTN,
    :func:`q3_k_params`); returns the raw blocks."""
    import gguf
    if qtype == "Q3_K":                                   # our writer (gguf-py reads it)
        return pack_q3_k(*q3_k_params(w))
    if qtype not in GGUF_WRITABLE:
        raise ValueError(f"cannot quantize to {qtype}; writable types: {GGUF_WRITABLE + ('Q3_K',)}")
    if qtype == "F32":
        return np.ascontiguousarray(w, dtype=np.float32)
    if qtype == "F16":
        return np.ascontiguousarray(w, dtype=np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), _qt(qtype))


def gguf_dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    import gguf
    return gguf.quants.dequantize(raw, _qt(qtype)).astype(np.float32)


def write_gguf(path: str | Path, tensors: dict, arch: str = "llama",
               metadata: dict | None = None) -> Path:
    """Write tensors to a GGUF file.

    ``tensors`` maps a name to a float ``np.ndarray`` (written as F32) or to a pair
    ``(raw_blocks, qtype_name)`` as made by :func:`gguf_quantize` or the ``pack_*`` helpers.
    ``metadata`` values (str, int, float, bool) go into the key-value section.
    """
    import gguf
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    for k, v in (metadata or {}).items():
        if isinstance(v, bool):
            writer.add_bool(k, v)
        elif isinstance(v, int):
            writer.add_int64(k, v)
        elif isinstance(v, float):
            writer.add_float64(k, v)
        else:
            writer.add_string(k, str(v))
    for name, t in tensors.items():
        if isinstance(t, tuple):
            raw, qtype = t
            if qtype in ("F32", "F16"):
                writer.add_tensor(name, np.ascontiguousarray(raw))
            else:
                writer.add_tensor(name, np.ascontiguousarray(raw), raw_dtype=_qt(qtype))
        else:
            writer.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_gguf(path: str | Path) -> dict[str, dict]:
    """Read a GGUF file with ``gguf.GGUFReader``: name -> {qtype, raw, shape, values}.

    ``values`` is the dequantized float32 array in the logical (row-major, PyTorch) shape; ``raw``
    the stored blocks.
    """
    import gguf
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        raw = np.array(t.data)
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))   # ggml lists dims fastest first
        vals = raw.astype(np.float32) if qtype in ("F32", "F16") else gguf_dequantize(raw, qtype)
        out[t.name] = {"qtype": qtype, "raw": raw, "shape": shape, "values": vals.reshape(shape)}
    return out


def gguf_metadata(path: str | Path) -> dict:
    """The scalar and string key-value pairs of a GGUF file."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    meta = {}
    for k, f in reader.fields.items():
        if k.startswith("GGUF."):
            continue
        try:
            meta[k] = f.contents()
        except Exception:                       # arrays etc.: skip
            pass
    return meta


def export_model_gguf(model: nn.Module, path: str | Path, qtype: str = "Q4_0",
                      codes: dict | None = None, quantize: list[str] | None = None,
                      metadata: dict | None = None) -> Path:
    """Write every parameter of ``model`` to GGUF, keeping PyTorch names.

    Weights named in ``quantize`` are written as ``qtype``: from ``codes[name]`` when given
    (bit-exact, e.g. GSQ's assignment: ``(levels, d)``, or ``(levels, sub_scales, d)`` for Q3_K),
    else with :func:`gguf_quantize`. Everything else is F32. Tied parameters are written once.
    """
    packers = {"Q4_0": pack_q4_0, "Q8_0": pack_q8_0, "TQ2_0": pack_tq2_0, "Q3_K": pack_q3_k}
    tensors, seen = {}, set()
    quantize = set(quantize or [])
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        arr = p.detach().cpu().float().numpy()
        if name in quantize:
            if codes and name in codes:
                tensors[name] = (packers[qtype](*map(np.asarray, codes[name])), qtype)
            else:
                tensors[name] = (gguf_quantize(arr, qtype), qtype)
        else:
            tensors[name] = arr
    return write_gguf(path, tensors, metadata=metadata)


def import_model_gguf(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a file written by :func:`export_model_gguf` into ``model`` (dequantized, in place)."""
    data = read_gguf(path)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in data.items():
            if name not in params:
                raise KeyError(f"GGUF tensor {name!r} is not a parameter of the model")
            params[name].copy_(torch.from_numpy(t["values"]).reshape(params[name].shape))
    return model


def bits_per_weight(bits: int, group_size: int, scale_bits: int = 16) -> float:
    """Storage cost of a group-wise grid: ``bits + scale_bits / group_size``."""
    return bits + (scale_bits / group_size if group_size > 0 else 0.0)


__all__ = [n for n in dir() if not n.startswith("_") and n not in ("annotations", "math")]
