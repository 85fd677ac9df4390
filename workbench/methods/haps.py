"""HAPS: hierarchical routing over LLM architectures and parameters (paper 11,
``papers/11-haps.md``).

Routers usually pick one of K candidate LMs and use it as a black box. HAPS routes on two levels:

1. a **high-level router** π(k | x) over the K candidate architectures (:class:`HAPS.route`);
2. a **low-level router**, a hypernetwork G_k per architecture, that turns the same query into
   input-conditioned LoRA factors for every adapted projection of candidate k
   (:class:`LoraGenerator`): W'_j = W_j + s B_j(x) A_j(x), applied per example
   (:func:`lora_hooks`), exactly what ``peft`` computes with those A, B (the notebook checks it);
3. the **shared parameter-generation mechanism**: one trunk h(x) feeds the router and every G_k,
   so what the generators learn shapes the routing features and back (``shared=False`` gives
   every part its own trunk, the ablation);
4. the **reward-augmented objective** (:func:`reward_augmented_loss`): the expected answer loss
   under the router, minus λ times the expected verifiable reward of the routed choice, plus
   η times the mean answer loss of all generators (so every G_k trains on every query),

   L = Σ_k π_k(x) ℓ_k(x) − λ Σ_k π_k(x) r_k(x) + η (1/K) Σ_k ℓ_k(x),               (1)

   where ℓ_k is candidate k's answer loss with its generated LoRA and r_k ∈ {0, 1} says whether
   its teacher-forced greedy tokens reproduce the answer (a cheap exact-match reward). The
   baseline objective (:func:`supervised_loss`) replaces the reward term by cross-entropy
   against plain routing labels: which candidate, as a static model, answered correctly.

Queries are embedded by hashed character n-grams (:func:`prompt_features`): cheap, and the same
for every candidate, whose tokenizers may differ. The paper's equations are not public in the
abstract; (1) is our reading of "task loss plus a reward for routing choices".
"""
from __future__ import annotations

import contextlib
import copy
import warnings
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn

from ..data import packing

__all__ = ["IGNORE", "ARCH_TARGETS", "prompt_features", "target_modules", "lora_delta",
           "lora_hooks", "trunk", "LoraGenerator", "HAPS", "answer_loss", "reward_augmented_loss",
           "supervised_loss", "static_labels", "Settings", "forward_all", "train_haps", "peft_with"]

IGNORE = -100

# the projections the low-level router adapts, per architecture: attention output and MLP output
# of every block (present in all three zoo architectures, with the same shapes). Measured while
# choosing (smoke, seed 0): adding the attention q, k, v projections doubled the training time
# and, at any learning rate that moved them, broke skills the candidates had.
ARCH_TARGETS = {"gpt2": ("attn.c_proj", "mlp.c_proj"),
                "llama": ("self_attn.o_proj", "mlp.down_proj"),
                "qwen2": ("self_attn.o_proj", "mlp.down_proj")}


# -- features ---------------------------------------------------------------------------------

def prompt_features(prompts: list[str], dim: int = 256) -> torch.Tensor:
    """Hashed character 1-, 2- and 3-gram counts of each prompt, log1p-scaled and L2-normalized:
    a tokenizer-free query embedding (the same input for every candidate)."""
    out = torch.zeros(len(prompts), dim)
    for i, p in enumerate(prompts):
        s = f"^{p}$"
        for n in (1, 2, 3):
            for j in range(len(s) - n + 1):
                out[i, zlib.crc32(f"{n}:{s[j:j + n]}".encode()) % dim] += 1.0
    out = out.log1p()
    return out / out.norm(dim=1, keepdim=True).clamp_min(1e-8)


# -- the adapted modules and the per-example LoRA ---------------------------------------------

def target_modules(model, arch: str | None = None) -> list[tuple[str, nn.Module, int, int]]:
    """``(name, module, in_features, out_features)`` of the projections the generator adapts.

    GPT-2's ``Conv1D`` stores its weight as (in, out), ``nn.Linear`` as (out, in)."""
    arch = arch or model.config.model_type
    suffixes = ARCH_TARGETS[arch]
    out = []
    for name, m in model.named_modules():
        if name.endswith(suffixes) and hasattr(m, "weight"):
            w = m.weight
            fan_in, fan_out = (w.shape[0], w.shape[1]) if type(m).__name__ == "Conv1D" \
                else (w.shape[1], w.shape[0])
            out.append((name, m, int(fan_in), int(fan_out)))
    if not out:
        raise ValueError(f"no {suffixes} modules in a {arch} model")
    return out


