"""Cached ``peft`` LoRA fine-tunes of zoo models on (prompt, completion) text.

Notebooks that fine-tune a zoo model on data they build themselves (06 on self-annotated
problems, 18 on curated traces) must not retrain what they have trained before. ``cached_lora``
trains a LoRA (every attention and MLP projection, :data:`workbench.models.adapters.TARGETS`,
``lora_alpha = scale * rank`` as in the pool) on the completions (labels on the completion and
``<eos>``, :func:`workbench.data.packing.encode`) and saves it under ``cache_dir()/group/`` keyed
by a hash of the base model's key, the training texts and the settings; a file lock and a
temporary directory renamed into place make concurrent callers train once and never read a
half-written adapter, as in the zoo. Importing this module imports neither torch nor peft.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoraSettings:
    """Settings of one LoRA fine-tune on (prompt, completion) pairs."""
    rank: int = 8            # LoRA rank on every attention and MLP projection
    scale: float = 2.0       # alpha / r (peft: lora_alpha = scale * rank)
    steps: int = 150         # AdamW steps
    batch: int = 32          # examples per step
    lr: float = 3e-3         # AdamW, linear decay to 10%
    seed: int = 0            # init of A and the batch order


def cache_root(group: str) -> Path:
    """``cache_dir() / group``: where one notebook's fine-tunes live."""
    from ..env import cache_dir
    p = cache_dir() / group
    p.mkdir(parents=True, exist_ok=True)
    return p


def cache_key(*parts) -> str:
    """A content key: sha1 of the JSON of ``parts`` (settings, model keys, training texts)."""
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def atomic_build(path: Path, build) -> Path:
    """Run ``build(tmp)`` once under a file lock, then rename ``tmp`` to ``path`` (the zoo's way:
    concurrent callers build once, a half-written result is never read)."""
    from filelock import FileLock
    if (path / "done.json").exists():
        return path
    with FileLock(str(path) + ".lock"):
        if (path / "done.json").exists():
            return path
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        info = build(tmp)
        (tmp / "done.json").write_text(json.dumps(info or {}, indent=2, default=str))
        os.rename(tmp, path)
    return path


def train_lora(model, tok, prompts: list[str], completions: list[str], s: LoraSettings):
    """A ``peft`` LoRA on ``model``'s projections trained on the completions (labels on the
    completion and ``<eos>`` only, :func:`workbench.data.packing.encode`); returns the
    ``PeftModel`` in eval mode and the last losses."""
    import torch
    from peft import LoraConfig, get_peft_model
    from ..data import packing
    from .adapters import TARGETS
    present = {n.split(".")[-1] for n, _ in model.named_modules()}
    device = next(model.parameters()).device
    torch.manual_seed(s.seed)
    pm = get_peft_model(model, LoraConfig(r=s.rank, lora_alpha=s.scale * s.rank, lora_dropout=0.0,
                                          target_modules=[t for t in TARGETS if t in present],
                                          task_type="CAUSAL_LM"))
    pairs = packing.encode(tok, prompts, completions)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=s.lr,
                            weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.9 * min(i, s.steps) / s.steps)
    g = torch.Generator().manual_seed(s.seed)
    losses = []
    pm.train()
    for _ in range(s.steps):
        idx = torch.randint(0, len(pairs), (min(s.batch, len(pairs)),), generator=g).tolist()
        b = packing.pad([pairs[i] for i in idx], tok.pad_token_id)
        loss = pm(**{k: v.to(device) for k, v in b.items()}).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return pm.eval(), losses[-10:]


def cached_lora(base: str, scale: str, prompts: list[str], completions: list[str],
                s: LoraSettings, tag: str = "lora", group: str = "finetune", recipe=None,
                device: str = "cpu"):
    """The zoo model ``base`` with a LoRA fine-tuned on ``(prompts, completions)``, trained once
    and cached under ``cache_dir()/group/`` with a key of the base model's recipe key, the texts
    and ``s`` (``recipe`` builds a model that is not a zoo recipe, as ``zoo.load`` does). Returns
    ``(PeftModel, tokenizer, info)``; ``info["cached"]`` says whether it was loaded."""
    from peft import PeftModel
    from . import zoo
    r = zoo._recipe(base, recipe)
    key = cache_key(r.key(scale), list(prompts), list(completions), asdict(s))
    path = cache_root(group) / f"{tag}-{base}-{scale}-{key}"
    cached = (path / "done.json").exists()

    def build(tmp):
        import time
        t0 = time.time()
        m, tok_ = zoo.load(base, scale, recipe=recipe, device=device)
        pm, last = train_lora(m, tok_, prompts, completions, s)
        pm.cpu().save_pretrained(tmp / "adapter")
        return {"train_seconds": round(time.time() - t0, 2), "final_losses": last,
                "n_examples": len(prompts), "settings": asdict(s), "base_key": r.key(scale)}

    atomic_build(path, build)
    model, tok = zoo.load(base, scale, recipe=recipe, device=device)
    model = PeftModel.from_pretrained(model, path / "adapter").eval()
    info = json.loads((path / "done.json").read_text())
    return model, tok, {**info, "cached": cached, "path": str(path)}
