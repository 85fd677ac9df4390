"""Paper 04's harness (workbench.experiments.hybrid_lora): the bed's splits, C3's Eckart-Young
check, the rank matched to Hybrid-LoRA's trainable count, the learning-rate sweep of the runs
(cached, selected on validation), the tables and intervals at the selected rates, the cost table
and the explorer over the score's rank r."""
from dataclasses import replace

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


def test_validation_and_test_splits_are_disjoint_held_out_problems():
    bed = X.problems("count", 5, n_eval=256, probe=4, seed=0, n_val=128)
    val, test = [[e.prompt for e in bed[k]] for k in ("val", "held")]
    assert len(val) == 128 and len(test) == 256 and not set(val) & set(test)
    assert val + test == [e.prompt for e in bed["held_all"][:384]]
    assert not set(val + test) & {e.prompt for e in bed["train"]}
    with pytest.raises(ValueError, match="held-out problems"):
        X.problems("count", 5, n_eval=10_000, probe=4, seed=0, n_val=128)


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


def _runs(**kw):
    return X.Runs(base="lm-tiny", zoo_scale="smoke", device="cpu", tok=None, family="count", difficulty=5,
                  train=[], val=[], held=[], settings=X.GRPOSettings(steps=4),
                  ranks={m: 8 for m in H.METHODS}, full={"hybrid": ["a"], "random": ["b"]},
                  lora_scale=2.0, **kw)


def test_runs_put_adapters_at_the_ratio_of_the_dense_rate():
    s = _runs(adapter_ratio=10.0).at(3e-4)
    assert s.lr == 3e-4 and s.lr_adapter == pytest.approx(3e-3) and s.steps == 4


def test_runs_sweep_trains_each_method_and_rate_once_and_selects_on_validation(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    calls = []

    def result(self, method, lr):
        calls.append((method, lr))
        val = {1e-4: 0.3, 3e-4: 0.5 if method == "full" else 0.1}[lr]
        return {"val": val, "test": 1 - val, "items": {"test": [1 - val]}, "trainable": 1}

    monkeypatch.setattr(X.Runs, "result", result)
    runs = _runs()
    sw = runs.sweep(["full", "lora"], [3e-4, 1e-4])
    assert sorted(calls) == sorted((m, v) for m in ("full", "lora") for v in (1e-4, 3e-4))
    again = runs.sweep(["full", "lora"], [1e-4, 3e-4])
    assert len(calls) == 4 and again.table.equals(sw.table)          # cached
    best = X.selected(sw)
    assert best["full"]["lr"] == 3e-4 and best["lora"]["lr"] == 1e-4  # on val, never on test
    _runs(adapter_ratio=3.0).sweep(["full"], [1e-4])
    assert len(calls) == 5                                           # the ratio is in the key
    moved = _runs()
    moved.settings = replace(moved.settings, lr=1.0, lr_adapter=2.0)
    assert moved.key() == runs.key()                                 # the rate is the sweep's


def test_train_grpo_runs_trl_without_gradient_checkpointing(monkeypatch):
    seen = {}

    class Stop(Exception):
        pass

    def trainer(**kw):                       # stands in for GRPOTrainer: keep the config, go no further
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(X, "GRPOTrainer", trainer)
    tok = type("Tok", (), {"bos_token": "<s>", "padding_side": "right"})()
    ex = type("Ex", (), {"prompt": "1+1="})()
    with pytest.raises(Stop):
        X.train_grpo(torch.nn.Linear(2, 2), tok, [ex], {}, X.GRPOSettings(steps=3, prompts=1, group=2), "unused")
    cfg = seen["args"]
    assert not cfg.activation_checkpointing and not cfg.gradient_checkpointing   # no recompute on 1M weights
    assert (cfg.max_steps, cfg.num_generations, cfg.per_device_train_batch_size) == (3, 2, 2)


def test_final_table_and_paired_intervals_at_the_selected_rates():
    best = {"full": {"lr": 1e-4, "val": 0.6, "test": 0.7, "trainable": 9,
                     "items": {"test": [1.0] * 70 + [0.0] * 30}},
            "lora": {"lr": 3e-4, "val": 0.4, "test": 0.4, "trainable": 3,
                     "items": {"test": [1.0] * 40 + [0.0] * 60}}}
    final = X.final_table(best, start=0.5)
    assert list(final.index) == ["full", "lora"]
    assert final.loc["full", "gain"] == pytest.approx(0.2) and final.loc["lora", "lr"] == 3e-4
    c = X.paired(best, "full", ["lora"])
    assert c.loc["lora", "diff"] == pytest.approx(0.3) and 0 < c.loc["lora", "low"] < 0.3 < c.loc["lora", "high"]
    assert c.loc["lora", "n_items"] == 100


def test_reward_curves_are_moving_means_of_the_rollout_reward():
    rc = X.reward_curves({"full": {"reward": [0.0, 1.0, 1.0, 0.0]}}, window=2)
    assert list(rc.index) == [1, 2, 3, 4] and list(rc["full"]) == [0.0, 0.5, 1.0, 0.5]


def test_cost_table_is_relative_to_full_ft():
    recs = {"full": {"trainable": 100, "optimizer_bytes": 800, "step_time": [1.0, 3.0, 2.0]},
            "hybrid": {"trainable": 20, "optimizer_bytes": 160, "step_time": [0.5, 1.5]}}
    cost = X.cost_table(recs)
    assert cost.loc["full", "trainable / full"] == 1 and cost.loc["hybrid", "trainable / full"] == 0.2
    assert cost.loc["hybrid", "bytes_per_trained_weight"] == 8
    assert cost.loc["full", "step_ms"] == pytest.approx(2000) and \
        cost.loc["hybrid", "step_ms / full"] == pytest.approx(0.5)


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
    # past the smaller side no energy is missed: 1 minus a cumulative energy that sums to 1 up to
    # rounding (about 1e-16 on some CPUs' kernels, exactly 0 on others)
    assert X.scores_at(curves, 50) == pytest.approx({n: 0.0 for n in curves}, abs=1e-12)


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


def test_grid_metrics_name_every_method_and_rate_in_grid_order():
    from workbench import sweep
    sw = sweep.sweep(lambda m, v: {"val": v * (2 if m == "a" else 1), "test": -v}, ["a", "b"],
                     [3e-4, 1e-4], "val")
    g = X.grid_metrics(sw)
    assert g["grid_lr_0"] == 1e-4 and g["grid_lr_1"] == 3e-4
    assert g["grid_val_a_1"] == pytest.approx(6e-4) and g["grid_test_b_0"] == pytest.approx(-1e-4)
    assert len(g) == 2 + 2 * 2 * 2
