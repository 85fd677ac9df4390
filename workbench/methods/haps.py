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
import zlib
from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

from .. import cache

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


class StaticRouter(nn.Module):
    """Architecture-only routing: a classifier over the candidates as black boxes."""

    def __init__(self, n: int, d_in: int, d_h: int):
        super().__init__()
        self.net = nn.Sequential(trunk(d_in, d_h), nn.Linear(d_h, n))

    def forward(self, x):
        return self.net(x)


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
    from ..data import packing
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


def train_static_router(x, labels, n: int, d_h: int, steps: int, lr: float, seed: int):
    """Architecture-only router: cross-entropy on the static routing labels, full batch."""
    torch.manual_seed(seed)
    net = StaticRouter(n, x.shape[1], d_h)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    for _ in range(steps):
        loss = F.cross_entropy(net(x), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net.eval()


# -- evaluation -----------------------------------------------------------------------------------

def adapted_completions(model, tok, haps: HAPS, name: str, prompts: list[str],
                        x: torch.Tensor, scale: float, max_new_tokens: int,
                        batch: int = 64) -> list[str]:
    """Greedy completions of candidate ``name`` with each prompt's own generated LoRA."""
    from ..models import zoo
    from .. import evaluate
    mods = [m for _, m, _, _ in target_modules(model)]
    device = next(model.parameters()).device
    outs = []
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            with lora_hooks(mods, haps.lora(x[i: i + batch].to(device), name), scale):
                outs += evaluate.generate(model, tok, prompts[i: i + batch], max_new_tokens,
                                     batch=batch)
    return outs


def peft_with(model, names: list[str], factors: list[tuple[torch.Tensor, torch.Tensor]],
              scale: float):
    """A deep copy of ``model`` with a ``peft`` LoRA on the modules ``names`` whose
    ``lora_A``/``lora_B`` are the given (A (r, in), B (out, r)) of one example: the reference the
    generated update must equal."""
    import copy
    import warnings
    from peft import LoraConfig, get_peft_model
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


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# -- the benchmark and the cached one-time computations -------------------------------------------

GROUP = "haps"          # this notebook's folder under the cache


def benchmark(families: list[str], n_train: int, n_test: int, seed: int):
    """A mixed benchmark: ``n_train`` training queries per family (every difficulty) and up to
    ``n_test`` test queries per family whose prompts never occur in training."""
    from ..data import tasks
    train = [e for f in families for e in tasks.generate(f, n_train, 1000 + seed)]
    seen = {e.prompt for e in train}
    test = []
    for f in families:
        cand = [e for e in tasks.generate(f, 3 * n_test, 2000 + seed) if e.prompt not in seen]
        test += cand[:n_test]
    return train, test


def encode(tok, examples, with_steps: bool):
    """``(ids, labels)`` of each example in a candidate's tokenizer and answer style."""
    from ..data import packing
    return packing.encode(tok, [e.prompt for e in examples],
                          [e.completion(with_steps) for e in examples])


def max_new_tokens(tok, examples, with_steps: bool) -> int:
    return 2 + max(len(tok(e.completion(with_steps), add_special_tokens=False)["input_ids"])
                   for e in examples)


def teacher_forced(model, tok, examples, with_steps: bool, batch: int = 128):
    """Answer loss and teacher-forced reward of a static candidate on each example."""
    from ..data import packing
    pairs, dev = encode(tok, examples, with_steps), next(model.parameters()).device
    losses, hits = [], []
    with torch.no_grad():
        for i in range(0, len(pairs), batch):
            b = packing.pad(pairs[i: i + batch], tok.pad_token_id)
            loss, hit = answer_loss(model(input_ids=b["input_ids"].to(dev)).logits,
                                    b["labels"].to(dev))
            losses += loss.tolist()
            hits += hit.tolist()
    return losses, hits


def static_scores(names, zoo_scale: str, models: dict, toks: dict, splits: dict) -> dict:
    """Per candidate, per split, per example: greedy exact match (the family's verifier) and the
    answer loss of the static model, computed once and cached (``cache.build``)."""
    import json
    from ..data import tasks
    from ..models import finetune, zoo
    key = cache.key([zoo.recipe(n).key(zoo_scale) for n in names],
                             {s: [e.prompt for e in ex] for s, ex in splits.items()})
    path = cache.folder(GROUP) / f"static-{zoo_scale}-{key}"

    def build(tmp):
        out = {}
        for n in names:
            ws = zoo.RECIPES[n].with_steps
            out[n] = {}
            for split, ex in splits.items():
                comps = evaluate.generate(models[n], toks[n], [e.prompt for e in ex],
                                     max_new_tokens(toks[n], ex, ws))
                loss, _ = teacher_forced(models[n], toks[n], ex, ws)
                out[n][split] = {"correct": [tasks.score(e, c) for e, c in zip(ex, comps)],
                                 "loss": loss}
        (tmp / "scores.json").write_text(json.dumps(out))
        return {"names": list(names)}

    cache.build(path, build)
    return json.loads((path / "scores.json").read_text())


def cached_haps(names, zoo_scale: str, models: dict, toks: dict, train, test,
                labels: torch.Tensor, s: Settings, feat_dim: int, device="cpu"):
    """A trained :class:`HAPS` and its record (training log, seconds, each candidate's greedy
    exact match on ``test`` with its generated LoRA), trained once and cached under
    ``cache_dir()/haps/`` keyed by the candidates' recipe keys, the settings and the prompts."""
    import json
    import time
    from dataclasses import asdict
    from ..data import tasks
    from ..models import finetune, zoo
    shapes = {n: [(i, o) for _, _, i, o in target_modules(models[n])] for n in names}
    key = cache.key([zoo.recipe(n).key(zoo_scale) for n in names], asdict(s), feat_dim,
                             [e.prompt for e in train], [e.prompt for e in test])
    tag = f"{'shared' if s.shared else 'separate'}-{s.objective}"
    path = cache.folder(GROUP) / f"haps-{tag}-{zoo_scale}-{key}"
    make = lambda: HAPS(names, shapes, feat_dim, s.d_h, s.rank, s.shared)   # noqa: E731

    def build(tmp):
        t0 = time.time()
        torch.manual_seed(s.seed)
        haps = make().to(device)
        pairs = {n: encode(toks[n], train, zoo.RECIPES[n].with_steps) for n in names}
        x = prompt_features([e.prompt for e in train], feat_dim)
        log = train_haps(haps, models, pairs, {n: toks[n].pad_token_id for n in names}, x,
                         labels, s)
        seconds = time.time() - t0
        haps.eval()
        xt = prompt_features([e.prompt for e in test], feat_dim)
        adapted = {}
        for n in names:
            ws = zoo.RECIPES[n].with_steps
            comps = adapted_completions(models[n], toks[n], haps, n, [e.prompt for e in test], xt,
                                        s.scale, max_new_tokens(toks[n], test, ws))
            adapted[n] = [tasks.score(e, c) for e, c in zip(test, comps)]
        torch.save(haps.cpu().state_dict(), tmp / "haps.pt")
        return {"train_seconds": round(seconds, 1), "log": log, "adapted_test": adapted,
                "settings": asdict(s)}

    cache.build(path, build)
    haps = make()
    haps.load_state_dict(torch.load(path / "haps.pt"))
    info = json.loads((path / "done.json").read_text())
    return haps.to(device).eval(), info
