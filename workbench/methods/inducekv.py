"""InduceKV: fixed-footprint continual adaptation with attention-ready memory (paper 01,
``docs/papers/01-inducekv.md``).

The backbone stays frozen; what a task teaches is kept outside it, in a memory of **entries**.
An entry is one selected training prefix ``x = <bos> prompt completion <eos>`` stored as

- a frozen **retrieval key** ``r(x)``: the mean of the backbone's last hidden states over the
  prompt tokens (what a test query can compute for itself), and
- its layerwise **key/value payload** ``{(K_l, V_l)}_l``: exactly what the backbone's
  self-attention cache holds after reading ``x`` (keys post-rotary, at positions ``0..L-1``).

An entry may instead be rendered as the first demonstration of a document,
``<bos> prompt completion \n`` (:func:`prefix_ids`), with the query continuing it: the layout in
which the zoo's LMs learned to read examples in context.

At test time the query's key retrieves the top-k entries under a light calibration; their
payloads are written into a ``transformers`` :class:`~transformers.DynamicCache` and the query runs
on top with position ids starting after them (:func:`build_cache`, :func:`forward_with_entries`).
For one entry this is *exactly* running the prefix text itself (claim C1): keys were stored
rotated at their own positions, so the query must sit at ``L, L+1, ...``. Several entries are
laid end to end: entry ``i``'s keys are rotated on by the length of those before it
(:func:`shift_keys`, RoPE rotations compose: ``R(j + d) = R(d) R(j)``), which equals running the
concatenated prefixes with each entry attending only to itself (the per-example attention the
zoo's packed training uses).

The **budget** (claim C2) is bytes of keys + payloads + stored tokens + calibration;
:class:`Budget` is checked after every change of the deployed state and keeps a trace.

**Bilevel selection** (claim C4, :func:`select`): the inner level fits the retrieval calibration
(:func:`fit_calibration`: centring and a diagonal weighting fit so stored entries retrieve their
own task, leave-one-out); the outer level greedily picks candidate prefixes maximising

    a * likelihood gain on current-task probes  +  b * anchor retention  +  c * coverage gain

per byte: likelihood gain = mean over probes of ``log p(answer | entry, probe) - log p(answer |
probe)``; retention = minus the expected NLL increase on anchors (entries already in memory, of
old tasks) weighted by the probability that the candidate would be retrieved for them; coverage =
the facility-location gain ``sum_x max_{s in S} sim(x, s)`` over the current task's pool in the
calibrated retrieval space.

Continual-learning metrics follow PyCIL (``G-U-N/PyCIL`` ``trainer.py`` / ``utils/toolkit.py``):
average incremental accuracy is the mean of the per-stage accuracy (over the
tasks seen so far); forgetting is the mean over old tasks of (best accuracy ever - final accuracy).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn import functional as F
from transformers import DynamicCache

from ..data import packing, tasks

__all__ = ["TOKEN_BYTES", "Entry", "tensor_bytes", "prefix_ids", "make_entry", "query_keys",
           "rotate_half", "shift_keys", "build_cache", "forward_with_entries", "answer_scores",
           "score_logits", "BudgetExceeded", "Budget", "Calibration", "fit_calibration",
           "similarity", "retrieve", "Memory", "likelihood_gain", "retention", "coverage_gain",
           "select", "stage_accuracy", "average_accuracy", "last_accuracy", "forgetting",
           "state_hash", "Prepared", "prepare", "run_stream"]

TOKEN_BYTES = 2           # stored token ids as int16 (vocabularies here are < 32768)


# -- memory entries ---------------------------------------------------------------------------

@dataclass(eq=False)
class Entry:
    """One attention-ready memory entry: retrieval key, layerwise K/V payload, its tokens."""
    task: str
    key: torch.Tensor                    # (d,) frozen retrieval key
    keys: tuple[torch.Tensor, ...]       # per layer (heads, L, head_dim), post-rotary at 0..L-1
    values: tuple[torch.Tensor, ...]     # per layer (heads, L, head_dim)
    ids: list[int]                       # <bos> prompt completion <eos>
    n_prompt: int                        # tokens of <bos> + prompt (the answer starts after)
    utility: float = 0.0                 # the selection score it was admitted with
    example: object = None               # the source example (its text is ``ids``)
    document: bool = False               # a demonstration of one document (see prefix_ids)

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        """Bytes of the deployed entry: key + payload tensors + token ids (int16)."""
        return tensor_bytes(self.key, *self.keys, *self.values) + TOKEN_BYTES * len(self.ids)


def tensor_bytes(*tensors) -> int:
    """Storage bytes of tensors (numel times element size)."""
    return int(sum(t.numel() * t.element_size() for t in tensors))


def _backbone(model):
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def prefix_ids(tok, example, with_steps: bool = False,
               document: bool = False) -> tuple[list[int], int]:
    """``(<bos> prompt completion <eos>, len(<bos> prompt))`` token ids of a training example.

    ``document``: ``<bos> prompt completion`` then the context separator instead of ``<eos>``,
    the first demonstration of a document as the zoo's LMs learned to read examples in context
    (:func:`workbench.models.training.encode_documents`); a query scored after such entries
    continues the document (:func:`answer_scores`)."""
    (ids, labels), = packing.encode(tok, [example.prompt], [example.completion(with_steps)])
    n_prompt = next(i for i, y in enumerate(labels) if y != packing.IGNORE)
    if document:
        ids = ids[:-1] + tok(tasks.CONTEXT_SEP, add_special_tokens=False)["input_ids"]
    return ids, n_prompt


@torch.no_grad()
def make_entry(model, tok, example, task: str | None = None, with_steps: bool = False,
               document: bool = False) -> Entry:
    """The entry of one training example: one forward pass of the frozen backbone.

    The payload is what the model's own ``DynamicCache`` holds after the prefix; the retrieval
    key is the mean last hidden state over the prompt tokens (causal, so the same as a query of
    that prompt alone would compute). ``document``: rendered as :func:`prefix_ids` says."""
    ids, n_prompt = prefix_ids(tok, example, with_steps, document)
    x = torch.tensor([ids], device=model.device)
    out = model(input_ids=x, use_cache=True, output_hidden_states=True)
    cache = out.cache
    keys = tuple(layer.keys[0].detach().clone() for layer in cache.layers)
    values = tuple(layer.values[0].detach().clone() for layer in cache.layers)
    key = out.hidden_states[-1][0, 1:n_prompt].mean(0).detach().clone()
    return Entry(task or example.family, key, keys, values, ids, n_prompt, example=example,
                 document=document)


@torch.no_grad()
def query_keys(model, tok, examples, batch: int = 64) -> torch.Tensor:
    """Retrieval keys of test queries (prompts only): (n, d), same map as :func:`make_entry`."""
    out = []
    for i in range(0, len(examples), batch):
        chunk = examples[i: i + batch]
        enc = packing.encode(tok, [e.prompt for e in chunk])
        lens = [len(ids) - 1 for ids, _ in enc]              # drop the <eos> encode appends
        b = packing.pad([(ids[:n], lab[:n]) for (ids, lab), n in zip(enc, lens)],
                        tok.pad_token_id)
        h = model(input_ids=b["input_ids"].to(model.device),
                  output_hidden_states=True).hidden_states[-1]
        for j, n in enumerate(lens):
            out.append(h[j, 1:n].mean(0))
    return torch.stack(out)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@torch.no_grad()
def shift_keys(model, k: torch.Tensor, delta: int) -> torch.Tensor:
    """Keys rotated at positions ``j`` moved to ``j + delta``: apply the rotary rotation of
    ``delta`` (RoPE rotations compose). ``k``: (heads, L, head_dim)."""
    if delta == 0:
        return k
    rot = getattr(_backbone(model), "rotary_emb", None)
    if rot is None:
        raise NotImplementedError("shifting cached keys needs rotary positions (a Llama/Qwen2 "
                                  "backbone); with absolute positions recompute the payload")
    pos = torch.tensor([[delta]], device=k.device)
    cos, sin = rot(k[None], pos)                       # (1, 1, head_dim)
    return k * cos[0] + rotate_half(k) * sin[0]


def build_cache(model, entries: list[Entry], batch: int = 1):
    """A ``DynamicCache`` holding ``entries`` end to end (each key block rotated on by the
    length before it), repeated over ``batch`` rows; returns ``(cache, prefix_length)``."""
    if not entries:
        return None, 0
    layers, offset = [], 0
    n_layers = len(entries[0].keys)
    ks = [[] for _ in range(n_layers)]
    vs = [[] for _ in range(n_layers)]
    for e in entries:
        for layer in range(n_layers):
            ks[layer].append(shift_keys(model, e.keys[layer], offset))
            vs[layer].append(e.values[layer])
        offset += e.length
    for layer in range(n_layers):
        k = torch.cat(ks[layer], dim=1)[None].expand(batch, -1, -1, -1).contiguous()
        v = torch.cat(vs[layer], dim=1)[None].expand(batch, -1, -1, -1).contiguous()
        layers.append((k, v))
    return DynamicCache(ddp_cache_data=layers), offset


def forward_with_entries(model, entries: list[Entry], input_ids: torch.Tensor, **kw):
    """Run ``input_ids`` (B, T; right padding needs no mask under the causal mask) after the
    entries' payloads, at position ids ``P, P+1, ...`` where ``P`` is the prefix length."""
    B, T = input_ids.shape
    cache, P = build_cache(model, entries, B)
    pos = (P + torch.arange(T, device=input_ids.device)).expand(B, T)
    return model(input_ids=input_ids, position_ids=pos, cache=cache, **kw)


