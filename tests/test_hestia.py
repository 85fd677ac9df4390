"""Hestia: the relaxed quantizer, its gradient and limit, the STE baseline, Hutchinson traces,
flip counting, schedules and the layer swap."""
import math

import pytest
import torch
from torch import nn

from workbench import diagnostics as D
from workbench.diagnostics import hutchinson_trace
from workbench.methods import hestia as H


def _weights(shape=(48, 40), seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype) * 0.05


def _expectation_of_x(x, temp):
    """sum_c c p_c(x) written independently: explicit Gibbs weights of the three codewords."""
    num = {c: torch.exp(-(x - c) ** 2 / temp) for c in (-1.0, 0.0, 1.0)}
    z = num[-1.0] + num[0.0] + num[1.0]
    return (num[1.0] - num[-1.0]) / z


def _expectation_by_hand(w, temp):
    """Eq. (2): gamma * E_T(W / gamma), gamma = mean |W| (kept in the graph)."""
    gamma = w.abs().mean()
    return gamma * _expectation_of_x(w / gamma, temp)


def test_soft_quantizer_tends_to_the_hard_one():
    w = _weights()
    hard = H.hard_ternary(w)
    x = (w / w.abs().mean()).abs()
    margin = float((x - 0.5).abs().min())               # distance of the nearest weight to a tie
    gaps = []
    for temp in (1.0, 0.3, 0.1, 0.03, 0.01, 1e-3):
        gaps.append(float((H.soft_ternary(w, temp) - hard).abs().max()))
    assert all(a > b for a, b in zip(gaps, gaps[1:])), gaps
    # for T well below the smallest margin the softmax is one-hot to float64 precision
    temp = margin / 40
    assert torch.allclose(H.soft_ternary(w, temp), hard, rtol=0, atol=1e-12)
    assert torch.equal(H.soft_ternary(w, 0.0), hard)       # T = 0 is the hard quantizer itself
    # at high temperature it is far from hard (the relaxation is real)
    assert gaps[0] > 0.1 * float(w.abs().mean())


def test_soft_quantizer_matches_the_literal_formula_and_its_gradient():
    w = _weights(seed=1).requires_grad_()
    up = torch.randn(w.shape, dtype=w.dtype, generator=torch.Generator().manual_seed(2))
    for temp in (2.0, 0.35, 0.05):
        fast = H.soft_ternary(w, temp)
        ref = _expectation_by_hand(w, temp)
        lit = H.soft_ternary_reference(w, temp)
        assert torch.allclose(fast, ref, atol=1e-14) and torch.allclose(lit, ref, atol=1e-14)
        g_fast, = torch.autograd.grad((fast * up).sum(), w)
        g_ref, = torch.autograd.grad((ref * up).sum(), w)
        assert torch.allclose(g_fast, g_ref, rtol=1e-9, atol=1e-12)
    # and finite differences of the forward itself (the gradient is the forward's derivative)
    small = _weights((6, 5), seed=3).requires_grad_()
    assert torch.autograd.gradcheck(lambda v: H.soft_ternary(v, 0.3), (small,))


def test_closed_form_of_the_public_code():
    x = torch.linspace(-3, 3, 601, dtype=torch.float64)
    for temp in (0.2, 0.5, 1.5):
        e = H.soft_ternary_closed_form(x, temp)
        ref = _expectation_of_x(x, temp)
        assert torch.allclose(e, ref, atol=1e-12)
    t0 = H.optimal_init_temp()
    assert 0.1 < t0 < 2.0


def test_ste_forward_is_exactly_the_hard_quantizer():
    for dtype in (torch.float32, torch.float64):
        w = _weights((128, 96), seed=4, dtype=dtype).requires_grad_()
        q, gamma = H.absmean_ternary(w.detach())
        out = H.ste_ternary(w)
        assert torch.equal(out, q * gamma)                     # bit-for-bit
        assert set(torch.unique(out / gamma).round().tolist()) <= {-1.0, 0.0, 1.0}
        g, = torch.autograd.grad(out.sum(), w)
        assert torch.equal(g, torch.ones_like(w))             # identity backward


