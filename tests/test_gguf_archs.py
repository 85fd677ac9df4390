"""GGUF files of the architectures beyond Llama / Qwen2 / GPT-2 (``tests/test_gguf.py``): a tiny
random Qwen3 (per-head q/k RMSNorm weights, no q/k/v biases) written with llama.cpp's ``qwen3``
names and keys, read back by gguf-py, by transformers (``gguf_file=``) and by our own reader, with
the in-memory model's logits."""
import gguf
import numpy as np
import pytest
import torch
from test_gguf import (LLAMA_LOGPROB_ATOL, TF_ATOL, _gguf_py_roundtrip, _ids, _logits, _tokens,
                       _with_block_weights, needs_llama)

from workbench import quant as Q
from workbench.data import corpus

# TF_ATOL (1e-4): the file holds the model's own float32 numbers (or exactly the dequantized
# blocks the expected model is given) and transformers runs the same Qwen3 code on them, so only
# float32 summation order could differ (measured: 0.0 at F32 and Q8_0, on logits of size ~1).


@pytest.fixture(scope="module")
def tok():
    return corpus.train_tokenizer(300)


def qwen3(tok, head_dim=16, seed=0):
    """hidden 64, 2 layers, 4 heads, 2 kv heads; the q/k norm weights moved off their init of
    ones, so that a dropped or misplaced norm changes the logits."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    m = Qwen3ForCausalLM(Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=64,
        tie_word_embeddings=True, **_ids(tok))).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    return m


def test_qwen3_is_exportable():
    from transformers import Gemma2Config, Qwen3Config
    assert Q.gguf.unsupported(Qwen3Config()) is None
    assert Q.gguf.gguf_arch(Qwen3Config()) == gguf.MODEL_ARCH.QWEN3
    assert "not 'gemma2'" in Q.gguf.unsupported(Gemma2Config())


def test_qwen3_file_has_llama_cpp_names_keys_and_types(tmp_path, tok):
    m = qwen3(tok)
    path = Q.gguf.export_model_gguf(m, tmp_path / "m.gguf", "Q8_0", tokenizer=tok, name="q3")
    per_block = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    expect = {"token_embd.weight": "F32", "output_norm.weight": "F32"}
    for b in range(2):
        expect.update({f"blk.{b}.{n}.weight": "Q8_0" for n in per_block})
        expect.update({f"blk.{b}.{n}.weight": "F32" for n in ("attn_norm", "ffn_norm",
                                                               "attn_q_norm", "attn_k_norm")})
    assert Q.gguf.tensor_types(path) == expect        # tied head, and no q/k/v biases
    meta = Q.gguf.gguf_metadata(path)
    K, arch = gguf.Keys, "qwen3"
    assert meta[K.General.ARCHITECTURE] == arch
    want = {K.LLM.EMBEDDING_LENGTH: 64, K.LLM.BLOCK_COUNT: 2, K.LLM.FEED_FORWARD_LENGTH: 128,
            K.Attention.HEAD_COUNT: 4, K.Attention.HEAD_COUNT_KV: 2, K.Rope.DIMENSION_COUNT: 16,
            K.Attention.KEY_LENGTH: 16, K.Attention.VALUE_LENGTH: 16}
    for k, v in want.items():
        assert meta[k.format(arch=arch)] == v, k
    data = Q.gguf.read_gguf(path)                     # gguf-py: the norms as they are, unpermuted
    for b in range(2):
        attn = m.model.layers[b].self_attn
        for g, hf in (("attn_q_norm", attn.q_norm), ("attn_k_norm", attn.k_norm)):
            assert data[f"blk.{b}.{g}.weight"]["shape"] == (16,)
            assert np.array_equal(data[f"blk.{b}.{g}.weight"]["values"],
                                  hf.weight.detach().numpy())


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_transformers_and_our_reader_load_qwen3(tmp_path, tok, qtype):
    m = qwen3(tok)
    path = Q.gguf.export_model_gguf(m, tmp_path / f"{qtype}.gguf", qtype, tokenizer=tok)
    loaded, _ = Q.gguf.load_transformers(path)
    assert type(loaded) is type(m)
    x = _tokens(tok)
    expect = _with_block_weights(m, _gguf_py_roundtrip(qtype))
    assert torch.allclose(_logits(loaded, x), _logits(expect, x), atol=TF_ATOL, rtol=0)
    if qtype == "F32":
        assert torch.allclose(_logits(loaded, x), _logits(m, x), atol=TF_ATOL, rtol=0)
    else:                           # the quantized model really differs from the float one
        assert (_logits(loaded, x) - _logits(m, x)).abs().max() > 10 * TF_ATOL
    back = Q.gguf.import_model_gguf(qwen3(tok, seed=1), path)
    assert torch.allclose(_logits(back, x), _logits(expect, x), atol=TF_ATOL, rtol=0)


def test_qwen3_head_dim_other_than_hidden_over_heads(tmp_path, tok):
    """Qwen3's head_dim is its own (e.g. 128 at hidden 1024, 16 heads): key_length carries it."""
    m = qwen3(tok, head_dim=32)
    path = Q.gguf.export_model_gguf(m, tmp_path / "m.gguf", "F32", tokenizer=tok)
    assert Q.gguf.gguf_metadata(path)["qwen3.attention.key_length"] == 32
    loaded, _ = Q.gguf.load_transformers(path)
    assert loaded.config.head_dim == 32
    x = _tokens(tok)
    assert torch.allclose(_logits(loaded, x), _logits(m, x), atol=TF_ATOL, rtol=0)


@needs_llama
def test_llama_cpp_loads_qwen3_and_agrees(tmp_path, tok):
    m = qwen3(tok)
    path = Q.gguf.export_model_gguf(m, tmp_path / "m.gguf", "F32", tokenizer=tok)
    x = _tokens(tok, n=3, t=32)
    ours = torch.log_softmax(_logits(m, x).double(), -1)
    theirs = torch.log_softmax(torch.from_numpy(Q.gguf.llama_cpp_logits(path, x.numpy()))
                               .double(), -1)
    assert float((ours - theirs).abs().max()) < LLAMA_LOGPROB_ATOL


def test_qwen3_ternary_codes_are_stored_exactly(tmp_path, tok):
    """10's path: ternary codes of the block linears (TQ2_0, Q4_0 for 64-long rows), the stored
    weights exactly fp16(gamma) * q, and transformers' logits those of the stored weights."""
    m = qwen3(tok)
    codes = {n + ".weight": Q.ternary_quantized(lin.weight) for n, lin in
             Q.block_linears(m).items()}
    path = Q.gguf.export_model_gguf(m, tmp_path / "m.gguf", "TQ2_0", tokenizer=tok, codes=codes)
    expect = _with_block_weights(m, lambda n, w: Q.gguf.stored_weight(codes[n + ".weight"],
                                                                     "TQ2_0"))
    back = dict(Q.gguf.import_model_gguf(qwen3(tok, seed=1), path).named_parameters())
    assert all(torch.equal(back[n], Q.gguf.stored_weight(q, "TQ2_0")) for n, q in codes.items())
    loaded, _ = Q.gguf.load_transformers(path)
    x = _tokens(tok)
    assert torch.allclose(_logits(loaded, x), _logits(expect, x), atol=TF_ATOL, rtol=0)
