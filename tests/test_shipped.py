"""The shipped zoo (data/zoo): every recipe, the pool and the mini-CLIP at today's keys, and a
small recipe that rebuilds to its shipped card."""
import json

import pytest

from workbench import cache
from workbench.models import shipped, zoo

# a rebuild on another CPU may round differently (data/zoo.md); one on a machine of the same kind
# reproduced every card digit for digit. Within these the rebuild is the shipped model's twin.
PPL_REL_TOL = 0.05          # held-out perplexity, relative
ACC_ABS_TOL = 0.15          # each family's exact match (100 prompts a family for lm-tiny)


def test_every_recipe_pool_and_clip_is_shipped_at_its_key():
    """A recipe change moves its key: ship its rebuild (`workbench zoo ship`) with it."""
    assert shipped.check() == []
    assert set(shipped.entries()) >= set(zoo.RECIPES) | {"lora-pool/lm-base", "clip-mini"}


def test_check_names_a_missing_a_mislabelled_and_a_stale_entry(tmp_path):
    rel, key = shipped.entries()["lm-micro"]
    (tmp_path / rel).mkdir(parents=True)
    (tmp_path / rel / "card.json").write_text(json.dumps({"key": "0000000000"}))
    (tmp_path / "lm-old-smoke-1234567890").mkdir()
    (tmp_path / "lm-old-smoke-1234567890" / "card.json").write_text("{}")
    problems = "\n".join(shipped.check(tmp_path))
    assert f"its card says key 0000000000, the recipe's is {key}" in problems
    assert "lm-base: nothing shipped" in problems
    assert "lm-old-smoke-1234567890: shipped but no recipe has this key" in problems


def test_ship_touches_nothing_when_an_entry_is_not_built(tmp_path, monkeypatch):
    # an unbuilt entry used to leave the shipped zoo half replaced
    shipped_root, cache_root = tmp_path / "shipped", tmp_path / "cache"
    old = shipped_root / "lm-old-smoke-1234567890"
    old.mkdir(parents=True)
    (old / "card.json").write_text("{}")
    monkeypatch.setenv("WORKBENCH_CACHE", str(cache_root))
    first_rel, _ = next(iter(shipped.entries().values()))     # built; the others are not
    (zoo.zoo_dir() / first_rel).mkdir(parents=True)
    (zoo.zoo_dir() / first_rel / "card.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="workbench zoo build"):
        shipped.ship(shipped_root)
    assert [p.name for p in shipped_root.iterdir()] == ["lm-old-smoke-1234567890"]


def test_the_shipped_zoo_stays_small():
    assert shipped.size_bytes() < 60e6


@pytest.mark.slow
def test_lm_tiny_rebuilds_to_its_shipped_card(tmp_path, monkeypatch):
    """CI trains one small recipe from scratch and compares it with the card it ships."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    rel, _ = shipped.entries()["lm-tiny"]
    want = json.loads((cache.shipped_root() / rel / "card.json").read_text())
    got = zoo.build("lm-tiny", force=True)
    assert got["key"] == want["key"] and got["parameters"] == want["parameters"]
    assert got["tokens_seen"] == want["tokens_seen"]
    assert got["heldout_ppl"] == pytest.approx(want["heldout_ppl"], rel=PPL_REL_TOL)
    for fam, acc in want["task_accuracy"].items():
        assert abs(got["task_accuracy"][fam] - acc) <= ACC_ABS_TOL, fam
