"""LM evaluation shared by the zoo, the pool, every method and every notebook.

Perplexity (against a unigram baseline), greedy generation through ``transformers``'
``generate``, exact match of the final answer on task examples (:func:`workbench.data.tasks.score`),
held-out examples at a family's middle difficulty, the zoo card's task section, and what
round-to-nearest quantization costs a model. One generation loop for everyone: a method that
steers the model while it generates (hilora's routed adapters) passes a ``prepare`` hook.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from . import quant
from .data import corpus, tasks
from .data.tasks import ALL_FAMILIES, difficulties

__all__ = ["MIDDLE", "LONG_LEVEL", "heldout_examples", "evaluate_tasks", "in_context_examples",
           "in_context_accuracy", "evaluate_in_context", "forced_direct", "direct_section",
           "long_trace_section", "quant_sensitivity", "perplexity", "unigram_perplexity",
           "generate", "chat_prompt", "task_accuracy", "item_scores", "exact_match", "room"]


# the "middle" difficulty of each family: 3-digit add/sub, strings of 5, kv with 4
# pairs, count over 6 letters, motifs of 3
MIDDLE = {"add": 3, "addmod": 3, "sub": 3, "mul": 2, "chain": 3, "reverse": 5, "sort": 5,
          "rotate": 5, "swap": 5, "dedupe": 5, "kv": 4, "count": 6, "pattern": 3,
          "pattern_skip": 3, "lettermap": 2, "digitmap": 2, "pick": 3, "tag": 3, "longadd": 10,
          "kv_dense": 4, "kv_dense_sp": 4}
# the difficulty at which a long-trace family's card column is read (papers 18 and 04): 12-digit
# sums, about 150 tokens written
LONG_LEVEL = {"longadd": 12}


def heldout_examples(family: str, difficulty: int, n: int, exclude: set[str] = frozenset(),
                     seed: int = 12345) -> tuple[list, float]:
    """``n`` evaluation examples whose prompts are not in ``exclude`` (the training prompts),
    and the share of the drawn candidates that were unseen. Where a difficulty has so few
    distinct problems that fewer than ``n // 4`` unseen ones turn up, the seen ones are used too
    (the share says so)."""
    cand = tasks.generate(family, 4 * n, seed, difficulty)
    unseen = [e for e in cand if e.prompt not in exclude]
    share = len(unseen) / len(cand)
    return (unseen[:n] if len(unseen) >= max(1, n // 4) else cand[:n]), share


def evaluate_tasks(model, tok, n: int, with_steps: bool = False,
                   exclude: set[str] = frozenset(), families=ALL_FAMILIES) -> dict:
    """The card's task section: greedy exact match at every difficulty of every family on
    held-out prompts, the tokens the model wrote, and each family's middle-difficulty score."""
    acc, written, unseen = {}, {}, {}
    for f in families:
        acc[f], written[f], unseen[f] = {}, {}, {}
        for d in tasks.get(f).difficulties:
            exs, share = heldout_examples(f, d, n, exclude)
            a, w = exact_match(model, tok, exs, with_steps, return_tokens=True)
            acc[f][str(d)], written[f][str(d)], unseen[f][str(d)] = \
                round(a, 4), round(w, 2), round(share, 3)
    return {"task_accuracy_by_difficulty": acc, "tokens_written": written,
            "eval_unseen_share": unseen,
            "task_accuracy": {f: round(sum(v.values()) / len(v), 4) for f, v in acc.items()},
            "task_accuracy_middle": {f: acc[f][str(MIDDLE[f])] for f in families},
            "task_difficulties": {f: list(tasks.get(f).difficulties) for f in families}}