def test_hutchinson_matches_the_exact_hessian_trace():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    X = torch.randn(32, 4, dtype=torch.float64)
    Y = torch.randn(32, 3, dtype=torch.float64)
    params = list(net.parameters())
    shapes = [p.shape for p in params]
    sizes = [p.numel() for p in params]
    flat0 = torch.cat([p.detach().flatten() for p in params])

    def loss_of(flat):
        ps = [t.view(s) for t, s in zip(flat.split(sizes), shapes)]
        h = torch.tanh(X @ ps[0].T + ps[1])
        return ((h @ ps[2].T + ps[3] - Y) ** 2).mean()

    Hx = torch.autograd.functional.hessian(loss_of, flat0)
    exact = float(torch.trace(Hx))
    n = 3000
    # variance of one Rademacher probe: 2 * sum_{i != j} H_ij^2
    sd = math.sqrt(2 * float((Hx ** 2).sum() - (torch.diagonal(Hx) ** 2).sum()) / n)
    gen = torch.Generator().manual_seed(1)
    loss = ((net(X) - Y) ** 2).mean()
    est = hutchinson_trace(loss, params, n_samples=n, generator=gen)
    assert abs(est - exact) < 4 * sd + 1e-9, (est, exact, sd)
    # per-tensor blocks from joint probes
    loss = ((net(X) - Y) ** 2).mean()
    blocks = hutchinson_trace(loss, params, n_samples=n, generator=torch.Generator().manual_seed(2),
                              per_tensor=True)
    off = 0
    for b, k in zip(blocks, sizes):
        blk = float(torch.trace(Hx[off:off + k, off:off + k]))
        assert abs(b - blk) < 4 * sd + 1e-9, (b, blk, sd)
        off += k
    assert abs(sum(blocks) - exact) < 4 * sd * len(blocks)


def test_flip_counting_on_a_hand_made_sequence():
    lin = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[0.0, 1.0, -1.0, 2.0]]))      # gamma = 1: states 0 1 -1 1
    fc = H.FlipCounter({"l": lin})
    for new in ([0.0, 1.0, -1.0, 2.0], [0.9, 1.0, -1.0, 2.0], [0.1, 1.0, -1.0, 2.0]):
        with torch.no_grad():                # keep gamma = 1 by adjusting the last weight
            w = torch.tensor([new])
            w[0, 3] = 4.0 - w[0, :3].abs().sum()
            lin.weight.copy_(w)
        fc.update()
    assert fc.counts["l"].tolist() == [[2, 0, 0, 0]]
    assert fc.never_flipped() == 0.75 and fc.changed_overall() == 0.0


def test_schedule_endpoints():
    s = H.Schedule(steps=100, t0=0.4, compress_ratio=0.2, scale=0.8)
    temps = [s.temperature(t) for t in range(100)]
    press = [s.pressure(t) for t in range(100)]
    assert press[0] == pytest.approx(0.05) and press[19] == 1.0 and min(press[19:]) == 1.0
    assert all(a <= b for a, b in zip(press, press[1:]))
    assert temps[0] == pytest.approx(0.32) and temps[19] == pytest.approx(0.32)
    assert temps[-1] == 0.0 and temps[-2] > 0
    assert all(a >= b for a, b in zip(temps[20:], temps[21:]))     # the anneal never warms
    hes = H.Schedule(steps=100, t0=0.4, compress_ratio=0.2, scale=0.8, decay_style="hessian")
    temps = [hes.temperature(t) for t in range(100)]
    assert all(a >= b for a, b in zip(temps, temps[1:])) and temps[-1] == 0.0
    assert H.Schedule(10, 0.5, compress_ratio=0.0).pressure(0) == 1.0


