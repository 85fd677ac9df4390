"""Cached peft LoRA fine-tunes (workbench.models.finetune): trained once, keyed by content."""
import pytest

from workbench.data import tasks
from workbench.models import finetune


def test_cached_lora_trains_once_and_changes_the_model(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from workbench.models import zoo
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    exs = tasks.generate("pattern", 16, seed=0, difficulty=2)
    prompts, comps = [e.prompt for e in exs], [e.completion() for e in exs]
    s = finetune.LoraSettings(rank=2, steps=3, batch=4)
    m1, tok, info1 = finetune.cached_lora("lm-micro", "smoke", prompts, comps, s)
    m2, _, info2 = finetune.cached_lora("lm-micro", "smoke", prompts, comps, s)
    assert not info1["cached"] and info2["cached"] and info1["path"] == info2["path"]
    _, _, info3 = finetune.cached_lora("lm-micro", "smoke", prompts, comps[::-1], s)
    assert info3["path"] != info1["path"]                # the key covers the training texts
    base, _ = zoo.load("lm-micro")
    ids = tok([tok.bos_token + prompts[0]], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        a, b = m1(**ids).logits, m2(**ids).logits
        assert torch.equal(a, b)
        assert not torch.allclose(a, base(**ids).logits)


def test_cache_key_covers_every_part():
    k = finetune.cache_key("a", [1, 2], {"x": 1})
    assert k == finetune.cache_key("a", [1, 2], {"x": 1})
    assert k != finetune.cache_key("a", [2, 1], {"x": 1}) != finetune.cache_key("a", [1, 2], {"x": 2})
