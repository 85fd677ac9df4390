"""Hestia: the relaxed quantizer, its gradient and limit, the STE baseline, Hutchinson traces,
flip counting, schedules and the layer swap."""
import math

import pytest
import torch
from torch import nn

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
    assert all(a >= b for a, b in zip(temps, temps[1:]))
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
