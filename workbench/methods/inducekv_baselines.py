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
- **MoE of LoRAs, trained gate** (LoRAMoE, Dou et al. 2023, "LoRAMoE: Alleviating World
  Knowledge Forgetting in Large Language Models via MoE-Style Plugin"; MoELoRA in CoIN, Chen et
  al. 2024, the continual multimodal instruction-tuning benchmark): the same experts, mixed by a
  learned linear gate, ``h = W x + scale * sum_e g_e(q) B_e A_e x`` with ``g(q) = softmax(W_g q +
  b_g)`` over the live experts. Our gate reads the frozen retrieval key ``q`` of the whole
  prompt (one weight vector per sequence, where LoRAMoE routes every token of every layer) and
  is trained with the task loss through the mixture on each task's training data as the task
  arrives (the stream's data; no replay), the experts frozen: it differs from the centroid MoE
  only in the router. Bytes: experts + gate.
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
           "l2p_scores", "expert_factors", "LoraMixture", "Gate", "train_gate",
           "gated_scores"]


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
    return K.similarity(q - mu, cents - mu).argmax(1).numpy()


# -- MoE of LoRAs with a trained gate (LoRAMoE / MoELoRA) ---------------------------------------

def expert_factors(state: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module name: (A, B)}`` of a peft LoRA state (keys ``base_model.model.<module>.lora_A
    .weight``, as :func:`lora_state` and :func:`pool_state` give them)."""
    out = {}
    for k, v in state.items():
        if ".lora_A." in k:
            name = k.removeprefix("base_model.model.").split(".lora_A.")[0]
            out[name] = (v, state[k.replace(".lora_A.", ".lora_B.")])
    return out


class LoraMixture:
    """Expert LoRAs applied to a frozen (non-peft) model by forward hooks on its projections:
    ``y = W x + scale * sum_e w[b, e] B_e A_e x``, with per-row weights ``w`` (B, E) set in
    :attr:`weights` before a forward (gradients flow into ``w``). Use as a context manager."""

    def __init__(self, model, states: list[dict], scale: float = 2.0):
        facs = [expert_factors(s) for s in states]
        mods = dict(model.named_modules())
        self.A = {n: torch.stack([f[n][0] for f in facs]) for n in facs[0]}   # (E, r, in)
        self.B = {n: torch.stack([f[n][1] for f in facs]) for n in facs[0]}   # (E, out, r)
        self.scale, self.weights, self.n = scale, None, len(states)
        self.handles = [mods[n].register_forward_hook(self._hook(n)) for n in self.A]

    def _hook(self, name):
        def hook(module, inp, out):
            z = torch.einsum("bti,eri->bter", inp[0], self.A[name])
            d = torch.einsum("bter,eor->bteo", z, self.B[name])
            return out + self.scale * torch.einsum("bteo,be->bto", d, self.weights)
        return hook

    def close(self):
        for h in self.handles:
            h.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Gate(nn.Module):
    """A linear gate over ``n`` experts on the frozen retrieval key: ``softmax(W q + b)``;
    ``live`` masks the experts not (or no longer) deployed."""

    def __init__(self, d: int, n: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W = nn.Parameter(torch.randn(n, d, generator=g) * 0.01)
        self.b = nn.Parameter(torch.zeros(n))

    def forward(self, q: torch.Tensor, live: list[int] | None = None) -> torch.Tensor:
        z = q @ self.W.T + self.b
        if live is not None:
            off = torch.ones(z.shape[1], dtype=torch.bool)
            off[live] = False
            z = z.masked_fill(off, float("-inf"))
        return torch.softmax(z, -1)

    def nbytes(self, n_live: int) -> int:
        """Bytes of the deployed rows (weights and bias of the live experts)."""
        return n_live * (self.W.shape[1] + 1) * self.W.element_size()


def train_gate(model, mix: LoraMixture, gate: Gate, pairs, q: torch.Tensor, live: list[int],
               steps: int, batch: int, lr: float, seed: int, pad_id: int) -> list[float]:
    """Adam on the gate alone: the task loss of the mixture weighted by ``gate(q)`` on random
    rows of ``pairs`` (``q`` their retrieval keys). Returns the losses."""
    opt = torch.optim.Adam(gate.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(pairs), (batch,), generator=g)
        b = packing.pad([pairs[i] for i in idx], pad_id)
        mix.weights = gate(q[idx], live)
        loss = model(**b).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def gated_scores(model, mix: LoraMixture, weights: torch.Tensor, tok, examples,
                 with_steps: bool = False, batch: int = 64):
    """:func:`K.answer_scores` under the mixture, row ``i`` with expert weights ``weights[i]``."""
    pairs = packing.encode(tok, [e.prompt for e in examples],
                           [e.completion(with_steps) for e in examples])
    logp, exact = np.zeros(len(examples)), np.zeros(len(examples))
    for s in range(0, len(examples), batch):
        b = packing.pad(pairs[s: s + batch], tok.pad_token_id)
        mix.weights = weights[s: s + batch]
        logp[s: s + batch], exact[s: s + batch] = K.score_logits(model(**b).logits, b["labels"])
    return logp, exact


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
