"""GSQ as IST-DASLab/GSQ defines it: the candidate sets, the initial logits, the schedules, one
Lion step by hand, the sub-block output MSE, the relaxed weight's gradients, hard results on
the grid, and the closed-form scales of our ablation."""
import math

import pytest
import torch
import torch.nn.functional as F

from tiny_models import tiny_llama
from workbench import quant as Q
from workbench.methods import gsq as M


def test_config_is_the_reference_s():
    """The reference's lr1/lr2 2e-4 (logits) and 1e-4 (scales), weight decay 1.0, Lion betas
    (0.9, 0.95), cosine to 0.1 (src/config.py); temperature 2 -> 0.05 and logit scale 100 -> 500
    (README.md, production configs); std 0.01, strength 6; config_smoke.yaml's schedule apart."""
    c = M.GSQConfig()
    assert (c.lr_logits, c.lr_scales, c.weight_decay, c.betas, c.min_lr) == \
        (2e-4, 1e-4, 1.0, (0.9, 0.95), 0.1)
    assert (c.temperature, c.logit_scale, c.std, c.strength) == ((2.0, 0.05), (100.0, 500.0),
                                                                 0.01, 6.0)
    assert M.SMOKE_SCHEDULE == {"temperature": (2.0, 0.5), "logit_scale": (10.0, 50.0)}


def test_candidates_are_four_levels_at_2_bits_and_five_shifts_above():
    lv = torch.tensor([[-4, -3, 0, 3]])
    cand, valid = M.candidates(lv, 3)                 # GumbelQuantizerInt: init + {-2..2}
    assert cand.shape == (5, 1, 4)
    assert cand[:, 0, 2].tolist() == [-2, -1, 0, 1, 2] and valid[:, 0, 2].all()
    assert cand[valid[:, 0, 0], 0, 0].tolist() == [-4, -3, -2]       # grid is -4..3
    assert cand[valid[:, 0, 1], 0, 1].tolist() == [-4, -3, -2, -1]
    assert cand[valid[:, 0, 3], 0, 3].tolist() == [1, 2, 3]
    cand4, valid4 = M.candidates(torch.tensor([[-8, 7]]), 4)
    assert cand4[valid4[:, 0, 0], 0, 0].tolist() == [-8, -7, -6]
    assert cand4[valid4[:, 0, 1], 0, 1].tolist() == [5, 6, 7]
    cand2, valid2 = M.candidates(torch.tensor([[-2, 1]]), 2)        # GumbelQuantizer2Bit
    assert cand2.shape == (4, 1, 2) and valid2.all()
    assert cand2[:, 0, 0].tolist() == cand2[:, 0, 1].tolist() == [-2, -1, 0, 1]


def test_initial_logits_follow_the_reference():
    """std * (N(0,1) + strength * (d - mean_valid d)), d_k = -(c_k - level0)^2 / 2."""
    for bits, low, want in ((2, -2, [[-1.25, 0.25, 0.75, 0.25], [1.75, 1.25, -0.25, -2.75]]),
                            (3, -4, [[-1.0, 0.5, 1.0, 0.5, -1.0], [None, None, 5 / 6, 1 / 3, -7 / 6]])):
        lv = torch.tensor([[0, low]])
        cand, valid = M.candidates(lv, bits)
        z = M.init_logits(lv, cand, valid, 0.01, 6.0, torch.Generator().manual_seed(3))
        noise = torch.randn(cand.shape, generator=torch.Generator().manual_seed(3))
        prior = (z - 0.01 * noise) / 0.06
        for j, col in enumerate(want):
            for k, v in enumerate(col):
                if v is not None:
                    assert abs(prior[k, 0, j] - v) < 1e-5, (bits, j, k)