# -- scoring ------------------------------------------------------------------------------------

@torch.no_grad()
def answer_scores(model, tok, examples, entries=None, with_steps: bool = False, batch: int = 64):
    """Per example: the answer's log-likelihood (completion + ``<eos>``) and whether greedy
    decoding reproduces it (every teacher-forced argmax equals the target token: then greedy
    writes exactly ``completion <eos>``, the verifier's exact match).

    ``entries``: None, one list of entries for all, or one list per example (examples with
    the same entries are batched together). After document entries (:func:`prefix_ids`) the
    query continues their document: its ``<bos>`` is dropped, so entry and query read as the
    backbone's training documents, ``<bos> demo \\n query answer <eos>``."""
    n = len(examples)
    if entries is None or (entries and isinstance(entries[0], Entry)):
        entries = [entries or []] * n
    groups: dict[tuple, list[int]] = {}
    for i, es in enumerate(entries):
        groups.setdefault(tuple(id(e) for e in es), []).append(i)
    logp, exact = np.zeros(n), np.zeros(n)
    pairs = packing.encode(tok, [e.prompt for e in examples],
                           [e.completion(with_steps) for e in examples])
    for idx in groups.values():
        es = entries[idx[0]]
        for s in range(0, len(idx), batch):
            chunk = idx[s: s + batch]
            cut = int(bool(es) and es[-1].document)      # continue the entries' document
            b = packing.pad([(pairs[i][0][cut:], pairs[i][1][cut:]) for i in chunk],
                            tok.pad_token_id)
            ids, labels = b["input_ids"].to(model.device), b["labels"].to(model.device)
            logits = forward_with_entries(model, list(es), ids).logits
            logp[chunk], exact[chunk] = score_logits(logits, labels)
    return logp, exact


