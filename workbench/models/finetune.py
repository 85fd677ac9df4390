"""Cached ``peft`` LoRA fine-tunes of zoo models on (prompt, completion) text.

Notebooks that fine-tune a zoo model on data they build themselves (06 on self-annotated
problems, 18 on curated traces) must not retrain what they have trained before. ``cached_lora``
trains a LoRA (every attention and MLP projection, :data:`TARGETS`,
``lora_alpha = scale * rank`` as in the pool) on the completions (labels on the completion and
``<eos>``, :func:`workbench.data.packing.encode`) and saves it under ``cache.folder(group)`` keyed
by a hash of the base model's key, the training texts and the settings, built once through
:func:`workbench.cache.build` (concurrent callers train once, a half-written adapter is never read).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from .. import cache
from ..data import packing
from ..device import fast_math, zoo_scale
from . import zoo

__all__ = ["TARGETS", "LoraSettings", "lora_model", "train_steps", "train_lora", "cached_lora"]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "c_attn", "c_proj", "c_fc")       # llama/qwen2 and gpt2 projection names


@dataclass(frozen=True)
class LoraSettings:
    """Settings of one LoRA fine-tune on (prompt, completion) pairs."""
    rank: int = 8            # LoRA rank on every attention and MLP projection
    scale: float = 2.0       # alpha / r (peft: lora_alpha = scale * rank)
    steps: int = 150         # AdamW steps
    batch: int = 32          # examples per step
    lr: float = 3e-3         # AdamW, linear decay to 10%
    seed: int = 0            # init of A and the batch order


def lora_model(model, rank: int = 8, scale: float = 2.0, seed: int | None = None,
               use_dora: bool = False, custom_modules: dict | None = None,
               targets: list[str] | None = None, **lora_kwargs):
    """``model`` with a fresh ``peft`` LoRA on every attention and MLP projection it has
    (:data:`TARGETS`), ``lora_alpha = scale * rank`` (Hu et al. 2021, eq. 3: ``scale`` is
    alpha / r); ``seed`` seeds torch first (A's init) when given. ``use_dora`` makes it peft's
    DoRA (Liu et al. 2024: a trained magnitude per output times the normalized W + B A);
    ``custom_modules`` maps a layer type peft does not know (such as a quantized linear) to the
    peft LoRA layer that wraps it (``LoraConfig._register_custom_module``). ``targets``
    replaces :data:`TARGETS` (e.g. full module names, to adapt only some layers) and
    ``lora_kwargs`` go to ``LoraConfig`` as they are (``use_rslora``, ``init_lora_weights``,
    ``modules_to_save``)."""
    present = {n.split(".")[-1] for n, _ in model.named_modules()}
    if seed is not None:
        torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=scale * rank, lora_dropout=0.0,
                        target_modules=list(targets) if targets is not None
                        else [t for t in TARGETS if t in present],
                        task_type="CAUSAL_LM", use_dora=use_dora, **lora_kwargs)
    if custom_modules:
        config._register_custom_module(custom_modules)
    return get_peft_model(model, config)


def train_steps(model, pairs, steps: int, batch: int, lr: float, seed: int, pad_id: int,
                replay=None, callback=None) -> list[float]:
    """AdamW on ``model``'s trainable parameters with a linear decay to 10%, ``batch`` random
    (prompt, completion) rows a step (:func:`workbench.data.packing.pad`), half of them from
    ``replay`` when given; returns every step's loss. The loop of the LoRA pool, the notebooks'
    fine-tunes and InduceKV's baselines. ``callback(step, loss)``, when given, runs after each
    step (step counts from 1; evaluate a checkpoint there, the model is back in train mode
    after it); returning True stops the loop."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.9 * min(i, steps) / steps)
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    n_old = batch // 2 if replay else 0
    losses = []
    model.train()
    for _ in range(steps):
        rows = [pairs[i] for i in torch.randint(0, len(pairs), (batch - n_old,), generator=g)]
        if n_old:
            rows += [replay[i] for i in torch.randint(0, len(replay), (n_old,), generator=g)]
        b = packing.pad(rows, pad_id)
        with fast_math(device):
            loss = model(**{k: v.to(device) for k, v in b.items()}).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if callback is not None:
            stop = callback(len(losses), losses[-1])
            model.train()
            if stop:
                break
    return losses


def train_lora(model, tok, prompts: list[str], completions: list[str], s: LoraSettings):
    """A ``peft`` LoRA on ``model``'s projections trained on the completions (labels on the
    completion and ``<eos>`` only, :func:`workbench.data.packing.encode`); returns the
    ``PeftModel`` in eval mode and the last losses."""
    pm = lora_model(model, s.rank, s.scale, s.seed)
    pairs = packing.encode(tok, prompts, completions)
    losses = train_steps(pm, pairs, s.steps, min(s.batch, len(pairs)), s.lr, s.seed,
                         tok.pad_token_id)
    return pm.eval(), losses[-10:]


def cached_lora(base: str, scale: str, prompts: list[str], completions: list[str],
                s: LoraSettings, tag: str = "lora", group: str = "finetune", recipe=None,
                device: str = "cpu"):
    """The zoo model ``base`` with a LoRA fine-tuned on ``(prompts, completions)``, trained once
    and cached under ``cache.folder(group)`` with a key of the base model's recipe key, the texts
    and ``s`` (``recipe`` builds a model that is not a zoo recipe, as ``zoo.load`` does). Returns
    ``(PeftModel, tokenizer, info)``; ``info["cached"]`` says whether it was loaded."""
    scale = zoo_scale(scale)                      # a mid run reuses the smoke fine-tunes
    base_key = zoo.key(base, scale, recipe)
    key = cache.key(base_key, list(prompts), list(completions), asdict(s))
    path = cache.folder(group) / f"{tag}-{zoo.label(base)}-{scale}-{key}"
    cached = (path / "done.json").exists()

    def build(tmp):
        t0 = time.time()
        m, tok_ = zoo.load(base, scale, recipe=recipe, device=device)
        pm, last = train_lora(m, tok_, prompts, completions, s)
        pm.cpu().save_pretrained(tmp / "adapter")
        return {"train_seconds": round(time.time() - t0, 2), "final_losses": last,
                "n_examples": len(prompts), "settings": asdict(s), "base_key": base_key}

    cache.build(path, build)
    model, tok = zoo.load(base, scale, recipe=recipe, device=device)
    model = PeftModel.from_pretrained(model, path / "adapter").eval()
    info = json.loads((path / "done.json").read_text())
    return model, tok, {**info, "cached": cached, "path": str(path)}
