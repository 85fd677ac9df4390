"""Unit tests of workbench.experiments.fewshot_optim: notebook 15's harness on a tiny CLIP."""
import math

import pandas as pd
import pytest

torch = pytest.importorskip("torch")

from workbench.data import images  # noqa: E402
from workbench.experiments import fewshot_optim as lab  # noqa: E402
from workbench.methods import fewshot_optim as fo  # noqa: E402
from workbench.models import clip  # noqa: E402

TINY = clip.ClipSize(dim=16, vision_layers=1, text_layers=1, heads=2, mlp=32, proj=8, steps=2,
                     n_per_class=2)
SIZES = {"shots": [1, 2, 3], "steps": 2, "n_query": 1, "n_val": 1, "n_full": 4, "noise": 0.3,
         "lrs": [1e-3, 1e-1]}


@pytest.fixture(scope="module")
def tiny():
    tok = clip.tokenizer()
    return clip.make_model(TINY, len(tok)).eval(), tok


def test_target_draws_are_seeded_and_the_query_is_not_a_support_set():
    names = list(images.SHAPES_HELDOUT[:3])
    (xq, yq), support = lab.draw_target(names, [1, 2], n_query=2, noise=0.3, seed=0)
    again, support2 = lab.draw_target(names, [1, 2], n_query=2, noise=0.3, seed=0)
    assert torch.equal(xq, again[0]) and torch.equal(support[2][0], support2[2][0])
    assert xq.shape[0] == 6 and [len(support[k][1]) for k in (1, 2)] == [3, 6]
    assert sorted(yq.tolist()) == [0, 0, 1, 1, 2, 2]
    assert not torch.equal(xq[:3], support[1][0])            # other render and noise seeds
    other, _ = lab.draw_target(names, [1], n_query=2, noise=0.3, seed=1)
    assert not torch.equal(xq, other[0])
    xf, yf = lab.full_pool(names, 4, 0.3, seed=0)
    assert len(yf) == 12 and float(xf.min()) >= 0 and float(xf.max()) <= 1


def test_the_validation_split_is_its_own_draw():
    names = list(images.SHAPES_HELDOUT[:3])
    (xq, _), support = lab.draw_target(names, [1, 2], n_query=2, noise=0.3, seed=0)
    xv, yv = lab.validation_split(names, 2, 0.3, seed=0)
    assert torch.equal(xv, lab.validation_split(names, 2, 0.3, seed=0)[0])
    assert len(yv) == 6 and not torch.equal(xv, xq) and not torch.equal(xv[:3], support[1][0])
    flat = lambda t: {tuple(r.flatten().tolist()) for r in t}  # noqa: E731
    assert not flat(xv) & (flat(xq) | flat(support[1][0]) | flat(support[2][0]))


def test_plan_gives_budget_matched_adam_sgds_first_step_and_peft_adamw():
    assert lab.plan("sgd", 1e-3, 0.2) == ("sgd", "full", 1e-3)
    assert lab.plan("adam_numerator", 1e-3, 0.2) == ("adam_numerator", "full", 1e-3)
    opt, mode, lr = lab.plan("adam_budget", 1e-3, 0.2)
    assert (opt, mode) == ("adam", "full") and lr == pytest.approx(2e-4)
    assert lab.plan("lora", 1e-2, 0.2) == ("adamw", "lora", 1e-2)
    assert set(lab.METHODS) == set(fo.OPTIMIZERS) | set(fo.PEFT)


def _setup(tiny):
    model, tok = tiny
    model.zoo_card = {"key": "tiny-test"}
    names = list(images.SHAPES_HELDOUT[:3])
    test, support = lab.draw_target(names, SIZES["shots"], n_query=2, noise=0.3, seed=0)
    val = lab.validation_split(names, 1, 0.3, seed=0)
    clf0 = fo.FewShotClassifier(model, tok, names, "full")
    xf, yf = lab.full_pool(names, 4, 0.3, seed=0)
    ratios, c2 = lab.second_moments(clf0, support, xf, yf, 1e-3)
    return model, tok, names, test, support, val, fo.full_grad(clf0, xf, yf), c2


