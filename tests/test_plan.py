"""``workbench plan``: a cost model for every notebook, every full row sized for 10 minutes on one
H100 (as estimated), knobs move the estimate, and nothing heavy is imported or run."""
import subprocess
import sys

import pytest

from workbench import cli, notebooks, plan

NOTEBOOKS = notebooks.discover()


def test_every_notebook_has_a_cost_model():
    assert sorted(plan.MODELS) == sorted(i.number for i in NOTEBOOKS)


@pytest.mark.parametrize("info", NOTEBOOKS, ids=lambda i: i.slug)
def test_full_is_sized_for_ten_minutes_on_one_h100(info):
    full = plan.estimate(info.slug, info.path, "full")
    smoke = plan.estimate(info.slug, info.path, "smoke")
    assert 0 < full.seconds <= plan.BUDGET_S, plan.table([full.row()])
    assert full.flops >= smoke.flops
    assert full.peak_bytes < 78 * 2**30          # one H100's memory


def test_zoo_builds_fit_ten_minutes_at_full():
    from workbench.models import recipes
    for name in recipes.RECIPES:
        assert plan.zoo_build(name, "full").seconds <= plan.BUDGET_S, name


def test_a_knob_moves_the_estimate():
    info = notebooks.resolve("14")
    base = plan.estimate(info.slug, info.path, "full")
    more = plan.estimate(info.slug, info.path, "full", {"gsq_steps": "1280"})
    assert more.flops > 1.5 * base.flops - base.own[1].flops - base.own[2].flops


def test_training_counts_six_n_per_token():
    m = plan.Shape("x", n_layers=2, d_model=64, d_ff=128, vocab=100, ctx=1)
    attention = 3 * 4 * 2 * 1 * 64 * 1000          # 3 x (4 L T d) a token, T = 1
    assert m.train(1000, 1) == pytest.approx(6 * m.params * 1000 + attention)


def test_plan_command(capsys):
    assert cli.main(["plan", "14", "--scale", "full"]) == 0
    out = capsys.readouterr().out
    assert "14-gsq at full" in out and "H100" in out and "assumed" in out
    assert cli.main(["plan"]) == 2


def test_plan_imports_neither_torch_nor_transformers():
    code = ("import sys; from workbench import plan, notebooks; i = notebooks.resolve('16'); "
            "plan.estimate(i.slug, i.path); print('torch' in sys.modules, "
            "'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_full_run_prints_its_estimate_first():
    from workbench import runtime
    line = runtime.full_estimate("14-gsq", {"model_name": "lm-qbed", "zoo_scale": "smoke"})
    assert "14-gsq: estimated" in line and "on one H100" in line
    assert "no estimate" in runtime.full_estimate("99-none", {})
