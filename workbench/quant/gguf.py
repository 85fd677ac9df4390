"""GGUF files that llama.cpp and transformers load, through the ``gguf`` package (ggml-org/llama.cpp
``gguf-py``).

:func:`export_model_gguf` writes a ``transformers`` Llama, Qwen2, Qwen3 or GPT-2 causal LM the
way llama.cpp's ``convert_hf_to_gguf.py`` does: tensor names from ``gguf.get_tensor_name_map``
(``token_embd``, ``blk.N.attn_q``, ``blk.N.attn_q_norm``, ``output_norm``, ...), Llama's q/k rows
permuted to GGML's rotary layout (Qwen2 and Qwen3 rotate halves, as HF does, and are not), the
``general.*`` and ``<arch>.*`` hyper-parameters, and the tokenizer as a ``gpt2`` (byte-level BPE)
vocabulary with merges and special ids. Block weights are written in the asked
type: the project's own integer codes (RTN, GPTQ, GSQ, a :class:`QuantLinear`, ternary levels)
are packed bit-exactly into Q4_0 / Q8_0 / TQ1_0 / TQ2_0 blocks when the grid fits
(:func:`block_codes`), float weights go through gguf-py's quantizer; a row that a block size does
not divide follows llama.cpp's fallback rule (:func:`fallback_type`). Norms and biases stay F32.
:func:`load_transformers` and :func:`llama_cpp_logits` read the files back with the real
runtimes (the latter needs the optional ``llama-cpp-python``).

gguf-py quantizes in numpy only Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TQ1_0, TQ2_0 and BF16 (K-quants are
dequantize-only there), so those plus F32 and F16 are what :func:`gguf_quantize` writes from
floats; the ``pack_*`` helpers write given integer codes and scales bit-exactly. The K-quant
writer is ours: :func:`pack_q3_k` (Q3_K, symmetric 3-bit levels, 6-bit scales per 16 weights,
fp16 scale per 256) with an RTN quantizer :func:`q3_k_params`; gguf-py's dequantizer reads it
back bit-exactly.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig
from transformers.pytorch_utils import Conv1D

from .grid import Quantized
from .linear import QuantLinear

__all__ = ["ARCHS", "FLOAT_TYPES", "GGUF_WRITABLE", "LEVEL_RANGE", "QK_K", "add_tokenizer",
           "block_codes", "block_size", "export_model_gguf", "fallback_type", "gguf_arch",
           "gguf_dequantize", "gguf_metadata", "gguf_quantize", "have_llama_cpp",
           "import_model_gguf", "llama_cpp_logits", "llama_cpp_model", "llama_cpp_perplexity",
           "llama_permute_rows", "load_transformers", "logits_perplexity", "pack_q3_k",
           "pack_q4_0", "pack_q8_0", "pack_tq1_0", "pack_tq2_0", "q3_k_params", "q4_0_codes",
           "q4_0_quantized", "read_gguf", "stored_weight", "tensor_types", "tokenizer_pre",
           "unpack_q4_0", "unsupported", "write_gguf"]

# -- GGUF -------------------------------------------------------------------------------------

GGUF_WRITABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0")


def _qt(name: str):
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
    return gguf.quants.dequantize(raw, _qt(qtype)).astype(np.float32)


def write_gguf(path: str | Path, tensors: dict, arch: str = "llama",
               metadata: dict | None = None) -> Path:
    """Write tensors to a GGUF file.

    ``tensors`` maps a name to a float ``np.ndarray`` (written as F32) or to a pair
    ``(raw_blocks, qtype_name)`` as made by :func:`gguf_quantize` or the ``pack_*`` helpers.
    ``metadata`` values (str, int, float, bool) go into the key-value section.
    """
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    for k, v in (metadata or {}).items():
        _add_value(writer, k, v)
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



def pack_tq1_0(levels: np.ndarray, d: np.ndarray) -> np.ndarray:
    """TQ1_0 blocks (54 bytes per 256 weights, 1.6875 bpw) from ternary levels (rows, in) and fp16
    scales (rows, in // 256).

    The bytes are gguf-py's own ``TQ1_0`` quantizer applied to the levels themselves (each
    block's absmax is 1, or 0 for an all-zero block, so it stores exactly these levels, five
    base-3 digits per byte); then each block's trailing fp16 scale is set to ``d``.
    """
    rows, cols = levels.shape
    lv = np.asarray(levels)
    if cols % QK_K:
        raise ValueError(f"TQ1_0 needs in-features divisible by {QK_K}, got {cols}")
    if lv.min() < -1 or lv.max() > 1:
        raise ValueError("TQ1_0 levels must lie in {-1, 0, 1}")
    raw = gguf_quantize(lv.astype(np.float32), "TQ1_0").reshape(rows * cols // QK_K, 54).copy()
    raw[:, -2:] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return raw.reshape(rows, cols // QK_K * 54)


# -- which grids fit which blocks, and the rule for rows a block does not divide ----------------

# what each block type holds exactly: value = d * level, one fp16 d per block. Q8_0 stores int8,
# but llama.cpp's own quantizer writes only -127..127 (a symmetric range its SIMD kernels are
# built and tested for), so -128 is refused rather than trusted.
LEVEL_RANGE = {"Q4_0": (-8, 7), "Q8_0": (-127, 127), "TQ1_0": (-1, 1), "TQ2_0": (-1, 1)}
PACKERS = {"Q4_0": pack_q4_0, "Q8_0": pack_q8_0, "TQ1_0": pack_tq1_0, "TQ2_0": pack_tq2_0,
           "Q3_K": pack_q3_k}
FLOAT_TYPES = ("F32", "F16", "BF16")


def block_size(qtype: str) -> int:
    """Weights per block of ``qtype`` (1 for the float types), from ``gguf.GGML_QUANT_SIZES``."""
    return gguf.GGML_QUANT_SIZES[_qt(qtype)][0]


def fallback_type(qtype: str, cols: int) -> str:
    """The type a tensor with rows of ``cols`` weights is written as when asked for ``qtype``.

    llama.cpp's rule (``tensor_type_fallback`` in ``src/llama-quant.cpp``, what ``llama-quantize``
    does): ``qtype`` itself when its block size divides the row; a 256-block ternary or K type
    (TQ1_0, TQ2_0, Q3_K) falls back to Q4_0; a row that 32 does not divide either is F16.
    """
    if qtype in FLOAT_TYPES or cols % block_size(qtype) == 0:
        return qtype
    if qtype in ("TQ1_0", "TQ2_0", "Q3_K") and cols % 32 == 0:
        return "Q4_0"
    return "F16"


def block_codes(q: Quantized, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``(levels int8, d float16 per block)`` of a :class:`Quantized` in ``qtype``'s blocks.

    A grid fits exactly when it is symmetric (``value = scale * level``, integer zero points),
    its levels lie in :data:`LEVEL_RANGE` and every block lies inside one scale group (the group
    size is a multiple of the block size: each block repeats its group's scale). The scales are
    rounded to fp16, as all of these formats store them. Anything else raises ``ValueError``
    (act-order's scattered groups, groups smaller than a block, asymmetric levels out of range):
    writing it would silently requantize the codes.
    """
    if qtype not in LEVEL_RANGE:
        raise ValueError(f"integer codes are packed into {sorted(LEVEL_RANGE)}, not {qtype}")
    if q.g_idx is not None:
        raise ValueError("act-order groups are scattered over the columns, a GGUF block holds "
                         "consecutive weights: quantize with static_groups=True")
    rows, cols = q.codes.shape
    b = block_size(qtype)
    g = cols if q.group_size <= 0 else q.group_size
    if cols % b:
        raise ValueError(f"{qtype} needs rows divisible by {b}, got {cols} (see fallback_type)")
    if g % b:
        raise ValueError(f"{qtype} stores one scale per {b} weights: groups of {g} do not tile it")
    z = q.per_column(q.zero.float())
    if not torch.equal(z, torch.round(z)):
        raise ValueError("non-integer zero points: not an integer grid")
    lv = q.level_index.cpu().numpy()
    lo, hi = LEVEL_RANGE[qtype]
    if lv.min() < lo or lv.max() > hi:
        raise ValueError(f"levels {lv.min()}..{lv.max()} do not fit {qtype}'s {lo}..{hi}")
    scale = q.scale.detach().float().cpu().numpy()
    if scale.shape != (rows, cols // g):
        raise ValueError(f"scale has shape {scale.shape}, expected {(rows, cols // g)}")
    return lv.astype(np.int8), np.repeat(scale, g // b, axis=1).astype(np.float16)


def stored_weight(q: Quantized, qtype: str) -> torch.Tensor:
    """The float32 weight a ``qtype`` file holds for ``q``: its levels times fp16-rounded scales
    (``qtype`` after :func:`fallback_type`; F16/F32 hold ``q.dequantize()`` in that precision)."""
    t = fallback_type(qtype, q.codes.shape[1])
    if t in FLOAT_TYPES:
        w = q.dequantize().float()
        return w.half().float() if t == "F16" else w
    lv, d = block_codes(q, t)
    return torch.from_numpy(np.repeat(d.astype(np.float32), block_size(t), axis=1)
                            * lv.astype(np.float32))


# -- a transformers causal LM as a llama.cpp GGUF file --------------------------------------------

# model_type -> gguf.MODEL_ARCH; Mistral is written as Llama, as llama.cpp's converter does (the
# same tensors; its sliding window is not carried, which only matters past the window). Qwen3 is
# Qwen2 without q/k/v biases and with per-head RMSNorm weights on q and k (``attn_q_norm``,
# ``attn_k_norm``, head_dim long, F32 like every norm)
ARCHS = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gpt2": "GPT2",
         "mistral": "LLAMA"}


def gguf_arch(config):
    """``gguf.MODEL_ARCH`` of a ``transformers`` config (Llama, Qwen2, Qwen3 or GPT-2)."""
    mt = getattr(config, "model_type", None)
    if mt not in ARCHS:
        raise ValueError(f"GGUF export knows the architectures {sorted(ARCHS)}, not {mt!r}")
    return gguf.MODEL_ARCH[ARCHS[mt]]


def _rope_theta(config) -> float:
    rp = getattr(config, "rope_parameters", None) or {}
    return float(rp.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def llama_permute_rows(rows: int, n_head: int) -> np.ndarray:
    """Row order of ``LlamaModel.permute`` in llama.cpp's ``convert_hf_to_gguf.py`` for a q or k
    projection (HF's rotary layout, halves of each head, to GGML's interleaved pairs):
    ``w_gguf = w_hf[idx]``. transformers' GGUF loader applies the inverse."""
    half = rows // n_head // 2
    return np.arange(rows).reshape(n_head, 2, half).swapaxes(1, 2).reshape(-1)


def tokenizer_pre(tokenizer) -> str:
    """The llama.cpp pre-tokenizer (``tokenizer.ggml.pre``) that splits text as ``tokenizer`` does.

    The zoo's byte-level BPE isolates every digit, then applies GPT-2's regex: llama.cpp's
    ``refact`` pre-type is exactly that (``\\p{N}``, then GPT-2's regex). A plain GPT-2
    byte-level BPE is ``gpt-2``. Anything else raises: a wrong pre-type would tokenize differently
    without a word.
    """
    return _pre_type(json.loads(tokenizer.backend_tokenizer.to_str()))


def _pre_type(spec: dict) -> str:
    """:func:`tokenizer_pre` of a tokenizer's ``tokenizer.json`` content."""
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [(p.get("type"), p.get("individual_digits"), p.get("use_regex")) for p in parts]
    if kinds == [("Digits", True, None), ("ByteLevel", None, True)]:
        return "refact"
    if kinds == [("ByteLevel", None, True)]:
        return "gpt-2"
    raise ValueError(f"no llama.cpp pre-tokenizer is known for {pre}; pass tokenizer_pre=")


def unsupported(config, tokenizer=None) -> str | None:
    """Why :func:`export_model_gguf` cannot write a model of ``config`` with ``tokenizer`` (a fast
    tokenizer, or its ``tokenizer.json`` content as a dict), or None when it can: an architecture
    outside :data:`ARCHS`, or a tokenizer that is not a byte-level BPE with a known llama.cpp
    pre-tokenizer. Nothing is written or loaded; the notebooks ask before they train."""
    mt = getattr(config, "model_type", None)
    if mt not in ARCHS:
        return f"GGUF export knows the architectures {sorted(ARCHS)}, not {mt!r}"
    if tokenizer is None:
        return None
    spec = tokenizer if isinstance(tokenizer, dict) else json.loads(
        tokenizer.backend_tokenizer.to_str())
    kind = (spec.get("model") or {}).get("type")
    if kind != "BPE":
        return f"GGUF export writes byte-level BPE tokenizers, not {kind}"
    try:
        _pre_type(spec)
    except ValueError:
        pre = spec.get("pre_tokenizer") or {}
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        return ("GGUF export knows the pre-tokenizers of the zoo's byte-level BPE and GPT-2's, "
                f"not {' + '.join(str(q.get('type')) for q in parts) or 'none'}")
    return None


def add_tokenizer(writer, tokenizer, vocab_size: int, pre: str | None = None) -> None:
    """Write ``tokenizer`` as llama.cpp's ``gpt2`` model (byte-level BPE): tokens, token types
    (special tokens CONTROL), merges, bos/eos/unk/pad ids, and no BOS/EOS added on encode (as the
    zoo's tokenizer does). Ids past the tokenizer's vocabulary (a padded embedding) are UNUSED."""

    bpe = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    if bpe.get("type") != "BPE":
        raise ValueError(f"only byte-level BPE tokenizers are written, not {bpe.get('type')}")
    tokens = tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), vocab_size))))
    special = set(tokenizer.all_special_ids)
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
             for i in range(len(tokens))]
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or tokenizer_pre(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in bpe.get("merges", [])])
    for kind in ("bos", "eos", "unk", "pad"):
        tid = getattr(tokenizer, f"{kind}_token_id", None)
        if tid is not None:
            getattr(writer, f"add_{kind}_token_id")(int(tid))
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)