def test_every_method_is_swept_on_every_support_set_selected_on_validation_and_cached(
        tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    model, tok, names, test, support, val, g, c2 = _setup(tiny)
    assert list(c2.index) == SIZES["shots"] and (c2.adam_step1 > 0).all()
    keep = {}
    sweeps = lab.sweep_shots(model, tok, names, support, val, test, grad_full=g, c2=c2, sizes=SIZES,
                             seed=0, keep=keep)
    assert list(sweeps) == SIZES["shots"]
    for sw in sweeps.values():
        assert len(sw.table) == len(lab.METHODS) * len(SIZES["lrs"])
        assert all(len(c) == len(test[1]) for c in sw.table.test_correct)
        for m in lab.METHODS:                      # the selected rate has the best validation
            runs = sw.table[sw.table.method == m]
            assert sw.at_best(m)["val_acc"] == runs.val_acc.max()
    assert set(keep) == {(m, v) for m in lab.FULL for v in SIZES["lrs"]}   # middle shot count: 2
    # a second call reads every run from the cache: nothing is trained, the tables are the same
    again = {}
    sweeps2 = lab.sweep_shots(model, tok, names, support, val, test, grad_full=g, c2=c2, sizes=SIZES,
                              seed=0, keep=again)
    assert again == {} and sweeps2[3].table.equals(sweeps[3].table)
    sel = lab.selected(sweeps)
    assert len(sel) == 3 * len(lab.METHODS) and "test_correct" not in sel
    cmp = lab.comparisons(sweeps)
    assert len(cmp) == 3 * len(lab.PAIRS)
    row = cmp.loc[("sgd", "adam", 2)]
    d = lab.compare(sweeps[2], "sgd", "adam")
    assert row["diff"] == pytest.approx(d["diff"]) and row["low"] <= row["diff"] <= row["high"]
    assert (cmp.loc[("sgd", "peft")].vs == [lab.best_peft(sweeps[k]) for k in SIZES["shots"]]).all()
    # C5 at the selected rates: from keep, or refitted when the sweep read the cache (same numbers)
    refit = lambda m, v: lab.fit(model, tok, names, m, v, support[2], steps=SIZES["steps"],  # noqa: E731
                                 budget_ratio=lab.budget_ratio(c2, 2), grad_full=g)[0]
    c5 = lab.curvature(keep, sweeps[2], refit, *support[2], iters=2, seed=0)
    c5b = lab.curvature({}, sweeps[2], refit, *support[2], iters=2, seed=0)
    assert list(c5.index) == list(lab.FULL) and (c5.dist_from_init > 0).all()
    assert c5.top_eig.to_numpy() == pytest.approx(c5b.top_eig.to_numpy(), rel=1e-4)
    acc = sel.pivot(index="method", columns="shots", values="test_acc")
    m = lab.scalar_metrics(sel, cmp, c2, c5)
    assert m["acc_sgd_3shot"] == acc.loc["sgd", 3] and m["lr_sgd_3shot"] in SIZES["lrs"]
    assert m["d_sgd_adam_2shot_low"] == row["low"]
    assert m["c2_adam_over_sgd_step1_1shot"] == pytest.approx(c2.loc[1, "adam_step1"]
                                                             / c2.loc[1, "sgd_step1"])
    assert all(isinstance(v, float) for v in m.values())


def test_a_diverged_run_has_no_validation_accuracy_so_it_is_never_selected(tiny):
    model, tok = tiny
    names = list(images.SHAPES_HELDOUT[:3])
    test, support = lab.draw_target(names, [1], n_query=1, noise=0.3, seed=0)
    val = lab.validation_split(names, 1, 0.3, seed=0)
    clf, losses, init = lab.fit(model, tok, names, "sgd", 1e-3, support[1], steps=2, budget_ratio=1.0)
    ok = lab.score(clf, losses, init, val, test)
    bad = lab.score(clf, losses + [float("nan")], init, val, test)
    assert not ok["diverged"] and ok["steps_run"] == 2 and math.isfinite(ok["val_acc"])
    assert bad["diverged"] and bad["steps_run"] == 2 and math.isnan(bad["val_acc"])
    assert bad["test_acc"] == ok["test_acc"]


def test_the_best_peft_baseline_is_chosen_on_validation_accuracy():
    from workbench.sweep import Sweep
    rows = [{"method": m, "lr": 1.0, "val_acc": v, "test_acc": 1 - v}
            for m, v in zip(fo.PEFT, [0.2, 0.5, 0.5, 0.1])]
    sw = Sweep("lr", "val_acc", "max", pd.DataFrame(rows))
    assert lab.best_peft(sw) == fo.PEFT[1]            # the first of the tied best, not by test


def test_gap_closed_is_the_share_of_the_sgd_adam_gap():
    acc = pd.DataFrame({1: [0.6, 0.2, 0.5, 0.3], 4: [0.5, 0.5, 0.5, 0.5]},
                       index=["sgd", "adam", "adam_budget", "adam_numerator"])
    gap, closed, num = lab.gap_closed(acc)
    assert gap[1] == pytest.approx(0.4) and closed[1] == pytest.approx(0.75)
    assert num[1] == pytest.approx(0.25)
    assert math.isnan(closed[4]) and math.isnan(num[4])       # no gap: nothing to close


def test_rate_table_marks_each_method_s_selected_rate_and_the_figure_reads_it():
    from workbench.sweep import Sweep
    rows = [{"method": m, "lr": lr, "val_acc": va, "test_acc": ta, "dist_from_init": lr,
             "test_correct": [1]}
            for m, accs in (("sgd", ((0.5, 0.4), (0.7, 0.6))),
                            ("linear", ((0.6, 0.5), (math.nan, 0.1))))
            for lr, (va, ta) in zip((1e-3, 1e-1), accs)]
    sw = Sweep(knob="lr", select="val_acc", mode="max", table=pd.DataFrame(rows))
    t = lab.rate_table({2: sw, 4: sw})
    assert len(t) == 8 and set(t["shots"]) == {2, 4} and "test_correct" not in t
    picked = t[(t["shots"] == 2) & t["selected"]].set_index("method")["lr"]
    assert picked.to_dict() == {"sgd": 1e-1, "linear": 1e-3}      # a diverged run is never picked
    fig = lab.rate_figure(t, 2, 1e-1, zero_shot=0.3, chance=0.25)
    bars = fig.axes[1].patches
    assert [b.get_height() for b in bars] == pytest.approx([0.7, 0.0, 0.6, 0.1])  # val, then test
    ring = fig.axes[1].lines[0].get_ydata()
    assert list(ring) == pytest.approx([0.6, 0.5])                # test at the selected rates
