"""LQZO: seed trick, unbiasedness on a quadratic, BAG moments, isotropy of every law, no graph."""
import copy
import math

import pytest
import torch

from workbench import quant as Q
from workbench.quant import QuantLinear
from workbench.experiments import lqzo as X
from workbench.methods import lqzo as M
from tiny_models import TwoLayerNet

STRUCTURES = [M.Perturbation(law) for law in M.LAWS] + \
    [M.Perturbation(law, 2) for law in M.LAWS] + \
    [M.Perturbation(law, 2, True) for law in M.LAWS] + [M.Perturbation("bag", 1, True, bag_k=5)]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(12, 4, generator=g), torch.randn(6, 10, generator=g),
            torch.randn(7, generator=g)]


@pytest.mark.parametrize("p", STRUCTURES, ids=lambda p: p.label)
def test_seed_trick_regenerates_identical_directions(p):
    ps = _params()
    a = list(M.directions(ps, p, 123))
    b = list(M.directions(ps, p, 123))
    c = list(M.directions(ps, p, 124))
    assert all(torch.equal(x, y) for x, y in zip(a, b))          # bit-identical
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    assert all(x.shape == t.shape for x, t in zip(a, ps))


def test_probe_restores_parameters_within_float_tolerance():
    """+eps, -2 eps, +eps in float32 restores up to rounding (not bit-identical in general)."""
    ps = _params()
    before = [t.clone() for t in ps]
    g, lp, lm = M.two_point(lambda: sum((t ** 2).sum() for t in ps), ps,
                            M.Perturbation("bag", 2, True), seed=7, eps=1e-3)
    assert lp != lm
    for t, b in zip(ps, before):
        assert torch.allclose(t, b, rtol=0, atol=1e-6)
        assert (t - b).abs().max() <= 4 * torch.finfo(torch.float32).eps * b.abs().max()


@pytest.mark.parametrize("p", [M.Perturbation("gaussian"), M.Perturbation("bag", 2, True),
                               M.Perturbation("rademacher", 1)], ids=lambda p: p.label)
def test_two_point_estimator_is_unbiased_on_a_quadratic(p):
    """f(x) = 1/2 x^T A x + b^T x: the central difference is exact, E[<Z, G> Z] = G."""
    torch.manual_seed(0)
    x = [torch.randn(4, 3)]
    A = torch.randn(12, 12) / 4
    A = A @ A.T + torch.eye(12)
    bvec = torch.randn(12)
    f = lambda: 0.5 * x[0].reshape(-1) @ A @ x[0].reshape(-1) + bvec @ x[0].reshape(-1)
    G = (A @ x[0].reshape(-1) + bvec)
    n = 3000
    est = torch.zeros(12, dtype=torch.float64)
    for s in range(n):
        est += M.flat(M.zo_estimate(f, x, p, s, eps=1e-2))
    est /= n
    rel = float((est - G.double()).norm() / G.norm())
    assert rel < 0.2, rel                         # MC error ~ sqrt((D + 2) / n) ~ 0.07
    # a biased law would fail: Bernoulli {0, 1} directions do not satisfy E[z z^T] = I
    gen = torch.Generator().manual_seed(1)
    bern = torch.zeros(12, dtype=torch.float64)
    for _ in range(n):
        z = torch.randint(0, 2, (12,), generator=gen).double()
        bern += (z @ G.double()) * z
    assert float((bern / n - G.double()).norm() / G.norm()) > 0.5


def test_bag_moments_by_sampling():
    g = torch.Generator().manual_seed(0)
    for k in (1, 2, 3, 4):
        z = M.sample_law("bag", (400_000,), g, k=k).double()
        ex = M.law_moments("bag", k)
        assert abs(float(z.mean())) < 0.01
        assert abs(float(z.var()) - 1) < 0.01
        m4 = float((z ** 4).mean())
        assert abs(m4 - ex["m4"]) < 0.05 and m4 < 3.0          # bounded below Gaussian's 3
        assert float(z.abs().max()) <= math.sqrt(k) + 1e-6      # bounded support
    gz = M.sample_law("gaussian", (400_000,), g).double()
    assert abs(float((gz ** 4).mean()) - 3) < 0.1


SECOND_MOMENT = [M.Perturbation(law) for law in M.LAWS] + \
    [M.Perturbation("gaussian", 2), M.Perturbation("bag", 2), M.Perturbation("rademacher", 1),
     M.Perturbation("bag", 2, True), M.Perturbation("rademacher", 1, True)]


@pytest.mark.parametrize("p", SECOND_MOMENT, ids=lambda p: p.label)
def test_second_moment_is_identity_for_every_law(p):
    """E[vec Z vec Z^T] = I, including low-rank and reshaped structures, by sampling."""
    g = torch.Generator().manual_seed(0)
    n, shape = 8000, (6, 2)                   # isotropic factor shape 3 x 4
    Z = torch.stack([M.sample_direction(shape, p, g).reshape(-1) for _ in range(n)]).double()
    C = Z.T @ Z / n
    assert float((C - torch.eye(12, dtype=torch.float64)).abs().max()) < 0.15
    assert abs(float(Z.mean())) < 0.02