def _add_hparams(writer, config, arch) -> None:
    """``<arch>.*`` keys, as ``convert_hf_to_gguf.py`` writes them for these architectures."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    if arch == gguf.MODEL_ARCH.GPT2:
        writer.add_context_length(config.n_positions)
        writer.add_embedding_length(config.n_embd)
        writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)
        writer.add_head_count_kv(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_rope_dimension_count(head_dim)
    # llama.cpp takes head_dim as hidden / heads unless these say otherwise (Qwen3's often does)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def _model_tensors(model: nn.Module, codes: dict):
    """``(hf_name, source)`` for every tensor of ``model``: a float array (GPT-2's ``Conv1D``
    weights transposed to (out, in)), a :class:`Quantized` (a :class:`QuantLinear`'s codes, or
    ``codes[name]``), or a ``pack_*`` tuple from ``codes[name]``. A parameter shared by two modules
    (tied embeddings) comes once, under its first name."""

    seen = set()
    for mname, mod in model.named_modules():
        pre = f"{mname}." if mname else ""
        if isinstance(mod, QuantLinear):
            yield pre + "weight", codes.get(pre + "weight", mod.quantized())
            if mod.bias is not None:
                yield pre + "bias", mod.bias.detach().float().cpu().numpy()
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            name = pre + pname
            if name in codes:
                yield name, codes[name]
                continue
            arr = p.detach().float().cpu().numpy()
            if isinstance(mod, Conv1D) and pname == "weight":
                arr = arr.T
            yield name, np.ascontiguousarray(arr)


def _encode(src, want: str) -> tuple[np.ndarray, str]:
    """``(raw, type)`` of one 2-D tensor asked for as ``want``: :func:`fallback_type` picks the
    type for its row length (given ``pack_*`` tuples have no fallback: they are blocks already)."""
    if isinstance(src, tuple):
        cols = np.asarray(src[0]).shape[1]
        if want not in PACKERS or cols % block_size(want):
            raise ValueError(f"codes given as {want} blocks need a {want} packer and rows "
                             f"divisible by its block size, got {cols}")
        return PACKERS[want](*map(np.asarray, src)), want
    if isinstance(src, Quantized):
        t = fallback_type(want, src.codes.shape[1])
        if t == "Q3_K":
            raise ValueError("Q3_K needs sub-block scales: give codes as (levels, sub_scales, d)")
        if t in FLOAT_TYPES:
            w = src.dequantize().float().cpu().numpy()
            return (w if t == "F32" else w.astype(np.float16)), t
        return PACKERS[t](*block_codes(src, t)), t
    t = fallback_type(want, src.shape[1])
    return gguf_quantize(src, t), t


def export_model_gguf(model: nn.Module, path: str | Path, qtype: str = "Q4_0", tokenizer=None,
                      codes: dict | None = None, quantize: list[str] | None = None,
                      name: str | None = None, metadata: dict | None = None,
                      tokenizer_pre: str | None = None) -> Path:
    """Write a ``transformers`` Llama / Qwen2 / Qwen3 / GPT-2 causal LM as a GGUF file that
    llama.cpp and ``transformers`` (``gguf_file=``) load.

    Which tensors are ``qtype``: the weights named in ``quantize`` (parameter names such as
    ``model.layers.0.self_attn.q_proj.weight``), by default every 2-D weight inside the
    transformer blocks (the attention and MLP projections; embeddings, the LM head, norms and
    biases are not quantized, as everywhere in this project), plus every tensor given in
    ``codes`` and every :class:`QuantLinear`. Their source, in order:

    - ``codes[name]``: a :class:`Quantized` (RTN, GPTQ, GSQ, :func:`~.grid.ternary_quantized`),
      packed bit-exactly by :func:`block_codes`, or a ``pack_*`` tuple such as ``(levels, d)``;
    - a :class:`QuantLinear`'s own codes and scales (packed the same way);
    - else the float weight, quantized by gguf-py's numpy quantizer (:func:`gguf_quantize`).

    A tensor whose rows ``qtype``'s block size does not divide is written as
    :func:`fallback_type` says (llama.cpp's rule: TQ1_0/TQ2_0 -> Q4_0 -> F16). The other 2-D
    tensors (embeddings, an untied LM head) and every 1-D tensor (norms, biases) are F32; a tied
    LM head is not written (llama.cpp and transformers reuse ``token_embd``). Llama's q and k rows
    are permuted as llama.cpp's converter does. ``tokenizer`` (the zoo's byte-level BPE) is
    required: both runtimes read the vocabulary from the file. ``metadata`` adds string, int,
    float or bool keys (e.g. ``workbench.method``).
    """
    if tokenizer is None:
        raise ValueError("pass tokenizer=: llama.cpp and transformers read the vocabulary from "
                         "the file")
    if qtype not in PACKERS and qtype not in GGUF_WRITABLE:
        raise ValueError(f"cannot write {qtype}; writable: {GGUF_WRITABLE + ('Q3_K',)}")
    config = model.config
    arch = gguf_arch(config)
    tmap = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    codes = dict(codes or {})
    chosen = set(quantize) if quantize is not None else None
    n_head, n_kv = config.num_attention_heads, getattr(config, "num_key_value_heads",
                                                       config.num_attention_heads)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(name or Path(getattr(config, "_name_or_path", "") or "workbench").name)
    _add_hparams(writer, config, arch)
    add_tokenizer(writer, tokenizer, config.vocab_size, tokenizer_pre)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "F32"
                         else getattr(gguf.LlamaFileType, f"MOSTLY_{qtype}",
                                      gguf.LlamaFileType.GUESSED))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for k, v in (metadata or {}).items():
        _add_value(writer, k, v)
    written = set()
    for hf_name, src in _model_tensors(model, codes):
        base, suffix = hf_name.rsplit(".", 1)
        gname = tmap.get_name(base)
        if gname is None:
            raise KeyError(f"{hf_name}: no llama.cpp tensor name for it in gguf's "
                           f"{gguf.MODEL_ARCH_NAMES[arch]} map")
        gname = f"{gname}.{suffix}"
        is_2d = not isinstance(src, np.ndarray) or src.ndim == 2
        if hf_name in codes or isinstance(src, Quantized):
            want = qtype
        elif chosen is not None:
            want = qtype if hf_name in chosen else "F32"
        else:
            want = qtype if (is_2d and gname.startswith("blk.")) else "F32"
        raw, t = _encode(src, want) if is_2d else (np.asarray(src, np.float32), "F32")
        if arch == gguf.MODEL_ARCH.LLAMA and gname.split(".")[-2] in ("attn_q", "attn_k"):
            heads = n_head if ".attn_q." in gname else n_kv
            raw = raw[llama_permute_rows(raw.shape[0], heads)]
        if t in FLOAT_TYPES[:2]:
            writer.add_tensor(gname, np.ascontiguousarray(raw))
        else:
            writer.add_tensor(gname, np.ascontiguousarray(raw), raw_dtype=_qt(t))
        written.add(hf_name)
    if chosen is not None and chosen - written:
        raise KeyError(f"not parameters of the model: {sorted(chosen - written)}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_value(writer, key: str, v) -> None:
    if isinstance(v, bool):
        writer.add_bool(key, v)
    elif isinstance(v, int):
        writer.add_int64(key, v)
    elif isinstance(v, float):
        writer.add_float64(key, v)
    else:
        writer.add_string(key, str(v))


def tensor_types(path: str | Path) -> dict[str, str]:
    """``tensor name -> GGML type name`` of a GGUF file, read with ``gguf.GGUFReader``."""
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def import_model_gguf(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a file written by :func:`export_model_gguf` into ``model`` (same architecture and
    shapes), dequantized with gguf-py, in place: the inverse of the export's names, Llama's q/k
    permutation and GPT-2's transposes. Our reader; :func:`load_transformers` is the real one."""
    config = model.config
    arch = gguf_arch(config)
    tmap = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    data = read_gguf(path)
    n_head, n_kv = config.num_attention_heads, getattr(config, "num_key_value_heads",
                                                       config.num_attention_heads)
    mods = dict(model.named_modules())
    with torch.no_grad():
        for hf_name, p in model.named_parameters():
            base, suffix = hf_name.rsplit(".", 1)
            gname = f"{tmap.get_name(base)}.{suffix}"
            if gname not in data:
                raise KeyError(f"{hf_name}: {gname} is not in {path}")
            v = data[gname]["values"]
            if arch == gguf.MODEL_ARCH.LLAMA and gname.split(".")[-2] in ("attn_q", "attn_k"):
                heads = n_head if ".attn_q." in gname else n_kv
                v = v[np.argsort(llama_permute_rows(v.shape[0], heads))]
            if isinstance(mods[base], Conv1D) and suffix == "weight":
                v = v.T
            p.copy_(torch.from_numpy(np.ascontiguousarray(v)).reshape(p.shape))
    return model


