"""Baselines of InduceKV (paper 01) at matched byte budgets, on the same frozen zoo backbone.

- **Sequential LoRA** (PEFT): one ``peft`` LoRA trained on each task in turn; stage 1 is the
  zoo pool's adapter of the first task (what training a LoRA on task 1 gives, cached), later
  stages continue training the same adapter. Bytes: the LoRA factors.
- **Replay**: sequential LoRA whose batches mix stored examples of the old tasks (half of
  each batch); bytes: the LoRA factors + the buffer's token ids (int16).
- **MoE of LoRAs**: one expert per task (the pool's adapters, or fresh LoRAs where the pool has
  none) and a router on the frozen
  retrieval key (nearest task centroid, cosine after centring); bytes: experts + centroids. When
  the experts outgrow the budget the oldest is dropped.
- **L2P-style prompt pool** (Wang et al. 2022, "Learning to Prompt for Continual Learning"): a
  pool of soft prompts with keys; the frozen query feature picks the top-N prompts by cosine,
  which are prepended to the input embeddings; prompts and keys are trained with the task loss
  plus the key-pull term ``1 - cos(q, k)``. Bytes: prompts + keys.

Trained states are cached under ``zoo_dir()/inducekv/<kind>-<hash>`` (a hash of everything
that changes them), behind a file lock, so a notebook never retrains what is cached.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..data import packing
from .. import cache
from ..models import finetune
from . import inducekv as K


def lora_bytes(model, adapter: str | None = None) -> int:
    """Bytes of the LoRA factors of ``adapter`` (all adapters when None) in a ``PeftModel``."""
    return int(sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                   if "lora_" in n and (adapter is None or f".{adapter}." in n)))


def cache_path(kind: str, spec: dict) -> Path:
    from ..models import zoo
    key = hashlib.sha1(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return zoo.zoo_dir() / "inducekv" / f"{kind}-{key}"


def cached_states(kind: str, spec: dict, build) -> list[dict]:
    """The per-stage state dicts ``build()`` returns, computed once and cached by ``spec``
    (:func:`workbench.cache.build`: a file lock, a directory renamed into place)."""
    path = cache_path(kind, spec)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp):
        torch.save(build(), tmp / "states.pt")
        return spec

    cache.build(path, write)
    return torch.load(path / "states.pt", weights_only=False)


def train_steps(model, pairs, steps: int, batch: int, lr: float, seed: int, replay=None,
                pad_id: int = 0) -> int:
    """The shared LoRA loop (:func:`workbench.models.finetune.train_steps`: AdamW, linear decay
    to 10%, the pool's schedule); with a ``replay`` buffer half of every batch comes from it.
    Returns example-passes (fwd + bwd counted as 3 forwards)."""
    finetune.train_steps(model, pairs, steps, batch, lr, seed, pad_id, replay)
    model.eval()
    return 3 * steps * batch


def lora_state(model) -> dict:
    from peft import get_peft_model_state_dict
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def set_lora_state(model, state: dict) -> None:
    from peft import set_peft_model_state_dict
    set_peft_model_state_dict(model, state)


def fresh_lora(model, seed: int, rank: int = 8, lora_scale: float = 2.0):
    """A new ``peft`` LoRA on every projection of ``model`` (the pool's configuration)."""
    return finetune.lora_model(model, rank, lora_scale, seed)


def pool_state(pool, name: str) -> dict:
    """The saved LoRA factors of the pool's adapter ``name``."""
    from safetensors.torch import load_file
    return load_file(str(pool.path(name) / "adapter_model.safetensors"))


def sequential_lora(pool, base: str, stream: list[str], train_pairs: dict, steps: int,
                    batch: int, lr: float, seed: int, replay_per_task: int = 0,
                    first: str | None = None, rank: int = 8, lora_scale: float = 2.0):
    """``(peft_model, states, info)``: one LoRA after each stage of ``stream`` (cached).

    ``first``: the pool adapter that is stage 1 (what training a LoRA on the first task gives,
    already cached); None trains a fresh LoRA (``rank``, ``lora_scale``) ``steps`` on it, as
    every later stage is trained. With ``replay_per_task`` that many examples of each finished
    task join a replay buffer that fills half of every later batch."""
    from peft import PeftModel
    from ..models import zoo
    model, tok = zoo.load(base, pool.scale)
    if first is not None:
        model = PeftModel.from_pretrained(model, pool.path(first), is_trainable=True)
    else:
        model = fresh_lora(model, seed, rank, lora_scale)
    spec = {"pool": str(pool.dir.name), "base": base, "stream": stream, "steps": steps,
            "batch": batch, "lr": lr, "seed": seed, "replay": replay_per_task, "first": first,
            "rank": rank, "lora_scale": lora_scale,
            "data": {t: [len(train_pairs[t]), sum(len(i) for i, _ in train_pairs[t])]
                     for t in stream}}

    def build():
        states, buf, buffers = [], [], []
        for t, task in enumerate(stream):
            if t > 0 or first is None:
                train_steps(model, train_pairs[task], steps, batch, lr, seed + 1000 * t,
                            buf or None, tok.pad_token_id)
            states.append(lora_state(model))
            if replay_per_task:
                rs = np.random.default_rng(seed + t)
                pick = rs.choice(len(train_pairs[task]), replay_per_task, replace=False)
                buf = buf + [train_pairs[task][i] for i in pick]
            buffers.append(sum(len(ids) for ids, _ in buf) * K.TOKEN_BYTES)
        return {"states": states, "buffer_bytes": buffers}

    kind = ("replay" if replay_per_task else "seqlora") + ("" if first else "-fresh")
    got = cached_states(kind, spec, build)
    n_train = sum(1 for t in range(len(stream)) if t > 0 or first is None)
    info = {"buffer_bytes": got["buffer_bytes"], "adapter_bytes": lora_bytes(model),
            "passes": 3 * steps * batch * n_train}
    set_lora_state(model, got["states"][-1])
    model.eval()
    return model, tok, got["states"], info


def moe_experts(pool, base: str, stream: list[str], train_pairs: dict, experts_from_pool,
                steps: int, batch: int, lr: float, seed: int):
    """``(peft_model, states, passes)``: one expert LoRA per task. ``experts_from_pool`` names
    the pool adapter of each task (cached, no training); None trains a fresh one per task."""
    from peft import PeftModel
    from ..models import zoo
    if experts_from_pool is not None:
        model, _ = zoo.load(base, pool.scale)
        model = PeftModel.from_pretrained(model, pool.path(experts_from_pool[0]))
        return model.eval(), [pool_state(pool, f) for f in experts_from_pool], 0
    states, passes, model = [], 0, None
    for t, name in enumerate(stream):
        model, _, st, info = sequential_lora(pool, base, [name], train_pairs, steps, batch, lr,
                                             seed + t)
        states.append(st[0])
        passes += info["passes"]
    return model, states, passes


# -- MoE of LoRAs ----------------------------------------------------------------------------

def centroids(keys: dict[str, torch.Tensor]) -> tuple[list[str], torch.Tensor]:
    names = list(keys)
    return names, torch.stack([keys[n].mean(0) for n in names])


def route(q: torch.Tensor, cents: torch.Tensor) -> np.ndarray:
    """Index of the nearest centroid (cosine after centring on the centroids' mean)."""
    mu = cents.mean(0) if len(cents) > 1 else torch.zeros_like(cents[0])
    return K.similarity(q - mu, cents - mu).argmax(1).numpy()


# -- L2P-style prompt pool -------------------------------------------------------------------

class PromptPool(nn.Module):
    """``n`` soft prompts of ``length`` tokens with keys; the top-``top_n`` by cosine of the
    frozen query feature are prepended (L2P, Wang et al. 2022, eq. 3-5)."""

    def __init__(self, n: int, length: int, d: int, top_n: int, scale: float, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.prompts = nn.Parameter(torch.randn(n, length, d, generator=g) * scale)
        self.keys = nn.Parameter(torch.randn(n, d, generator=g))
        self.top_n = top_n

    @property
    def nbytes(self) -> int:
        return K.tensor_bytes(self.prompts, self.keys)

    def select(self, q: torch.Tensor) -> torch.Tensor:
        sim = F.normalize(q, dim=-1) @ F.normalize(self.keys, dim=-1).T
        return sim.topk(self.top_n, dim=1).indices

    def inputs(self, model, ids: torch.Tensor, q: torch.Tensor):
        """``(inputs_embeds, pull)``: chosen prompts then the token embeddings, and the
        key-pull term ``mean(1 - cos(q, k_chosen))``."""
        idx = self.select(q)
        P = self.prompts[idx].flatten(1, 2)                        # (B, top_n * length, d)
        emb = model.get_input_embeddings()(ids)
        pull = (1 - F.cosine_similarity(q[:, None], self.keys[idx], dim=-1)).mean()
        return torch.cat([P, emb], 1), pull


def l2p_forward(model, pool: PromptPool, ids, labels, q):
    embeds, pull = pool.inputs(model, ids, q)
    pad = torch.full((ids.shape[0], embeds.shape[1] - ids.shape[1]), packing.IGNORE,
                     dtype=labels.dtype)
    lab = torch.cat([pad, labels], 1)
    out = model(inputs_embeds=embeds, labels=lab)
    return out, lab, pull


def train_l2p(model, pool: PromptPool, pairs, qkeys: torch.Tensor, steps: int, batch: int,
              lr: float, seed: int, pad_id: int, pull_weight: float = 0.5) -> int:
    opt = torch.optim.Adam(pool.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(pairs), (batch,), generator=g)
        b = packing.pad([pairs[i] for i in idx], pad_id)
        out, _, pull = l2p_forward(model, pool, b["input_ids"], b["labels"], qkeys[idx])
        loss = out.loss + pull_weight * pull
        opt.zero_grad()
        loss.backward()
        opt.step()
    return 3 * steps * batch


@torch.no_grad()
def l2p_scores(model, pool: PromptPool, tok, examples, q, with_steps: bool = False,
               batch: int = 64):
    pairs = packing.encode(tok, [e.prompt for e in examples],
                           [e.completion(with_steps) for e in examples])
    logp, exact = np.zeros(len(examples)), np.zeros(len(examples))
    for s in range(0, len(examples), batch):
        b = packing.pad(pairs[s: s + batch], tok.pad_token_id)
        out, lab, _ = l2p_forward(model, pool, b["input_ids"], b["labels"], q[s: s + batch])
        logp[s: s + batch], exact[s: s + batch] = K.score_logits(out.logits, lab)
    return logp, exact
