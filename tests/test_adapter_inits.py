"""Where the LoRA pool's adapters start: the shared init (every adapter from the same A, the
shipped pool's key unchanged) and per-adapter inits (each A its own draw, a pool keyed apart)."""
import json

import pytest

torch = pytest.importorskip("torch")

from workbench import cache  # noqa: E402
from workbench.models import adapters, shipped, zoo  # noqa: E402


def _factors(peft_model, kind):
    return [p.detach().clone() for n, p in peft_model.named_parameters() if f"lora_{kind}." in n]


def test_init_seeds_and_keys():
    fams = adapters.INIT_POOL_FAMILIES
    assert {adapters.init_seed(f) for f in fams} == {0}
    seeds = [adapters.init_seed(f, "per_adapter") for f in fams]
    assert len(set(seeds)) == len(fams)
    assert seeds == [adapters.init_seed(f, "per_adapter") for f in fams]     # reproducible
    with pytest.raises(ValueError, match="init must be one of"):
        adapters.init_seed("sort", "random")
    with pytest.raises(ValueError, match="init must be one of"):
        adapters.adapters("lm-micro", ["sort"], init="random")
    # the shared-init pool keeps the key it was shipped at; the init is in the other pools' key
    shared = adapters.pool_dir(families=fams)
    assert adapters.pool_dir(families=fams, init="shared") == shared
    assert adapters.pool_dir(families=fams, init="per_adapter") != shared
    assert (cache.shipped_root() / adapters.pool_dir().relative_to(zoo.zoo_dir())).exists()


def test_per_adapter_inits_start_from_different_A_and_zero_B(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))     # lm-micro is copied from data/zoo
    a = {(f, init): adapters.fresh_lora("lm-micro", "smoke", f, rank=2, init=init)
         for f in ("sort", "dedupe") for init in adapters.INITS}
    assert all(bool((b == 0).all()) for m in a.values() for b in _factors(m, "B"))
    same = zip(_factors(a["sort", "shared"], "A"), _factors(a["dedupe", "shared"], "A"))
    assert all(torch.equal(x, y) for x, y in same)
    apart = list(zip(_factors(a["sort", "per_adapter"], "A"),
                     _factors(a["dedupe", "per_adapter"], "A")))
    assert apart and not any(torch.allclose(x, y) for x, y in apart)
    again = adapters.fresh_lora("lm-micro", "smoke", "sort", rank=2, init="per_adapter")
    first = _factors(a["sort", "per_adapter"], "A")
    assert all(torch.equal(x, y) for x, y in zip(_factors(again, "A"), first))


def test_the_per_adapter_init_pool_is_shipped_and_carded():
    rel, key = shipped.entries()[adapters.INIT_POOL_NAME]
    assert rel == adapters.pool_dir(families=adapters.INIT_POOL_FAMILIES,
                                    init="per_adapter").relative_to(zoo.zoo_dir())
    card = json.loads((cache.shipped_root() / rel / "card.json").read_text())
    assert card["init"] == "per_adapter"
    assert list(card["adapters"]) == list(adapters.INIT_POOL_FAMILIES)
    assert card["base_key"] == zoo.recipe(adapters.POOL_BASE).key("smoke")
    assert rel.name.endswith(key)