# -- reading the files back with the real runtimes ----------------------------------------------

def load_transformers(path: str | Path, dtype=torch.float32, config=None):
    """``(model, tokenizer)`` from a GGUF file through ``transformers`` (``gguf_file=``; needs
    ``accelerate``): its own dequantizer, tensor-name map and inverse q/k permutation.

    For GPT-2, transformers' GGUF config mapping reads ``gpt2.context_length`` as ``n_ctx`` and
    ``gpt2.feed_forward_length`` under a name ``GPT2Config`` ignores, so a file whose
    ``n_positions`` / ``n_inner`` are not GPT-2's defaults (1024, 4 x width) would load with the
    wrong shapes; unless ``config`` is given, we read the config it parses and set those two from
    the file's own keys.
    """
    p = Path(path)
    kw = dict(gguf_file=p.name)
    if config is None:
        meta = gguf_metadata(p)
        if meta.get("general.architecture") == "gpt2":
            config = AutoConfig.from_pretrained(str(p.parent), **kw)
            config.n_positions = int(meta["gpt2.context_length"])
            config.n_inner = int(meta["gpt2.feed_forward_length"])
        elif meta.get("general.architecture") == "llama":
            # transformers reads a Llama-arch file whose general.name says "mistral" as Mistral,
            # whose tensor map this gguf-py lacks: read it as the Llama it is written as
            parsed = AutoConfig.from_pretrained(str(p.parent), **kw)
            if parsed.model_type != "llama":
                config = LlamaConfig(**{k: v for k, v in parsed.to_dict().items()
                                        if k != "model_type"})
        elif meta.get("general.architecture") == "qwen3" and "qwen3.attention.key_length" in meta:
            # its Qwen3 mapping skips key_length: a head_dim other than hidden / heads is set here
            parsed = AutoConfig.from_pretrained(str(p.parent), **kw)
            if parsed.head_dim != int(meta["qwen3.attention.key_length"]):
                parsed.head_dim = int(meta["qwen3.attention.key_length"])
                config = parsed
    if config is not None:
        kw["config"] = config
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), dtype=dtype, **kw)
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return model.eval(), tok


