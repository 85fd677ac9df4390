"""GGUF export/import through the ``gguf`` package (ggml-org/llama.cpp ``gguf-py``).

gguf-py quantizes in numpy only Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TQ1_0, TQ2_0 and BF16 (K-quants are
dequantize-only there), so those plus F32 and F16 are what :func:`write_gguf` can write from
floats; :func:`pack_q4_0`, :func:`pack_q8_0` and :func:`pack_tq2_0` write given integer codes and
scales bit-exactly (what a method that chooses its own codes, like GSQ, needs). The K-quant writer
is ours: :func:`pack_q3_k` (Q3_K, symmetric 3-bit levels, 6-bit scales per 16 weights, fp16 scale
per 256) with an RTN quantizer :func:`q3_k_params`; gguf-py's dequantizer reads it back
bit-exactly.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from .grid import Quantized

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


def q4_0_quantized(w: np.ndarray) -> Quantized:
    """gguf-py's own Q4_0 of a float (rows, in) weight, read back as a :class:`Quantized`
    (codes ``level + 8``, fp16 scales as float32, zero 8, groups of 32): its ``dequantize()``
    is exactly gguf-py's dequantized tensor."""
    lv, d = unpack_q4_0(gguf_quantize(np.asarray(w, dtype=np.float32), "Q4_0"), w.shape[1])
    return Quantized(torch.from_numpy(lv.astype(np.int16) + 8),
                     torch.from_numpy(d.astype(np.float32)), torch.full(d.shape, 8.0), 4, 32)


def q4_0_codes(q: Quantized) -> tuple[np.ndarray, np.ndarray]:
    """``(levels int8, d float16)`` for :func:`pack_q4_0` from a 4-bit, group-32 symmetric
    :class:`Quantized`; the scales are rounded to fp16, as the format stores them."""
    if q.bits != 4 or q.group_size != 32 or q.g_idx is not None:
        raise ValueError(f"Q4_0 holds 4-bit levels in consecutive groups of 32; got {q.bits} "
                         f"bits, groups of {q.group_size}")
    return q.level_index.cpu().numpy().astype(np.int8), q.scale.cpu().numpy().astype(np.float16)


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
