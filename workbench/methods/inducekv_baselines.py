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

Here are the baselines' building blocks (LoRA bytes and states, the shared LoRA loop, the
router, the prompt pool and its training and scoring). The runs of the notebook (sequential LoRA
and replay over a stream, the experts, their cached states) are its harness:
:mod:`workbench.experiments.inducekv`.
"""
from __future__ import annotations

import numpy as np
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

from ..data import packing
from ..models import finetune
from . import inducekv as K

__all__ = ["lora_bytes", "train_steps", "lora_state", "set_lora_state", "fresh_lora",
           "pool_state", "centroids", "route", "PromptPool", "l2p_forward", "train_l2p",
           "l2p_scores"]


def lora_bytes(model, adapter: str | None = None) -> int:
    """Bytes of the LoRA factors of ``adapter`` (all adapters when None) in a ``PeftModel``."""
    return int(sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                   if "lora_" in n and (adapter is None or f".{adapter}." in n)))


def train_steps(model, pairs, steps: int, batch: int, lr: float, seed: int, replay=None,
                pad_id: int = 0) -> int:
    """The shared LoRA loop (:func:`workbench.models.finetune.train_steps`: AdamW, linear decay
    to 10%, the pool's schedule); with a ``replay`` buffer half of every batch comes from it.
    Returns example-passes (fwd + bwd counted as 3 forwards)."""
    finetune.train_steps(model, pairs, steps, batch, lr, seed, pad_id, replay)
    model.eval()
    return 3 * steps * batch


def lora_state(model) -> dict:
    """A detached copy of the LoRA factors of a ``PeftModel``."""
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def set_lora_state(model, state: dict) -> None:
    """Load LoRA factors (as :func:`lora_state` gives them) into a ``PeftModel``."""
    set_peft_model_state_dict(model, state)


def fresh_lora(model, seed: int, rank: int = 8, lora_scale: float = 2.0):
    """A new ``peft`` LoRA on every projection of ``model`` (the pool's configuration)."""
    return finetune.lora_model(model, rank, lora_scale, seed)


def pool_state(pool, name: str) -> dict:
    """The saved LoRA factors of the pool's adapter ``name``."""
    return load_file(str(pool.path(name) / "adapter_model.safetensors"))


# -- MoE of LoRAs ----------------------------------------------------------------------------

def centroids(keys: dict[str, torch.Tensor]) -> tuple[list[str], torch.Tensor]:
    names = list(keys)
    return names, torch.stack([keys[n].mean(0) for n in names])


def route(q: torch.Tensor, cents: torch.Tensor) -> np.ndarray:
    """Index of the nearest centroid (cosine after centring on the centroids' mean)."""
    mu = cents.mean(0) if len(cents) > 1 else torch.zeros_like(cents[0])
    return K.similarity(q - mu, cents - mu).argmax(1).cpu().numpy()


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
    ids, labels = ids.to(q.device), labels.to(q.device)         # the query keys' (model's) device
    embeds, pull = pool.inputs(model, ids, q)
    pad = torch.full((ids.shape[0], embeds.shape[1] - ids.shape[1]), packing.IGNORE,
                     dtype=labels.dtype, device=labels.device)
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