def have_llama_cpp() -> bool:
    """Is ``llama-cpp-python`` (the optional ``[llama]`` extra) importable?"""
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_model(path: str | Path, n_ctx: int, threads: int = 1):
    """A ``llama_cpp.Llama`` on ``path`` that keeps the logits of every position."""
    from llama_cpp import Llama     # the optional [llama] extra: imported only where it is used
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                 logits_all=True, n_threads=threads, n_threads_batch=threads, verbose=False)


def llama_cpp_logits(path: str | Path, blocks, threads: int = 1) -> np.ndarray:
    """llama.cpp's logits (B, T, vocab) for (B, T) token ``blocks``, each block evaluated from an
    empty KV cache, float32 as llama.cpp computes them (its CPU kernels quantize activations to
    Q8_0 / Q8_K for the quantized matmuls)."""
    blocks = np.asarray(blocks)
    llm = llama_cpp_model(path, blocks.shape[1], threads)
    out = np.empty((*blocks.shape, llm.n_vocab()), np.float32)
    for i, row in enumerate(blocks):
        llm.reset()
        llm.eval([int(t) for t in row])
        out[i] = np.asarray(llm.scores[: blocks.shape[1]], dtype=np.float32)
    llm.close()
    return out


def llama_cpp_perplexity(path: str | Path, blocks, threads: int = 1) -> float:
    """exp(mean next-token NLL) of (B, T) token ``blocks`` under llama.cpp (as ``evaluate.perplexity``:
    every block from an empty cache, each position predicting the next), one block at a time."""
    blocks = np.asarray(blocks)
    llm = llama_cpp_model(path, blocks.shape[1], threads)
    total, count = 0.0, 0
    for row in blocks:
        llm.reset()
        llm.eval([int(t) for t in row])
        lg = torch.from_numpy(np.asarray(llm.scores[: len(row)], dtype=np.float32))[:-1].double()
        total += float(torch.nn.functional.cross_entropy(lg, torch.from_numpy(row[1:]),
                                                         reduction="sum"))
        count += len(row) - 1
    llm.close()
    return float(np.exp(total / count))


def logits_perplexity(logits, blocks) -> float:
    """exp(mean next-token NLL) from (B, T, V) logits of (B, T) blocks (as ``evaluate.perplexity``)."""
    lg = torch.as_tensor(np.asarray(logits))[:, :-1].double()
    y = torch.as_tensor(np.asarray(blocks))[:, 1:]
    nll = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1))
    return float(torch.exp(nll))
