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
SIZES = {"shots": [1, 2, 3], "steps": 2, "lr_sgd": 1e-2, "lr_adam": 1e-3, "lr_shampoo": 1e-2,
         "lr_soap": 1e-3, "lr_peft": 1e-2}


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


def test_every_method_runs_on_every_support_set_and_the_middle_states_are_kept(tiny):
    model, tok = tiny
    names = list(images.SHAPES_HELDOUT[:3])
    query, support = lab.draw_target(names, SIZES["shots"], n_query=1, noise=0.3, seed=0)
    clf0 = fo.FewShotClassifier(model, tok, names, "full")
    xf, yf = lab.full_pool(names, 4, 0.3, seed=0)
    ratios, c2 = lab.second_moments(clf0, support, xf, yf, SIZES["lr_sgd"], SIZES["lr_adam"])
    assert list(c2.index) == SIZES["shots"] and (c2.adam_step1 > 0).all()
    res, states = lab.accuracy_vs_shots(model, tok, names, support, query,
                                        fo.full_grad(clf0, xf, yf), c2, SIZES)
    methods = [m for m, _, _ in lab.method_plan(SIZES, 1.0)]
    assert len(res) == len(methods) * 3 and set(res.method) == set(methods)
    # budget-matched Adam's lr is the one that equalises the first steps of that shot count
    row = res[(res.shots == 2) & (res.method == "adam_budget")].iloc[0]
    assert row.lr == pytest.approx(1e-3 * c2.loc[2, "sgd_step1"] / c2.loc[2, "adam_step1"])
    assert set(states) == {m for m, mode, _ in lab.method_plan(SIZES, 1.0) if mode == "full"}
    assert lab.middle_shots(SIZES["shots"]) == 2
    c5 = lab.curvature(states, res, *support[2], 2, iters=2, seed=0)
    assert (c5.dist_from_init > 0).all()
    assert c5.loc["sgd", "dist_from_init"] == res[(res.shots == 2) & (res.method == "sgd")
                                                  ].dist_from_init.iloc[0]
    acc = res.pivot(index="method", columns="shots", values="acc")
    m = lab.scalar_metrics(acc, c2, c5)
    assert m["acc_sgd_3shot"] == acc.loc["sgd", 3]
    assert m["c2_adam_over_sgd_step1_1shot"] == pytest.approx(c2.loc[1, "adam_step1"]
                                                             / c2.loc[1, "sgd_step1"])
    assert all(isinstance(v, float) for v in m.values())


def test_gap_closed_is_the_share_of_the_sgd_adam_gap():
    acc = pd.DataFrame({1: [0.6, 0.2, 0.5, 0.3], 4: [0.5, 0.5, 0.5, 0.5]},
                       index=["sgd", "adam", "adam_budget", "adam_numerator"])
    gap, closed, num = lab.gap_closed(acc)
    assert gap[1] == pytest.approx(0.4) and closed[1] == pytest.approx(0.75)
    assert num[1] == pytest.approx(0.25)
    assert math.isnan(closed[4]) and math.isnan(num[4])       # no gap: nothing to close
