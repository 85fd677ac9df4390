"""Quantization primitives: RTN error bound, GPTQ vs RTN, GPTQ(H=I) == RTN, QuantLinear, GGUF."""
import numpy as np
import pytest
import torch

from workbench import quant as Q


def _w(out=24, cols=64, seed=0):
    return torch.randn(out, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_rtn_error_bound(bits, sym):
    w = _w()
    q = Q.rtn(w, bits, 16, sym)
    err = (q.dequantize() - w).abs()
    bound = Q.expand_groups(q.scale, 16, w.shape[1]) / 2 + 1e-6
    assert torch.all(err <= bound)
    assert q.codes.min() >= 0 and q.codes.max() <= 2 ** bits - 1
    # error shrinks with bits
    if bits < 8:
        assert (Q.rtn(w, bits + 1, 16, sym).dequantize() - w).pow(2).mean() < err.pow(2).mean()


def test_symmetric_grid_levels():
    q = Q.rtn(_w(), 3, 32, sym=True)
    lv = q.level_index
    assert lv.min() >= -4 and lv.max() <= 3
    assert torch.allclose(q.dequantize(), Q.expand_groups(q.scale, 32, 64) * lv.float())


def test_gptq_identity_hessian_is_rtn():
    w = _w(16, 128)
    for sym in (True, False):
        for g in (32, -1):
            a, b = Q.rtn(w, 3, g, sym), Q.gptq(w, torch.eye(128), 3, g, sym, blocksize=64)
            assert torch.equal(a.codes, b.codes)
            assert torch.allclose(a.scale, b.scale) and torch.equal(a.zero, b.zero)


def test_gptq_beats_rtn_on_its_calibration_data():
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(1024, 64, generator=gen) @ torch.randn(64, 64, generator=gen)
    X[:, 5] = 0                                            # a dead input column
    H = 2 / len(X) * X.T @ X
    w = _w(32, 64)
    for bits in (2, 3, 4):
        r, g = Q.rtn(w, bits, 16), Q.gptq(w, H, bits, 16, blocksize=32)
        e_r = ((r.dequantize() - w) @ X.T).pow(2).sum()
        e_g = ((g.dequantize() - w) @ X.T).pow(2).sum()
        assert e_g < 0.8 * e_r, (bits, e_g, e_r)
        assert Q.output_error(w, g.dequantize(), H) == pytest.approx(
            2 / len(X) * float(e_g), rel=1e-3)


def test_hessian_collector():
    lin = torch.nn.Linear(8, 4)
    X = torch.randn(3, 5, 8)
    col = Q.HessianCollector({"l": lin})
    lin(X)
    col.remove()
    x = X.reshape(-1, 8)
    assert torch.allclose(col.hessians()["l"], 2 / 15 * x.T @ x, atol=1e-5)


def test_quantlinear_matches_dequantized_and_scales_are_parameters():
    lin = torch.nn.Linear(64, 8)
    ql = Q.QuantLinear.from_linear(lin, 4, 32)
    x = torch.randn(5, 64)
    ref = x @ Q.rtn(lin.weight.detach(), 4, 32).dequantize().T + lin.bias
    assert torch.allclose(ql(x), ref, atol=1e-5)
    assert [n for n, _ in ql.named_parameters()] == ["scale", "bias"]
    assert ql.codes.dtype == torch.int16 and not ql.codes.is_floating_point()
    ql(x).sum().backward()
    assert ql.scale.grad is not None and ql.scale.grad.shape == (8, 2)


def test_quantlinear_caches_its_weight_until_codes_or_scales_change():
    lin = torch.nn.Linear(64, 8)
    ql = Q.QuantLinear.from_linear(lin, 4, 32)
    ql.scale.requires_grad_(False)
    x = torch.randn(5, 64)
    fresh = lambda: torch.nn.functional.linear(x, ql.dequantized(), ql.bias)
    w0 = ql.cached_weight()
    assert ql.cached_weight() is w0                          # nothing changed: the same tensor
    assert torch.equal(ql(x), fresh())
    with torch.no_grad():
        ql.scale.mul_(1.5)                                   # in place (what LQZO's steps do)
    assert ql.cached_weight() is not w0 and torch.allclose(ql(x), fresh())
    w1 = ql.cached_weight()
    ql.codes[0, 0] = 15 - ql.codes[0, 0]                     # a code changes
    assert ql.cached_weight() is not w1 and torch.equal(ql(x), fresh())
    w2 = ql.cached_weight()
    ql.scale = torch.nn.Parameter(ql.scale.detach() * 2, requires_grad=False)   # a new tensor
    assert ql.cached_weight() is not w2 and torch.equal(ql(x), fresh())
    ql.zero.add_(1)
    assert torch.equal(ql(x), fresh())


def test_quantlinear_does_not_cache_while_training_its_scales():
    ql = Q.QuantLinear.from_linear(torch.nn.Linear(64, 8), 4, 32)
    x = torch.randn(5, 64)
    for _ in range(2):                                       # a second backward works too
        ql.scale.grad = None
        ql(x).sum().backward()
        assert ql.scale.grad is not None and ql.scale.grad.abs().sum() > 0
    with torch.no_grad():                                    # evaluation caches
        assert ql.cached_weight() is ql.cached_weight()


def test_ternary_absmean_and_ste():
    w = _w().requires_grad_(True)
    q, gamma = Q.absmean_ternary(w.detach())
    assert set(q.unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert torch.isclose(gamma, w.detach().abs().mean())
    y = Q.ternary_ste(w)
    assert torch.equal(y, q * gamma)                        # forward is exactly the hard value
    y.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))          # straight-through


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "TQ2_0", "Q5_1", "F16"])
def test_gguf_round_trip_bit_exact(tmp_path, qtype):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 512)).astype(np.float32)
    raw = Q.gguf.gguf_quantize(w, qtype)
    path = Q.gguf.write_gguf(tmp_path / "m.gguf", {"w": (raw, qtype), "norm": w[0]},
                        metadata={"bits": 4, "note": "test"})
    back = Q.gguf.read_gguf(path)
    assert back["w"]["qtype"] == qtype and back["w"]["shape"] == (8, 512)
    assert np.array_equal(back["w"]["raw"], raw)                 # bytes are identical
    assert np.array_equal(back["w"]["values"], Q.gguf.gguf_dequantize(raw, qtype).reshape(8, 512))
    assert np.array_equal(back["norm"]["values"], w[0])
    assert Q.gguf.gguf_metadata(path)["bits"] == 4