def test_schedules_endpoints_and_a_single_step():
    c = M.GSQConfig(steps=5)
    taus = [M.schedule(t, 5, *c.temperature) for t in range(5)]
    lams = [M.schedule(t, 5, *c.logit_scale) for t in range(5)]
    assert taus == pytest.approx([2.0, 1.5125, 1.025, 0.5375, 0.05])
    assert lams == pytest.approx([100, 200, 300, 400, 500])
    smoke = [M.schedule(t, 5, *M.SMOKE_SCHEDULE["temperature"]) for t in range(5)]
    assert smoke == pytest.approx([2.0, 1.625, 1.25, 0.875, 0.5])
    assert M.schedule(0, 1, 2.0, 0.5) == 2.0                          # no division by zero
    assert M.lr_factor(0, 5, 0.1) == 1.0 and abs(M.lr_factor(4, 5, 0.1) - 0.1) < 1e-12
    assert abs(M.lr_factor(2, 5, 0.1) - 0.55) < 1e-12                 # cosine midpoint
    assert M.lr_factor(0, 1, 0.1) == 0.1                              # CustomLRScheduler: progress 1


def test_one_lion_step_by_hand():
    """Chen et al. 2023, Alg. 2 with decoupled weight decay (lion_pytorch's update)."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = M.Lion([p], lr=0.1, betas=(0.9, 0.95), weight_decay=1.0)
    p.grad = torch.tensor([0.5, -0.1])
    opt.step()                                         # m = 0: sign(0.1 g) = sign(g)
    assert torch.allclose(p.detach(), torch.tensor([1.0 * 0.9 - 0.1, -2.0 * 0.9 + 0.1]))
    assert torch.allclose(opt.state[p]["exp_avg"], torch.tensor([0.025, -0.005]))
    p.grad = torch.tensor([-0.01, 0.2])               # 0.9 m + 0.1 g = (0.0215, 0.0155): (+, +)
    opt.step()
    assert torch.allclose(p.detach(), torch.tensor([0.8 * 0.9 - 0.1, -1.7 * 0.9 - 0.1]))


def test_block_mse_is_the_mean_over_every_element():
    out_q, out_fp = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.ones(2, 2)
    assert M.block_mse(out_q, out_fp) == (0 + 1 + 4 + 9) / 4


def test_sub_blocks_are_the_decoder_layer_s_two_halves():
    """The attention sub-block is x + attn(ln1 x) (get_mlp_input), the MLP sub-block
    h + mlp(ln2 h) (get_mlp_output); together the decoder layer. Swapped-in weights act as
    the layer's own would: the block MSE equals the hand-computed one."""
    model, _ = tiny_llama(1)
    layer = model.model.layers[0]
    x, kw = M.layer_inputs(model, torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(0)))
    attn, mlp = M._attention(layer, kw), M._mlp(layer)
    with torch.no_grad():
        assert torch.allclose(mlp(attn(x, {}), {}), layer(x, **kw), atol=1e-5)
        m = layer.mlp
        h = attn(x, {})
        wd = 0.9 * m.down_proj.weight
        a = layer.post_attention_layernorm(h)
        by_hand = h + F.linear(F.silu(F.linear(a, m.gate_proj.weight)) * F.linear(a, m.up_proj.weight), wd)
        out = mlp(h, {"mlp.down_proj": wd})
        assert torch.allclose(out, by_hand, atol=1e-5)
        assert math.isclose(float(M.block_mse(out, mlp(h, {}))),
                            float(((by_hand - mlp(h, {})) ** 2).sum() / by_hand.numel()), rel_tol=1e-5)


def test_relaxed_weight_gradients_match_autograd():
    gen = torch.Generator().manual_seed(0)
    for bits in (2, 3):
        q = Q.rtn(torch.randn(3, 8, generator=gen), bits, 4)
        gq = M.GumbelQuantizer(q, M.GSQConfig(std=0.5), gen)
        assert (gq.invalid is None) == (bits == 2)     # 3 bits: edge levels lose some shifts
        g = -torch.log(-torch.log(torch.rand(gq.z.shape, generator=gen)))
        upstream = torch.randn(3, 8, generator=gen)
        for tau, lam in ((2.0, 10.0), (0.5, 50.0), (1.0, 1.0)):
            z = gq.z.detach().clone().requires_grad_()
            s = gq.scales.detach().clone().requires_grad_()
            (M._Relaxed.apply(z, s, gq.cand, gq.invalid, g, 4, tau, lam) * upstream).sum().backward()
            za, sa = z.detach().clone().requires_grad_(), s.detach().clone().requires_grad_()
            p = torch.softmax((za.masked_fill(~gq.valid, -1e9) * lam + g) / tau, dim=0)
            ((p * gq.cand).sum(0) * Q.expand_groups(sa, 4, 8) * upstream).sum().backward()
            assert torch.allclose(z.grad, za.grad, atol=1e-5)
            assert torch.allclose(s.grad, sa.grad, atol=1e-5)


