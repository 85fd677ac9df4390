"""Properties of HTFM (paper 08): clock laws against scipy (KS), the log-signature against the
analytic Levy area and esig, the FM target (the metrics: tests/test_experiments_htfm.py)."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from workbench.data.heavy_tailed import extreme_field, imbalanced_digits, stable_mixture
from workbench.methods import htfm as H


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# -- clock laws (C1) ----------------------------------------------------------------------------
def test_inverse_gamma_scale_mixture_is_student_t():
    x0, tau = H.sample_source(H.Clock("inverse_gamma", 3.0), 4000, 1, generator=gen())
    assert stats.kstest(tau[:, -1].numpy(), stats.invgamma(1.5, scale=1.5).cdf).pvalue > 1e-3
    assert stats.kstest(x0[:, 0].numpy(), stats.t(3.0).cdf).pvalue > 1e-3
    # the test has power: the same samples are not t with 30 degrees of freedom
    assert stats.kstest(x0[:, 0].numpy(), stats.t(30.0).cdf).pvalue < 1e-3


def test_cms_positive_stable_matches_scipy():
    beta = 0.75
    a = H.positive_stable(beta, 3000, gen(1)).numpy()
    assert (a > 0).all()
    ref = stats.levy_stable(beta, 1.0, scale=math.cos(math.pi * beta / 2) ** (1 / beta))
    assert stats.kstest(a, ref.cdf).pvalue > 1e-3
    # Laplace transform exp(-lam^beta) at lam = 1
    assert abs(np.exp(-a).mean() - math.exp(-1)) < 0.02


def test_stable_clock_marginal_is_symmetric_stable():
    clock = H.Clock("stable", 1.5)
    x0, tau = H.sample_source(clock, 3000, 1, generator=gen(2))
    assert (tau.diff(dim=1) >= 0).all() and (tau[:, 0] == 0).all()
    assert stats.kstest(x0[:, 0].numpy(), clock.marginal_law().cdf).pvalue > 1e-3
    assert stats.kstest(x0[:, 0].numpy(), stats.norm(scale=x0.std().item()).cdf).pvalue < 1e-3


def test_constant_and_alpha_two_clocks_are_gaussian():
    for clock in (H.Clock("constant"), H.Clock("stable", 2.0)):
        x0, tau = H.sample_source(clock, 3000, 1, generator=gen(3))
        assert torch.allclose(tau[:, -1], torch.ones(3000, dtype=tau.dtype))
        assert stats.kstest(x0[:, 0].numpy(), stats.norm.cdf).pvalue > 1e-3


def test_bad_clock_parameters_are_clear_errors():
    with pytest.raises(ValueError, match="alpha"):
        H.Clock("stable", 2.5)
    with pytest.raises(ValueError, match="kind"):
        H.Clock("cauchy")


# -- log-signature (C2) ---------------------------------------------------------------------------
def test_levy_area_of_known_paths():
    square = torch.tensor([[[0., 0.], [1., 0.], [1., 1.], [0., 1.], [0., 0.]]], dtype=torch.float64)
    ls = H.log_signature(square)
    assert torch.allclose(ls, torch.tensor([[0., 0., 1.]], dtype=torch.float64))  # area 1, ccw
    assert torch.allclose(H.log_signature(square.flip(1))[0, 2], torch.tensor(-1.0, dtype=torch.float64))
    line = torch.linspace(0, 1, 7, dtype=torch.float64)[None, :, None] * torch.tensor([2., -3.])
    assert torch.allclose(H.log_signature(line.double()), torch.tensor([[2., -3., 0.]], dtype=torch.float64))
    # a polygon inscribed in a circle: the area tends to pi r^2
    th = torch.linspace(0, 2 * math.pi, 2001, dtype=torch.float64)
    circle = torch.stack([torch.cos(th) - 1, torch.sin(th)], 1)[None] * 2.0
    assert abs(H.log_signature(circle)[0, 2].item() - math.pi * 4) < 1e-3


def test_log_signature_matches_esig():
    pytest.importorskip("esig")
    path = torch.randn(6, 9, 3, generator=gen(4), dtype=torch.float64).cumsum(1)
    assert torch.allclose(H.log_signature(path), H.log_signature(path, backend="esig"), atol=1e-10)
    assert H.logsig_keys(3) == ["1", "2", "3", "[1,2]", "[1,3]", "[2,3]"]


def test_time_augmented_clock_area():
    # area 1/2 int (s dtau - tau ds): a clock that runs late has positive area, one that runs
    # early negative, a uniform one none
    tau = torch.tensor([[0., 0., 1.], [0., 1., 1.], [0., .5, 1.]], dtype=torch.float64)
    area = H.log_signature(H.time_augmented(tau))[:, 2]
    assert torch.allclose(area, torch.tensor([0.25, -0.25, 0.0], dtype=torch.float64))
    assert H.clock_features(tau).shape == (3, 2)
    paths = H.Clock("stable", 1.5).sample_paths(50, 16, gen(8))
    full = torch.asinh(H.log_signature(H.time_augmented(paths))[:, 1:])
    assert torch.allclose(H.clock_features(paths), full, rtol=1e-10, atol=1e-12)


def test_clock_features_are_the_truncated_log_signature_by_hand():
    # the clock tau = (0, 0.5, 0.5, 2) on s = (0, 1/3, 2/3, 1). By hand, segment by segment:
    # level 1 is (1, 2); the Levy area 1/2 int (s dtau - tau ds) = 1/2 (4/3 - 2/3) = 1/3, since
    # int s dtau = 0.5 * 1/6 + 0 + 1.5 * 5/6 = 4/3 and int tau ds = (0.25 + 0.5 + 1.25) / 3 = 2/3
    tau = torch.tensor([[0.0, 0.5, 0.5, 2.0]], dtype=torch.float64)
    path = H.time_augmented(tau)
    assert torch.allclose(H.log_signature(path), torch.tensor([[1.0, 2.0, 1 / 3]], dtype=torch.float64))
    # the same from the signature, by Chen's identity on the segments' exponentials: level 2 is
    # S2 = sum_{k<l} d_k (x) d_l + sum_k d_k (x) d_k / 2, and log S at level 2 is S2 - S1 (x) S1 / 2
    d = path[0, 1:] - path[0, :-1]
    s1 = d.sum(0)
    s2 = sum(torch.outer(d[k], d[m]) for k in range(3) for m in range(k + 1, 3)) \
        + sum(torch.outer(x, x) for x in d) / 2
    log2 = s2 - torch.outer(s1, s1) / 2
    assert torch.allclose(log2, -log2.T) and abs(log2[0, 1].item() - 1 / 3) < 1e-12
    # phi, what the velocity field sees: (tau(1), area) without the constant time increment, asinh'd
    phi = H.clock_features(tau)
    assert torch.allclose(phi, torch.asinh(torch.tensor([[2.0, 1 / 3]], dtype=torch.float64)))
    if H.esig is not None:
        assert torch.allclose(H.log_signature(path, backend="esig"), H.log_signature(path))


def test_the_velocity_field_sees_the_features_of_the_clock_that_made_its_source(monkeypatch):
    # training and sampling pass phi(tau) of the very paths that scaled the source, so the field is
    # conditioned on the realized clock (the abstract's "clock-conditioned vector field")
    seen = []

    class Spy(H.VelocityMLP):
        def forward(self, x, t, cond=None):
            seen.append((x.detach().clone(), cond))
            return super().forward(x, t, cond)

    made = []
    real = H.sample_source

    def spy_source(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(H, "sample_source", spy_source)
    model = Spy(2, cond_dim=2, hidden=8, depth=1)
    H.sample(model, H.Clock("stable", 1.5), 7, nfe=2, generator=gen(9))
    x0, tau = made[0]
    assert torch.allclose(seen[0][1], H.clock_features(tau).float())
    assert torch.allclose(seen[1][1], seen[0][1]) and torch.allclose(seen[0][0], x0.float())
    monkeypatch.setattr(H, "VelocityMLP", lambda *a, **k: Spy(*a, **k))
    made.clear()
    seen.clear()
    H.train_fm(torch.randn(16, 2), H.methods_for(1.5)["htfm"], steps=1, batch=8, hidden=8,
               depth=1, generator=gen(10))
    assert torch.allclose(seen[0][1], H.clock_features(made[0][1]).float())


# -- flow matching --------------------------------------------------------------------------------
def test_fm_target_is_the_path_velocity():
    x0, x1 = torch.randn(5, 2), torch.randn(5, 2)
    t, h = torch.rand(5, 1) * 0.9, 1e-3
    xt, u = H.fm_pair(x0, x1, t)
    assert torch.allclose(xt, (1 - t) * x0 + t * x1)
    assert torch.allclose((H.fm_pair(x0, x1, t + h)[0] - xt) / h, u, atol=1e-2)
    assert torch.allclose(H.fm_pair(x0, x1, torch.zeros(5, 1))[0], x0)


def test_training_reduces_loss_and_sampling_moves_to_data():
    data = torch.tensor([[3.0, 0.0]]).repeat(256, 1) + 0.05 * torch.randn(256, 2, generator=gen(5))
    m = H.methods_for(1.5)["htfm"]
    model, losses = H.train_fm(data, m, steps=300, batch=64, hidden=32, depth=2, generator=gen(6))
    assert losses[-50:].mean() < 0.5 * losses[:50].mean()
    x = H.sample(model, H.Clock("constant"), 500, 8, generator=gen(7))
    assert torch.linalg.norm(x.median(0).values - torch.tensor([3.0, 0.0])) < 0.5


# -- data -----------------------------------------------------------------------------------------
def test_stable_mixture_is_seeded_and_imbalanced():
    a, b = stable_mixture(2000, seed=4), stable_mixture(2000, seed=4)
    assert np.array_equal(a.x, b.x)
    freq = np.bincount(a.label, minlength=6) / 2000
    assert freq[0] > 10 * freq[-1] and len(a.rare) >= 1 and a.weights[a.rare].max() < 0.05


def test_c5_data_shapes():
    x, y, frac = imbalanced_digits(ratio=20, seed=0)
    counts = np.bincount(y, minlength=10)
    assert x.shape[1] == 64 and counts[0] > 10 * counts[9] and 0 <= x.min() and x.max() <= 1
    f = extreme_field(50, size=8, seed=0)
    assert f.shape == (50, 64) and np.isfinite(f).all()