def test_our_packers_match_gguf_bytes():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 256)).astype(np.float32)
    raw = Q.gguf.gguf_quantize(w, "Q4_0")
    lv, d = Q.gguf.unpack_q4_0(raw, 256)
    assert np.array_equal(Q.gguf.pack_q4_0(lv, d), raw)
    deq = Q.gguf.gguf_dequantize(raw, "Q4_0")
    assert np.array_equal(deq, np.repeat(d.astype(np.float32), 32, 1) * lv)
    raw8 = Q.gguf.gguf_quantize(w, "Q8_0")
    d8 = raw8.reshape(4, 8, 34)[..., :2].copy().view(np.float16)[..., 0]
    l8 = raw8.reshape(4, 8, 34)[..., 2:].copy().view(np.int8).reshape(4, 256)
    assert np.array_equal(Q.gguf.pack_q8_0(l8, d8), raw8)
    rawt = Q.gguf.gguf_quantize(w, "TQ2_0")
    dt = np.abs(w).max(1).astype(np.float16)
    lt = np.round(Q.gguf.gguf_dequantize(rawt, "TQ2_0") / dt.astype(np.float32)[:, None])
    assert np.array_equal(Q.gguf.pack_tq2_0(lt, dt[:, None]), rawt)


def test_gguf_refuses_k_quants():
    with pytest.raises(ValueError, match="cannot quantize"):
        Q.gguf.gguf_quantize(np.zeros((1, 256), np.float32), "Q4_K")


def test_block_linears_are_the_block_projections_only():
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=2))
    layers = Q.block_linears(model)
    assert len(layers) == 2 * 7                       # q, k, v, o, gate, up, down per block
    assert "lm_head" not in layers and all(".layers." in n for n in layers)
    assert all(isinstance(m, torch.nn.Linear) for m in layers.values())