def test_hard_result_is_exactly_on_the_grid_with_the_learned_scales():
    gen = torch.Generator().manual_seed(1)
    for bits in (2, 3, 4):
        q = Q.rtn(torch.randn(4, 16, generator=gen), bits, 8)
        gq = M.GumbelQuantizer(q, M.GSQConfig(std=1.0), gen)      # large noise: many moves
        with torch.no_grad():
            gq.scales.mul_(1.1)
        h = gq.quantized()
        lv = h.level_index
        assert lv.min() >= -(2 ** (bits - 1)) and lv.max() <= 2 ** (bits - 1) - 1
        assert (lv - q.level_index).abs().max() <= (3 if bits == 2 else 2)
        assert not torch.equal(lv, q.level_index)
        assert torch.equal(h.dequantize(), Q.expand_groups(gq.scales.detach(), 8, 16) * lv)
        codes = Q.quantize_codes(h.dequantize(), h.scale, h.zero, bits, 8)   # RTN re-quantizes it
        assert torch.equal(codes.long(), h.codes.long())


def test_zero_and_one_step_runs():
    """gsq(steps=0) raised ZeroDivisionError; now 0 steps keeps the initial argmax, 1 step runs
    at the schedules' start with the decayed learning rate."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 8, generator=gen)
    x = torch.randn(16, 8, generator=gen)
    for steps in (0, 1):
        gq = M.GumbelQuantizer(Q.rtn(w, 2, 8), M.GSQConfig(), gen)
        z0 = gq.z.detach().clone()
        hist = M.train_subblock(lambda a, ws: a @ ws["l"].T, {"l": gq}, x, x @ w.T,
                                M.GSQConfig(steps=steps, batch=4), gen)
        assert len(hist["loss"]) == steps and hist["tau"] == [2.0] * steps
        if steps == 0:
            assert torch.equal(gq.z, z0)
        else:            # one Lion step at lr 2e-4 * 0.1: decay z (1 - lr), then move by <= lr
            assert ((gq.z - z0 * (1 - 2e-5)).abs() <= 2e-5 + 1e-8).all()
            assert ((gq.z - z0 * (1 - 2e-5)).abs() > 1e-5).any()


def test_gsq_lowers_a_sub_block_s_error_from_a_noisy_start():
    """With enough steps GSQ lowers the hard sub-block MSE of its (noise-flipped) start."""
    model, _ = tiny_llama(1)
    ids = torch.randint(3, 40, (16, 12), generator=torch.Generator().manual_seed(1))
    lin = Q.block_linears(model)
    x, kw = M.layer_inputs(model, ids)
    layer = model.model.layers[0]
    init = {n: Q.rtn(m.weight.detach(), 2, 32) for n, m in lin.items()}
    cfg = M.GSQConfig(steps=60, batch=4, lr_logits=5e-3, lr_scales=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights, info = M.quantize_model(model, ids, init, cfg, seed=0)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())   # restored
    mlp = M._mlp(layer)
    with torch.no_grad():
        h = M._attention(layer, kw)(x, {k.split("0.", 1)[1]: weights[k] for k in weights
                                         if "self_attn" in k})
        fp = layer(x, **kw)
        err = {s: float(M.block_mse(mlp(h, {k.split("0.", 1)[1]: w[k] for k in w if ".mlp." in k}), fp))
               for s, w in (("rtn", {n: q.dequantize() for n, q in init.items()}), ("gsq", weights))}
    assert err["gsq"] < err["rtn"], err
    assert len(info["model.layers.0.mlp.up_proj"]["hist"]["loss"]) == 60


def test_optimal_scales_match_least_squares():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(512, 64, generator=g) @ (torch.randn(64, 64, generator=g) / 8 + torch.eye(64))
    W, H = torch.randn(3, 64, generator=g), 2 / 512 * X.T @ X
    lv = torch.randint(-2, 2, (1, 3, 64), generator=g).float()
    s = M.optimal_scales(W[None], H[None], lv, 16)[0]
    L = torch.linalg.cholesky(H.double())                     # H = L L^T
    for o in range(3):
        A = torch.zeros(64, 4, dtype=torch.float64)
        for gi in range(4):
            A[gi * 16:(gi + 1) * 16, gi] = lv[0, o, gi * 16:(gi + 1) * 16]
        ref = torch.linalg.lstsq(L.T @ A, L.T @ W[o].double()).solution
        assert torch.allclose(s[o].double(), ref, rtol=1e-3, atol=1e-5)


def _reference_search(row, bits):
    """One row's scale by the reference's loop, written out per candidate: absmax start, then
    p = 1, 0.99, ..., 0.21, positive then negative sign, strict improvement only."""
    maxq, zero = 2 ** bits - 1, 2 ** (bits - 1)
    xmax = max(float(row.abs().max()), 0.0) or 1.0
    best, scale = float("inf"), 2 * xmax / maxq
    for i in range(80):
        s1 = 2 * (1 - i / 100) * xmax / maxq
        e = {}
        for s in (s1, -s1):
            c = torch.clamp(torch.round(row / s) + zero, 0, maxq)
            e[s] = float((s * (c - zero) - row).abs().pow(2.4).sum())
        s = -s1 if e[-s1] < e[s1] else s1
        if e[s] < best:
            best, scale = e[s], s
    return scale


def test_gptq_start_is_the_official_code_s():
    """GSQ's GPTQ start as IST-DASLab/GSQ (commit 03fc164) computes it:
    ``src/models/base.py`` lines 393-396 configure the quantizer with ``mse=True``;
    ``src/prior/quant.py`` lines 91-149 (``Quantizer.find_params``) search the group's scale
    over ``p = 1 - i/100``, ``i < 80``, from the absmax scale, comparing ``|q - x|^2.4`` of the
    scale and of its negative (lines 135-143) and keeping a strict improvement; ``src/prior/
    gptq.py`` lines 165-174 fit each group on the outer ``W`` when its first column comes up;
    every config sets ``gptq.percdamp: 0.1`` (``configs/local/config.yaml`` line 42, used by
    ``GPTQ.cholesky``, ``src/prior/gptq.py`` lines 75-88)."""
    assert M.START_PERCDAMP == 0.1
    g = torch.Generator().manual_seed(4)
    wg = torch.randn(12, 32, generator=g)
    wg[0] = 0.0                                                     # a dead group
    wg[1, 5] = 4.0                                                  # largest weight positive
    for bits in (2, 3, 4):
        got = M.search_scale(wg, bits)
        want = torch.tensor([_reference_search(r, bits) for r in wg])
        assert torch.allclose(got, want, rtol=1e-6), bits
        assert got[1] < 0               # the negative scale puts the extra level on +4.0's side
    assert (M.search_scale(wg, 2) < 0).any() and (M.search_scale(wg, 2) > 0).any()
    # with H = I there is no error to feed forward: the start is RTN on the searched scales
    w = torch.randn(6, 64, generator=g)
    for bits in (2, 3):
        q = M.gptq_start(w, torch.eye(64), bits, 32)
        s = torch.stack([M.search_scale(w[:, k:k + 32], bits) for k in (0, 32)], 1)
        assert torch.equal(q.scale, s)
        assert torch.equal(q.codes, Q.quantize_codes(w, s, q.zero, bits, 32))
    # on a correlated Hessian it beats the GPTQ baseline's absmax start at damping 0.01
    X = torch.randn(512, 64, generator=g) @ (torch.randn(64, 64, generator=g) / 4 + torch.eye(64))
    H = 2 / 512 * X.T @ X
    start, plain = M.gptq_start(w, H, 2, 32), Q.gptq(w, H, 2, 32)
    assert Q.output_error(w, start.dequantize(), H) < Q.output_error(w, plain.dequantize(), H)
