"""Diagnostics against hand-made cases with known answers."""
import math

import numpy as np
import pytest
import torch

from workbench import diagnostics as d


def test_dormant_scores_and_fraction():
    acts = torch.tensor([[1.0, 0.0, 2.0, 1.0], [3.0, 0.0, -2.0, 1.0]])   # unit 1 is dead
    s = d.dormant_scores(acts)
    # per-unit mean |a| = [2, 0, 2, 1], layer mean 1.25
    assert torch.allclose(s, torch.tensor([1.6, 0.0, 1.6, 0.8]), atol=1e-6)
    assert d.dormant_fraction(acts, tau=0.0) == pytest.approx(0.25)
    assert d.dormant_fraction(acts, tau=0.9) == pytest.approx(0.5)


def test_dormant_averages_spatial_positions_like_the_batch():
    acts = torch.zeros(2, 3, 4, 4)
    acts[:, 0] = 1.0
    acts[:, 2, 0, 0] = 16.0         # unit 2 is active at one position only: mean 1
    assert d.dormant_fraction(acts, tau=0.0) == pytest.approx(1 / 3)
    assert torch.allclose(d.dormant_scores(acts), torch.tensor([1.5, 0.0, 1.5]))


def test_activity_sees_dead_relu_and_saturated_tanh_units():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(512, 4, generator=g)
    h = torch.empty(512, 4)
    h[:, 0] = torch.relu(z[:, 0] - 10.0)           # dead ReLU unit: 0 for every state
    h[:, 1] = torch.tanh(0.3 * z[:, 1] + 6.0)      # saturated tanh: about +1 for every state
    h[:, 2] = torch.tanh(z[:, 2])                  # live units
    h[:, 3] = torch.relu(z[:, 3])
    a = d.activity_scores(h)
    assert (a[:2] <= 0.1).all() and (a[2:] > 0.5).all()
    assert d.inactive_fraction(h) == pytest.approx(0.5)
    # the tau-dormant score (mean |h|) sees the dead unit but not the saturated one
    s = d.dormant_scores(h)
    assert s[0] <= 0.1 and s[1] > 1.0
    assert d.dormant_fraction(h, tau=0.1) == pytest.approx(0.25)


def test_activity_is_the_normalized_standard_deviation():
    h = torch.tensor([[0.0, 1.0, 5.0], [2.0, 1.0, 1.0]])       # sd across states: 1, 0, 2
    assert torch.allclose(d.activity_scores(h), torch.tensor([1.0, 0.0, 2.0]), atol=1e-6)
    assert d.inactive_fraction(h, tau=0.0) == pytest.approx(1 / 3)
    assert d.inactive_fraction(h, tau=1.0) == pytest.approx(2 / 3)
    # invariant to the level and the scale of the whole layer
    assert torch.allclose(d.activity_scores(3.0 * h - 7.0), d.activity_scores(h), atol=1e-6)
    # an all-constant layer is all inactive (the eps keeps it finite)
    assert d.inactive_fraction(torch.ones(5, 3)) == 1.0


def test_activity_of_feature_maps_is_per_channel_across_states():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(64, 3, 5, 5, generator=g)         # batch x channels x H x W
    pattern = torch.randn(5, 5, generator=g)
    h[:, 1] = pattern                                  # the same map for every state: constant
    h[:, 2] = 0.0                                      # dead channel
    a = d.activity_scores(h)
    assert a.shape == (3,) and a[0] > 2.0 and a[1] == 0.0 and a[2] == 0.0
    assert d.inactive_fraction(h) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="batch"):
        d.activity_scores(torch.ones(1, 4))
    with pytest.raises(ValueError, match="units"):
        d.activity_scores(torch.ones(8))


def test_saturated_fraction_finds_constant_tanh_units():
    g = torch.Generator().manual_seed(0)
    acts = torch.tanh(torch.randn(256, 4, generator=g))
    acts[:, 0] = 0.999                 # saturated, constant
    acts[:, 1] = -0.99 + 0.001 * torch.randn(256, generator=g)
    assert d.saturated_fraction(acts) == pytest.approx(0.5)


def test_srank_and_erank_on_known_spectra():
    assert d.srank(torch.eye(10)) == 10 and d.erank(torch.eye(10)) == pytest.approx(10)
    rank_one = torch.outer(torch.arange(1.0, 6.0), torch.arange(1.0, 4.0))
    assert d.srank(rank_one) == 1 and d.erank(rank_one) == pytest.approx(1, abs=1e-6)
    # a long flat tail: the two definitions disagree a lot
    sv = torch.tensor([100.0] + [1.0] * 100)
    assert d.srank(sv, is_sv=True) == 99                 # 100 + 98 >= 0.99 * 200
    assert d.erank(sv, is_sv=True) == pytest.approx(math.sqrt(2 * 200), rel=1e-9)
    assert d.srank(sv, delta=0.5, is_sv=True) == 1
    assert d.srank(torch.zeros(3, 3)) == 0 and d.erank(torch.zeros(3, 3)) == 0.0


def test_srank_accepts_numpy_and_matrices_of_any_shape():
    x = np.diag([3.0, 2.0, 1.0, 0.0])[:, :3]
    assert d.srank(x) == 3
    with pytest.raises(ValueError):
        d.singular_values(torch.zeros(2, 2, 2))