def score_logits(logits: torch.Tensor, labels: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the labelled tokens' summed log-probability and whether each is the argmax."""
    logits, y = logits[:, :-1].float(), labels[:, 1:]
    mask = y != packing.IGNORE
    lp = torch.log_softmax(logits, -1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
    hit = (logits.argmax(-1) == y) | ~mask
    return (lp * mask).sum(1).cpu().numpy(), hit.all(1).float().cpu().numpy()


# -- the budget ---------------------------------------------------------------------------------

class BudgetExceeded(RuntimeError):
    pass


@dataclass
class Budget:
    """A fixed footprint in bytes; :meth:`check` raises past it and records every point."""
    limit: int
    trace: list[tuple[str, int]] = field(default_factory=list)

    def check(self, nbytes: int, where: str = "") -> int:
        self.trace.append((where, int(nbytes)))
        if nbytes > self.limit:
            raise BudgetExceeded(f"{where}: {nbytes} bytes > budget {self.limit}")
        return nbytes

    @property
    def peak(self) -> int:
        return max((b for _, b in self.trace), default=0)


# -- retrieval and its calibration ----------------------------------------------------------------

@dataclass
class Calibration:
    """The light retrieval calibration: ``z = w * (x - mu)``, then cosine. ``w`` = 1/std of the
    stored keys, refined by a few steps so entries retrieve their own task (leave-one-out)."""
    mu: torch.Tensor
    w: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mu) * self.w

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.mu, self.w)


