"""Unit tests of workbench.experiments.nfi: notebook 12's harness (trainer, spikes, growth fits,
the story of a spike), on tiny inputs."""
import math

import numpy as np
import pytest

from workbench.data import classification
from workbench.diagnostics import Tracker
from workbench.experiments import nfi as lab


# -- spikes and growth ---------------------------------------------------------------------------
def test_spike_detector_on_synthetic_loss_curve():
    t = np.arange(2000)
    loss = 2.0 * np.exp(-t / 60.0) + 1e-9        # a smooth fit down to a floor
    loss[1200:1500] = 0.0                        # exactly zero, as when every sample is absorbed
    for k, h in [(600, 0.5), (1000, 3.0), (1520, 0.05)]:
        loss[k:k + 30] = h * np.exp(-np.arange(30) / 5.0)   # spike and fast recovery
    loss[1010] *= 0.5                            # a ragged peak still counts once
    spikes = lab.detect_spikes(loss, window=50)
    assert spikes.tolist() == [600, 1000, 1520]
    assert lab.detect_spikes(2.0 * np.exp(-t / 60.0)).size == 0    # a plain decay has none
    assert lab.detect_spikes(loss, min_loss=0.1).tolist() == [600, 1000]


def test_growth_fit_and_window():
    s = np.arange(100)
    fit = lab.growth_fit(s, 0.5 * np.exp(0.03 * s))
    assert fit["rate"] == pytest.approx(0.03) and fit["r2"] == pytest.approx(1.0)
    assert fit["r2"] > fit["linear_r2"] and fit["factor"] == pytest.approx(math.exp(2.97))
    absorbed = np.r_[np.zeros(10), np.linspace(0.2, 1.0, 40), np.ones(50)]
    assert lab.inflation_window(absorbed, spikes=[5, 70]) == (int(np.argmax(absorbed >= 0.5)), 70)
    assert lab.inflation_window(absorbed) == (int(np.argmax(absorbed >= 0.5)), 100)
    assert lab.inflation_window(np.zeros(10)) is None


# -- the trainer ---------------------------------------------------------------------------------
def test_trainer_variants_start_identical_and_track_everything():
    task = classification.modular_addition(p=7, train_frac=0.6, seed=0)
    cfg = lab.TrainConfig(steps=5, hidden=16, eval_every=2)
    init = lab.init_model(task, cfg, seed=0)
    runs = {v: lab.train(task, cfg, v, init) for v in lab.VARIANTS}
    for tr in runs.values():
        assert set(lab.TRACKED) <= set(tr.series) and len(tr.steps) == 5
        assert np.isnan(tr["test_acc"][1]) and np.isfinite(tr["test_acc"][[0, 2, 4]]).all()
    first = {v: tr["loss"][0] for v, tr in runs.items()}
    assert first["float32"] == first["zero_sum"] == pytest.approx(first["float64"], rel=1e-6)
    with pytest.raises(ValueError):
        lab.train(task, cfg, "float16")


def test_train_variants_shares_the_initial_weights_and_only_float32_absorbs():
    """The three variants start from one init; on a task fitted far past the float32 threshold,
    the float32 run absorbs samples while float64 and the zero-sum backward do not."""
    task = classification.modular_addition(p=5, train_frac=0.8, seed=0)
    cfg = lab.TrainConfig(steps=150, lr=5e-2, hidden=16, eval_every=50)
    init = lab.init_model(task, cfg, seed=0)
    runs = lab.train_variants(task, cfg, init)
    assert list(runs) == list(lab.VARIANTS)
    first = {v: tr["param_norm"][0] for v, tr in runs.items()}
    assert first["float32"] == first["zero_sum"] == pytest.approx(first["float64"], rel=1e-6)
    assert runs["float32"]["absorbed"].max() > 0
    assert runs["zero_sum"]["absorbed"].max() == 0      # the fix: never an exactly-0 grad_y
    assert runs["float64"]["absorbed"].max() == 0       # float64's threshold is at 36.7


def test_spike_story_reads_growth_jump_and_absorbed_fraction():
    tr = Tracker()
    for t in range(400):
        spike = t == 300
        tr.log(t, loss=1.0 if spike else 1e-8, cls_mean=math.exp(0.01 * min(t, 300)),
               grad_norm=1e3 if spike else 1e-3, absorbed=0.2 if t >= 300 else 0.9)
    s = lab.spike_story(tr, 300)
    assert s["step"] == 300 and s["peak_loss"] == 1.0
    assert s["cls_mean_growth_before"] == pytest.approx(math.exp(2.0))   # 200 steps at 0.01
    assert s["grad_norm_jump"] == pytest.approx(1e6)
    assert (s["absorbed_before"], s["absorbed_after"]) == (0.9, 0.2)
    # spikes without room around them (before step 100, within 20 of the end) are left out
    assert [x["step"] for x in lab.spike_stories(tr, [50, 300, 390])] == [300]


