"""GGUF files that real runtimes load: llama.cpp names, hyper-parameters and tokenizer; the asked
tensor types (read back with ``gguf.GGUFReader``); the project's codes packed bit-exactly; logits
through ``transformers`` (``gguf_file=``) and, when ``llama-cpp-python`` is installed, llama.cpp."""
import copy

import numpy as np
import pytest
import torch

from workbench import quant as Q
from workbench.data import corpus

TF_ATOL = 1e-4          # transformers dequantizes the same numbers: float32 matmul-order noise only


@pytest.fixture(scope="module")
def tok():
    return corpus.train_tokenizer(300)


def _ids(tok):
    return dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, vocab_size=len(tok))


def llama(tok, d=256, ff=512, layers=1, heads=4, kv=2, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=d, intermediate_size=ff, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, max_position_embeddings=64, tie_word_embeddings=True,
        rms_norm_eps=1e-5, **_ids(tok))).eval()


def qwen2(tok, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        **_ids(tok))).eval()


def gpt2(tok, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_inner=96, n_positions=64,
                                      **_ids(tok))).eval()


def _tokens(tok, n=2, t=32):
    return torch.randint(4, len(tok), (n, t), generator=torch.Generator().manual_seed(5))


def _with_block_weights(model, fn):
    """A copy of ``model`` whose block 2-D weights (nn.Linear or GPT-2 Conv1D) are ``fn(w)``
    for ``w`` (out, in)."""
    from transformers.pytorch_utils import Conv1D
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, mod in m.named_modules():
            if (".layers." in name or ".h." in name) and isinstance(mod, (torch.nn.Linear,
                                                                        Conv1D)):
                w = mod.weight.detach()
                w = w.T if isinstance(mod, Conv1D) else w
                new = fn(name, w.contiguous())
                mod.weight.copy_(new.T if isinstance(mod, Conv1D) else new)
    return m


def _gguf_py_roundtrip(qtype):
    def fn(_name, w):
        t = Q.gguf.fallback_type(qtype, w.shape[1])
        a = w.numpy().astype(np.float32)
        if t == "F16":
            return torch.from_numpy(a.astype(np.float16).astype(np.float32))
        return torch.from_numpy(Q.gguf.gguf_dequantize(Q.gguf.gguf_quantize(a, t), t).reshape(w.shape))
    return fn


def _logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits.float()


# -- names, keys, types --------------------------------------------------------------------------

def test_llama_file_has_llama_cpp_names_keys_tokenizer_and_the_asked_types(tmp_path, tok):
    import gguf
    m = llama(tok, d=64, ff=128, layers=2, heads=4, kv=2)
    path = Q.gguf.export_model_gguf(m, tmp_path / "m.gguf", "Q4_0", tokenizer=tok, name="tiny")
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    per_block = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    expect = {"token_embd.weight": "F32", "output_norm.weight": "F32"}
    for b in range(2):
        expect.update({f"blk.{b}.{n}.weight": "Q4_0" for n in per_block})
        expect.update({f"blk.{b}.attn_norm.weight": "F32", f"blk.{b}.ffn_norm.weight": "F32"})
    assert types == expect                                   # tied head: no output.weight
    meta = Q.gguf.gguf_metadata(path)
    K = gguf.Keys
    arch = "llama"
    assert meta[K.General.ARCHITECTURE] == arch and meta[K.General.NAME] == "tiny"
    assert meta[K.General.FILE_TYPE] == gguf.LlamaFileType.MOSTLY_Q4_0
    want = {K.LLM.CONTEXT_LENGTH: 64, K.LLM.EMBEDDING_LENGTH: 64, K.LLM.BLOCK_COUNT: 2,
            K.LLM.FEED_FORWARD_LENGTH: 128, K.Attention.HEAD_COUNT: 4,
            K.Attention.HEAD_COUNT_KV: 2, K.Rope.DIMENSION_COUNT: 16, K.LLM.VOCAB_SIZE: len(tok)}
    for k, v in want.items():
        assert meta[k.format(arch=arch)] == v, k
    assert meta[K.Rope.FREQ_BASE.format(arch=arch)] == pytest.approx(10000.0)
    assert meta[K.Attention.LAYERNORM_RMS_EPS.format(arch=arch)] == pytest.approx(1e-5)
    assert meta[K.Tokenizer.MODEL] == "gpt2" and meta[K.Tokenizer.PRE] == "refact"
    assert meta[K.Tokenizer.BOS_ID] == tok.bos_token_id
    assert meta[K.Tokenizer.EOS_ID] == tok.eos_token_id
    assert meta[K.Tokenizer.PAD_ID] == tok.pad_token_id
    f = reader.fields
    assert len(f[K.Tokenizer.LIST].data) == len(tok)
    kinds = [int(f[K.Tokenizer.TOKEN_TYPE].parts[i][0]) for i in f[K.Tokenizer.TOKEN_TYPE].data]
    assert {i for i, k in enumerate(kinds) if k == gguf.TokenType.CONTROL} == set(
        tok.all_special_ids)
    import json
    n_merges = len(json.loads(tok.backend_tokenizer.to_str())["model"]["merges"])
    assert len(f[K.Tokenizer.MERGES].data) == n_merges > 0