def test_q3_k_writer_matches_gguf_dequantizer_bit_exactly(tmp_path):
    rng = np.random.default_rng(1)
    lv = rng.integers(-4, 4, (6, 512))
    lv[0, :16] = -4                                               # both ends of the grid
    lv[0, 16:32] = 3
    sc = rng.integers(-32, 32, (6, 32))
    sc[1, :2] = (-32, 31)
    d = (rng.random((6, 2)) + 0.01).astype(np.float16)
    raw = Q.gguf.pack_q3_k(lv, sc, d)
    assert raw.shape == (6, 2 * 110)                              # 110 bytes per 256 weights
    expect = (np.repeat(d.astype(np.float32), 256, 1) * np.repeat(sc, 16, 1) * lv).astype(np.float32)
    assert np.array_equal(Q.gguf.gguf_dequantize(raw, "Q3_K").reshape(6, 512), expect)
    path = Q.gguf.write_gguf(tmp_path / "k.gguf", {"w": (raw, "Q3_K")})
    back = Q.gguf.read_gguf(path)["w"]
    assert back["qtype"] == "Q3_K" and np.array_equal(back["raw"], raw)
    assert np.array_equal(back["values"], expect)
    with pytest.raises(ValueError, match="levels"):
        Q.gguf.pack_q3_k(lv + 4, sc, d)
    with pytest.raises(ValueError, match="divisible by 256"):
        Q.gguf.pack_q3_k(lv[:, :128], sc[:, :8], d[:, :1])


def test_q3_k_rtn_error_is_within_half_a_step():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 512)).astype(np.float32)
    lv, sc, d = Q.gguf.q3_k_params(w)
    step = np.repeat(d.astype(np.float32), 256, 1) * np.repeat(sc.astype(np.float32), 16, 1)
    w_hat = Q.gguf.gguf_dequantize(Q.gguf.gguf_quantize(w, "Q3_K"), "Q3_K").reshape(w.shape)
    assert np.array_equal(w_hat, step * lv)
    inside = (w / step >= -4) & (w / step <= 3)                   # not clipped at the grid's ends
    assert np.all(np.abs(w - w_hat)[inside] <= step[inside] / 2 + 1e-6)
    assert inside.mean() > 0.9


