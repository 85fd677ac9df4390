"""Paper 04's harness (workbench.experiments.hybrid_lora): the bed's splits, C3's Eckart-Young
check, the rank matched to Hybrid-LoRA's trainable count, the cached run, the cost table and the
explorer over the score's rank r."""
import json

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch
from matplotlib.patches import Rectangle

from workbench.experiments import hybrid_lora as X
from workbench.methods import hybrid_lora as H


def test_probe_batches_are_disjoint_train_problems_and_held_out_is_unseen():
    bed = X.problems("kv", 2, n_eval=8, probe=5, seed=3)
    train = {e.prompt for e in bed["train"]}
    a, b = [{e.prompt for e in bed[k]} for k in ("probe_a", "probe_b")]
    assert len(a) == len(b) == 5 and not a & b and a | b <= train
    assert len(bed["held"]) == 8 and not {e.prompt for e in bed["held_all"]} & train
    assert [e.prompt for e in X.problems("kv", 2, 8, 5, 3)["probe_a"]] == \
        [e.prompt for e in bed["probe_a"]]                         # seeded


def test_eckart_young_check_accepts_the_score_and_rejects_anything_else():
    g = torch.Generator().manual_seed(0)
    grads = {f"m{i}": torch.randn(12, 9, generator=g) for i in range(4)}
    scores = {n: H.hybrid_score(v, 3) for n, v in grads.items()}
    err, rand_worse = X.eckart_young_check(grads, scores, 3, seed=0)
    assert err < 1e-10 and rand_worse
    err, _ = X.eckart_young_check(grads, {n: s + 0.05 for n, s in scores.items()}, 3, seed=0)
    assert abs(err - 0.05) < 1e-9


def test_matched_rank_counts_full_modules_and_lora_factors():
    lin = torch.nn.ModuleDict({"a": torch.nn.Linear(10, 20), "b": torch.nn.Linear(30, 10)})
    names = ["a", "b"]
    hybrid, r = X.matched_rank(lin, names, [], 4)
    assert hybrid == 4 * (10 + 20 + 30 + 10) and r == 4                # no full module: rank r
    hybrid, r = X.matched_rank(lin, names, ["b"], 4)
    assert hybrid == 300 + 4 * 30 and r == max(4, round(420 / 70))


def test_cached_run_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    calls = []

    def build(out):
        calls.append(out)
        return {"heldout": {"0": 0.5}, "train_seconds": 1.0}

    first = X.cached_run("t", ["k", 1], build)
    again = X.cached_run("t", ["k", 1], build)
    other = X.cached_run("t", ["k", 2], build)
    assert len(calls) == 2 and not first["cached"] and again["cached"] and not other["cached"]
    assert first["heldout"] == again["heldout"] == {"0": 0.5}
    (entry,) = [p for p in (tmp_path / "t").iterdir() if p.name.endswith(
        __import__("workbench.cache", fromlist=["key"]).key("k", 1))]
    assert json.loads((entry / "record.json").read_text())["train_seconds"] == 1.0


def test_cost_table_is_relative_to_full_ft():
    recs = {"full": {"trainable": 100, "optimizer_bytes": 800, "step_time": [1.0, 3.0, 2.0]},
            "hybrid": {"trainable": 20, "optimizer_bytes": 160, "step_time": [0.5, 1.5]}}
    cost = X.cost_table(recs)
    assert cost.loc["full", "trainable / full"] == 1 and cost.loc["hybrid", "trainable / full"] == 0.2
    assert cost.loc["hybrid", "bytes_per_trained_weight"] == 8
    assert cost.loc["full", "step_ms"] == pytest.approx(2000) and \
        cost.loc["hybrid", "step_ms / full"] == pytest.approx(0.5)


def test_final_table_takes_the_last_step_and_the_gain_over_step_zero():
    recs = {("full", 0): {"heldout": {0: 0.2, 10: 0.6}, "trainable": 9},
            ("full", 1): {"heldout": {0: 0.2, 10: 0.4}, "trainable": 9},
            ("lora", 0): {"heldout": {0: 0.2, 10: 0.3}, "trainable": 3},
            ("lora", 1): {"heldout": {0: 0.2, 10: 0.3}, "trainable": 3}}
    final = X.final_table(X.curves(recs), recs, ("full", "lora"), seed=0)
    assert list(final.index) == ["full", "lora"]
    assert final.loc["full", "mean"] == pytest.approx(0.5) and final.loc["full", "gain"] == pytest.approx(0.3)
    assert final.loc["lora", "trainable"] == 3 and isinstance(final, pd.DataFrame)


def _grads(seed=0, layers=2):
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.{k}": torch.randn(12, 3, generator=g) @ torch.randn(
        3, 9, generator=g) + 0.1 * torch.randn(12, 9, generator=g)
        for i in range(layers) for k in ("q_proj", "v_proj")}


def test_energy_curves_give_the_score_at_every_rank():
    grads = _grads()
    curves = X.energy_curves(grads)
    for n, c in curves.items():
        assert len(c) == 10 and c[0] == 0 and c[-1] == pytest.approx(1)
        assert (pd.Series(c).diff()[1:] >= 0).all()
    for r in (1, 2, 3, 5, 8):
        want = {n: H.hybrid_score(g, r) for n, g in grads.items()}
        assert X.scores_at(curves, r) == pytest.approx(want)
    assert set(X.scores_at(curves, 50).values()) == {0.0}     # past the smaller side: none missed


def test_rank_sweep_selects_like_the_method_and_compares_the_two_batches():
    ca = X.energy_curves(_grads(0))
    same = X.rank_sweep(ca, ca, range(1, 5), budget=0.5)
    assert list(same["rank"]) == [1, 2, 3, 4]
    assert (same.spearman == 1).all() and (same.overlap == 1).all()
    for row in same.itertuples():
        assert row.chosen == H.select_modules(X.scores_at(ca, row.rank), 0.5)
        assert len(row.chosen) == 2
        assert row.max_score == pytest.approx(max(X.scores_at(ca, row.rank).values()))
    other = X.rank_sweep(ca, X.energy_curves(_grads(1)), [2], budget=0.25)
    assert -1 <= other.spearman[0] <= 1 and other.overlap[0] in (0.0, 1.0)


def test_rank_figure_boxes_the_selection_and_marks_the_trained_one():
    ca = X.energy_curves(_grads(0))
    sweep = X.rank_sweep(ca, X.energy_curves(_grads(1)), range(1, 6), 0.5)
    trained = ["model.layers.0.self_attn.q_proj"]
    fig = X.rank_figure(ca, sweep, 2, 0.5, trained, 3)
    heat_ax = fig.axes[0]
    boxes = [p for p in heat_ax.patches if isinstance(p, Rectangle)]
    assert len(boxes) == 2 + 1 and sum(p.get_linestyle() == "--" for p in boxes) == 1
    assert len(fig.axes[1].get_lines()) == len(ca) + 1          # a curve per module, the r line
    assert "r = 2" in fig.axes[1].get_title()
    plt.close(fig)
