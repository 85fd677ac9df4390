"""Quantization primitives shared by notebooks 02, 10 and 14 (and the GGUF files they write).

- :mod:`.grid`: group-wise RTN grids (the GPTQ reference's convention), BitNet b1.58 absmean
  ternary + STE, the layers a quantizer replaces, storage cost;
- :mod:`.gptq`: GPTQ as the reference ``IST-DASLab/gptq`` does it (groups, act-order, static
  groups) and the input Hessians it needs;
- :mod:`.linear`: :class:`QuantLinear`, integer codes and trainable per-group scales;
- :mod:`.gguf`: GGUF files that llama.cpp and transformers load (llama.cpp's names,
  hyper-parameters and tokenizer; the project's codes packed into Q4_0/Q8_0/TQ1_0/TQ2_0
  blocks), through the ``gguf`` package, plus our Q3_K writer.

Everything is re-exported here: ``from workbench import quant; quant.rtn(...)``.
"""
from .gguf import (ARCHS, FLOAT_TYPES, GGUF_WRITABLE, LEVEL_RANGE, QK_K, add_tokenizer,
                   block_codes, block_size, export_model_gguf, fallback_type, gguf_arch,
                   gguf_dequantize, gguf_metadata, gguf_quantize, have_llama_cpp,
                   import_model_gguf, llama_cpp_logits, llama_cpp_model,
                   llama_cpp_perplexity, llama_permute_rows,
                   load_transformers, logits_perplexity, pack_q3_k, pack_q4_0, pack_q8_0,
                   pack_tq1_0, pack_tq2_0, q3_k_params, q4_0_codes, q4_0_quantized, read_gguf,
                   stored_weight, tensor_types, tokenizer_pre, unpack_q4_0, write_gguf)
from .gptq import HessianCollector, collect_hessians, gptq, output_error
from .grid import (Quantized, absmean_ternary, bits_per_weight, block_linears, dequantize,
                   expand_groups, levels, quantize_codes, rtn, rtn_params, ste, ternary_quantized,
                   ternary_ste)
from .linear import QuantLinear

__all__ = ["ARCHS", "FLOAT_TYPES", "GGUF_WRITABLE", "LEVEL_RANGE", "QK_K", "add_tokenizer",
           "block_codes", "block_size", "export_model_gguf", "fallback_type", "gguf_arch",
           "gguf_dequantize", "gguf_metadata", "gguf_quantize", "have_llama_cpp",
           "import_model_gguf", "llama_cpp_logits", "llama_cpp_model", "llama_cpp_perplexity", "llama_permute_rows",
           "load_transformers", "logits_perplexity", "pack_q3_k", "pack_q4_0", "pack_q8_0",
           "pack_tq1_0", "pack_tq2_0", "q3_k_params", "q4_0_codes", "q4_0_quantized",
           "read_gguf", "stored_weight", "tensor_types", "tokenizer_pre", "unpack_q4_0",
           "write_gguf",
           "HessianCollector", "collect_hessians", "gptq", "output_error",
           "Quantized", "absmean_ternary", "bits_per_weight", "block_linears", "dequantize",
           "expand_groups", "levels", "quantize_codes", "rtn", "rtn_params", "ste",
           "ternary_quantized", "ternary_ste",
           "QuantLinear"]
