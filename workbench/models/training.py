"""How the zoo trains a backbone from its recipe: the model, the data rows, the loops, the card.

:func:`train_and_save` trains the recipe's model (:func:`make_model`) on its prose and task rows
with one of :data:`LOOPS`, measures the card (held-out perplexity against a unigram baseline,
task accuracy through :mod:`workbench.evaluate`) and saves model, tokenizer and ``card.json``
into a folder. The cache (:mod:`workbench.models.zoo`) decides where and when.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from typing import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

from .. import evaluate
from ..data import corpus, packing, tasks
from ..data.tasks import ALL_FAMILIES, difficulties
from ..device import fast_math
from ..env import torch_threads
from ..progress import progress
from .recipes import ZOO_VERSION, Recipe, Size

__all__ = ["make_model", "tokenizer", "task_examples", "completions", "task_documents",
           "encode_documents", "init_model", "task_rows", "optimizer", "loop_v1", "loop_v2", "LOOPS",
           "train_and_save"]


def make_model(arch: str, s: Size, tok):
    """A freshly initialised ``transformers`` causal LM of architecture ``arch``."""
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id, vocab_size=len(tok))
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=s.d_model, intermediate_size=s.d_ff,
                          num_hidden_layers=s.n_layers, num_attention_heads=s.n_heads,
                          num_key_value_heads=s.n_heads, max_position_embeddings=s.ctx,
                          tie_word_embeddings=True, rms_norm_eps=1e-5, **ids)
        return LlamaForCausalLM(cfg)
    if arch == "qwen2":
        cfg = Qwen2Config(hidden_size=s.d_model, intermediate_size=s.d_ff,
                          num_hidden_layers=s.n_layers, num_attention_heads=s.n_heads,
                          num_key_value_heads=s.n_heads, max_position_embeddings=s.ctx,
                          tie_word_embeddings=True, **ids)
        return Qwen2ForCausalLM(cfg)
    if arch == "gpt2":
        cfg = GPT2Config(n_embd=s.d_model, n_layer=s.n_layers, n_head=s.n_heads,
                         n_inner=s.d_ff, n_positions=s.ctx, **ids)
        return GPT2LMHeadModel(cfg)
    raise ValueError(f"unknown architecture {arch!r}; choose llama, qwen2 or gpt2")


def task_examples(r: Recipe, s: Size) -> list:
    """The recipe's rendered training examples, shuffled with the build seed."""
    exs = []
    weights = r.task_weights or (1.0,) * len(r.train_tasks)
    if len(weights) != len(r.train_tasks):
        raise ValueError("task_weights needs one weight per train task")
    mean_w = sum(weights) / len(weights)
    for fam, w in zip(r.train_tasks, weights):
        ds = difficulties(fam, r.easiest)
        n_fam = int(round(s.n_task_examples * w / mean_w))
        for d in ds:
            exs += tasks.generate(fam, -(-n_fam // len(ds)), r.seed + 1, d)
    random.Random(r.seed + 1).shuffle(exs)
    return exs


def task_documents(r: Recipe, s: Size) -> list[list]:
    """The recipe's training examples grouped into documents (lists of examples of one family,
    trained as one sequence: one ``<bos>``, no attention reset inside). Without
    ``context_share`` and in-context families each example is its own document (loops v1-v3).
    Otherwise a ``context_share`` of each ordinary family's examples is cut into documents of
    2..max_shots+1 examples, and an in-context family's examples are drawn as contexts that share
    one rule (:meth:`workbench.data.tasks.Family.context`, 1..max_shots demonstrations)."""
    weights = r.task_weights or (1.0,) * len(r.train_tasks)
    if len(weights) != len(r.train_tasks):
        raise ValueError("task_weights needs one weight per train task")
    if r.context_share == 0 and not any(tasks.get(f).rule for f in r.train_tasks):
        return [[e] for e in task_examples(r, s)]
    if r.max_shots < 1:
        raise ValueError("multi-example contexts need max_shots >= 1")
    mean_w = sum(weights) / len(weights)
    rng = random.Random(r.seed + 3)
    docs = []
    for fam, w in zip(r.train_tasks, weights):
        n_fam = int(round(s.n_task_examples * w / mean_w))
        family = tasks.get(fam)
        if family.rule is not None:
            frng = random.Random(f"{r.seed}:{fam}")
            made = 0
            while made < n_fam:
                docs.append(family.context(frng, frng.randint(1, r.max_shots)))
                made += len(docs[-1])
            continue
        ds = difficulties(fam, r.easiest)
        exs = [e for d in ds for e in tasks.generate(fam, -(-n_fam // len(ds)), r.seed + 1, d)]
        rng.shuffle(exs)
        n_ctx, i = int(round(len(exs) * r.context_share)), 0
        while i < n_ctx:
            k = rng.randint(2, r.max_shots + 1)
            docs.append(exs[i: i + k])
            i += k
        docs += [[e] for e in exs[i:]]
    rng.shuffle(docs)
    return docs


def encode_documents(tok, docs: list[list], ctx: int, with_steps: bool = False,
                     comps: list[str] | None = None):
    """``(ids, labels)`` per document: ``<bos>`` then each example's prompt and completion
    (``comps``, one per example in document order, as :func:`completions` renders them; default
    each example's own ``completion(with_steps)``),
    examples separated by :data:`workbench.data.tasks.CONTEXT_SEP`, ``<eos>`` at the end; labels
    on every completion (and the separator after it) and ``<eos>``. A document longer than
    ``ctx`` keeps its first examples that fit. The ids equal the tokens of
    :func:`workbench.data.tasks.render_context`'s text (the separator is a pre-token of its own)."""
    flat = [e for d in docs for e in d]
    firsts = {id(d[0]) for d in docs}
    prompts = [(e.prompt if id(e) in firsts else tasks.CONTEXT_SEP + e.prompt) for e in flat]
    ps = tok(prompts, add_special_tokens=False)["input_ids"]
    comps = [e.completion(with_steps) for e in flat] if comps is None else comps
    cs = tok(comps, add_special_tokens=False)["input_ids"]
    out, j = [], 0
    for d in docs:
        ids, lab = [tok.bos_token_id], [packing.IGNORE]
        for _ in d:
            p, c = ps[j], cs[j]
            j += 1
            if len(ids) + len(p) + len(c) + 1 > ctx:
                continue
            ids, lab = ids + p + c, lab + [packing.IGNORE] * len(p) + c
        if len(ids) > 1:
            out.append((ids + [tok.eos_token_id], lab + [tok.eos_token_id]))
    return out


def completions(r: Recipe, exs) -> list[str]:
    """The rendered completion of each training example. Without steps: the bare answer. With
    steps: the steps then the answer, except the ``direct_levels[i]`` easiest difficulties
    of train task ``i``, rendered as bare answers (easy items answered at once), and a
    ``forced_direct_share`` of the rest (of every family but ``trace_only``'s, so the form is
    known everywhere) rendered ``" => answer"`` (the form of a forced direct answer, notebook
    06's ``truncate@0``), drawn with the build seed."""
    if not r.with_steps:
        return [e.completion(False) for e in exs]
    levels = dict(zip(r.train_tasks, r.direct_levels)) if r.direct_levels else {}
    if r.direct_levels is not None and len(r.direct_levels) != len(r.train_tasks):
        raise ValueError("direct_levels needs one count per train task")
    rng = random.Random(r.seed + 3)
    out = []
    for e in exs:
        if e.difficulty in tasks.get(e.family).difficulties[:levels.get(e.family, 0)]:
            out.append(e.completion(False))
        elif (r.forced_direct_share and e.family not in r.trace_only
              and rng.random() < r.forced_direct_share):
            out.append(f" {tasks.ANSWER_MARK} {e.target}")
        else:
            out.append(e.completion(True))
    return out


def init_model(r: Recipe, scale: str, s: Size, load: Callable):
    """``(model, tokenizer, base card)`` of the zoo model ``r.init_from`` through ``load(name,
    scale)`` (``zoo.load``, which builds it if missing; passed in, so that training never imports
    the cache in front of it), to be fine-tuned: the recipe's sizes must keep the base's
    architecture (its ``ctx`` may grow)."""
    model, tok = load(r.init_from, scale)
    base = model.zoo_card
    arch_fields = ("d_model", "n_layers", "n_heads", "d_ff", "vocab")
    diff = {k: (base["size"][k], getattr(s, k)) for k in arch_fields
            if base["size"][k] != getattr(s, k)}
    if diff or base["arch"] != r.arch:
        raise ValueError(f"{r.name} fine-tunes {r.init_from} but changes its architecture: "
                         f"{diff or (base['arch'], r.arch)}")
    model.config.max_position_embeddings = max(s.ctx, model.config.max_position_embeddings)
    return model, tok, base


def task_rows(r: Recipe, s: Size, tok, exs=None):
    """Task examples packed into ``ctx``-token rows, ``<bos> prompt completion <eos>`` each
    (or, for recipes with contexts, ``<bos>`` and a document of several examples).

    Returns ``(ids, labels)`` (rows, ctx): labels are -100 on ``<bos>``, prompt and padding, so
    task rows train the completions only (their prompts are random and carry no signal).
    ``exs`` may be a list of examples or of documents (lists of examples).
    """
    exs = task_documents(r, s) if exs is None else exs
    if exs and isinstance(exs[0], list):
        comps = completions(r, [e for d in exs for e in d])
        return packing.pack(encode_documents(tok, exs, s.ctx, r.with_steps, comps), s.ctx,
                            tok.pad_token_id)
    pairs = packing.encode(tok, [e.prompt for e in exs], completions(r, exs))
    return packing.pack(pairs, s.ctx, tok.pad_token_id)


def tokenizer(r: Recipe, s: Size):
    """The recipe's byte-level BPE: the train documents plus rendered lines of every family."""
    sample_lines = corpus.task_lines(ALL_FAMILIES + tuple(f for f in r.train_tasks
                                                          if f not in ALL_FAMILIES), 100,
                                     seed=r.seed + 2, with_steps=True)
    if r.loop == "v3":
        # every letter also as one " x" token: with the sampled task lines alone the BPE left
        # " q", " x", " y", " z" as two tokens, so a kv key could tokenize two ways
        sample_lines += [" ".join(tasks.LETTERS)] * 200
    return corpus.train_tokenizer(s.vocab, extra_text=sample_lines)


def train_and_save(r: Recipe, scale: str, out: Path, load: Callable | None = None) -> dict:
    """Train ``r`` at ``scale`` and save model, tokenizer and card into ``out``. ``load(name,
    scale) -> (model, tok)`` (``zoo.load``) gives a fine-tune its base (``init_from``) and the
    card its comparison model (``compare_direct``)."""
    # Small matmuls on a shared CPU: one thread avoids OpenMP spin-waiting, which we measured
    # making a 2-thread step ~10x slower under contention (loop v1). Recipes on the later loops
    # name their threads (benchmarks/zoo_throughput.py measures both). WORKBENCH_ZOO_THREADS
    # overrides either.
    default = r.size(scale).threads if r.loop != "v1" else 1
    with torch_threads(os.environ.get("WORKBENCH_ZOO_THREADS", default)):
        return _train_and_save_inner(r, scale, out, load)


def optimizer(model, s: Size):
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)            # one kernel for all parameters (CPU and GPU)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / s.warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, s.steps) / s.steps))))
    return opt, sched


def loop_v1(model, opt, sched, text_ids, task_x, task_y, r: Recipe, s: Size, pad_id: int,
             device, steps: int | None = None, desc: str = "zoo", bos_id: int | None = None):
    """lm-tiny's original loop, unchanged (its weights depend on every call here): a fresh
    batch gathered in Python each step, a host sync per step for the loss and the token count."""
    g = torch.Generator().manual_seed(r.seed)
    n_task = int(round(s.batch * r.task_fraction)) if r.train_tasks else 0
    losses, tokens = [], 0
    model.train()
    for step in progress(range(s.steps if steps is None else steps), desc=desc):
        starts = torch.randint(0, len(text_ids) - s.ctx - 1, (s.batch - n_task,), generator=g)
        x = torch.stack([text_ids[i: i + s.ctx] for i in starts.tolist()])
        y = x.clone()
        if n_task:
            pick = torch.randint(0, len(task_x), (n_task,), generator=g)
            x, y = torch.cat([x, task_x[pick]]), torch.cat([y, task_y[pick]])
        x, y = x.to(device), y.to(device)
        loss = model(input_ids=x, labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        tokens += int((x != pad_id).sum())       # padding is not seen
    return losses, tokens


def loop_v2(model, opt, sched, text_ids, task_x, task_y, r: Recipe, s: Size, pad_id: int,
             device, steps: int | None = None, desc: str = "zoo", bos_id: int | None = None):
    """The faster loop: every step's rows drawn up front (one gather per step from a strided
    view of the text, no Python list of slices), losses kept on the device and read once at the
    end, tokens counted from precomputed row lengths. Text rows are contiguous windows (no
    padding); task rows are whole examples packed greedily (padding only at a row's tail).

    Loop v3 (``r.loop == "v3"``) is this loop with task rows carrying position ids that
    restart at each ``<bos>``, so attention is block-diagonal per example (:func:`workbench.data.packing.positions`)."""
    steps = s.steps if steps is None else steps
    g = torch.Generator().manual_seed(r.seed)
    n_task = int(round(s.batch * r.task_fraction)) if r.train_tasks else 0
    windows = text_ids.unfold(0, s.ctx, 1)                  # (L - ctx + 1, ctx), a view
    starts = torch.randint(0, len(windows), (steps, s.batch - n_task), generator=g)
    picks = torch.randint(0, len(task_x), (steps, n_task), generator=g) if n_task else None
    windows, tx, ty, tpos = windows.to(device), None, None, None
    if n_task:
        tx, ty = task_x.to(device), task_y.to(device)
        if r.loop == "v3":
            tpos = packing.positions(task_x, bos_id).to(device)
    text_pos = torch.arange(s.ctx, device=device).expand(s.batch - n_task, -1)
    params = list(model.parameters())
    losses = torch.zeros(steps, device=device)
    model.train()
    for step in progress(range(steps), desc=desc):
        x = windows[starts[step].to(device)]
        y, pos = x, None
        if n_task:
            p = picks[step].to(device)
            x, y = torch.cat([x, tx[p]]), torch.cat([x, ty[p]])
            if tpos is not None:
                pos = torch.cat([text_pos, tpos[p]])
        with fast_math(device):                     # bf16 on CUDA; nothing on the CPU
            loss = model(input_ids=x, labels=y, position_ids=pos, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = loss.detach()
    tokens = (s.batch - n_task) * s.ctx * steps
    if n_task:
        tokens += int((task_x != pad_id).sum(1)[picks].sum())
    return losses.cpu().tolist(), tokens


# every loop takes the same arguments (v1 ignores ``bos_id``); v3 is v2 with per-example positions
LOOPS = {"v1": loop_v1, "v2": loop_v2, "v3": loop_v2}


def _direct_comparison(r: Recipe, scale: str, s: Size, model, tok, card: dict,
                       trained_prompts: set[str], load: Callable) -> dict:
    """The card's direct-answer column (paper 06): this model's forced direct answers
    (:func:`workbench.evaluate.forced_direct`) against the direct answers of ``r.compare_direct``
    (built if missing) on the same held-out prompts, at every difficulty of the families both
    models solve (exact match >= 0.8 at the middle difficulty, each in its own mode); ``ratio``
    is the mean of ours over the mean of theirs."""
    other, otok = load(r.compare_direct, scale)
    both = [f for f in r.train_tasks if f in other.zoo_card["trained_tasks"]]
    ours = evaluate.direct_section(model, tok, s.eval_examples, both, trained_prompts, True)
    theirs = evaluate.direct_section(other, otok, s.eval_examples, both, trained_prompts, False)
    mid = lambda acc, f: acc[f][str(evaluate.MIDDLE[f])]                     # noqa: E731
    solved = [f for f in both if card["task_accuracy_middle"][f] >= 0.8
              and mid(theirs, f) >= 0.8]
    mean = lambda acc: (sum(sum(acc[f].values()) / len(acc[f]) for f in solved)  # noqa: E731
                        / len(solved)) if solved else float("nan")
    return {"against": r.compare_direct, "against_key": other.zoo_card["key"],
            "protocol": "forced: prompt + ' =>' then greedy (06's truncate@0)",
            "forced_direct": ours, "other_direct": theirs, "solved_by_both": solved,
            "forced_direct_mean": mean(ours), "other_direct_mean": mean(theirs),
            "ratio": mean(ours) / mean(theirs) if solved else float("nan")}


def _train_and_save_inner(r: Recipe, scale: str, out: Path, load: Callable | None) -> dict:
    if (r.init_from or r.compare_direct) and load is None:
        raise ValueError(f"{r.name} needs other zoo models: build it through zoo.ensure")
    t0 = time.time()
    s = r.size(scale)
    torch.manual_seed(r.seed)
    device = torch.device("cuda" if scale == "full" and torch.cuda.is_available() else "cpu")
    base_card = None
    if r.init_from is not None:      # a fine-tune of a built zoo model, its tokenizer too
        model, tok, base_card = init_model(r, scale, s, load)
    else:
        tok = tokenizer(r, s)
    text_ids = torch.tensor(corpus.encode_documents(tok, corpus.train_text()), dtype=torch.long)
    task_x = task_y = None
    trained_prompts: set[str] = set()
    if r.train_tasks:
        docs = task_documents(r, s)
        trained_prompts = {e.prompt for d in docs for e in d}
        task_x, task_y = task_rows(r, s, tok, docs)
    if r.init_from is None:
        model = make_model(r.arch, s, tok)
    model = model.to(device)
    opt, sched = optimizer(model, s)
    if r.loop not in LOOPS:
        raise ValueError(f"unknown training loop {r.loop!r}; choose {sorted(LOOPS)}")
    losses, tokens = LOOPS[r.loop](model, opt, sched, text_ids, task_x, task_y, r, s,
                                   tok.pad_token_id, device, desc=f"zoo {r.name}/{scale}",
                                   bos_id=tok.bos_token_id)
    model.eval()
    train_s = time.time() - t0
    card = {
        "name": r.name, "scale": scale, "key": r.key(scale), "arch": r.arch,
        "description": r.description, "recipe": {k: v for k, v in asdict(r).items()
                                                 if k not in ("smoke", "full")},
        "size": asdict(s),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens_seen": tokens, "train_loss_first": losses[0],
        "train_loss_last": sum(losses[-10:]) / len(losses[-10:]),
        "heldout_ppl": evaluate.perplexity(model, corpus.heldout_blocks(tok, s.ctx)),
        "unigram_ppl": evaluate.unigram_perplexity(text_ids, corpus.encode_documents(
            tok, corpus.heldout_text()), len(tok)),
        # the families a prompt alone can solve (what retention, quantization and the cards
        # score zero-shot); the in-context ones are in the card's in-context column
        "trained_tasks": [f for f in r.train_tasks if tasks.get(f).rule is None],
        "trained_in_context": [f for f in r.train_tasks if tasks.get(f).rule is not None],
        "train_seconds": round(train_s, 1), "device": str(device), "build_pid": os.getpid(),
        "zoo_version": ZOO_VERSION,
    }
    if r.eval_by_difficulty:
        card.update(evaluate.evaluate_tasks(model, tok, s.eval_examples, r.with_steps,
                                            trained_prompts, ALL_FAMILIES + tuple(r.extra_eval)))
        if base_card is not None:
            card["init_from"] = {"name": base_card["name"], "key": base_card["key"]}
        for f in r.extra_eval:
            if f in evaluate.LONG_LEVEL:
                card.setdefault("long_trace", {})[f] = evaluate.long_trace_section(
                    model, tok, f, s.eval_examples, trained_prompts)
        if r.with_steps and r.compare_direct:
            card["direct"] = _direct_comparison(r, scale, s, model, tok, card, trained_prompts,
                                                load)
        if r.icl_shots:
            card["in_context"] = evaluate.evaluate_in_context(
                model, tok, s.eval_examples, r.icl_shots, r.with_steps, trained_prompts,
                ALL_FAMILIES + tasks.ICL_FAMILIES)
    else:
        card["task_accuracy"] = {f: evaluate.task_accuracy(model, tok, f, s.eval_examples, seed=12345,
                                                  with_steps=r.with_steps, easiest=r.easiest)
                                 for f in ALL_FAMILIES}
        card["task_difficulties"] = {f: list(difficulties(f, r.easiest)) for f in ALL_FAMILIES}
    card["build_seconds"] = round(time.time() - t0, 1)
    out.mkdir(parents=True, exist_ok=True)
    model.cpu().save_pretrained(out)
    tok.save_pretrained(out)
    (out / "card.json").write_text(json.dumps(card, indent=2))
    return card