def test_temperature_scales_order_by_sensitivity():
    traces = {"a": 10.0, "b": 1.0, "c": 0.1, "d": -0.5}
    scales, sens = H.temperature_scales(traces, kappa=1.0, alpha=0.5)
    assert scales["a"] < scales["b"] < scales["c"] <= scales["d"]
    assert sens["a"] > sens["b"] > sens["c"]
    assert all(math.exp(-0.5) < v < 1.0 for v in scales.values())


def test_ternarize_swaps_block_linears_only():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, vocab_size=50,
                      max_position_embeddings=16, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    x = torch.randint(0, 50, (2, 8))
    ref = model(input_ids=x).logits
    layers = H.ternarize(model, "fp")
    assert len(layers) == 2 * 7 and isinstance(model.lm_head, nn.Linear)
    assert torch.equal(model(input_ids=x).logits, ref)       # fp mode changes nothing
    with H.mode_as(model, "hard"):
        hard = model(input_ids=x).logits
        gap = H.relaxed_gap(layers)
    assert gap["max_abs"] == 0.0 and not torch.allclose(hard, ref)
    for m in layers.values():
        m.mode, m.temp, m.pressure = "hestia", 1e-9, 1.0
    assert H.relaxed_gap(layers)["max_rel"] < 1e-6
    with pytest.raises(ValueError):
        H.ternarize(model, "lsq")


def test_directional_check_tells_consistent_from_straight_through():
    w = _weights((64, 48), seed=5, dtype=torch.float32)
    soft = H.directional_check(w, "hestia", 0.1)
    ste = H.directional_check(w, "ste", 0.1)
    assert soft["rel_error"] < 1e-6
    # the hard forward moves only through gamma (and at boundary crossings): not the identity
    assert ste["rel_error"] > 0.1