def fit_calibration(keys: torch.Tensor, tasks: list[str], steps: int = 60, lr: float = 0.05,
                    temperature: float = 0.1) -> Calibration:
    """Centre on the stored keys' mean and weight each dimension (init 1/std); with entries of
    two or more tasks, fit log-weights on a leave-one-out soft retrieval loss (Adam)."""
    keys = keys.detach().float()
    mu = keys.mean(0)
    logw = (1.0 / (keys.std(0) + 1e-4)).log() if len(keys) > 1 else torch.zeros_like(mu)
    if len(set(tasks)) >= 2 and steps > 0:
        logw = logw.clone().requires_grad_(True)
        same = torch.tensor([[a == b for b in tasks] for a in tasks], device=keys.device)
        eye = torch.eye(len(tasks), dtype=torch.bool, device=keys.device)
        opt = torch.optim.Adam([logw], lr=lr)
        for _ in range(steps):
            z = F.normalize((keys - mu) * logw.exp(), dim=-1)
            s = (z @ z.T / temperature).masked_fill(eye, -1e9)
            pos = s.masked_fill(~same | eye, -1e9).logsumexp(1)
            valid = (same & ~eye).any(1)
            loss = (s.logsumexp(1) - pos)[valid].mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        logw = logw.detach()
    return Calibration(mu, logw.exp())


def similarity(q: torch.Tensor, k: torch.Tensor, calib: Calibration | None = None) -> torch.Tensor:
    """Cosine similarity (n_q, n_k) of query and entry keys, after the calibration if given."""
    if calib is not None:
        q, k = calib(q), calib(k)
    return F.normalize(q.float(), dim=-1) @ F.normalize(k.float(), dim=-1).T


def retrieve(memory: list[Entry], q: torch.Tensor, k: int = 1,
             calib: Calibration | None = None) -> list[list[Entry]]:
    """The top-``k`` entries per query (most similar last, nearest the query)."""
    if not memory:
        return [[] for _ in range(len(q))]
    sim = similarity(q, torch.stack([e.key for e in memory]), calib)
    top = sim.topk(min(k, len(memory)), dim=1).indices.flip(1)
    return [[memory[j] for j in row.tolist()] for row in top]


# -- the memory under a budget --------------------------------------------------------------------

