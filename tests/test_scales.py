"""The three scales: smoke (CI), mid (a reader's laptop), full (one GPU). A mid run uses the
smoke zoo, so every shipped model, pool and cached fine-tune is found, never retrained."""
import pytest

from workbench import device
from workbench.runtime import SCALES, Run


def test_the_scales_and_the_zoo_each_one_loads():
    assert SCALES == device.SCALES == ("smoke", "mid", "full")
    assert [device.zoo_scale(s) for s in SCALES] == ["smoke", "smoke", "full"]
    with pytest.raises(ValueError, match="scale must be one of"):
        device.zoo_scale("medium")


def test_a_mid_run_finds_the_smoke_zoo_where_it_is():
    from workbench.models import adapters, clip, recipes, zoo
    for name in ("lm-base", "lm-qbed", "lm-reasoning"):
        assert zoo.model_dir(name, "mid") == zoo.model_dir(name, "smoke")
        assert zoo.key(name, "mid") == zoo.key(name, "smoke") != zoo.key(name, "full")
        assert recipes.recipe(name).size("mid") == recipes.recipe(name).size("smoke")
    assert clip.model_dir("mid") == clip.model_dir("smoke") != clip.model_dir("full")
    assert adapters.pool_dir(model_scale="mid") == adapters.pool_dir(model_scale="smoke")
    assert adapters.recipe_key("mid") == adapters.recipe_key("smoke")


def test_a_run_at_mid_reads_its_row_or_the_row_it_names(tmp_path):
    table = {"smoke": {"steps": 10}, "mid": {"steps": 100}, "full": {"steps": 1000}}
    run = Run("99-demo", scale="mid", out_dir=tmp_path / "a")
    assert run.sizes(table) == {"steps": 100}
    run = Run("99-demo", scale="mid", out_dir=tmp_path / "b")
    assert run.sizes({**table, "mid": "smoke"}) == {"steps": 10}
    run = Run("99-demo", scale="mid", out_dir=tmp_path / "c")
    with pytest.raises(KeyError, match="no row for scale 'mid'"):
        run.sizes({"smoke": {"steps": 10}, "full": {"steps": 1000}})
    with pytest.raises(ValueError, match="scale must be one of"):
        Run("99-demo", scale="medium", out_dir=tmp_path / "d")