def test_fallback_rule_for_rows_a_block_does_not_divide(tmp_path, tok):
    assert Q.gguf.fallback_type("TQ2_0", 512) == "TQ2_0"
    assert Q.gguf.fallback_type("TQ2_0", 384) == "Q4_0"           # llama.cpp: TQ -> Q4_0 -> F16
    assert Q.gguf.fallback_type("TQ1_0", 48) == "F16"
    assert Q.gguf.fallback_type("Q4_0", 96) == "Q4_0" and Q.gguf.fallback_type("Q8_0", 40) == "F16"
    m = llama(tok, d=256, ff=384, layers=1)                  # ffn_down rows are 384 long
    path = Q.gguf.export_model_gguf(m, tmp_path / "t.gguf", "TQ2_0", tokenizer=tok)
    types = Q.gguf.tensor_types(path)
    assert types["blk.0.ffn_down.weight"] == "Q4_0"
    assert {types[f"blk.0.{n}.weight"] for n in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                 "ffn_gate", "ffn_up")} == {"TQ2_0"}


# -- round trips through transformers ----------------------------------------------------------

@pytest.mark.parametrize("qtype", ["F32", "Q4_0", "Q8_0", "TQ2_0", "TQ1_0"])
def test_transformers_loads_gguf_py_quantized_llama(tmp_path, tok, qtype):
    m = llama(tok)
    path = Q.gguf.export_model_gguf(m, tmp_path / f"{qtype}.gguf", qtype, tokenizer=tok)
    assert {t for n, t in Q.gguf.tensor_types(path).items() if n.startswith("blk.")
            and ("attn_" in n or "ffn_" in n) and "norm" not in n} == {qtype}
    loaded, _ = Q.gguf.load_transformers(path)
    expect = _with_block_weights(m, _gguf_py_roundtrip(qtype))
    x = _tokens(tok)
    assert torch.allclose(_logits(loaded, x), _logits(expect, x), atol=TF_ATOL, rtol=0)
    if qtype != "F32":           # the quantized model really differs from the float one
        assert (_logits(loaded, x) - _logits(m, x)).abs().max() > 10 * TF_ATOL


@pytest.mark.parametrize("make", [qwen2, gpt2])
def test_transformers_loads_qwen2_and_gpt2(tmp_path, tok, make):
    m = make(tok)
    path = Q.gguf.export_model_gguf(m, tmp_path / "m.gguf", "Q8_0", tokenizer=tok)
    types = Q.gguf.tensor_types(path)
    assert all(types[n] == "F32" for n in types if n.endswith(".bias") or "norm" in n)
    assert all(types[n] == "Q8_0" for n in types if n.startswith("blk.") and n.endswith(
        ".weight") and "norm" not in n)
    loaded, _ = Q.gguf.load_transformers(path)
    assert type(loaded) is type(m)
    x = _tokens(tok)
    expect = _with_block_weights(m, _gguf_py_roundtrip("Q8_0"))
    assert torch.allclose(_logits(loaded, x), _logits(expect, x), atol=TF_ATOL, rtol=0)
    back = Q.gguf.import_model_gguf(make(tok, seed=1), path)       # our reader inverts it too
    assert torch.allclose(_logits(back, x), _logits(expect, x), atol=TF_ATOL, rtol=0)


def test_project_codes_are_packed_bit_exactly(tmp_path, tok):
    """RTN 4-bit codes (group 64) go into Q4_0 blocks unchanged; transformers then computes the
    model whose weights are those levels times fp16 scales."""
    import gguf
    m = llama(tok)
    codes = {n + ".weight": Q.rtn(lin.weight.detach(), 4, 64) for n, lin in
             Q.block_linears(m).items()}
    path = Q.gguf.export_model_gguf(m, tmp_path / "c.gguf", "Q4_0", tokenizer=tok, codes=codes)
    raw = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    qn = "model.layers.0.self_attn.v_proj.weight"           # not permuted: rows as given
    assert np.array_equal(raw["blk.0.attn_v.weight"],
                          Q.gguf.pack_q4_0(*Q.gguf.block_codes(codes[qn], "Q4_0")))
    kn = "model.layers.0.self_attn.k_proj.weight"           # permuted rows, same blocks
    perm = Q.gguf.llama_permute_rows(m.config.num_key_value_heads * 64, 2)
    assert np.array_equal(raw["blk.0.attn_k.weight"],
                          Q.gguf.pack_q4_0(*Q.gguf.block_codes(codes[kn], "Q4_0"))[perm])
    loaded, _ = Q.gguf.load_transformers(path)
    expect = _with_block_weights(m, lambda n, w: Q.gguf.stored_weight(codes[n + ".weight"], "Q4_0"))
    x = _tokens(tok)
    assert torch.allclose(_logits(loaded, x), _logits(expect, x), atol=TF_ATOL, rtol=0)
    # the stored model is the project's dequantized one up to fp16 scales
    deq = _with_block_weights(m, lambda n, w: codes[n + ".weight"].dequantize())
    assert (_logits(loaded, x) - _logits(deq, x)).abs().max() < 1e-2