@dataclass
class Memory:
    """The deployed adaptation state: entries and calibration, checked against the budget."""
    budget: Budget
    entries: list[Entry] = field(default_factory=list)
    calib: Calibration | None = None

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries) + (self.calib.nbytes if self.calib else 0)

    def check(self, where: str) -> int:
        return self.budget.check(self.nbytes, where)

    def add(self, e: Entry, where: str = "add"):
        if self.nbytes + e.nbytes > self.budget.limit:
            raise BudgetExceeded(f"{where}: adding {e.nbytes} bytes to {self.nbytes} exceeds "
                                 f"{self.budget.limit}")
        self.entries.append(e)
        self.check(where)

    def evict_to(self, limit: int, where: str = "evict"):
        """Drop lowest-utility entries of the task holding the most bytes until <= ``limit``."""
        while self.entries and self.nbytes > limit:
            per: dict[str, int] = {}
            for e in self.entries:
                per[e.task] = per.get(e.task, 0) + e.nbytes
            worst = max(per, key=per.get)
            victim = min((e for e in self.entries if e.task == worst), key=lambda e: e.utility)
            self.entries.remove(victim)
            self.check(where)

    def refit(self, steps: int = 60, where: str = "calibrate"):
        keys = torch.stack([e.key for e in self.entries])
        self.calib = fit_calibration(keys, [e.task for e in self.entries], steps=steps)
        self.check(where)


# -- bilevel selection ----------------------------------------------------------------------------

@torch.no_grad()
def likelihood_gain(model, tok, cands: list[Entry], probes, with_steps: bool = False) -> np.ndarray:
    """Mean over current-task probes of log p(answer | entry, probe) - log p(answer | probe)."""
    base, _ = answer_scores(model, tok, probes, with_steps=with_steps)
    return np.array([(answer_scores(model, tok, probes, [c], with_steps)[0] - base).mean()
                     for c in cands])


@torch.no_grad()
def retention(model, tok, cands: list[Entry], memory: Memory, k: int = 1,
              with_steps: bool = False) -> np.ndarray:
    """Minus the expected answer-NLL increase on the anchors (the stored entries, as queries) if
    the candidate joined the memory: retrieval probability (softmax over calibrated similarity,
    temperature 0.1) times the NLL increase over what the anchor retrieves now."""
    anchors = memory.entries
    if not anchors:
        return np.zeros(len(cands))
    exs = [a.example for a in anchors]
    akeys = torch.stack([a.key for a in anchors])
    # what each anchor retrieves now (itself excluded: a stored prefix is not its own context)
    now = []
    sim = similarity(akeys, akeys, memory.calib).fill_diagonal_(-2)
    for i in range(len(anchors)):
        j = sim[i].topk(min(k, len(anchors) - 1)).indices.flip(0).tolist() if len(anchors) > 1 \
            else []
        now.append([anchors[t] for t in j])
    lp_now, _ = answer_scores(model, tok, exs, now, with_steps)
    ckeys = torch.stack([c.key for c in cands])
    p = torch.softmax(torch.cat([similarity(akeys, ckeys, memory.calib),
                                 sim.clamp(min=-1)], 1) / 0.1, dim=1)[:, :len(cands)]
    out = []
    for ci, c in enumerate(cands):
        lp_c, _ = answer_scores(model, tok, exs, [c], with_steps)
        out.append(-(p[:, ci].cpu().numpy() * np.maximum(0.0, lp_now - lp_c)).mean())
    return np.array(out)


def coverage_gain(sim: np.ndarray, chosen: list[int], cand: int) -> float:
    """Facility-location gain of adding ``cand``: sum_x max(0, sim[x, cand] - best[x]), with
    ``sim`` (pool, candidates) shifted to [0, 1]."""
    best = sim[:, chosen].max(1) if chosen else np.zeros(len(sim))
    return float(np.maximum(0.0, sim[:, cand] - best).sum())


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    span = x.max() - x.min() if len(x) else 0.0
    return (x - x.min()) / span if span > 1e-12 else np.zeros_like(x)


