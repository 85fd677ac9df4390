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


def test_a_checkpoint_is_costed_by_its_own_config(tmp_path):
    """`-p model DIR`: the cost model reads the checkpoint's config.json (Llama- and GPT-2-style
    names) instead of a zoo recipe, so a larger model costs more; a config without the sizes is
    refused with the names it looked for."""
    import json
    info = notebooks.resolve("19")
    zoo = plan.estimate(info.slug, info.path, "smoke")
    for name, cfg in {"llama": {"num_hidden_layers": 8, "hidden_size": 512,
                                "intermediate_size": 1376, "vocab_size": 4096,
                                "max_position_embeddings": 512},
                      "gpt2": {"n_layer": 8, "n_embd": 512, "vocab_size": 4096,
                               "n_positions": 512}}.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        shape = plan.zoo_shape(str(d), "smoke")
        assert (shape.n_layers, shape.d_model, shape.vocab, shape.ctx) == (8, 512, 4096, 512)
        assert shape.d_ff == (1376 if name == "llama" else 2048)      # GPT-2: 4 x width
        own = plan.estimate(info.slug, info.path, "smoke", {"model": str(d)})
        assert own.flops > 4 * zoo.flops and own.peak_bytes > zoo.peak_bytes
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(ValueError, match="no n_layers, d_model.*num_hidden_layers"):
        plan.checkpoint_shape(tmp_path / "bare")


def test_the_cpu_rate_is_measured_from_a_shipped_build():
    rate, where = plan.cpu_rate()
    build = plan.zoo_build(plan.CPU_RATE_FROM, "smoke").flops
    assert 1e9 < rate < 1e12 and "shipped lm-base build" in where
    est = plan.estimate("12-nfi", notebooks.resolve("12").path, "smoke")
    assert est.cpu_seconds(rate) == pytest.approx(est.flops / rate)
    assert build / rate > 60                 # the calibrating build ran for minutes, not ms


def test_a_dry_run_prints_each_jobs_estimate(capsys):
    assert cli.main(["run", "12", "14", "--dry-run", "--seeds", "0,1"]) == 0
    out = capsys.readouterr().out                 # one estimate a notebook: seeds cost alike
    assert out.count("estimate of ") == 2 and "on one H100, at least" in out
    assert "one CPU thread" in out and "estimates, not measurements" in out