def test_near_square_and_reshape_round_trip():
    assert M.near_square(512) == (16, 32)
    assert M.near_square(1536) == (32, 48)
    assert M.near_square(13) == (1, 13)
    a, b = M.near_square(384 * 12)
    assert a * b == 384 * 12 and a <= b and b / a < 2
    # the isotropic factor shape holds the same entries: reshape there and back is the identity
    S = torch.arange(128 * 4.0).reshape(128, 4)
    m, n = M.factor_shape(S.shape, M.Perturbation("bag", 2, True))
    assert (m, n) == (16, 32) and torch.equal(S.reshape(m, n).reshape(128, 4), S)
    # a low-rank draw in the reshaped space has rank <= r there (and generally not in 128 x 4)
    Z = M.sample_direction((128, 4), M.Perturbation("gaussian", 2, True),
                           torch.Generator().manual_seed(0))
    assert Z.shape == (128, 4)
    assert int(torch.linalg.matrix_rank(Z.reshape(16, 32))) == 2
    Z2 = M.sample_direction((128, 4), M.Perturbation("gaussian", 2, False),
                            torch.Generator().manual_seed(0))
    assert int(torch.linalg.matrix_rank(Z2)) == 2


_Net = TwoLayerNet


def _tiny_quant_model():
    torch.manual_seed(0)
    q, scales = M.quantize(_Net(), 3, 8)
    assert list(scales) == ["layers.0.0", "layers.0.2"]
    return q, scales


def test_zo_step_builds_no_graph_and_moves_only_scales():
    q, scales = _tiny_quant_model()
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    loss_fn = lambda: ((q(x) - y) ** 2).mean()
    codes = M.codes_snapshot(q)
    params = list(scales.values())
    before = [p.detach().clone() for p in params]
    seen = []

    def watched():
        loss = loss_fn()
        seen.append((torch.is_grad_enabled(), loss.grad_fn, loss.requires_grad))
        return loss

    with X.SavedForBackward() as sv:
        out = M.zo_step(watched, params, M.Perturbation("bag", 2, True), 3, 1e-3, 1e-3)
    assert sv.bytes == 0 and sv.count == 0                  # autograd saved nothing
    assert seen == [(False, None, False)] * 2
    assert all(p.grad is None for p in params)
    assert any(not torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.equal(c, q.get_submodule(n).codes) for n, c in codes.items())
    assert all(bool((p >= M.MIN_SCALE).all()) for p in params)
    assert isinstance(q.layers[0][0], Q.QuantLinear) and out["graph_built"] is False
    with X.SavedForBackward() as sv2:                       # a backprop forward does save
        loss_fn()
    assert sv2.bytes > 0


def test_zo_update_uses_the_regenerated_direction_and_clips():
    ps = [torch.zeros(5, 3)]
    p = M.Perturbation("rademacher", 1)
    f = lambda: 1e4 * ps[0].sum()                           # huge directional derivative
    M.zo_step(f, ps, p, seed=11, eps=1e-3, lr=0.1, min_scale=None)
    z = next(M.directions([torch.zeros(5, 3)], p, 11))
    d = float(1e4 * z.sum())                                # exact derivative along z
    assert abs(d) > M.CLIP
    expected = -0.1 * math.copysign(M.CLIP, d) * z
    assert torch.allclose(ps[0], expected, atol=1e-3)


def test_true_gradient_matches_central_differences_and_estimator_quality_runs():
    q, scales = _tiny_quant_model()
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    loss_fn = lambda: ((q(x) - y) ** 2).mean()
    params = list(scales.values())
    G = X.true_gradient(loss_fn, params)
    assert all(g.shape == p.shape for g, p in zip(G, params))
    # every scale entry against a central difference, on a float64 copy so that h can be small
    q64 = copy.deepcopy(q).double()
    params64 = [m.scale for m in q64.modules() if isinstance(m, QuantLinear)]
    x64, y64 = x.double(), y.double()
    loss64 = lambda: float(((q64(x64) - y64) ** 2).mean())
    h = 1e-6
    for g, s in zip(G, params64):
        with torch.no_grad():
            for i in range(s.numel()):
                flat_s = s.view(-1)
                flat_s[i] += h
                up = loss64()
                flat_s[i] -= 2 * h
                down = loss64()
                flat_s[i] += h
                assert (up - down) / (2 * h) == pytest.approx(float(g.view(-1)[i]), rel=1e-4,
                                                              abs=1e-7)
    res = X.estimator_quality(loss_fn, params, M.Perturbation("gaussian"), G, range(50), 1e-4)
    lin = X.linearized_quality(G, M.Perturbation("gaussian"), 50, 0)
    assert all(c > 0 for c in res["cos"])                    # g Z always points uphill-ish
    assert abs(sum(res["cos"]) / 50 - sum(lin["cos"]) / 50) < 0.1
    sv = torch.linalg.svdvals(G[0])
    assert 0 < X.energy_top(sv, 1) <= 1 and X.energy_top(sv, len(sv)) == pytest.approx(1)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="law must be one of"):
        M.Perturbation("bernoulli")
    with pytest.raises(ValueError, match="rank"):
        M.Perturbation("bag", 0)
