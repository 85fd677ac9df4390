"""Quantization primitives shared by notebooks 02, 10 and 14 (and the GGUF files they write).

- :mod:`.grid`: group-wise RTN grids (the GPTQ reference's convention), BitNet b1.58 absmean
  ternary + STE, the layers a quantizer replaces, storage cost;
- :mod:`.gptq`: GPTQ as the reference ``IST-DASLab/gptq`` does it (groups, act-order, static
  groups) and the input Hessians it needs;
- :mod:`.linear`: :class:`QuantLinear`, integer codes and trainable per-group scales;
- :mod:`.awq`: AWQ's activation-aware per-channel scales before RTN (Lin et al. 2024);
- :mod:`.vq`: GPTVQ, vector GPTQ with small learned codebooks (van Baalen et al. 2024);
- :mod:`.gguf`: GGUF files that llama.cpp and transformers load (llama.cpp's names,
  hyper-parameters and tokenizer; the project's codes packed into Q4_0/Q8_0/TQ1_0/TQ2_0
  blocks), through the ``gguf`` package, plus our Q3_K writer.

The algorithms are re-exported here (``from workbench import quant; quant.rtn(...)``); the GGUF
file format stays under its own namespace: ``quant.gguf.export_model_gguf(...)``.
"""
from . import gguf
from .awq import awq, awq_scales, awq_weight, mean_abs_inputs
from .gptq import HessianCollector, collect_hessians, gptq, output_error
from .grid import (Quantized, absmean_ternary, bits_per_weight, block_linears, dequantize,
                   expand_groups, levels, quantize_codes, rtn, rtn_params, ste, ternary_quantized,
                   ternary_ste)
from .linear import QuantLinear
from .vq import VQQuantized, gptvq, rows_for_budget, vq_bits_per_weight

__all__ = ["gguf",
           "HessianCollector", "collect_hessians", "gptq", "output_error",
           "Quantized", "absmean_ternary", "bits_per_weight", "block_linears", "dequantize",
           "expand_groups", "levels", "quantize_codes", "rtn", "rtn_params", "ste",
           "ternary_quantized", "ternary_ste",
           "QuantLinear",
           "awq", "awq_scales", "awq_weight", "mean_abs_inputs",
           "VQQuantized", "gptvq", "rows_for_budget", "vq_bits_per_weight"]