def in_context_examples(family: str, difficulty: int, n: int, shots: int,
                        exclude: set[str] = frozenset(), seed: int = 2468) -> list[list]:
    """``n`` contexts (``shots`` demonstrations and a query, :func:`workbench.data.tasks.contexts`)
    whose query prompt is not in ``exclude``; like :func:`heldout_examples`, the seen ones fill
    in where fewer than ``n // 4`` unseen turn up."""
    cand = tasks.contexts(family, 4 * n, shots, seed, difficulty)
    unseen = [c for c in cand if c[-1].prompt not in exclude]
    return unseen[:n] if len(unseen) >= max(1, n // 4) else cand[:n]


def in_context_accuracy(model, tok, ctxs: list[list], with_steps: bool = False,
                        shots: int | None = None) -> float:
    """Greedy exact match on the queries of contexts ``ctxs`` with their demonstrations in the
    prompt (no attention reset between examples); ``shots`` keeps only the last ``shots``
    demonstrations (0: the query alone)."""
    keep = [c if shots is None else c[len(c) - 1 - shots:] for c in ctxs]
    rendered = [tasks.render_context(c, with_steps) for c in keep]
    longest = max(len(tok(comp, add_special_tokens=False)["input_ids"]) for _, comp in rendered)
    comps = generate(model, tok, [p for p, _ in rendered], max_new_tokens=longest + 2)
    return sum(tasks.score(c[-1], out) for c, out in zip(keep, comps)) / len(keep)


def evaluate_in_context(model, tok, n: int, shots: int, with_steps: bool = False,
                        exclude: set[str] = frozenset(), families=ALL_FAMILIES) -> dict:
    """The card's in-context column: exact match at each family's middle difficulty on the
    same unseen queries alone and after ``shots`` demonstrations of the same family (and, for
    an in-context family, the same rule), and the gain."""
    out = {}
    for f in families:
        ctxs = in_context_examples(f, MIDDLE[f], n, shots, exclude)
        a0 = in_context_accuracy(model, tok, ctxs, with_steps, 0)
        ak = in_context_accuracy(model, tok, ctxs, with_steps, shots)
        out[f] = {"0": round(a0, 4), str(shots): round(ak, 4), "gain": round(ak - a0, 4)}
    return {"shots": shots, "difficulty": "middle", "accuracy": out}


def quant_sensitivity(model, tok, bits: int = 2, group_size: int = 128, ctx: int = 64,
                      families=None, n: int = 40) -> dict:
    """What round-to-nearest of every block linear (group-wise symmetric, the grid of
    ``workbench.quant.rtn``) costs: held-out perplexity fp vs quantized, its relative increase,
    and exact match at each trained family's middle difficulty (points lost). The model is
    left unchanged (weights are restored)."""
    fams = list(families if families is not None else
                getattr(model, "zoo_card", {}).get("trained_tasks", []))
    held = corpus.heldout_blocks(tok, ctx)

    def measure():
        out = {"ppl": perplexity(model, held)}
        out["acc"] = {f: exact_match(model, tok, heldout_examples(f, MIDDLE[f], n)[0])
                      for f in fams}
        return out

    fp = measure()
    lin = quant.block_linears(model)
    saved = {k: m.weight.detach().clone() for k, m in lin.items()}
    try:
        with torch.no_grad():
            for m in lin.values():
                m.weight.copy_(quant.rtn(m.weight, bits, group_size).dequantize())
        q = measure()
    finally:
        with torch.no_grad():
            for k, m in lin.items():
                m.weight.copy_(saved[k])
    mean = (lambda d: sum(d.values()) / len(d) if d else float("nan"))
    return {"bits": bits, "group_size": group_size, "ppl_fp": fp["ppl"], "ppl_rtn": q["ppl"],
            "ppl_rel_increase": q["ppl"] / fp["ppl"] - 1, "acc_fp": fp["acc"],
            "acc_rtn": q["acc"], "acc_drop_points": 100 * (mean(fp["acc"]) - mean(q["acc"]))}


def perplexity(model, blocks, batch: int = 16) -> float:
    """exp(mean next-token negative log-likelihood) over (B, ctx) token ``blocks``."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(blocks), batch):
            x = blocks[i: i + batch].to(device)
            logits = model(input_ids=x).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
            total += float(nll)
            count += x[:, 1:].numel()
    return math.exp(total / count)


def unigram_perplexity(train_ids, heldout_ids, vocab: int) -> float:
    """Perplexity of add-one-smoothed unigram frequencies of the train tokens, on held-out."""
    counts = torch.bincount(torch.as_tensor(train_ids), minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return math.exp(-float(logp[torch.as_tensor(heldout_ids)].mean()))


def chat_prompt(tok, text: str) -> str:
    """``text`` as a user turn in ``tok``'s chat template, up to where the assistant's answer
    starts (``add_generation_prompt``), for a model tuned to chat; ``text`` itself where the
    tokenizer has no template (every zoo model). A leading ``<bos>`` that the template writes is
    dropped: :func:`generate` and the trainers put one before every prompt."""
    if not getattr(tok, "chat_template", None):
        return text
    out = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                  add_generation_prompt=True)
    return out[len(tok.bos_token):] if tok.bos_token and out.startswith(tok.bos_token) else out


def generate(model, tok, prompts: list[str], max_new_tokens: int = 16,
             batch: int = 64, k: int = 1, temperature: float | None = None,
             seed: int = 0) -> list[str]:
    """Greedy completions of ``prompts`` (each prefixed by ``<bos>``), cut at ``<eos>``; with a
    ``temperature``, ``k`` samples of each (top-k and top-p off, torch seeded with ``seed``),
    the ``k`` of a prompt next to each other."""
    device = next(model.parameters()).device
    tok.padding_side = "left"
    sampling = {} if temperature is None else dict(
        do_sample=True, temperature=temperature, top_k=0, top_p=1.0, num_return_sequences=k)
    if sampling:
        torch.manual_seed(seed)
    outs = []
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            chunk = [tok.bos_token + p for p in prompts[i: i + batch]]
            enc = tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = {n: v.to(device) for n, v in enc.items()}
            gen = model.generate(**enc, max_new_tokens=max_new_tokens,
                                 **(sampling or {"do_sample": False}),
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            new = gen[:, enc["input_ids"].shape[1]:]
            outs += tok.batch_decode(new, skip_special_tokens=True)
    return outs


def task_accuracy(model, tok, family: str, n: int = 50, seed: int = 0,
                  difficulty: int | None = None, with_steps: bool = False,
                  easiest: int | None = None) -> float:
    """Mean exact-match score of greedy completions on ``n`` examples of ``family``.

    ``difficulty`` fixes one difficulty; else ``n`` is spread over the family's ``easiest``
    difficulties (all when None).
    """
    if difficulty is not None:
        exs = tasks.generate(family, n, seed, difficulty)
    else:
        ds = difficulties(family, easiest)
        exs = [e for d in ds for e in tasks.generate(family, -(-n // len(ds)), seed, d)][:n]
    return exact_match(model, tok, exs, with_steps)


def room(tok, examples, with_steps: bool = False) -> int:
    """New tokens a greedy completion of ``examples`` gets: the longest reference completion
    (with its steps, if asked) and two more, the cards' rule."""
    return max(len(tok(e.completion(with_steps), add_special_tokens=False)["input_ids"])
               for e in examples) + 2


def _greedy_completions(model, tok, examples, with_steps: bool) -> list[str]:
    """Greedy completions with :func:`room` for the longest reference completion."""
    return generate(model, tok, [e.prompt for e in examples],
                    max_new_tokens=room(tok, examples, with_steps))


def item_scores(model, tok, examples, with_steps: bool = False) -> np.ndarray:
    """Per example, the verifier's score (1.0 or 0.0) of the greedy completion: what
    :func:`exact_match` averages, kept per item for paired comparisons
    (``diagnostics.paired_bootstrap``)."""
    comps = _greedy_completions(model, tok, examples, with_steps)
    return np.array([tasks.score(e, c) for e, c in zip(examples, comps)], dtype=float)


def exact_match(model, tok, examples, with_steps: bool = False, return_tokens: bool = False):
    """Mean verifier score (exact match of the final answer) of greedy completions; with
    ``return_tokens`` also the mean number of tokens the model wrote (up to its ``<eos>``)."""
    comps = _greedy_completions(model, tok, examples, with_steps)
    acc = sum(tasks.score(e, c) for e, c in zip(examples, comps)) / len(examples)
    if not return_tokens:
        return acc
    written = sum(len(tok(c, add_special_tokens=False)["input_ids"]) for c in comps)
    return acc, written / len(examples)


def forced_direct(model, tok, examples) -> list[str]:
    """Forced direct answers, notebook 06's ``truncate@0``: ``" =>"`` appended to each prompt, the
    model writes its answer at once. Returns the completions, ``" =>"`` included."""
    longest = max(len(tok(" " + e.target, add_special_tokens=False)["input_ids"]) for e in examples)
    tails = generate(model, tok, [e.prompt + f" {tasks.ANSWER_MARK}" for e in examples],
                     max_new_tokens=longest + 2)
    return [f" {tasks.ANSWER_MARK}" + t.split("\n")[0] for t in tails]


def direct_section(model, tok, n: int, families, exclude: set[str] = frozenset(),
                   forced: bool = True) -> dict:
    """Direct-answer exact match at every difficulty of ``families`` on held-out prompts: forced
    (:func:`forced_direct`, for a model that writes steps) or the model's own greedy answer (a
    model that answers directly). ``{family: {difficulty: accuracy}}``."""
    out = {}
    for f in families:
        out[f] = {}
        for d in tasks.get(f).difficulties:
            exs, _ = heldout_examples(f, d, n, exclude)
            if forced:
                comps = forced_direct(model, tok, exs)
                out[f][str(d)] = round(sum(tasks.score(e, c) for e, c in zip(exs, comps))
                                       / len(exs), 4)
            else:
                out[f][str(d)] = round(exact_match(model, tok, exs), 4)
    return out


def long_trace_section(model, tok, family: str, n: int, exclude: set[str] = frozenset(),
                       difficulty: int | None = None) -> dict:
    """The long-trace column: at ``difficulty`` (``LONG_LEVEL``), the median number of tokens
    the model wrote (up to ``<eos>``), the median tokens of the reference steps alone (before
    ``" =>"``), and the exact match of the answers."""
    import statistics
    d = LONG_LEVEL[family] if difficulty is None else difficulty
    exs, _ = heldout_examples(family, d, n, exclude)
    ref = [len(tok(" " + tasks.STEP_SEP.join(e.steps), add_special_tokens=False)["input_ids"])
           for e in exs]
    comps = generate(model, tok, [e.prompt for e in exs], max_new_tokens=room(tok, exs, True))
    written = [len(tok(c, add_special_tokens=False)["input_ids"]) for c in comps]
    return {"family": family, "difficulty": d,
            "median_tokens_written": statistics.median(written),
            "median_reference_trace_tokens": statistics.median(ref),
            "exact_match": round(sum(tasks.score(e, c) for e, c in zip(exs, comps)) / len(exs), 4)}
