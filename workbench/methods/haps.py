"""HAPS: hierarchical routing over LLM architectures and parameters (paper 11,
``docs/papers/11-haps.md``).

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

from ..data import packing, tasks

__all__ = ["IGNORE", "ARCH_TARGETS", "prompt_features", "target_modules", "lora_delta",
           "lora_hooks", "trunk", "LoraGenerator", "HAPS", "answer_loss", "reward_augmented_loss",
           "supervised_loss", "static_labels", "Settings", "forward_all", "train_haps", "peft_with",
           "pooled_state", "official_targets", "RefGenerator", "RefHAPS", "shaped_reward",
           "reinforce_loss", "top_p_logprobs", "sample_answers", "answer_logprob", "RefSettings",
           "sft_router", "rl_step_loss", "train_reference"]

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

    def modules_of(self, model):
        return target_modules(model)

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


# -- the reference's structure (zihangtian/HAPS, HotpotQA/joint_rl) -------------------------------
#
# The official code routes with a (SFT-warmed) LM and feeds the mean-pooled last hidden state of
# that same LM to one LoRA generator per candidate; the generators' gradients reach the router LM
# (``allow_backbone_grad=True``), which is how the two levels share parameters. Training is
# REINFORCE on the sampled answers of the routed candidate, reward = task score, -1 where it is 0.
# Below, at our scale: the router LM is a frozen zoo LM, and its trainable part is a residual
# layer on the pooled state (:class:`RefHAPS`, ``top``), shared by the router head and every
# generator (or one each, the C3 ablation).

def pooled_state(model, tok, prompts: list[str], batch: int = 64) -> torch.Tensor:
    """The router LM's mean-pooled last hidden state (n, d) of each ``<bos> prompt``, padding
    masked out: ``LoRAParamGenerator._encode`` (``joint_rl/lora_generator.py`` L96-121:
    ``hidden_states[-1] * mask``, summed, divided by the token count, float32). Frozen here;
    positions count from each prompt's first token, so left padding changes nothing (the
    reference passes none, which shifts absolute positions under padding)."""
    dev, out = next(model.parameters()).device, []
    tok.padding_side = "left"
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            enc = tok([tok.bos_token + p for p in prompts[i: i + batch]], return_tensors="pt",
                      padding=True, add_special_tokens=False).to(dev)
            hs = model(**enc, position_ids=_positions(enc["attention_mask"]),
                       output_hidden_states=True).hidden_states[-1]
            m = enc["attention_mask"].unsqueeze(-1).to(hs.dtype)
            out.append(((hs * m).sum(1) / m.sum(1).clamp_min(1)).float().cpu())
    return torch.cat(out)


def official_targets(model, layers: int = 1) -> list[tuple[str, nn.Module, int, int]]:
    """The attention-output projection of the last ``layers`` blocks, as :func:`target_modules`
    returns them: ``Agent.monkey_patch_all_layers`` patches ``self_attn.o_proj`` of
    ``layers[total - n:]`` (``joint_rl/agent.py`` L331-356), ``--layers`` 1 by default
    (``rl_batch.py`` L529)."""
    attn = ARCH_TARGETS[model.config.model_type][0]
    mods = [t for t in target_modules(model) if t[0].endswith(attn)]
    return mods[len(mods) - min(layers, len(mods)):]


def _xavier(layer: nn.Linear) -> nn.Linear:
    """``_init_linear_`` (``lora_generator.py`` L34-37): Xavier-uniform weight, zero bias."""
    nn.init.xavier_uniform_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


class RefGenerator(nn.Module):
    """One candidate's LoRA generator as ``LoRAParamGenerator`` builds it (``lora_generator.py``
    L40-48, L77-81, L123-128): an MLP of ``n_layers`` Linear+ReLU to ``d_hidden`` (256), then
    ``out_A`` -> A_ref (b, out, r) and ``out_B`` -> B_ref (b, r, in), all Xavier with zero bias
    (so, unlike LoRA, the update is not zero at the start). The update is ΔW = α A_ref B_ref
    (``agent.py`` L140-141, L83-97). :meth:`factors` gives them in this module's (A, B)
    convention (ΔW = s B A): A = B_ref, B = A_ref."""

    def __init__(self, d_in: int, fan_in: int, fan_out: int, rank: int, d_hidden: int = 256,
                 n_layers: int = 2):
        super().__init__()
        dims = [d_in] + [d_hidden] * n_layers
        self.mlp = nn.Sequential(*[m for a, b in zip(dims, dims[1:])
                                   for m in (_xavier(nn.Linear(a, b)), nn.ReLU())])
        self.out_A = _xavier(nn.Linear(d_hidden, fan_out * rank))
        self.out_B = _xavier(nn.Linear(d_hidden, rank * fan_in))
        self.fan_in, self.fan_out, self.rank = fan_in, fan_out, rank

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.mlp(h)
        return (self.out_A(z).view(-1, self.fan_out, self.rank),
                self.out_B(z).view(-1, self.rank, self.fan_in))

    def factors(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        A_ref, B_ref = self(h)
        return B_ref, A_ref


class RefHAPS(nn.Module):
    """The reference's two levels on a frozen router LM's pooled state h (n, d).

    ``top``: h + W h (W zero at the start, so it starts as the frozen LM's state): the
    trainable part of the router LM, which in the reference is the whole LM (``rl_batch.py``
    L336-346, ``allow_backbone_grad=True`` L161). ``shared=True``: one ``top`` for the router
    head and every generator; ``shared=False``: one each (the C3 ablation). The high-level
    router is a linear head, read greedily (``utils.route``, ``do_sample=False``)."""

    def __init__(self, names: list[str], dims: dict[str, tuple[int, int]], d: int, rank: int,
                 layers: int = 1, shared: bool = True, d_hidden: int = 256, n_layers: int = 2):
        super().__init__()
        self.names, self.shared, self.layers = list(names), shared, layers
        parts = ["shared"] if shared else ["router"] + [n.replace(".", "_") for n in self.names]
        self.tops = nn.ModuleDict({p: nn.Linear(d, d) for p in parts})
        for t in self.tops.values():
            nn.init.zeros_(t.weight)
            nn.init.zeros_(t.bias)
        self.router = nn.Linear(d, len(self.names))
        self.gens = nn.ModuleDict({n.replace(".", "_"): RefGenerator(d, *dims[n], rank, d_hidden,
                                                                     n_layers) for n in self.names})

    def top(self, h: torch.Tensor, part: str) -> torch.Tensor:
        t = self.tops["shared" if self.shared else part.replace(".", "_")]
        return h + t(h)

    def route(self, h: torch.Tensor) -> torch.Tensor:
        return self.router(self.top(h, "router"))

    def modules_of(self, model):
        return official_targets(model, self.layers)

    def lora(self, h: torch.Tensor, name: str):
        """One (A, B) for every patched block: the reference patches each of the last ``layers``
        blocks with the same generated update (``monkey_patch_all_layers``)."""
        fac = self.gens[name.replace(".", "_")].factors(self.top(h, name))
        return [fac] * self.layers


def shaped_reward(score: torch.Tensor) -> torch.Tensor:
    """``reward = -1 if f1 == 0 else f1`` (``rl_batch.py`` L418), with the task's score for F1."""
    return torch.where(score == 0, -torch.ones_like(score), score)


def reinforce_loss(logp: torch.Tensor, reward: torch.Tensor) -> torch.Tensor:
    """``total_loss = -reward * sum(log p)`` (``rl_batch.py`` L419-421): ``logp`` (b,) is the
    summed log-probability of each sampled answer, ``reward`` (b,) carries no gradient; the
    reference steps once per query, here the batch's losses are averaged. No baseline."""
    return -(reward.detach() * logp).mean()


def top_p_logprobs(logits: torch.Tensor, temperature: float, top_p: float,
                   keep: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probabilities after ``Agent._sample_from_logits`` (``agent.py`` L363-391): softmax of
    logits / T, keep the sorted tokens whose cumulative probability is <= ``top_p`` (the top one
    always), renormalize. ``keep``: token ids (..., ) always kept (the sampled ones)."""
    p = (logits / max(temperature, 1e-8)).softmax(-1)
    sp, si = p.sort(-1, descending=True)
    m = sp.cumsum(-1) <= top_p
    m[..., 0] = True
    mask = torch.zeros_like(m).scatter(-1, si, m)
    if keep is not None:
        mask = mask.scatter(-1, keep.unsqueeze(-1), True)
    p = torch.where(mask, p, torch.zeros_like(p))
    return (p / p.sum(-1, keepdim=True).clamp_min(1e-12)).clamp_min(1e-30).log()


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp_min(0)


def sample_answers(model, tok, prompts: list[str], max_new_tokens: int, temperature: float,
                   top_p: float, generator: torch.Generator):
    """Sampled completions of ``<bos> prompt`` (left-padded, KV cache), each token drawn from
    :func:`top_p_logprobs` as ``Agent._manual_decode_with_logprob`` does (``agent.py`` L393-431;
    ``LLM4generate`` defaults T = 1, top-p 0.9). Returns the prompt encoding, the new tokens
    (b, t) and their mask (up to and including ``<eos>``). No gradient."""
    dev = next(model.parameters()).device
    tok.padding_side = "left"
    enc = tok([tok.bos_token + p for p in prompts], return_tensors="pt", padding=True,
              add_special_tokens=False).to(dev)
    mask, ids, past = enc["attention_mask"], enc["input_ids"], None
    new, alive = [], torch.ones(len(prompts), dtype=torch.bool, device=dev)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)[:, -ids.shape[1]:],
                        cache=past, use_cache=True)
            past = out.cache
            lp = top_p_logprobs(out.logits[:, -1].float(), temperature, top_p)
            nxt = torch.multinomial(lp.exp().cpu(), 1, generator=generator).squeeze(1).to(dev)
            nxt = torch.where(alive, nxt, torch.full_like(nxt, tok.pad_token_id))
            new.append((nxt, alive.clone()))
            alive &= nxt != tok.eos_token_id
            if not alive.any():
                break
            ids, mask = nxt[:, None], torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    toks = torch.stack([t for t, _ in new], 1)
    return enc, toks, torch.stack([a for _, a in new], 1)


def answer_logprob(model, enc, new: torch.Tensor, new_mask: torch.Tensor, temperature: float,
                   top_p: float) -> torch.Tensor:
    """Summed log-probability (b,) of the sampled tokens ``new`` under :func:`top_p_logprobs`,
    one teacher-forced pass with gradient: the sum ``self.probs`` holds in the reference
    (``agent.py`` L419, L429), computed after sampling instead of during it."""
    ids = torch.cat([enc["input_ids"], new], 1)
    mask = torch.cat([enc["attention_mask"], new_mask.long()], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
    P = enc["input_ids"].shape[1]
    lg = logits[:, P - 1: P - 1 + new.shape[1]].float()
    lp = top_p_logprobs(lg, temperature, top_p, keep=new).gather(-1, new.unsqueeze(-1)).squeeze(-1)
    return (lp * new_mask).sum(1)


@dataclass(frozen=True)
class RefSettings:
    """One training of :class:`RefHAPS`; the reference's values where they transfer
    (``lora_r`` 8, α 0.01, ``--layers`` 1, MLP 2 x 256, T 1, top-p 0.9, linear decay to 10%)."""
    rank: int = 8
    alpha: float = 0.01      # the LoRA scale: ΔW = α A_ref B_ref
    layers: int = 1          # last blocks patched
    d_hidden: int = 256
    n_layers: int = 2
    sft_steps: int = 300     # the router's SFT warm-up (full batch, cross-entropy on labels)
    sft_lr: float = 3e-3
    steps: int = 150         # RL steps
    batch: int = 32
    lr: float = 3e-4         # the generators (low_router_lr)
    lr_top: float = 1.5e-4   # the shared top (high_router_lr: half, as the reference's 5e-6 : 1e-5)
    temperature: float = 1.0
    top_p: float = 0.9
    objective: str = "reinforce"   # reinforce (the reference) | supervised (answer NLL)
    shared: bool = True
    seed: int = 0


def sft_router(ref: RefHAPS, h: torch.Tensor, labels: torch.Tensor, steps: int, lr: float):
    """The high-level router's warm-up (``sft.py``: the router LM fine-tuned on which candidate
    did best as a static model): full-batch cross-entropy through ``top`` and the head."""
    opt = torch.optim.AdamW(list(ref.tops.parameters()) + list(ref.router.parameters()), lr=lr,
                            weight_decay=0.0)
    for _ in range(steps):
        loss = F.cross_entropy(ref.route(h), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return loss.item()


def rl_step_loss(ref, models, toks, examples, pairs, h, idx, s, g, max_new):
    """One step's loss over queries ``idx``: route greedily (no gradient, as ``utils.route``),
    then each routed candidate answers with its generated LoRA: REINFORCE on sampled answers
    (:func:`reinforce_loss` of :func:`shaped_reward`) or, supervised, the answer NLL."""
    with torch.no_grad():
        choice = ref.route(h[idx]).argmax(1)
    losses, scores = [], []
    for k, n in enumerate(ref.names):
        sub = idx[choice == k]
        if len(sub) == 0:
            continue
        mods = [m for _, m, _, _ in ref.modules_of(models[n])]
        with lora_hooks(mods, ref.lora(h[sub], n), s.alpha):
            if s.objective == "reinforce":
                enc, new, nm = sample_answers(models[n], toks[n], [examples[i].prompt for i in sub.tolist()],
                                              max_new[n], s.temperature, s.top_p, g)
                texts = [toks[n].decode(t[m], skip_special_tokens=True) for t, m in zip(new, nm)]
                sc = torch.tensor([tasks.score(examples[i], c) for i, c in zip(sub.tolist(), texts)])
                lp = answer_logprob(models[n], enc, new, nm, s.temperature, s.top_p)
                losses.append(reinforce_loss(lp, shaped_reward(sc).to(lp.device)) * len(sub))
            else:
                b = packing.pad([pairs[n][i] for i in sub.tolist()], toks[n].pad_token_id)
                ell, sc = answer_loss(models[n](input_ids=b["input_ids"].to(h.device)).logits,
                                      b["labels"].to(h.device))
                losses.append(ell.sum())
        scores.append(sc.float().cpu())
    return torch.stack(losses).sum() / len(idx), float(torch.cat(scores).mean()), choice


def train_reference(ref: RefHAPS, models: dict, toks: dict, examples: list, pairs: dict,
                    h: torch.Tensor, labels: torch.Tensor, max_new: dict, s: RefSettings) -> list[dict]:
    """The reference's pipeline at our scale: :func:`sft_router`, then ``s.steps`` RL steps
    (``rl_batch.rl_train``): AdamW on the generators (``lr``) and the shared top (``lr_top``),
    each decayed linearly to 10% (``get_linear_scheduler``). The router head is not trained in
    this phase (the reference routes without gradient); routing moves only through the top."""
    for m in models.values():
        m.requires_grad_(False).eval()
    sft = sft_router(ref, h, labels, s.sft_steps, s.sft_lr)
    opt = torch.optim.AdamW([{"params": ref.gens.parameters(), "lr": s.lr},
                             {"params": ref.tops.parameters(), "lr": s.lr_top}], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=s.steps)
    g = torch.Generator().manual_seed(s.seed)
    log = []
    for step in range(s.steps):
        idx = torch.randint(0, len(h), (s.batch,), generator=g).to(h.device)
        loss, score, choice = rl_step_loss(ref, models, toks, examples, pairs, h, idx, s, g, max_new)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        log.append({"step": step + 1, "loss": loss.item(), "reward": score, "sft_loss": sft,
                    "routed_to_first": float((choice == 0).float().mean())})
    return log