def select(cands: list[Entry], room: int, scores: dict, weights=(1.0, 1.0, 1.0),
           mode: str = "bilevel", rng: np.random.Generator | None = None) -> list[int]:
    """Indices of candidates to admit within ``room`` bytes.

    ``mode``: ``bilevel`` (greedy on a*likelihood + b*retention + c*coverage gain, each scaled
    to [0, 1] over the candidates), ``likelihood`` (likelihood gain only), ``random``.
    ``scores``: ``likelihood``, ``retention`` (arrays over candidates) and ``coverage_sim``
    (pool x candidates similarity in [0, 1])."""
    if mode == "random":
        order = (rng or np.random.default_rng(0)).permutation(len(cands)).tolist()
        out, used = [], 0
        for i in order:
            if used + cands[i].nbytes <= room:
                out.append(i)
                used += cands[i].nbytes
        return out
    a, b, c = weights if mode == "bilevel" else (1.0, 0.0, 0.0)
    lik, ret = _unit(scores["likelihood"]), _unit(scores["retention"])
    sim = scores.get("coverage_sim")
    out, used = [], 0
    left = set(range(len(cands)))
    while left:
        cov = np.zeros(len(cands))
        if c and sim is not None:
            for i in left:
                cov[i] = coverage_gain(sim, out, i)
            cov = cov / max(1e-12, cov.max())
        fit = [i for i in left if used + cands[i].nbytes <= room]
        if not fit:
            break
        best = max(fit, key=lambda i: (a * lik[i] + b * ret[i] + c * cov[i]) / cands[i].nbytes)
        out.append(best)
        used += cands[best].nbytes
        left.remove(best)
    return out


# -- continual-learning metrics (PyCIL) ----------------------------------------------------------

def stage_accuracy(acc: np.ndarray) -> np.ndarray:
    """Per stage i: mean accuracy over the tasks seen so far, ``acc[i, :i+1]`` (acc[i, j] is
    the accuracy on task j after training on task i)."""
    return np.array([acc[i, : i + 1].mean() for i in range(len(acc))])


def average_accuracy(acc: np.ndarray) -> float:
    """PyCIL's average incremental accuracy: the mean of the per-stage accuracy curve."""
    return float(stage_accuracy(acc).mean())


def last_accuracy(acc: np.ndarray) -> float:
    return float(acc[-1].mean())


def forgetting(acc: np.ndarray) -> float:
    """PyCIL: mean over old tasks j < T-1 of (max over stages of acc[:, j] - acc[T-1, j])."""
    T = len(acc)
    if T < 2:
        return 0.0
    return float(np.mean([acc[j:, j].max() - acc[-1, j] for j in range(T - 1)]))


# -- the backbone is unchanged --------------------------------------------------------------------

def state_hash(model) -> str:
    """sha1 over every parameter and buffer of ``model`` (names, dtypes and bytes)."""
    h = hashlib.sha1()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                 if t.numel() else b"")
    return h.hexdigest()


# -- the task stream ------------------------------------------------------------------------------

@dataclass
class Prepared:
    """What selection needs of one task that does not depend on the memory: the candidate
    entries, their likelihood gains on the probes, and the keys of the task's pool."""
    task: str
    cands: list[Entry]
    likelihood: np.ndarray
    pool_keys: torch.Tensor
    passes: int                    # example-forward passes spent preparing


def prepare(model, tok, task: str, train, probes, with_steps: bool = False,
            document: bool = False) -> Prepared:
    """Entries for every candidate prefix in ``train`` and their likelihood gains on
    ``probes`` (both from the task's training split); ``document``: entries rendered as
    demonstrations of one document (:func:`prefix_ids`)."""
    cands = [make_entry(model, tok, e, task, with_steps, document) for e in train]
    lik = likelihood_gain(model, tok, cands, probes, with_steps)
    pool = torch.cat([torch.stack([c.key for c in cands]), query_keys(model, tok, probes)])
    return Prepared(task, cands, lik, pool,
                    passes=len(train) + len(probes) * (len(train) + 2))