def lora_delta(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-example LoRA update s · x Aᵀ Bᵀ: x (b, t, in), A (b, r, in), B (b, out, r)."""
    return scale * torch.einsum("btr,bor->bto", torch.einsum("bti,bri->btr", x, A), B)


@contextlib.contextmanager
def lora_hooks(modules, factors, scale: float):
    """Add s B(x) A(x) to each module's output while inside the block (forward hooks).

    ``modules``: the modules of :func:`target_modules`; ``factors``: one ``(A, B)`` per module,
    batched over examples. The batch of every forward inside the block must be that of the
    factors (``generate`` keeps it: greedy, no beams)."""
    handles = []
    for m, (A, B) in zip(modules, factors):
        def hook(mod, inputs, output, A=A, B=B):
            return output + lora_delta(inputs[0], A, B, scale).to(output.dtype)
        handles.append(m.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# -- the routers ------------------------------------------------------------------------------

def trunk(d_in: int, d_h: int) -> nn.Module:
    """The query encoder h(x): two layers, GELU."""
    return nn.Sequential(nn.Linear(d_in, d_h), nn.GELU(), nn.Linear(d_h, d_h), nn.GELU())


class LoraGenerator(nn.Module):
    """The low-level router of one architecture: h(x) -> (A_j(x), B_j(x)) for every adapted module j.

    Modules of equal shape share one linear head, told apart by a learned module embedding
    e_j: [A_j; B_j] = W_shape [h; e_j] + b_shape. B's half of every head starts at zero, so the
    generated update starts at zero and the candidate starts as itself (as in LoRA)."""

    def __init__(self, shapes: list[tuple[int, int]], d_h: int, rank: int, d_emb: int = 8):
        super().__init__()
        self.shapes, self.rank = [tuple(s) for s in shapes], rank
        self.kinds = sorted(set(self.shapes))
        self.emb = nn.Embedding(len(self.shapes), d_emb)
        self.heads = nn.ModuleList(nn.Linear(d_h + d_emb, rank * (i + o)) for i, o in self.kinds)
        with torch.no_grad():
            for (i, o), head in zip(self.kinds, self.heads):
                head.weight[rank * i:].zero_()
                head.bias[rank * i:].zero_()
                # A's half: entries of about LoRA's kaiming scale 1/sqrt(in) for unit-norm input
                head.weight[: rank * i].mul_((d_h + d_emb) ** 0.5 / i ** 0.5)
                head.bias[: rank * i].uniform_(-(i ** -0.5), i ** -0.5)

    def forward(self, h: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for j, (i, o) in enumerate(self.shapes):
            e = self.emb.weight[j].expand(h.shape[0], -1)
            v = self.heads[self.kinds.index((i, o))](torch.cat([h, e], 1))
            r = self.rank
            out.append((v[:, : r * i].reshape(-1, r, i), v[:, r * i:].reshape(-1, o, r)))
        return out


class HAPS(nn.Module):
    """High-level router π(k | x) over ``names`` and one :class:`LoraGenerator` per candidate.

    ``shared=True``: one trunk feeds the router and every generator (the paper's shared
    parameter generation); ``shared=False``: each has its own trunk (the ablation)."""

    def __init__(self, names: list[str], shapes: dict[str, list], d_in: int, d_h: int,
                 rank: int, shared: bool = True):
        super().__init__()
        self.names, self.shared = list(names), shared
        parts = ["router"] + self.names
        self.trunks = nn.ModuleDict({"shared": trunk(d_in, d_h)} if shared else
                                    {p.replace(".", "_"): trunk(d_in, d_h) for p in parts})
        self.router = nn.Linear(d_h, len(self.names))
        self.gens = nn.ModuleDict({n.replace(".", "_"): LoraGenerator(shapes[n], d_h, rank)
                                   for n in self.names})

    def h(self, x: torch.Tensor, part: str) -> torch.Tensor:
        return self.trunks["shared" if self.shared else part.replace(".", "_")](x)

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits (b, K); softmax gives π(· | x)."""
        return self.router(self.h(x, "router"))

    def lora(self, x: torch.Tensor, name: str):
        """The generated ``(A, B)`` of every adapted module of candidate ``name``."""
        return self.gens[name.replace(".", "_")](self.h(x, name))


# -- objectives ---------------------------------------------------------------------------------

def answer_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example mean answer NLL ℓ (b,) and the teacher-forced reward r (b,): 1 when the greedy
    token at every labelled position is the reference token (the answer and ``<eos>``)."""
    lg, lb = logits[:, :-1].float(), labels[:, 1:]
    mask = lb != IGNORE
    nll = F.cross_entropy(lg.transpose(1, 2), lb.clamp_min(0), reduction="none") * mask
    loss = nll.sum(1) / mask.sum(1).clamp_min(1)
    hit = ((lg.argmax(-1) == lb) | ~mask).all(1).float()
    return loss, hit


def reward_augmented_loss(route_logits, lm_loss, reward, lam: float, eta: float) -> torch.Tensor:
    """Eq. (1): Σ_k π_k ℓ_k − λ Σ_k π_k r_k + η mean_k ℓ_k, averaged over the batch.

    ``route_logits``, ``lm_loss``, ``reward``: (b, K); the reward carries no gradient."""
    p = route_logits.softmax(1)
    return ((p * lm_loss).sum(1) - lam * (p * reward.detach()).sum(1)
            + eta * lm_loss.mean(1)).mean()


def supervised_loss(route_logits, lm_loss, labels, eta: float) -> torch.Tensor:
    """The baseline of C4: eq. (1) with the reward term replaced by the cross-entropy of the
    router against plain labels (b,): CE(π, y) + Σ_k π_k ℓ_k + η mean_k ℓ_k."""
    p = route_logits.softmax(1)
    return (F.cross_entropy(route_logits, labels, reduction="none") + (p * lm_loss).sum(1)
            + eta * lm_loss.mean(1)).mean()


def static_labels(correct: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """Plain routing labels: the candidate that answered correctly as a static model, ties (and
    all-wrong) broken by the lower answer loss. ``correct``, ``loss``: (n, K)."""
    return (correct - 1e-3 * loss).argmax(1)


# -- training -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Settings:
    """One HAPS training run."""
    d_h: int = 64            # trunk width
    rank: int = 4            # rank of every generated LoRA
    scale: float = 2.0       # LoRA scale s = alpha / r
    steps: int = 200         # AdamW steps
    batch: int = 32          # queries per step
    lr: float = 3e-3         # AdamW, linear decay to 10%
    lam: float = 1.0         # λ: weight of the routing reward in (1)
    eta: float = 1.0         # η: weight of every generator's own answer loss
    objective: str = "reward"  # reward (eq. 1) | supervised (cross-entropy on static labels)
    shared: bool = True      # one trunk for router and generators, or one each
    seed: int = 0


def forward_all(haps: HAPS, models: dict, batches: dict, x: torch.Tensor, scale: float):
    """Answer loss and teacher-forced reward (b, K) of every candidate with its generated LoRA."""
    losses, hits = [], []
    for name in haps.names:
        mods = [m for _, m, _, _ in target_modules(models[name])]
        with lora_hooks(mods, haps.lora(x, name), scale):
            logits = models[name](input_ids=batches[name]["input_ids"]).logits
        loss, hit = answer_loss(logits, batches[name]["labels"])
        losses.append(loss)
        hits.append(hit)
    return torch.stack(losses, 1), torch.stack(hits, 1)


def train_haps(haps: HAPS, models: dict, pairs: dict, pad_ids: dict, x: torch.Tensor,
               labels: torch.Tensor, s: Settings, callback=None) -> list[dict]:
    """Train ``haps`` on queries ``x`` (n, d_in); ``pairs[name]``: the encoded (ids, labels) of
    every query in candidate ``name``'s tokenizer and answer style; ``labels``: the static
    routing labels (used by the supervised objective only). The candidates stay frozen."""
    for m in models.values():
        m.requires_grad_(False).eval()
    opt = torch.optim.AdamW(haps.parameters(), lr=s.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.9 * min(i, s.steps) / s.steps)
    g = torch.Generator().manual_seed(s.seed)
    dev = next(haps.parameters()).device
    x, labels = x.to(dev), labels.to(dev)
    log = []
    for step in range(s.steps):
        idx = torch.randint(0, len(x), (s.batch,), generator=g).to(dev)
        batches = {n: {k: v.to(dev) for k, v in packing.pad(
            [pairs[n][i] for i in idx.tolist()], pad_ids[n]).items()} for n in haps.names}
        lm, hit = forward_all(haps, models, batches, x[idx], s.scale)
        logits = haps.route(x[idx])
        loss = (reward_augmented_loss(logits, lm, hit, s.lam, s.eta) if s.objective == "reward"
                else supervised_loss(logits, lm, labels[idx], s.eta))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        log.append({"step": step + 1, "loss": loss.item(), "answer_loss": lm.mean().item(),
                    "reward": hit.mean().item()})
        if callback is not None:
            callback(log[-1])
    return log


# -- the peft reference ---------------------------------------------------------------------------

def peft_with(model, names: list[str], factors: list[tuple[torch.Tensor, torch.Tensor]],
              scale: float):
    """A deep copy of ``model`` with a ``peft`` LoRA on the modules ``names`` whose
    ``lora_A``/``lora_B`` are the given (A (r, in), B (out, r)) of one example: the reference the
    generated update must equal."""
    rank = factors[0][0].shape[0]
    cfg = LoraConfig(r=rank, lora_alpha=scale * rank, lora_dropout=0.0, target_modules=names,
                     fan_in_fan_out=model.config.model_type == "gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = get_peft_model(copy.deepcopy(model), cfg).eval()
    mods = dict(pm.named_modules())
    with torch.no_grad():
        for n, (A, B) in zip(names, factors):
            m = mods["base_model.model." + n]
            m.lora_A["default"].weight.copy_(A)
            m.lora_B["default"].weight.copy_(B)
    return pm