def _gptq_by_the_book(w, H, bits, g, block, actorder=False, static=False, percdamp=0.01):
    """GPTQ written plainly from the paper's Algorithm 1 (float64, every later column updated at
    once, no lazy batches) plus the reference's group rule: a group's (scale, zero) is fitted on
    the weights as they stood at the start of the block holding the group's first column (or, with
    static groups, on the original weights, by original column)."""
    W = w.clone().double()
    H = H.clone().double()
    cols = W.shape[1]
    order = torch.argsort(torch.diag(H), descending=True) if actorder else torch.arange(cols)
    damp = percdamp * torch.diag(H).mean()
    U = torch.linalg.cholesky(torch.linalg.inv(H[order][:, order] + damp * torch.eye(cols)),
                              upper=True)
    W, W0 = W[:, order], W.clone()
    codes = torch.zeros_like(W, dtype=torch.long)
    fitted = {}
    for k in range(cols):
        if k % block == 0:
            snapshot = W.clone()
        if static:
            grp = int(order[k]) // g
            scale, zero = Q.rtn_params(W0[:, grp * g:(grp + 1) * g], bits, -1)
        elif k % g == 0:
            scale, zero = Q.rtn_params(snapshot[:, k:k + g], bits, -1)
            fitted[k // g] = (scale, zero)
        c = torch.clamp(torch.round(W[:, k] / scale[:, 0]) + zero[:, 0], 0, 2 ** bits - 1)
        err = (W[:, k] - scale[:, 0] * (c - zero[:, 0])) / U[k, k]
        W[:, k:] -= err[:, None] * U[k, k:][None, :]
        codes[:, k] = c.long()
    return codes[:, torch.argsort(order)], fitted


@pytest.mark.parametrize("actorder,static", [(False, False), (True, False), (True, True),
                                             (False, True)])
def test_gptq_groups_match_the_reference_procedure(actorder, static):
    """A fixed 4 x 8 case with groups of 2 inside blocks of 4: groups fitted at block start (the
    reference), act-order's scattered groups, static groups; code for code."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 8, generator=g, dtype=torch.float64)
    x = torch.randn(64, 8, generator=g, dtype=torch.float64) @ torch.randn(8, 8, generator=g,
                                                                          dtype=torch.float64)
    x = x * torch.linspace(0.5, 2.0, 8, dtype=torch.float64)     # a clear act order
    H = 2 / 64 * x.T @ x
    for bits in (2, 3):
        q = Q.gptq(w, H, bits, group_size=2, blocksize=4, actorder=actorder, static_groups=static)
        expected, fitted = _gptq_by_the_book(w, H, bits, 2, 4, actorder, static)
        assert torch.equal(q.codes.long(), expected), (bits, q.codes, expected)
        # the stored groups dequantize what was coded
        if actorder and not static:
            assert q.g_idx is not None and sorted(q.g_idx.tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]
            for k, (scale, _) in fitted.items():
                assert torch.allclose(q.scale[:, k].double(), scale[:, 0].double(), rtol=1e-6)
        else:
            assert q.g_idx is None
        deq = q.dequantize()
        assert deq.shape == w.shape and torch.isfinite(deq).all()


def test_gptq_group_fit_uses_block_start_weights_not_in_block_updates():
    """Within a block, the second group's quantizer must not see the first group's updates."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64)
    x = torch.randn(32, 4, generator=g, dtype=torch.float64)
    x[:, 1] = x[:, 0] + 0.1 * x[:, 1]                       # strongly correlated inputs
    H = 2 / 32 * x.T @ x
    q = Q.gptq(w, H, 2, group_size=2, blocksize=4)          # one block, two groups
    s_fit, _ = Q.rtn_params(w[:, 2:4], 2, -1)               # block start = the original weights
    assert torch.allclose(q.scale[:, 1].double(), s_fit[:, 0].double(), rtol=1e-6)


def test_quantlinear_refuses_scattered_groups():
    w = torch.randn(4, 8, dtype=torch.float64)
    H = torch.diag(torch.arange(1.0, 9.0, dtype=torch.float64))
    q = Q.gptq(w, H, 3, group_size=4, blocksize=4, actorder=True)
    with pytest.raises(ValueError, match="static_groups=True"):
        Q.QuantLinear(q)
    Q.QuantLinear(Q.gptq(w, H, 3, group_size=4, blocksize=4, actorder=True, static_groups=True))


def test_q4_0_round_trip_through_quantized_is_exact():
    w = torch.randn(8, 64).numpy()
    q = Q.gguf.q4_0_quantized(w)
    assert torch.equal(q.dequantize(), torch.from_numpy(Q.gguf.gguf_dequantize(Q.gguf.gguf_quantize(w, "Q4_0"), "Q4_0")))
    lv, d = Q.gguf.q4_0_codes(q)
    assert np.array_equal(Q.gguf.pack_q4_0(lv, d), Q.gguf.gguf_quantize(w, "Q4_0"))   # the same bytes
    with pytest.raises(ValueError, match="groups of 32"):
        Q.gguf.q4_0_codes(Q.rtn(torch.from_numpy(w), 4, 64))
def test_gptq_per_row_quantizer_is_fitted_before_dead_inputs_are_zeroed():
    """Without groups the reference fits each row's quantizer on the whole weight first, so a
    dead input's large weight still sets the row's scale (then that input is coded as 0)."""
    w = torch.tensor([[0.1, -0.2, 4.0, 0.3], [0.5, 0.1, -0.2, 0.05]], dtype=torch.float64)
    H = torch.diag(torch.tensor([1.0, 2.0, 0.0, 1.5], dtype=torch.float64))   # input 2 is dead
    q = Q.gptq(w, H, 3, group_size=-1, blocksize=2)
    s_ref, z_ref = Q.rtn_params(w, 3, -1)
    assert torch.allclose(q.scale.double(), s_ref.double()) and torch.equal(q.zero, z_ref)
    assert torch.equal(q.level_index[:, 2], torch.zeros(2, dtype=torch.long))
    # groups are fitted after the zeroing (a diagonal H moves no error: RTN of the zeroed weight)
    w0 = w.clone()
    w0[:, 2] = 0
    qg = Q.gptq(w, H, 3, group_size=2, blocksize=2)
    assert torch.allclose(qg.scale.double(), Q.rtn_params(w0, 3, 2)[0].double())


def test_quant_package_exports_its_names_explicitly():
    import types
    assert len(Q.__all__) == len(set(Q.__all__))
    for name in Q.__all__:
        obj = getattr(Q, name)
        # no torch, numpy, nn, ...: the one module is the GGUF file format's own namespace
        assert not isinstance(obj, types.ModuleType) or obj is Q.gguf, name
    for name in ("QuantLinear", "gptq", "rtn", "block_linears", "ternary_ste",
                 "HessianCollector", "expand_groups", "levels"):
        assert name in Q.__all__
    for name in ("export_model_gguf", "pack_q4_0", "read_gguf"):      # file format: quant.gguf
        assert name not in Q.__all__ and name in Q.gguf.__all__