def run_stream(model, tok, prepared: list[Prepared], tests: dict, budget: int,
               mode: str = "bilevel", k: int = 1, calibrate: bool = True,
               weights=(1.0, 1.0, 1.0), with_steps: bool = False, seed: int = 0,
               calib_steps: int = 60, also_raw: bool = False, query_cache: dict | None = None):
    """InduceKV over a task stream under a fixed byte ``budget``.

    Before task t the old tasks are evicted down to ``budget * t / (t + 1)`` (lowest utility
    first, from the task holding the most bytes), the new task's entries are selected into the
    room left, and the calibration is refit on the memory (bilevel: the calibration the
    selection used was fit on the memory plus the candidates). After each task every seen
    task is evaluated with retrieval: ``acc[t, j]`` (teacher-forced exact match of
    ``tests[j]``), ``hit[t, j]`` (share of queries whose top-1 entry is of task j); with
    ``also_raw`` the same memory is also evaluated with raw cosine retrieval. ``last_items``:
    the per-item exact match of every task's tests after the last task (stream order)."""
    rng = np.random.default_rng(seed)
    T = len(prepared)
    mem = Memory(Budget(budget))
    d = prepared[0].cands[0].key.numel()
    reserve = 2 * d * 4 if calibrate else 0
    acc, hit = np.full((T, T), np.nan), np.full((T, T), np.nan)
    acc_raw, hit_raw = np.full((T, T), np.nan), np.full((T, T), np.nan)
    qk = query_cache if query_cache is not None else {}
    passes, last = 0, []
    for t, P in enumerate(prepared):
        mem.evict_to(int(budget * t / (t + 1)), where=f"task {t}: evict")
        keys = torch.stack([e.key for e in mem.entries] + [c.key for c in P.cands])
        labels = [e.task for e in mem.entries] + [P.task] * len(P.cands)
        inner = fit_calibration(keys, labels, steps=calib_steps) if calibrate else None
        scores = {"likelihood": P.likelihood, "retention": np.zeros(len(P.cands))}
        if mode == "bilevel":
            probe_mem = Memory(Budget(budget), list(mem.entries), inner)
            scores["retention"] = retention(model, tok, P.cands, probe_mem, k, with_steps)
            passes += len(P.cands) * len(mem.entries)
            sim = similarity(P.pool_keys, torch.stack([c.key for c in P.cands]), inner)
            scores["coverage_sim"] = ((sim + 1) / 2).cpu().numpy()
        room = budget - mem.nbytes - (reserve if mem.calib is None else 0)
        chosen = select(P.cands, room, scores, weights, mode, rng)
        util = (_unit(scores["likelihood"]) + _unit(scores["retention"]))
        for i in chosen:
            P.cands[i].utility = float(util[i])
            mem.add(P.cands[i], where=f"task {t}: add")
        if calibrate:
            mem.refit(calib_steps, where=f"task {t}: calibrate")
        for j in range(t + 1):
            tj = prepared[j].task
            if tj not in qk:
                qk[tj] = query_keys(model, tok, tests[tj])
            views = [(mem.calib, acc, hit)] + ([(None, acc_raw, hit_raw)]
                                               if calibrate and also_raw else [])
            for calib, A, H in views:
                got = retrieve(mem.entries, qk[tj], k, calib)
                _, ex = answer_scores(model, tok, tests[tj], got, with_steps)
                A[t, j] = ex.mean()
                if t == T - 1 and A is acc:
                    last.append(ex)
                H[t, j] = np.mean([bool(g) and g[-1].task == tj for g in got])
    out = {"acc": acc, "hit": hit, "memory": mem, "trace": mem.budget.trace,
           "last_items": np.concatenate(last),
           "peak_bytes": mem.budget.peak, "passes": passes + sum(P.passes for P in prepared),
           "entries_per_task": {P.task: sum(e.task == P.task for e in mem.entries)
                                for P in prepared}}
    if also_raw and calibrate:
        out.update(acc_raw=acc_raw, hit_raw=hit_raw)
    return out
