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


def test_train_steps_callback_sees_every_step_and_can_stop():
    pytest.importorskip("torch")
    from workbench.data import packing
    from workbench.models import zoo
    model, tok = zoo.load("lm-micro")
    exs = tasks.generate("pattern", 8, seed=0, difficulty=2)
    pairs = packing.encode(tok, [e.prompt for e in exs], [e.completion() for e in exs])
    pm = finetune.lora_model(model, rank=2, seed=0)
    seen = []
    losses = finetune.train_steps(pm, pairs, 10, 4, 1e-3, 0, tok.pad_token_id,
                                  callback=lambda step, loss: seen.append((step, loss)) or step == 3)
    assert [s for s, _ in seen] == [1, 2, 3] and len(losses) == 3
    assert [l for _, l in seen] == losses


def test_lora_model_dora_adds_magnitudes():
    pytest.importorskip("torch")
    from workbench.models import zoo
    lora = finetune.lora_model(zoo.load("lm-micro")[0], rank=2, seed=0)
    dora = finetune.lora_model(zoo.load("lm-micro")[0], rank=2, seed=0, use_dora=True)
    n = lambda m: sum(p.numel() for p in m.parameters() if p.requires_grad)  # noqa: E731
    outs = sum(mod.out_features for name, mod in lora.named_modules()
               if name.endswith(finetune.TARGETS) and hasattr(mod, "lora_A"))
    assert n(dora) - n(lora) == outs          # one magnitude per output unit of every layer