def test_window_fits_fit_curve_and_metrics():
    tr = Tracker()
    for t in range(60):
        tr.log(t, cls_mean=2.0 * math.exp(0.05 * t), feat_mean=3.0, param_norm=1.0 + t)
    fits = lab.window_fits({"float32": tr}, (10, 50))
    assert fits["float32"]["cls_mean"]["rate"] == pytest.approx(0.05)
    assert fits["float32"]["cls_mean"]["factor"] == pytest.approx(math.exp(0.05 * 39))
    st, curve = lab.fit_curve(tr["cls_mean"], (10, 50), 0.05)
    np.testing.assert_allclose(curve, tr["cls_mean"][10:50], rtol=1e-9)
    assert st.tolist() == list(range(10, 50))
    m = lab.fit_metrics(fits, "mod")
    assert m["mod_cls_mean_rate_float32"] == fits["float32"]["cls_mean"]["rate"]
    assert m["mod_param_norm_factor_float32"] == pytest.approx(50 / 11)
    assert lab.window_fits({"float32": tr}, None) == {}
    assert lab.log_doubling(math.log(2) / 90) == pytest.approx(90)
    assert math.isnan(lab.log_doubling(None))


def test_increase_ratio_and_separation_step_on_hand_made_norms():
    """float32 grows like the controls for 60 steps, then twice as fast: the ratio is 1, then
    rises, and the separation step is the first step from which it stays above the margin."""
    t = np.arange(100, dtype=float)
    ctrl = 10 + 0.1 * t
    f32 = ctrl + np.where(t >= 60, 0.1 * (t - 60), 0.0)
    runs = {}
    for v, x in (("float32", f32), ("float64", ctrl), ("zero_sum", ctrl - 0.01 * t)):
        runs[v] = Tracker()
        for i, xi in enumerate(x):
            runs[v].log(i, param_norm=xi)
    r = lab.increase_ratio(runs, (10, 100))
    assert len(r) == 90 and np.isnan(r[0])                      # no growth yet at the start
    assert r[1:50] == pytest.approx(1.0)                        # the larger control is float64
    assert r[-1] == pytest.approx((0.1 * 89 + 0.1 * 39) / (0.1 * 89))
    first = 10 + int(np.argmax(r > 1.1))
    assert lab.separation_step(r, (10, 100)) == first and first > 60
    assert lab.separation_step(r, (10, 100), margin=5.0) is None
    wobble = np.r_[np.full(5, 1.2), np.full(5, 1.0), np.full(5, 1.3)]
    assert lab.separation_step(wobble, (0, 15)) == 10          # it must stay above to count


# -- the explorer ------------------------------------------------------------------------------
def test_gap_gradients_name_which_precisions_absorb_at_a_gap():
    t = lab.gap_gradients(20.0, 2).set_index("dtype")
    # past ln 2^24 = 16.6, float32 rounds p_y - 1 to exactly 0 while the row sum stays e^{-20}
    assert t.loc["float32", "grad_y"] == 0 and t.loc["float32", "absorbed"]
    assert t.loc["float32", "grad_sum"] == pytest.approx(math.exp(-20.0), rel=1e-3)
    assert t.loc["float64", "grad_y"] != 0 and not t.loc["float64", "absorbed"]
    assert t.loc["float16", "underflow"] and not t.loc["float16", "absorbed"]   # e^-20 < 6e-8
    low = lab.gap_gradients(3.0, 2)
    assert not low.absorbed.any() and (low.grad_y != 0).all()      # below every threshold


def test_gap_states_and_figure():
    sw = {"grad_y": np.array([-0.5, 0.0, 0.0]), "grad_other": np.array([0.5, 1e-9, 0.0])}
    assert lab.gap_states(sw).tolist() == [0, 1, 2]
    fig = lab.gap_figure(20.0, 5, step=0.5)
    left, right = fig.axes
    assert [t.get_text() for t in left.get_yticklabels()] == list(lab.DTYPES)
    assert "float32\nabsorbed" in [t.get_text() for t in right.get_xticklabels()]