@pytest.mark.parametrize("k", [0, 2])
def test_ablate_singular_removes_exactly_that_component(k):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(12, 10, generator=g, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    a = d.ablate_singular(w, k)
    # the named singular value is gone (one zero appears), every other one is untouched
    expected = torch.cat([s[:k], s[k + 1:], torch.zeros(1, dtype=s.dtype)])
    assert torch.allclose(torch.linalg.svdvals(a), expected, atol=1e-10)
    # its singular vectors are in the kernels of the ablated matrix: the change is s_k u_k v_k^T
    assert torch.allclose(a @ vh[k], torch.zeros(12, dtype=w.dtype), atol=1e-10)
    assert torch.allclose(u[:, k] @ a, torch.zeros(10, dtype=w.dtype), atol=1e-10)
    assert torch.allclose(w - a, s[k] * torch.outer(u[:, k], vh[k]), atol=1e-10)


def test_ablate_singular_removes_several_components():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 5, generator=g, dtype=torch.float64)
    s = torch.linalg.svdvals(w)
    s2 = torch.linalg.svdvals(d.ablate_singular(w, [1, 2]))
    assert torch.allclose(s2[:3], s[[0, 3, 4]], atol=1e-10) and s2[3:].max() < 1e-10


def test_ablate_random_removes_equal_norm():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(8, 8, generator=g, dtype=torch.float64)
    s = torch.linalg.svdvals(w)
    removed = w - d.ablate_random(w, 0, generator=g)
    assert torch.linalg.matrix_rank(removed) == 1
    assert torch.linalg.norm(removed) == pytest.approx(float(s[0]))
    # a control, not the same ablation: the removed direction is not the top singular pair
    assert not torch.allclose(removed, w - d.ablate_singular(w, 0), atol=1e-3)


def test_hutchinson_is_exact_for_a_diagonal_hessian():
    diag = torch.tensor([1.0, -2.0, 3.5, 0.25])
    x = torch.randn(4, requires_grad=True)
    loss = 0.5 * (diag * x * x).sum()          # H = diag: v^T H v = sum(diag) for any +-1 v
    assert d.hutchinson_trace(loss, [x], n_samples=3) == pytest.approx(float(diag.sum()))


def test_hutchinson_estimates_a_dense_trace():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(6, 6, generator=g)
    a = a @ a.T
    x = torch.randn(6, requires_grad=True)
    est = d.hutchinson_trace(0.5 * x @ a @ x, [x], n_samples=4000, generator=g)
    assert est == pytest.approx(float(torch.trace(a)), rel=0.05)


def test_growth_rate_and_tracker():
    t = np.arange(50)
    r, r2 = d.growth_rate(t, 3.0 * np.exp(0.1 * t))
    assert r == pytest.approx(0.1) and r2 == pytest.approx(1.0)
    tr = d.Tracker()
    for step in range(3):
        tr.log(step, loss=1.0 / (step + 1))
    assert list(tr["loss"]) == [1.0, 0.5, pytest.approx(1 / 3)] and "loss" in tr
    assert list(tr.frame().columns) == ["step", "loss"]
    assert d.global_norm([torch.tensor([3.0]), torch.tensor([4.0])]) == pytest.approx(5.0)


def test_spearman_ci_matches_scipy_and_brackets_rho():
    from scipy import stats
    from workbench.diagnostics import spearman_ci
    rng = np.random.default_rng(0)
    x = rng.normal(size=200)
    y = x + rng.normal(size=200)
    r = spearman_ci(x, y, n_resamples=500, seed=1)
    assert r["rho"] == pytest.approx(stats.spearmanr(x, y).statistic)
    assert r["low"] < r["rho"] < r["high"] and r["n"] == 200
    # ranks only: a monotone transform of either side changes nothing, the seed fixes the interval
    assert spearman_ci(np.exp(x), y ** 3 + y, n_resamples=500, seed=1) == pytest.approx(
        spearman_ci(x, y ** 3 + y, n_resamples=500, seed=1))
    z = spearman_ci(x, rng.normal(size=200), n_resamples=500, seed=1)
    assert z["low"] < 0 < z["high"]                     # independent: the interval covers 0
    assert np.isnan(spearman_ci(np.ones(10), x[:10])["rho"])


def test_paired_bootstrap_interval_covers_the_difference_and_keeps_the_pairing():
    from workbench.diagnostics import paired_bootstrap
    rng = np.random.default_rng(0)
    b = (rng.random(400) < 0.5).astype(float)
    a = np.where(rng.random(400) < 0.2, 1.0, b)        # a = b, plus 20% of items turned right
    r = paired_bootstrap(a, b)
    assert r["diff"] == pytest.approx((a - b).mean()) and r["low"] > 0 and r["high"] > r["diff"]
    # paired: b's own item-to-item spread cancels, so the interval is much narrower than
    # that of two independent samples of the same accuracies
    assert r["high"] - r["low"] < 0.6 * 2 * 1.96 * np.sqrt(2 * 0.25 / 400)
    same = paired_bootstrap(b, b)
    assert same["diff"] == same["low"] == same["high"] == 0
    # seeds x items: a repeated seed does not narrow the interval; differing seeds widen it
    two = paired_bootstrap(np.stack([a, a]), np.stack([b, b]))
    assert (two["low"], two["high"]) == pytest.approx((r["low"], r["high"]), abs=0.01)
    assert two["n_seeds"] == 2 and two["n_items"] == 400
    with pytest.raises(ValueError, match="one 1-D or 2-D shape"):
        paired_bootstrap(a, b[:10])
