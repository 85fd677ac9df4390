"""NBDIFF: adapting an autoregressive LM into a block-diffusion LM (paper 19,
``docs/papers/19-nbdiff.md``).

Block diffusion (BD3-LM, kuleshov-group/bd3lms ``models/dit.py``) splits a sequence into blocks
of ``size`` tokens; blocks are generated left to right, the tokens inside a block by masked
diffusion. Every mask here is a function of a vector of block ids (:func:`block_ids`): position
``j`` is visible to ``i`` iff ``ids[j] <= ids[i]`` (:func:`block_mask`). At block size 1 the ids
are ``0..n-1`` and the mask is the causal mask exactly (the paper's "AR is block size one").

Training in one pass (bd3lms' ``block_diff_mask``) runs ``[x_t ; x_0]`` (noisy and clean copies,
the same positions) under :func:`parallel_mask`: block-diagonal on x_t, offset block-causal from
x_t to x_0, and on x_0 either block-causal (bd3lms) or strictly causal (NBDIFF's context-causal
path, ``context_causal=True``), which also lets the clean copy's logits carry an auxiliary AR
next-token loss in the same pass.

Noise: the absorbing mask token (a ``<mask>`` token added to the vocabulary,
:func:`add_mask_token`); each block draws ``t ~ U(0, 1)`` and masks each of its tokens with
probability ``p_mask = (1 - eps) t + eps`` (LLaDA ``GUIDELINES.md``); the loss is the masked-token
cross-entropy weighted by ``1 / p_mask`` and averaged over the noisable tokens (LLaDA; the
discrete form of bd3lms' ``-(1/t) log p(x0 | x_t)``), an upper bound on the NLL (the NELBO).

The AR shift is kept (as DiffuLLaMA does): the token at position ``i`` is predicted from the
output at ``i - 1``; for the first token of a block that output is the clean context's last one
(:func:`shifted_logits`), so at block size 1 every prediction is the AR model's own.

Decoding, two variants. :func:`decode_threshold` is the reference's (YuchuanTian/NBDiff
``generation_utils.py``, ``diffusion_generate`` with ``alg="confidence_threshold"``, greedy):
a prefill pass writes the first generated token (the causal prediction); in each block every
pass commits the most confident masked token plus every masked token whose top probability is
above ``threshold`` (0.9, :func:`threshold_commit`), probabilities over the whole vocabulary,
the mask token included, as the reference's ``sample_tokens`` computes them; a committed block is
then run once more causally, which stores its keys and values in the cache (the reference's
``BlockDynamicCache`` with ``skip_cache_update=False``) and whose last output writes the next
block's first token.
Denoising passes see the cache but do not extend it (the reference concatenates without
storing; here the cache is cropped back, ``DynamicCache.crop``). :func:`decode` is ours:
a fixed ``per_pass`` tokens a pass, no causal first token, the whole sequence recomputed every
pass (no cache).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..device import fast_math

__all__ = ["EPS", "PATHS", "block_ids", "block_mask", "parallel_mask", "additive", "add_mask_token",
           "p_mask", "noise", "shifted_logits", "weighted_ce", "diffusion_loss", "one_pass",
           "two_pass", "ar_loss", "curriculum", "anneal_fraction", "annealed_parallel_mask",
           "nelbo_ppl", "task_rows", "train_step_loss", "adapt", "decode", "threshold_commit",
           "decode_threshold", "nelbo_rows", "nelbo"]

EPS = 1e-3          # LLaDA's floor on p_mask


# -- masks ------------------------------------------------------------------------------------

def block_ids(n: int, size: int, start: int = 0) -> torch.Tensor:
    """Block id of each of ``n`` positions: positions before ``start`` (the prompt, committed
    context) each get their own id (they are causal), then blocks of ``size`` from ``start``."""
    i = torch.arange(n)
    return torch.where(i < start, i - start, torch.div(i - start, size, rounding_mode="floor"))


def block_mask(ids: torch.Tensor) -> torch.Tensor:
    """Boolean (n, n) block-causal mask, True = may attend: ``ids[j] <= ids[i]`` (bd3lms'
    block-causal ``M_BC``). Equals the causal mask when the ids are strictly increasing."""
    return ids[None, :] <= ids[:, None]


def parallel_mask(ids: torch.Tensor, context_causal: bool = True) -> torch.Tensor:
    """Boolean (2n, 2n) mask over ``[x_t ; x_0]`` (bd3lms ``block_diff_mask``):
    x_t -> x_t block-diagonal (``ids[i] == ids[j]``), x_t -> x_0 offset block-causal
    (``ids[j] < ids[i]``), x_0 -> x_0 causal (context-causal, NBDIFF) or block-causal (bd3lms),
    x_0 -> x_t never (the clean copy never sees noise)."""
    n = len(ids)
    a, b = ids[:, None], ids[None, :]
    ctx = torch.tril(torch.ones(n, n, dtype=torch.bool)) if context_causal else b <= a
    top = torch.cat([a == b, b < a], dim=1)
    bottom = torch.cat([torch.zeros(n, n, dtype=torch.bool), ctx], dim=1)
    return torch.cat([top, bottom], dim=0)


def additive(mask: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """A boolean mask (..., Q, K) as the (B, 1, Q, K) additive float mask (0 where allowed, the
    dtype's minimum elsewhere) that transformers' Llama takes as a custom 4D ``attention_mask``."""
    m = mask if mask.dim() == 3 else mask[None]
    return torch.zeros(m.shape, dtype=dtype).masked_fill(~m, torch.finfo(dtype).min)[:, None]


# -- noise and the absorbing mask token -------------------------------------------------------

def add_mask_token(model, tok) -> int:
    """Add an absorbing ``<mask>`` token to ``tok`` and a row for it to ``model``'s (tied)
    embeddings, initialised at the mean embedding; returns its id."""
    if tok.mask_token is None:
        tok.add_special_tokens({"mask_token": "<mask>"})
    if model.get_input_embeddings().weight.shape[0] < len(tok):
        model.resize_token_embeddings(len(tok), mean_resizing=True)
    return tok.mask_token_id


def p_mask(t: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """LLaDA's masking probability ``(1 - eps) t + eps``."""
    return (1 - eps) * t + eps


def noise(x0: torch.Tensor, ids: torch.Tensor, noisable: torch.Tensor, mask_id: int,
          generator: torch.Generator | None = None):
    """``(x_t, masked, p)``: each block of each row draws ``t ~ U(0, 1)``; each noisable token is
    replaced by ``mask_id`` with probability ``p_mask(t)`` (absorbing noise). ``ids`` (n,) or
    (B, n); ``noisable`` (B, n) bool."""
    B, n = x0.shape
    ids = ids.expand(B, n) if ids.dim() == 1 else ids
    rel = ids - ids.min(dim=1, keepdim=True).values
    t = torch.rand(B, int(rel.max()) + 1, generator=generator)
    p = p_mask(torch.gather(t, 1, rel))
    masked = (torch.rand(B, n, generator=generator) < p) & noisable
    return torch.where(masked, torch.full_like(x0, mask_id), x0), masked, p


# -- the losses -------------------------------------------------------------------------------

def shifted_logits(noisy_out: torch.Tensor, clean_out: torch.Tensor, ids: torch.Tensor):
    """Logits predicting each position ``i >= 1`` (AR shift): the noisy copy's output at
    ``i - 1`` when ``i - 1`` is in ``i``'s block, else the clean copy's output at ``i - 1``.
    Returns (B, n, V) with position 0 zero (never predicted)."""
    ids = ids.expand(noisy_out.shape[:2]) if ids.dim() == 1 else ids
    same = (ids[:, 1:] == ids[:, :-1])[..., None]
    pred = torch.where(same, noisy_out[:, :-1], clean_out[:, :-1])
    return torch.cat([torch.zeros_like(pred[:, :1]), pred], dim=1)


def weighted_ce(logits, x0, masked, p):
    """Per token (B, n): CE / p_mask where the token is masked, 0 elsewhere (the summand of
    :func:`diffusion_loss`)."""
    ce = F.cross_entropy(logits.float().transpose(1, 2), x0, reduction="none")
    return ce * masked / p


def diffusion_loss(logits, x0, masked, p, noisable):
    """Masked-diffusion loss: sum over masked tokens of CE / p_mask, over the noisable tokens
    (LLaDA's weighting; an upper bound on the NLL per token)."""
    return weighted_ce(logits, x0, masked, p).sum() / noisable.sum().clamp(min=1)


def one_pass(model, x0, xt, ids, positions, context_causal: bool = True):
    """The parallel formulation: one forward over ``[x_t ; x_0]`` under :func:`parallel_mask`
    (per row when ``ids`` is (B, n)). Returns ``(shifted logits, clean-copy logits)``."""
    B, n = x0.shape
    rows = ids if ids.dim() == 2 else ids.expand(B, n)
    mask = torch.stack([parallel_mask(r, context_causal) for r in rows])
    dev = next(model.parameters()).device
    out = model(input_ids=torch.cat([xt, x0], 1).to(dev),
                attention_mask=additive(mask).to(dev),
                position_ids=torch.cat([positions, positions], 1).to(dev)).logits
    noisy, clean = out[:, :n], out[:, n:]
    return shifted_logits(noisy, clean, rows.to(dev)), clean


def two_pass(model, x0, xt, ids, positions, context_causal: bool = True):
    """The reference: the clean sequence alone (pass 1), then every block's noisy tokens after
    its clean context (pass 2, one forward per block with the block bidirectional), as a
    decoder sees them. Same return as :func:`one_pass`."""
    B, n = x0.shape
    dev = next(model.parameters()).device
    rows = ids if ids.dim() == 2 else ids.expand(B, n)
    ctx_ids = torch.arange(n).expand(B, n) if context_causal else rows
    clean = model(input_ids=x0.to(dev), attention_mask=additive(
        torch.stack([block_mask(r) for r in ctx_ids])).to(dev),
        position_ids=positions.to(dev)).logits
    noisy = torch.zeros_like(clean)
    for b in range(B):
        for blk in torch.unique(rows[b]):
            idx = (rows[b] == blk).nonzero().flatten()
            s, e = int(idx[0]), int(idx[-1]) + 1
            seq = torch.cat([x0[b, :s], xt[b, s:e]])[None]
            m = block_mask(torch.cat([ctx_ids[b, :s], torch.full((e - s,), n + 1)]))
            pos = positions[b, :e][None]
            o = model(input_ids=seq.to(dev), attention_mask=additive(m).to(dev),
                      position_ids=pos.to(dev)).logits
            noisy[b, s:e] = o[0, s:e]
    return shifted_logits(noisy, clean, rows.to(dev)), clean


def ar_loss(clean_logits, x0, valid):
    """Auxiliary AR guidance: next-token CE of the clean copy (valid only with a causal clean
    copy, where position ``i`` cannot see ``i + 1``), over the tokens ``valid`` marks."""
    ce = F.cross_entropy(clean_logits[:, :-1].float().transpose(1, 2), x0[:, 1:], reduction="none")
    v = valid[:, 1:].float()
    return (ce * v).sum() / v.sum().clamp(min=1)


# -- the curriculum ---------------------------------------------------------------------------

def curriculum(step: int, steps: int, sizes=(1, 2, 4, 8)) -> int:
    """The gradual block-size curriculum: equal shares of the steps at each size, smallest first
    (non-decreasing in ``step``; the last size from the last share on)."""
    k = min(len(sizes) - 1, step * len(sizes) // max(steps, 1))
    return sizes[k]


def anneal_fraction(step: int, steps: int, warm: float = 0.5) -> float:
    """Random mask annealing (the baseline, DiffuLLaMA-style): the share of the intra-block
    non-causal entries switched on, rising linearly from 0 to 1 over the first ``warm`` of
    training."""
    return min(1.0, step / max(1.0, warm * steps))


def annealed_parallel_mask(ids, frac: float, generator=None) -> torch.Tensor:
    """:func:`parallel_mask` (bd3lms' block-causal clean copy) whose x_t block-diagonal part keeps
    its causal entries and each non-causal one with probability ``frac``."""
    m = parallel_mask(ids, context_causal=False)
    n = len(ids)
    upper = torch.triu(torch.ones(n, n, dtype=torch.bool), 1) & m[:n, :n]
    drop = upper & (torch.rand(n, n, generator=generator) >= frac)
    m[:n, :n] &= ~drop
    return m


def nelbo_ppl(total: float, count: int) -> float:
    """exp of the diffusion bound per token (an upper bound on the perplexity)."""
    return math.exp(total / max(count, 1))


# -- data, adaptation loop, decoding ----------------------------------------------------------

def task_rows(tok, examples, n: int):
    """``(x0, start)``: ``<bos> prompt completion <eos>`` padded with ``<pad>`` to ``n`` tokens
    (pads are noised and predicted too, as LLaDA's SFT does, so a decoder learns to stop), and
    where each completion starts (the prompt is never noised)."""
    x, start = [], []
    for e in examples:
        p = [tok.bos_token_id] + tok(e.prompt, add_special_tokens=False).input_ids
        c = tok(e.completion(), add_special_tokens=False).input_ids + [tok.eos_token_id]
        row = (p + c)[:n]
        x.append(row + [tok.pad_token_id] * (n - len(row)))
        start.append(len(p))
    return torch.tensor(x), torch.tensor(start)


PATHS = ("nbdiff", "anneal", "direct")


def train_step_loss(model, x0, start, path: str, step: int, steps: int, final: int, mask_id: int,
                    ar_weight: float, g: torch.Generator):
    """One step's loss for an adaptation ``path``: ``nbdiff`` (context-causal clean copy, the
    block-size curriculum up to ``final``, plus ``ar_weight`` times the AR loss), ``anneal``
    (bd3lms' mask at ``final`` with the intra-block future switched on at random, share
    :func:`anneal_fraction`) or ``direct`` (bd3lms' objective at ``final`` from step 0)."""
    B, n = x0.shape
    sizes = tuple(s for s in (1, 2, 4, 8, 16, 32) if s <= final)
    size = curriculum(step, steps, sizes) if path == "nbdiff" else final
    ids = torch.stack([block_ids(n, size, int(s)) for s in start])
    noisable = ids >= 0
    xt, masked, p = noise(x0, ids, noisable, mask_id, g)
    pos = torch.arange(n).expand(B, n)
    dev = next(model.parameters()).device
    if path == "anneal":
        frac = anneal_fraction(step, steps)
        mask = torch.stack([annealed_parallel_mask(r, frac, g) for r in ids])
        out = model(input_ids=torch.cat([xt, x0], 1).to(dev), attention_mask=additive(mask).to(dev),
                    position_ids=torch.cat([pos, pos], 1).to(dev)).logits
        logits = shifted_logits(out[:, :n], out[:, n:], ids.to(dev))
        clean = None
    else:
        logits, clean = one_pass(model, x0, xt, ids, pos, context_causal=path == "nbdiff")
    loss = diffusion_loss(logits, x0.to(dev), masked.to(dev), p.to(dev), noisable.to(dev))
    if path == "nbdiff" and ar_weight > 0:
        loss = loss + ar_weight * ar_loss(clean, x0.to(dev), torch.ones_like(x0, dtype=torch.bool).to(dev))
    return loss, size


def adapt(model, x0, start, path: str, steps: int, final: int, mask_id: int, lr: float = 1e-3,
          batch: int = 32, ar_weight: float = 0.5, seed: int = 0) -> list[float]:
    """Full fine-tuning of ``model`` along ``path`` (AdamW, linear decay to 10%); every step's
    diffusion-plus-guidance loss."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.9 * min(i, steps) / steps)
    model.train()
    losses = []
    for step in range(steps):
        idx = torch.randint(0, len(x0), (batch,), generator=g)
        with fast_math(x0.device):
            loss, _ = train_step_loss(model, x0[idx], start[idx], path, step, steps, final,
                                      mask_id, ar_weight, g)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def _left_padded(prompt_ids: list[list[int]], gen_len: int, mask_id: int, pad_id: int):
    """``(x, L, pad counts, columns, positions)``: the prompts left-padded to the longest ``L``,
    then ``gen_len`` masks; positions count from each prompt's first token."""
    B, L = len(prompt_ids), max(len(p) for p in prompt_ids)
    x = torch.full((B, L + gen_len), mask_id, dtype=torch.long)
    padn = torch.tensor([L - len(p) for p in prompt_ids])
    for b, p in enumerate(prompt_ids):
        x[b, :L - len(p)] = pad_id
        x[b, L - len(p):L] = torch.tensor(p)
    cols = torch.arange(L + gen_len)
    return x, L, padn, cols, (cols[None] - padn[:, None]).clamp(min=0)


def decode(model, prompt_ids: list[list[int]], gen_len: int, size: int, per_pass: int,
           mask_id: int, context_causal: bool = True, pad_id: int = 0):
    """Block-diffusion decoding: blocks of ``size`` left to right; in each forward pass the
    ``per_pass`` most confident masked tokens of the current block are committed (greedy).
    The whole sequence is recomputed every pass (no KV cache). Prompts are left-padded (pad
    columns masked). Returns ``(generated ids (B, gen_len), forward passes)``."""
    dev = next(model.parameters()).device
    x, L, padn, cols, pos = _left_padded(prompt_ids, gen_len, mask_id, pad_id)
    passes = 0
    for s in range(L, L + gen_len, size):
        e = min(s + size, L + gen_len)
        n = e
        # committed context: causal (context-causal) or its own blocks (bd3lms); then the block
        ctx = torch.arange(s) if context_causal else torch.cat(
            [torch.arange(L) - L, torch.div(torch.arange(s - L), size, rounding_mode="floor")])
        ids = torch.cat([ctx, torch.full((e - s,), 10 ** 6)])
        m = block_mask(ids)[None].expand(len(prompt_ids), n, n).clone()
        m &= (cols[None, :n] >= padn[:, None])[:, None, :]          # pads are never seen
        m |= torch.eye(n, dtype=torch.bool)[None]                  # every row sees itself
        while (x[:, s:e] == mask_id).any():
            logits = model(input_ids=x[:, :n].to(dev), attention_mask=additive(m).to(dev),
                           position_ids=pos[:, :n].to(dev)).logits[:, s - 1:e - 1].float().cpu()
            passes += 1
            logits[..., mask_id] = -float("inf")
            conf, tokv = logits.softmax(-1).max(-1)
            still = x[:, s:e] == mask_id
            conf = conf.masked_fill(~still, -1.0)
            k = min(per_pass, e - s)
            top = conf.topk(k, dim=1).indices
            pick = torch.zeros_like(still).scatter(1, top, True) & still
            blk = x[:, s:e]
            blk[pick] = tokv[pick]
            x[:, s:e] = blk
    return x[:, L:], passes


def threshold_commit(conf: torch.Tensor, still: torch.Tensor, threshold: float = 0.9):
    """Which masked positions a pass commits (``diffusion_generate``, ``confidence_threshold``):
    per row the most confident masked one plus every masked one whose confidence is above
    ``threshold``. ``conf`` (B, k) top-token probabilities, ``still`` (B, k) still masked."""
    c = conf.masked_fill(~still, -float("inf"))
    top = torch.zeros_like(still).scatter(1, c.argmax(1, keepdim=True), True)
    return (top | (c > threshold)) & still


def _run(model, x, pos, seen, s: int, e: int, bidir: bool, cache):
    """Logits (B, e - s, V) of rows ``s..e-1``: keys ``0..e-1``, causal, the rows ``s..e-1``
    among themselves bidirectional when ``bidir``, pad keys never seen. With a ``cache`` (holding
    keys ``0..s-1``) only ``x[:, s:e]`` is run; else the whole prefix is recomputed."""
    dev = next(model.parameters()).device
    q0 = s if cache is not None else 0
    i, j = torch.arange(q0, e)[:, None], torch.arange(e)[None]
    m = (j <= i) | ((i >= s) & (j >= s) & bidir)
    m = (m[None] & seen[:, None, :e]) | (i == j)[None]
    kw = {"cache": cache, "use_cache": True} if cache is not None else {}
    out = model(input_ids=x[:, q0:e].to(dev), attention_mask=additive(m).to(dev),
                position_ids=pos[:, q0:e].to(dev), **kw).logits[:, s - q0:]
    return out.float().cpu()


def _greedy(logits: torch.Tensor):
    """(confidence, token) of greedy decoding as the reference's ``sample_tokens`` at temperature
    0 (``generation_utils.py`` L58-90: L66, L75): the softmax over the whole vocabulary, the mask
    token included, and its top probability and token. The mask token is neither removed nor
    the rest renormalised without it."""
    return logits.softmax(-1).max(-1)


@torch.no_grad()
def decode_threshold(model, prompt_ids: list[list[int]], gen_len: int, size: int, mask_id: int,
                     threshold: float = 0.9, use_cache: bool = True, pad_id: int = 0):
    """The reference decoder (YuchuanTian/NBDiff ``generation_utils.py``, ``diffusion_generate``,
    ``alg="confidence_threshold"``, temperature 0, one small block): the prompt's causal pass
    writes the first token (L225-240); while any token of the block is masked, a pass over the
    block (bidirectional, committed context causal) predicts position ``s`` from its own output
    and every later one from the output before it (L275) and commits by
    :func:`threshold_commit` (L280-284); a finished block is run causally once to store its keys
    and values (``use_cache``) and write the next block's first token from its last output
    (L289-301). Confidences and tokens are :func:`_greedy`'s (the whole vocabulary's softmax), so
    a committed token may be the mask token itself, which leaves its position masked, as there.
    ``use_cache=False`` recomputes the prefix in every pass (same tokens, for tests).
    Departures: a row whose pass would commit only mask tokens (the reference would repeat that
    pass forever) commits the top token other than the mask at its most confident position; a
    finished row's block is never rewritten (in a batch the reference's argmax over a row with
    nothing masked rewrites its first token); a last partial block is allowed; the last block's
    storing pass is skipped (it writes nothing); no stop at ``<eos>``. Prompts left-padded.
    Returns ``(generated ids (B, gen_len), forward passes including the prefill)``."""
    x, L, padn, cols, pos = _left_padded(prompt_ids, gen_len, mask_id, pad_id)
    seen = cols[None] >= padn[:, None]
    cache = DynamicCache() if use_cache else None
    x[:, L] = _greedy(_run(model, x, pos, seen, 0, L, False, cache)[:, -1])[1]
    passes = 1
    for s in range(L, L + gen_len, size):
        e = min(s + size, L + gen_len)
        while (x[:, s:e] == mask_id).any():
            out = _run(model, x, pos, seen, s, e, True, cache)
            passes += 1
            if cache is not None:
                cache.crop(s - e)           # drop the block: the cache holds 0..s-1 again
            logits = torch.cat([out[:, :1], out[:, :-1]], dim=1)
            conf, tokv = _greedy(logits)
            still = x[:, s:e] == mask_id
            pick = threshold_commit(conf, still, threshold)
            stuck = still.any(1) & ~(pick & (tokv != mask_id)).any(1)
            if stuck.any():                 # only the mask would be committed: its runner-up
                logits[..., mask_id] = -float("inf")
                alt = logits.argmax(-1)
                top = conf.masked_fill(~still, -float("inf")).argmax(1, keepdim=True)
                tokv = torch.where(stuck[:, None], alt, tokv)
                pick = torch.where(stuck[:, None],
                                   torch.zeros_like(still).scatter(1, top, True), pick)
            x[:, s:e] = torch.where(pick, tokv, x[:, s:e])
        if e < L + gen_len:
            x[:, e] = _greedy(_run(model, x, pos, seen, s, e, False, cache)[:, -1])[1]
            passes += 1
    return x[:, L:], passes


@torch.no_grad()
def nelbo_rows(model, x0, start, size: int, mask_id: int, context_causal: bool, draws: int = 4,
               seed: int = 0, batch: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``x0``: the Monte-Carlo diffusion bound summed over its noisable tokens, and
    their count, over ``draws`` fixed noise draws (the same ``seed`` for every model compared).
    ``total / count`` is a row's bound per token; :func:`nelbo` pools the rows."""
    g = torch.Generator().manual_seed(seed)
    model.eval()
    n = x0.shape[1]
    tot, cnt = torch.zeros(len(x0), dtype=torch.float64), torch.zeros(len(x0), dtype=torch.float64)
    with torch.no_grad():
        for _ in range(draws):
            for i in range(0, len(x0), batch):
                xb, sb = x0[i:i + batch], start[i:i + batch]
                ids = torch.stack([block_ids(n, size, int(s)) for s in sb])
                noisable = ids >= 0
                xt, masked, p = noise(xb, ids, noisable, mask_id, g)
                logits, _ = one_pass(model, xb, xt, ids, torch.arange(n).expand(len(xb), n),
                                     context_causal)
                dev = logits.device
                wce = weighted_ce(logits, xb.to(dev), masked.to(dev), p.to(dev))
                tot[i:i + len(xb)] += wce.sum(1).double().cpu()
                cnt[i:i + len(xb)] += noisable.sum(1)
    return tot, cnt


def nelbo(model, x0, start, size: int, mask_id: int, context_causal: bool, draws: int = 4,
          seed: int = 0, batch: int = 64) -> float:
    """Monte-Carlo diffusion bound (NELBO) per noisable token at block size ``size``, on fixed
    noise draws (the same ``seed`` for every model compared): exp of it bounds the perplexity.
    The rows of :func:`nelbo_rows`, pooled."""
    tot, cnt = nelbo_rows(model, x0, start, size, mask_id, context_causal, draws, seed, batch)
    return float(tot.sum() / cnt.sum().clamp(min=1))