def test_quantlinear_model_exports_its_own_codes(tmp_path, tok):
    m = llama(tok, d=64, ff=128)
    q = copy.deepcopy(m)
    mods = dict(q.named_modules())
    for name, lin in Q.block_linears(m).items():
        parent, attr = name.rsplit(".", 1)
        setattr(mods[parent], attr, Q.QuantLinear.from_linear(lin, 3, 32))
    path = Q.gguf.export_model_gguf(q, tmp_path / "ql.gguf", "Q4_0", tokenizer=tok)
    assert {t for n, t in Q.gguf.tensor_types(path).items() if "norm" not in n and "blk" in n} == {
        "Q4_0"}
    loaded, _ = Q.gguf.load_transformers(path)
    qls = dict(q.named_modules())
    expect = _with_block_weights(m, lambda n, w: Q.gguf.stored_weight(qls[n].quantized(), "Q4_0"))
    x = _tokens(tok)
    assert torch.allclose(_logits(loaded, x), _logits(expect, x), atol=TF_ATOL, rtol=0)


def test_ternary_levels_in_tq_blocks_and_the_q4_0_fallback(tmp_path, tok):
    m = llama(tok, d=256, ff=384)                      # ffn_down (rows of 384) -> Q4_0
    codes = {n + ".weight": Q.ternary_quantized(lin.weight) for n, lin in
             Q.block_linears(m).items()}
    for qtype in ("TQ2_0", "TQ1_0"):
        path = Q.gguf.export_model_gguf(m, tmp_path / f"{qtype}.gguf", qtype, tokenizer=tok,
                                   codes=codes)
        types = Q.gguf.tensor_types(path)
        assert types["blk.0.ffn_down.weight"] == "Q4_0" and types["blk.0.attn_q.weight"] == qtype
        data = Q.gguf.read_gguf(path)
        v = data["blk.0.attn_v.weight"]["values"]
        g = codes["model.layers.0.self_attn.v_proj.weight"]
        assert np.array_equal(v, Q.gguf.stored_weight(g, qtype).numpy())
        assert set(np.unique(np.round(v / float(np.float16(g.scale[0, 0]))))) <= {-1.0, 0.0, 1.0}
        loaded, _ = Q.gguf.load_transformers(path)
        expect = _with_block_weights(m, lambda n, w: Q.gguf.stored_weight(codes[n + ".weight"],
                                                                     qtype))
        x = _tokens(tok)
        assert torch.allclose(_logits(loaded, x), _logits(expect, x), atol=TF_ATOL, rtol=0)


def test_grids_that_do_not_fit_are_refused():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="do not fit"):                # asymmetric, zero 0:
        Q.gguf.block_codes(Q.rtn(w.abs(), 4, 32, sym=False), "Q4_0")       # levels 0..15
    with pytest.raises(ValueError, match="do not tile"):
        Q.gguf.block_codes(Q.rtn(w, 4, 16), "Q4_0")                 # two scales per block
    q8 = Q.rtn(w, 8, 32)
    q8.codes[0, 0] = 0                                         # level -128: not a Q8_0 level
    with pytest.raises(ValueError, match="do not fit"):
        Q.gguf.block_codes(q8, "Q8_0")
    H = torch.eye(64) + 0.1
    with pytest.raises(ValueError, match="scattered"):
        Q.gguf.block_codes(Q.gptq(w, H, 4, 32, actorder=True), "Q4_0")
    lv, d = Q.gguf.block_codes(Q.rtn(w, 3, 64), "Q4_0")             # 3-bit levels fit in Q4_0
    assert lv.min() >= -4 and lv.max() <= 3 and d.shape == (8, 2)