def _sym(eigs, seed):
    """A symmetric float64 matrix with the given eigenvalues and a random eigenbasis."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(len(eigs), len(eigs), generator=g, dtype=torch.float64))
    return q @ torch.diag(torch.as_tensor(eigs, dtype=torch.float64)) @ q.T


def test_hutchpp_is_exact_on_a_matrix_whose_rank_fits_its_sketch():
    eigs = [5.0, -2.0, 1.5, 0.7] + [0.0] * 56                     # rank 4, n = 60, indefinite
    A = _sym(eigs, seed=0)
    for k in (4, 6):                                                # sketch = rank, and wider
        for s in range(3):
            est = D.hutchpp(lambda X: A @ X, 60, num_sketch=k, num_query=5,
                            generator=torch.Generator().manual_seed(s))
            assert abs(est - sum(eigs)) < 1e-10
    # a sketch as wide as the matrix returns the subspace trace alone, exact for any matrix
    B = _sym(torch.linspace(1, 2, 10).tolist(), seed=1)
    assert abs(D.hutchpp(lambda X: B @ X, 10, 12, 3, torch.Generator().manual_seed(0))
               - float(torch.trace(B))) < 1e-10
    # Hutchinson is not exact on the same rank-4 matrix
    hut = D.hutchinson(lambda X: A @ X, 60, 16, torch.Generator().manual_seed(0))
    assert abs(hut - sum(eigs)) > 1e-3


def test_hutchpp_has_lower_variance_than_hutchinson_at_equal_matvecs():
    A = _sym([1 / (i + 1) ** 2 for i in range(100)], seed=2)       # a decaying spectrum
    exact = float(torch.trace(A))
    hpp, hut = [], []
    for s in range(300):
        g = torch.Generator().manual_seed(s)
        hpp.append(D.hutchpp(lambda X: A @ X, 100, 8, 8, g))        # 2 * 8 + 8 = 24 matvecs
        hut.append(D.hutchinson(lambda X: A @ X, 100, 24, g))      # 24 matvecs
    hpp, hut = torch.tensor(hpp), torch.tensor(hut)
    assert abs(float(hpp.mean()) - exact) < 4 * float(hpp.std()) / math.sqrt(300)  # unbiased
    assert float(hpp.var()) < 0.2 * float(hut.var())


def test_trace_groups_follow_the_public_granularities():
    """Every path of hestia2026/Hestia computes one trace per tensor: ``QuantConfig`` sets
    ``calibration_granularity = "tensor"`` (src/hestia/quant_config.py, line 18), as do the shipped
    configs (configs/hessian_calibration.yaml, line 4); its "layer" groups are keyed
    ``layer_{counter}`` (hessian/calibrator.py, lines 136-153) with a counter advanced at every
    Linear (src/hestia/model_utils.py, lines 94-116), so each holds one tensor. Per-block groups
    are our named option ``"block"``."""
    names = [f"model.layers.{b}.{m}.weight" for b in (0, 1)
             for m in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj")]
    assert list(H.trace_groups(names).values()) == [[n] for n in names]      # default: tensor
    assert list(H.trace_groups(names, "tensor").values()) == [[n] for n in names]
    assert list(H.trace_groups(names, "layer").values()) == [[n] for n in names]
    block = H.trace_groups(names, "block")
    assert list(block.values()) == [names[:3], names[3:]]          # q_proj first: it is estimated
    comp = H.trace_groups(names, "component")
    assert comp["q_proj"] == [names[0], names[3]] and len(comp) == 3
    with pytest.raises(ValueError):
        H.trace_groups(names, "row")


def test_per_tensor_traces_by_default_and_block_groups_share_the_first_tensors_exact_trace():
    """The default is one exact trace per tensor (hessian/calibrator.py, lines 121-134:
    ``"tensor"`` registers every Linear); ``"block"`` gives the first tensor's to its block."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, vocab_size=20,
                      max_position_embeddings=8)
    model = LlamaForCausalLM(cfg).double().eval()
    x = torch.randint(0, 20, (3, 8), generator=torch.Generator().manual_seed(1))
    names = [n for n, _ in model.named_parameters() if "layers." in n and n.endswith("proj.weight")]
    # a sketch as wide as q_proj (64 weights) makes Hutch++ exact: the reference value is tr(H_qq)
    tr = H.hessian_traces(model, names, x, granularity="block", num_sketch=64, num_query=0)
    q0 = dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]

    def loss_of(w):
        return torch.func.functional_call(model, {"model.layers.0.self_attn.q_proj.weight": w},
                                          kwargs={"input_ids": x, "labels": x}).loss
    model.config._attn_implementation = "eager"
    exact = float(torch.trace(torch.autograd.functional.hessian(loss_of, q0.detach()).reshape(64, 64)))
    block0 = [n for n in names if ".layers.0." in n]
    block1 = [n for n in names if ".layers.1." in n]
    assert len(block0) == 7 and len({tr[n] for n in block0}) == 1   # one trace per block
    assert abs(tr[block0[0]] - exact) < 1e-8 * max(1.0, abs(exact))
    assert len({tr[n] for n in block1}) == 1 and tr[block1[0]] != tr[block0[0]]
    per_tensor = H.hessian_traces(model, names, x, num_sketch=64, num_query=0)   # the default
    assert per_tensor[block0[0]] == tr[block0[0]] and len(set(per_tensor.values())) == len(names)


