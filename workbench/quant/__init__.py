"""Quantization primitives shared by notebooks 02, 10 and 14 (and the GGUF files they write).

- :mod:`.grid`: group-wise RTN grids (the GPTQ reference's convention), BitNet b1.58 absmean
  ternary + STE, the layers a quantizer replaces, storage cost;
- :mod:`.gptq`: GPTQ as the reference ``IST-DASLab/gptq`` does it (groups, act-order, static
  groups) and the input Hessians it needs;
- :mod:`.linear`: :class:`QuantLinear`, integer codes and trainable per-group scales;
- :mod:`.gguf`: GGUF files through the ``gguf`` package, plus our Q3_K writer.

Everything is re-exported here: ``from workbench import quant; quant.rtn(...)``.
"""
from .gguf import (GGUF_WRITABLE, QK_K, export_model_gguf, gguf_dequantize, gguf_metadata,
                   gguf_quantize, import_model_gguf, pack_q3_k, pack_q4_0, pack_q8_0, pack_tq2_0,
                   q3_k_params, q4_0_codes, q4_0_quantized, read_gguf, unpack_q4_0, write_gguf)
from .gptq import HessianCollector, collect_hessians, gptq, output_error
from .grid import (Quantized, absmean_ternary, bits_per_weight, block_linears, dequantize,
                   expand_groups, levels, quantize_codes, rtn, rtn_params, ste, ternary_ste)
from .linear import QuantLinear

__all__ = ["GGUF_WRITABLE", "QK_K", "export_model_gguf", "gguf_dequantize", "gguf_metadata",
           "gguf_quantize", "import_model_gguf", "pack_q3_k", "pack_q4_0", "pack_q8_0",
           "pack_tq2_0", "q3_k_params", "q4_0_codes", "q4_0_quantized", "read_gguf",
           "unpack_q4_0", "write_gguf",
           "HessianCollector", "collect_hessians", "gptq", "output_error",
           "Quantized", "absmean_ternary", "bits_per_weight", "block_linears", "dequantize",
           "expand_groups", "levels", "quantize_codes", "rtn", "rtn_params", "ste", "ternary_ste",
           "QuantLinear"]