def test_pack_tq1_0_matches_gguf_py_bytes():
    rng = np.random.default_rng(0)
    lv = rng.integers(-1, 2, size=(4, 512)).astype(np.int8)
    d = rng.uniform(0.01, 0.1, size=(4, 2)).astype(np.float16)
    ours = Q.gguf.pack_tq1_0(lv, d)
    w = lv.astype(np.float32) * np.repeat(d.astype(np.float32), 256, 1)
    assert np.array_equal(ours, Q.gguf.gguf_quantize(w, "TQ1_0"))           # gguf-py's own bytes
    assert np.array_equal(Q.gguf.gguf_dequantize(ours, "TQ1_0").reshape(4, 512), w)
    assert np.array_equal(Q.gguf.pack_tq2_0(lv, d), Q.gguf.gguf_quantize(w, "TQ2_0"))


def test_tokenizer_from_the_file_tokenizes_like_the_zoo_one(tmp_path, tok):
    m = llama(tok, d=64, ff=128)
    path = Q.gguf.export_model_gguf(m, tmp_path / "m.gguf", "Q8_0", tokenizer=tok)
    _, tt = Q.gguf.load_transformers(path)
    text = "\n".join(corpus.heldout_text())[:20000] + "\nQ: 123 + 45 = ? A: 168 <eos>"
    assert tt(text, add_special_tokens=False)["input_ids"] == tok(
        text, add_special_tokens=False)["input_ids"]


def test_export_needs_a_tokenizer_and_a_known_architecture(tmp_path, tok):
    m = llama(tok, d=64, ff=128)
    with pytest.raises(ValueError, match="tokenizer"):
        Q.gguf.export_model_gguf(m, tmp_path / "x.gguf")
    from transformers import BertConfig
    with pytest.raises(ValueError, match="architectures"):
        Q.gguf.gguf_arch(BertConfig())


# -- llama.cpp ----------------------------------------------------------------------------------

# llama.cpp's CPU kernels quantize the activations (Q8_0 for Q4_0/Q8_0 weights, Q8_K for TQ1_0 and
# TQ2_0) and sum in another order, so its log-probs are compared with a tolerance: the largest
# next-token log-prob difference and the relative perplexity difference over the tokens
# (measured on this model: at most 0.009 and 0.02%; on the zoo's lm-qbed, 0.10 and 0.05%).
LLAMA_LOGPROB_ATOL = 0.05
LLAMA_PPL_RTOL = 0.01

needs_llama = pytest.mark.skipif(
    not Q.gguf.have_llama_cpp(),
    reason="llama-cpp-python is not installed (optional extra: pip install -e '.[llama]'; it "
           "builds llama.cpp from source, several minutes)")


@needs_llama
@pytest.mark.parametrize("qtype", ["F32", "Q4_0", "Q8_0", "TQ2_0", "TQ1_0"])
def test_llama_cpp_loads_the_files_and_agrees(tmp_path, tok, qtype):
    m = llama(tok)                                # 256 wide: every block tensor is ``qtype``
    if qtype.startswith("TQ"):
        codes = {n + ".weight": Q.ternary_quantized(lin.weight) for n, lin in
                 Q.block_linears(m).items()}
        expect = _with_block_weights(m, lambda n, w: Q.gguf.stored_weight(codes[n + ".weight"],
                                                                     qtype))
    else:
        codes = None
        expect = _with_block_weights(m, _gguf_py_roundtrip(qtype))
    path = Q.gguf.export_model_gguf(m, tmp_path / f"{qtype}.gguf", qtype, tokenizer=tok, codes=codes)
    assert {t for n, t in Q.gguf.tensor_types(path).items() if n.startswith("blk.")
            and "norm" not in n} == {qtype}
    x = _tokens(tok, n=3, t=32)
    ours = torch.log_softmax(_logits(expect, x).double(), -1)
    theirs = torch.log_softmax(torch.from_numpy(Q.gguf.llama_cpp_logits(path, x.numpy())).double(), -1)
    y = x[:, 1:, None]
    lp_ours, lp_theirs = ours[:, :-1].gather(-1, y), theirs[:, :-1].gather(-1, y)
    assert float((lp_ours - lp_theirs).abs().max()) < LLAMA_LOGPROB_ATOL
    p_ours = Q.gguf.logits_perplexity(_logits(expect, x), x)
    p_theirs = Q.gguf.logits_perplexity(Q.gguf.llama_cpp_logits(path, x.numpy()), x)
    assert abs(p_theirs / p_ours - 1) < LLAMA_PPL_RTOL


@needs_llama
def test_llama_cpp_tokenizes_like_the_zoo_tokenizer(tmp_path, tok):
    m = llama(tok, d=64, ff=128)
    path = Q.gguf.export_model_gguf(m, tmp_path / "m.gguf", "Q8_0", tokenizer=tok)
    llm = Q.gguf.llama_cpp_model(path, 64)
    text = "\n".join(corpus.heldout_text())[:20000]
    got = llm.tokenize(text.encode(), add_bos=False, special=False)
    assert got == tok(text, add_special_tokens=False)["input_ids"]
