"""Unit tests of workbench.methods.nfi: the properties paper 12 states, on tiny inputs."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from workbench.methods import nfi


# -- C1: the absorption threshold ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(nfi.DTYPES))
def test_analytic_threshold_matches_measured_two_classes(dtype):
    """With two classes the measured threshold is ln(2 / eps) up to the dtype's gap resolution."""
    r = nfi.threshold_report(dtype, num_classes=2)
    assert r["analytic"] == pytest.approx(math.log(2 / torch.finfo(nfi.DTYPES[dtype]).eps))
    assert abs(r["measured"] - r["analytic"]) <= r["tolerance"]
    assert r["broken_zero_sum"]


@pytest.mark.parametrize("dtype", list(nfi.DTYPES))
def test_threshold_with_many_classes_lies_between_the_bounds(dtype):
    """With C classes the shift is at most ln(C - 1): the measurement lies between the bounds."""
    r = nfi.threshold_report(dtype, num_classes=23)
    assert r["analytic"] - r["analytic_unpooled"] == pytest.approx(math.log(22))
    assert r["matches"]
    tol = r["tolerance"]
    assert r["analytic_unpooled"] - tol <= r["measured"] <= r["analytic"] + tol


def test_float32_threshold_is_ln_2_to_the_24():
    assert nfi.absorption_threshold("float32") == pytest.approx(24 * math.log(2))
    assert nfi.absorption_threshold(torch.float32, 11) == pytest.approx(
        24 * math.log(2) + math.log(10))


def test_gradient_stays_exact_below_threshold():
    """Just below the float32 threshold the correct-class gradient is still non-zero."""
    sw = nfi.gap_sweep("float32", gaps=[16.0, 16.5, 16.6, 16.7, 17.0, 30.0])
    assert (sw["grad_y"][:3] != 0).all()
    assert (sw["grad_y"][3:] == 0).all() and (sw["grad_other"][3:] > 0).all()
    np.testing.assert_allclose(sw["grad_sum"][3:], sw["grad_other"][3:])   # sum = the others


# -- absorbed samples on hand-made logits --------------------------------------------------------
def test_absorbed_detection_on_hand_made_logits():
    logits = torch.tensor([[20.0, 0.0, 0.0],     # gap 20 > 16.6 + ln 2: absorbed
                           [5.0, 0.0, 0.0],      # confident but exact: not absorbed
                           [0.0, 30.0, 0.0],     # wrong class far ahead: not absorbed
                           [0.0, 0.0, 40.0]])    # absorbed, class 2
    y = torch.tensor([0, 0, 0, 2])
    grad = nfi.ce_logit_grad(logits, y)
    assert nfi.absorbed_mask(grad, y).tolist() == [True, False, False, True]
    assert nfi.absorbed_fraction(logits, y) == 0.5
    assert nfi.collapsed_mask(logits).tolist() == [True, False, True, True]   # no label needed
    assert nfi.collapse_fraction(logits) == 0.75
    assert (grad[0, 1:] > 0).all() and grad[0].sum() > 0          # the zero-sum is broken
    assert nfi.logit_gaps(logits, y).tolist() == [20.0, 5.0, -30.0, 40.0]


def test_float64_does_not_absorb_float32_gaps():
    logits = torch.tensor([[20.0, 0.0, 0.0]], dtype=torch.float64)
    assert nfi.absorbed_fraction(logits, torch.tensor([0])) == 0.0


# -- the zero-sum-preserving cross-entropy -------------------------------------------------------
def test_zero_sum_gradient_sums_to_exactly_zero_in_float32():
    torch.manual_seed(0)
    logits = torch.randn(64, 7) * 2
    logits[:32, 0] += 40.0                        # half the batch absorbed under plain CE
    y = torch.zeros(64, dtype=torch.long)
    y[32:] = torch.randint(0, 7, (32,))
    z = logits.clone().requires_grad_(True)
    loss = nfi.zero_sum_cross_entropy(z, y)
    loss.backward()
    g = z.grad
    assert g.dtype == torch.float32
    others = g.scatter(1, y[:, None], 0.0)
    assert (g.gather(1, y[:, None]).squeeze(1) + others.sum(1) == 0).all()   # exactly
    assert not nfi.absorbed_mask(g, y)[:32].any()
    # the plain cross-entropy breaks it on exactly those rows, by the whole of the others' sum
    g_plain = nfi.ce_logit_grad(logits, y) / len(y)
    assert nfi.absorbed_mask(g_plain, y)[:32].all()
    assert (g_plain[:32].sum(1) > 0).all()
    # same loss value, and the same gradient wherever plain CE is exact to rounding
    assert loss.item() == pytest.approx(F.cross_entropy(logits, y).item())
    torch.testing.assert_close(g[32:], g_plain[32:], rtol=1e-4, atol=1e-7)


def test_zero_sum_gradient_matches_float64_reference():
    torch.manual_seed(1)
    logits = torch.randn(16, 5) * 10
    y = torch.randint(0, 5, (16,))
    z = logits.clone().requires_grad_(True)
    (3.0 * nfi.zero_sum_cross_entropy(z, y)).backward()       # grad_output != 1 is honoured
    ref = 3.0 * (torch.softmax(logits.double(), 1) - F.one_hot(y, 5).double()) / 16
    torch.testing.assert_close(z.grad.double(), ref, rtol=1e-5, atol=1e-9)


def test_global_means():
    w = torch.tensor([[1.0, 2.0], [3.0, -2.0]])
    assert nfi.classifier_mean_norm(w).item() == pytest.approx(2.0)
    assert nfi.feature_mean_norm(torch.ones(5, 4)).item() == pytest.approx(2.0)