def test_cosine_decay_scales_the_constant_phase_only_and_restarts_the_anneal():
    """hestia2026/Hestia's default ``temp_decay_style = "cosine"`` (src/hestia/quant_config.py,
    lines 26-33; configs/quant_example.yaml and configs/hessian_calibration.yaml, lines 8-11:
    compress 0.2, anneal 0.8, "cosine"): ``ThermoScheduler.get_temp`` (thermo_scheduler.py,
    lines 76-87) multiplies by ``temp_scale`` while ``cur_ratio <= 1 - anneal_ratio`` only; in the
    anneal ``_calculate_eff_temp`` (lines 93-105) returns ``init_temp * coeff`` unscaled for
    "cosine" and ``init_temp * coeff * temp_scale`` for "hessian"."""
    t0, scale, n = 0.35, 0.7, 100
    cos = H.Schedule(n, t0, compress_ratio=0.2, scale=scale)               # the default style
    hes = H.Schedule(n, t0, compress_ratio=0.2, scale=scale, decay_style="hessian")
    glob = H.Schedule(n, t0, compress_ratio=0.2)
    assert cos.decay_style == "cosine" and H.QATConfig().decay_style == "cosine"
    for t in range(n):
        r = (t + 1) / n
        coeff = 0.5 * (1 + math.cos(math.pi * (r - 0.2) / 0.8))
        if r <= 0.2:                                                       # constant phase
            assert cos.temperature(t) == pytest.approx(t0 * scale)
            assert hes.temperature(t) == pytest.approx(t0 * scale)
        else:
            assert cos.temperature(t) == pytest.approx(t0 * coeff, abs=1e-12)
            assert cos.temperature(t) == pytest.approx(glob.temperature(t), abs=1e-12)
            assert hes.temperature(t) == pytest.approx(t0 * coeff * scale, abs=1e-12)
    # the restart: the first anneal step is hotter than the scaled constant phase before it
    assert cos.temperature(20) > cos.temperature(19) == pytest.approx(t0 * scale)
    assert cos.temperature(n - 1) == 0.0 == hes.temperature(n - 1)
    with pytest.raises(ValueError):
        H.Schedule(n, t0, decay_style="linear")


def test_qat_config_carries_the_decay_style_to_every_schedule():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=8, intermediate_size=12, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, vocab_size=20,
                      max_position_embeddings=8)
    data = torch.randint(0, 20, (4, 8), generator=torch.Generator().manual_seed(0))
    for style in H.DECAY_STYLES:
        m = LlamaForCausalLM(cfg)
        scales = {n: 0.8 for n in H.ternarize(m, "hestia")}
        hist = H.qat(m, data, H.QATConfig(steps=10, batch=2, decay_style=style, log_every=10),
                     "hestia", scales)
        assert {s.decay_style for s in hist["schedules"].values()} == {style}


def test_zero_temperature_has_the_public_straight_through_gradient():
    """At ``T = 0`` the public ``ThermoQuantizer.forward`` (src/hestia/thermo_quantizer.py,
    lines 86-100) returns ``x + (round-and-clip(x * s) / s) - x.detach()`` with the scale
    ``1 / s = mean|x|`` left in the graph: the identity plus ``q`` times the scale's derivative.
    The STE baseline (its ``TernaryLinear``, quant_linear.py, lines 245-251) detaches all of it."""
    w = _weights((6, 5), seed=3).requires_grad_()
    up = torch.randn(6, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out = H.soft_ternary(w, 0.0)
    assert torch.equal(out.detach(), H.hard_ternary(w))
    g, = torch.autograd.grad((up * out).sum(), w)
    q = torch.clamp(torch.round(w.detach() / w.detach().abs().mean()), -1, 1)
    # d gamma / dW = sign(W) / numel, so d<up, q gamma>/dW = <up, q> sign(W) / numel
    expect = up + float((up * q).sum()) * torch.sign(w.detach()) / w.numel()
    assert torch.allclose(g, expect, atol=1e-12)
    g_ste, = torch.autograd.grad((up * H.ste_ternary(w)).sum(), w)
    assert torch.equal(g_ste, up)


def test_initial_temperature_is_the_public_codes_optimum():
    t0 = H.optimal_init_temp()
    assert abs(t0 - 0.35089) < 2e-4                                  # scipy's bounded Brent there
    grid = torch.linspace(0.3, 0.4, 41, dtype=torch.float64)
    z = torch.linspace(-10, 10, 8001, dtype=torch.float64)
    pdf = torch.exp(-z ** 2 / math.pi) / math.pi                     # N(0, pi/2)
    mse = [float(torch.trapezoid((H.soft_ternary_closed_form(z, float(t)) - z) ** 2 * pdf, z))
           for t in grid]
    assert abs(float(grid[int(torch.tensor(mse).argmin())]) - t0) <= 0.0026
