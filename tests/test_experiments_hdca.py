"""The harness of notebook 03 (HDCA): training a session, PyCIL's metrics, the
class-incremental split and runs, the seeded comparison and the C1/C2 diagnostics."""
import numpy as np
import pandas as pd
import pytest
import torch

from workbench.experiments import hdca as ex
from workbench.methods import hdca


def _train_on(n_classes, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.functional.normalize(torch.randn(n_classes, 8, generator=g), dim=-1)
    y = torch.arange(n_classes).repeat(5)
    f = torch.nn.functional.normalize(w[y] + 0.8 * torch.randn(len(y), 8, generator=g), dim=-1)
    ad = hdca.HDCAAdapter(8, rank=2, per_session=True, c_task=4.0, c_cum=4.0)
    ad.new_session()
    ex.train_session(ad, f, y, w, "poincare", 10.0, steps=5, lr=1e-2, generator=g)
    return ad.state_dict()


def test_saved_state_holds_no_per_class_statistics():
    # the state is the adapter factors only; its keys and shapes do not depend on the classes
    s2, s5 = _train_on(2), _train_on(5)
    assert set(s2) == set(s5) == {"adapters.0.A", "adapters.0.B"}
    assert all(s2[k].shape == s5[k].shape for k in s2)
    assert s2["adapters.0.A"].shape == (2, 8) and s2["adapters.0.B"].shape == (8, 2)


def test_training_a_session_lowers_its_loss():
    g = torch.Generator().manual_seed(0)
    w = torch.nn.functional.normalize(torch.randn(4, 8, generator=g), dim=-1)
    y = torch.arange(4).repeat(10)
    f = torch.nn.functional.normalize(torch.randn(len(y), 8, generator=g), dim=-1)
    ad = hdca.HDCAAdapter(8, rank=4, per_session=True, c_task=1.0, c_cum=1.0)
    ad.new_session()
    out = ex.train_session(ad, f, y, w, "poincare", 10.0, steps=60, lr=3e-2, generator=g,
                             log_every=10)
    assert out["loss"][-1] < out["loss"][0] - 0.1
    assert len(out["raw"]) == 6 and all(c <= r + 1e-6 for r, c in zip(out["raw"], out["compressed"]))


# -- metrics (PyCIL) ----------------------------------------------------------------------------

def test_cil_metrics_follow_pycil():
    table = np.array([[0.9, 0.6, 0.5], [np.nan, 0.8, 0.4], [np.nan, np.nan, 0.7]])
    curve = [0.9, 0.7, 0.55]
    m = ex.cil_metrics(table, curve)
    assert m["avg_incremental"] == pytest.approx(np.mean(curve))
    assert m["last"] == pytest.approx(0.55)
    assert m["forgetting"] == pytest.approx(((0.9 - 0.5) + (0.8 - 0.4)) / 2)


def test_session_splits_partition_the_classes():
    s = ex.session_splits(10, 5, seed=3)
    assert len(s) == 5 and all(len(p) == 2 for p in s)
    assert sorted(np.concatenate(s).tolist()) == list(range(10))
    assert not all(np.array_equal(a, b) for a, b in zip(s, ex.session_splits(10, 5, seed=4)))


def test_run_sessions_on_separable_features():
    g = torch.Generator().manual_seed(1)
    w = torch.nn.functional.normalize(torch.randn(6, 16, generator=g), dim=-1)
    y = torch.arange(6).repeat(8)
    f = torch.nn.functional.normalize(w[y] + 0.3 * torch.randn(len(y), 16, generator=g), dim=-1)
    splits = ex.session_splits(6, 3, seed=0)
    zs = ex.run_sessions(f, y, f, y, w, splits, None, "cosine", 20.0, 0, 0.0)
    assert zs["table"].shape == (3, 3) and np.isnan(zs["table"][1, 0])
    assert zs["last"] > 0.9                                       # separable: zero-shot is right
    ad = hdca.HDCAAdapter(16, rank=2, per_session=True, c_task=4.0, c_cum=4.0)
    r = ex.run_sessions(f, y, f, y, w, splits, ad, "poincare", 20.0, 20, 1e-2, seed=0)
    assert len(r["displacement"]) == 3 and len(ad.adapters) == 3
    assert all(d["cumulative"] <= 0.5 + 1e-6 for d in r["displacement"])


def _bed(seed=1, n_classes=6, d=16):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.functional.normalize(torch.randn(n_classes, d, generator=g), dim=-1)
    y = torch.arange(n_classes).repeat(8)
    f = torch.nn.functional.normalize(w[y] + 0.6 * torch.randn(len(y), d, generator=g), dim=-1)
    return {"f_tr": f, "y_tr": y, "f_te": f, "y_te": y, "w": w,
            "names": [str(k) for k in range(n_classes)], "splits": ex.session_splits(n_classes, 3, 0)}


S = {"steps": 5, "lr": 1e-2, "rank": 2, "alpha": 1.0, "c_head": 1.0, "c_task": 4.0, "c_cum": 4.0,
     "enc_norm": 2.0, "replay_per_class": 2, "lwf": 1.0}


def _clip_bed(seed=0, n_classes=6, n_blocks=1):
    """A bed on a tiny random CLIP vision tower, with the in-encoder adapter's inputs."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection
    torch.manual_seed(seed)
    m = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        image_size=8, patch_size=4, projection_dim=12)).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n_classes).repeat(6)
    x = (torch.rand(n_classes, 3, 8, 8, generator=g)[y] + 0.3 * torch.rand(len(y), 3, 8, 8, generator=g))
    with torch.no_grad():
        f = torch.nn.functional.normalize(m(pixel_values=x).image_embeds, dim=-1)
        w = torch.stack([f[y == k].mean(0) for k in range(n_classes)])   # only for this test
    h = ex.encoder_inputs(m, x, n_blocks)
    vm = m.vision_model
    return {"f_tr": f, "y_tr": y, "f_te": f, "y_te": y, "h_tr": h, "h_te": h, "w": w,
            "encoder": (vm.encoder.layers[-n_blocks:], vm.post_layernorm, m.visual_projection),
            "names": [str(k) for k in range(n_classes)], "splits": ex.session_splits(n_classes, 3, 0)}


def test_every_adapter_starts_from_the_same_initialisation():
    # the factors are drawn at the first session, from torch's generator seeded at creation
    bed = _bed()
    a = ex.new_adapter(bed, "output", 2, 7, True, 4.0, 4.0)
    a.new_session()
    b = ex.new_adapter(bed, "output", 2, 7, False)
    b.new_session()
    assert torch.equal(a.adapters[0].A, b.adapters[0].A)
    c = ex.new_adapter(bed, "output", 2, 8)
    c.new_session()
    assert not torch.equal(a.adapters[0].A, c.adapters[0].A)


def test_encoder_inputs_reproduce_clips_image_features():
    bed = _clip_bed(n_blocks=2)
    ad = ex.new_adapter(bed, "encoder", 2, 0, True, 1.0, 1.0)
    with torch.no_grad():
        assert torch.allclose(ad(bed["h_te"]), bed["f_te"], atol=1e-5)
    assert ex.curvatures(S, "encoder") == (1.0, 1.0) and ex.curvatures(S, "output") == (4.0, 4.0)


@pytest.mark.parametrize("variant", list(ex.VARIANTS))
def test_compare_methods_is_deterministic_and_fills_the_ablation(variant):
    bed = _clip_bed() if variant == "encoder" else _bed()
    res, ad = ex.compare_methods(bed, S, 20.0, seed=0, variant=variant)
    assert list(res) == ["zero-shot", "seq-ft", "lwf", "replay", "hdca"]
    abl = ex.ablation_runs(bed, S, 20.0, 0, res["hdca"], variant)
    assert set(abl) == {(s, h) for s in ex.ABLATION for h in ("cosine", "poincare")}
    assert abl["both", "poincare"] is res["hdca"]
    again, _ = ex.compare_methods(bed, S, 20.0, seed=0, variant=variant)
    for m in res:
        assert res[m]["curve"] == again[m]["curve"]
    lwf, seq = res["lwf"]["logs"], res["seq-ft"]["logs"]
    # LwF and sequential fine-tuning reach these losses along different code (LwF adds a zero
    # distillation term, or none), so a CPU may round them apart in the last float32 bits (about
    # 1e-7 relative); 1e-6 still fails any real difference between the two methods
    assert lwf[0]["loss"] == pytest.approx(seq[0]["loss"], rel=1e-6)   # the first task: no teacher
    assert lwf[1]["loss"][0] == pytest.approx(seq[1]["loss"][0], rel=1e-6)  # teacher = student
    assert lwf[1]["loss"][1:] != seq[1]["loss"][1:]                # then the distillation acts
    # the ablation's "none" keeps no compression: its displacement is the raw sum
    d = abl["none", "cosine"]["displacement"][-1]
    assert d["cumulative"] == pytest.approx(d["sum_raw"], rel=1e-5)
    assert {k.split(".")[-1] for k in ad.state_dict()} == {"A", "B"}


def test_item_scores_average_to_pycils_metrics():
    bed = _bed()
    res, _ = ex.compare_methods(bed, S, 20.0, seed=0, variant="output")
    for r in res.values():
        s = ex.item_scores(r)
        assert s["avg"].mean() == pytest.approx(r["avg_incremental"])
        assert s["last"].mean() == pytest.approx(r["last"])
        assert s["retention"].mean() == pytest.approx(-r["forgetting"])
    g = ex.paired_gains(res, ["seq-ft", "hdca"])
    assert g["hdca"]["avg"]["diff"] == 0 and g["hdca"]["avg"]["low"] == 0
    assert g["seq-ft"]["last"]["diff"] == pytest.approx(res["hdca"]["last"] - res["seq-ft"]["last"])
    assert ex.beats(g)["hdca"] == {"avg": False, "last": False, "retention": False}


def test_lwf_distillation_is_zero_when_student_and_teacher_agree():
    z = torch.randn(5, 4)
    assert float(ex._distill(z, z)) == pytest.approx(0.0, abs=1e-6)
    assert float(ex._distill(z, z.flip(0))) > 0


def test_residual_growth_keeps_direction_and_saturates_at_the_bound():
    bed = _bed()
    ad = ex.new_adapter(bed, "output", 2, 0, True, 16.0, 16.0)
    ex.run_sessions(bed["f_tr"], bed["y_tr"], bed["f_te"], bed["y_te"], bed["w"], bed["splits"],
                    ad, "poincare", 20.0, 10, 1e-2)
    grow, cos_min = ex.residual_growth(ad, bed["f_te"], 2.0 ** np.arange(-8, 7))
    assert len(grow) == 3 * 15 and cos_min > 1 - 1e-9
    mean = grow.groupby("k")[["raw", "compressed"]].mean()
    assert (mean.compressed <= 0.25 + 1e-9).all()
    assert mean.compressed.iloc[0] / mean.raw.iloc[0] > 0.99


def test_the_poincare_head_ranks_as_the_cosine_head():
    bed = _bed()
    ad = ex.new_adapter(bed, "output", 2, 0, True, 4.0, 4.0)
    ad.new_session()
    with torch.no_grad():
        ad.adapters[0].B.normal_(0, 1.0)
        z = ad(bed["f_te"])
    r = ex.ranking_agreement(z, bed["w"], 20.0, 1.0, 1.0)
    assert r["argmax_agree"] == 1.0 and r["order_agree"] == 1.0 and r["classes"] == 6
    s = ex.slope_ratios(20.0, 1.0, 1.0)
    assert s["cosine_0.95_over_0"] == pytest.approx(1.0) and s["poincare_0.95_over_0"] > 1.5


def test_restrict_to_all_images_gives_the_runs_metrics():
    bed = _bed()
    r = ex.compare_methods(bed, S, 20.0, seed=0, variant="output")[0]["hdca"]
    y = bed["y_te"].numpy()
    whole = ex.restrict(r, np.arange(len(y)), y, bed["splits"])
    assert whole["curve"] == pytest.approx(r["curve"])
    np.testing.assert_allclose(whole["table"], r["table"])
    for k in ex.METRICS:
        assert whole[k] == pytest.approx(r[k])


def test_selection_bed_holds_out_training_images_per_class():
    bed = _bed()
    sel = ex.selection_bed(bed, 0.25, seed=3)
    n = len(bed["y_tr"])
    assert sel["n_val"] == 6 * 2 and len(sel["y_tr"]) == n - sel["n_val"]
    assert len(sel["y_te"]) == sel["n_val"] + len(bed["y_te"])
    assert torch.equal(sel["y_te"][sel["n_val"]:], bed["y_te"])           # the test rows, after
    assert torch.equal(sel["f_te"][sel["n_val"]:], bed["f_te"])
    held = sel["f_te"][: sel["n_val"]]
    # a held-out image is not trained on: no row of the kept training set equals it
    assert not (torch.cdist(held, sel["f_tr"]) < 1e-7).any()
    assert np.bincount(sel["y_te"][: sel["n_val"]].numpy()).tolist() == [2] * 6
    assert torch.equal(ex.selection_bed(bed, 0.25, seed=3)["f_tr"], sel["f_tr"])  # seeded


def test_tuned_ablation_picks_each_arms_curvature_on_validation():
    bed = _bed()
    out = ex.tuned_ablation(bed, S, 20.0, 0, [1.0, 64.0], "cosine", variant="output", frac=0.25)
    per, both = out["per-task"], out["both"]
    vals = out["val_avg"]
    assert per["c_task"] == max(vals["per-task"], key=vals["per-task"].get) and per["c_cum"] == 0
    assert both["c_task"] == per["c_task"] and both["c_cum"] in (1.0, 64.0)
    assert both["c_cum"] == max(vals["both"], key=vals["both"].get)
    assert per["val"]["avg_incremental"] == vals["per-task"][per["c_task"]]
    assert per["test"]["correct"].shape[1] == len(bed["y_te"])
    assert per["val"]["correct"].shape[1] == out["n_val"]


def test_curvature_sweep_has_one_row_per_curvature():
    sweep = ex.curvature_sweep(_bed(), S, 20.0, 0, [1.0, 64.0], "output")
    assert list(sweep.index) == [1.0, 64.0] and list(sweep.columns) == list(ex.METRICS)
    assert isinstance(sweep, pd.DataFrame)


def test_residual_plane_and_the_explorers_figure():
    bed = _bed()
    ad = ex.new_adapter(bed, "output", 2, 0, True, 4.0, 4.0)
    for _ in range(2):
        ad.new_session()
        with torch.no_grad():
            ad.adapters[-1].B.normal_(0, 1.0)
    plane = ex.residual_plane(ad, bed["f_te"], n_max=10)
    assert plane["raw"].shape == (20, bed["f_te"].shape[1]) and plane["basis"].shape[0] == 2
    assert plane["session"].tolist() == [0] * 10 + [1] * 10
    with torch.no_grad():                       # the rows are the adapter's own residuals
        assert np.allclose(plane["raw"][:10], ad.residuals(bed["f_te"][:10])[0].numpy(), atol=1e-6)
    proj = np.linalg.norm(plane["raw"] @ plane["basis"].T, axis=1)
    assert (proj <= np.linalg.norm(plane["raw"], axis=1) + 1e-9).all()   # never longer
    sweep = pd.DataFrame({k: [0.5, 0.4] for k in ex.METRICS}, index=[1.0, 16.0])
    fig = ex.compression_figure(plane, 16.0, sweep, units=4.0)
    assert len(fig.axes) == 3 and fig.axes[2].get_lines()[-1].get_xdata()[0] == 16.0
    circle = fig.axes[0].patches[0]
    assert circle.get_radius() == pytest.approx(0.5)           # 1 / sqrt(16 / 4)
