"""lm-base with kv's dense look-up format inside its mix (docs/zoo-lessons.md).

``benchmarks/kv_isolated.py`` found kv learned to >= 0.8 at four pairs at lm-base's smoke shape only when a context
carries several questions on one set of pairs and the value token follows its key
(``kv m7 b9 u2 ; u`` -> ``2``), trained alone for about 640k-770k answers. This script builds a
*variant* of the registered lm-base recipe (never added to ``RECIPES``) whose ``kv`` is the
registry's optional ``kv_dense`` format (:data:`workbench.data.tasks.OPTIONAL`), with kv's share
of the mix raised (``--kv-weight``) and the steps raised (``--steps``), from scratch into the
cache named by ``WORKBENCH_CACHE`` (use a scratch one: the script refuses a cache whose zoo holds
the shipped lm-base build). It measures the variant's card with the same card function as
the shipped lm-base (``zoo.ensure`` -> ``training.train_and_save``), then kv_dense itself: one
question at each number of pairs (no demonstrations) and a question after four earlier
questions on the same pairs, and prints the card beside the shipped lm-base's.

    WORKBENCH_CACHE=/work/cache-kv19 python benchmarks/lm_base_kv_dense.py --dry
    WORKBENCH_CACHE=/work/cache-kv19 python benchmarks/lm_base_kv_dense.py --probe 20
    WORKBENCH_CACHE=/work/cache-kv19 python benchmarks/lm_base_kv_dense.py --out /tmp/kv19.json

The builds compared in docs/zoo-lessons.md: A ``--steps 5000 --kv-weight 20 --n-task-examples 60000
--seed 0`` (and ``--seed 1``); B the same with ``--family kv_dense_sp --steps 4000`` (every
question written `` ; k``, the first question's tokens). Add ``--positions`` to read a built one.
The registered lm-base *is* B (``SMOKE_V4_KV``; its weights are B seed 0's byte for byte), so a
variant starts from B's mix and the "shipped" column reads B's card.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from workbench import cache, evaluate
from workbench.data import tasks
from workbench.models import training, zoo
from workbench.models.recipes import RECIPES


def variant(steps: int, kv_weight: float, n_task_examples: int, warmup: int, seed: int = 0,
            family: str = "kv_dense"):
    """lm-base's recipe with kv written as kv_dense (weight ``kv_weight``), ``steps`` steps,
    ``n_task_examples`` examples per unit of weight and build ``seed``; the rest as registered."""
    base = RECIPES["lm-base"]
    # lm-base trains kv_dense_sp (the registered form of build B); any kv form is swapped
    i = next(i for i, f in enumerate(base.train_tasks) if f in ("kv", "kv_dense", "kv_dense_sp"))
    fams = base.train_tasks[:i] + (family,) + base.train_tasks[i + 1:]
    weights = base.task_weights[:i] + (kv_weight,) + base.task_weights[i + 1:]
    return replace(base, name="lm-base-kvdense", train_tasks=fams, task_weights=weights, seed=seed,
                   description=base.description + f"; kv as {family}",
                   smoke=replace(base.smoke, steps=steps, warmup=warmup,
                                 n_task_examples=n_task_examples))


def mix(r) -> dict:
    """Per family: examples (answers) in the task pool, its share of the pool's task tokens,
    and the answers the build's steps draw (rows are drawn uniformly from the packed pool)."""
    s = r.smoke
    tok = training.tokenizer(r, s)
    docs = training.task_documents(r, s)
    comps = training.completions(r, [e for d in docs for e in d])
    enc = training.encode_documents(tok, docs, s.ctx, r.with_steps, comps)
    x, _ = training.task_rows(r, s, tok, docs)
    per = {}
    for d, (ids, _) in zip(docs, enc):
        f = per.setdefault(d[0].family, {"docs": 0, "answers": 0, "tokens": 0})
        f["docs"], f["answers"], f["tokens"] = f["docs"] + 1, f["answers"] + len(d), \
            f["tokens"] + len(ids)
    total = sum(f["tokens"] for f in per.values())
    drawn = s.steps * int(round(s.batch * r.task_fraction))
    for f in per.values():
        f["token_share"] = round(f["tokens"] / total, 3)
        f["answers_drawn"] = round(f["answers"] * drawn / len(x))
    return {"pool_rows": len(x), "rows_drawn": drawn, "families": per}


def probe(r, steps: int) -> float:
    """Seconds a training step of ``r`` takes here (``steps`` steps of loop v3, one thread)."""
    s = r.smoke
    tok = training.tokenizer(r, s)
    from workbench.data import corpus
    text = torch.tensor(corpus.encode_documents(tok, corpus.train_text()), dtype=torch.long)
    tx, ty = training.task_rows(r, s, tok)
    model = training.make_model(r.arch, s, tok)
    opt, sched = training.optimizer(model, s)
    t0 = time.time()
    training.loop_v2(model, opt, sched, text, tx, ty, r, s, tok.pad_token_id, "cpu", steps=steps,
                     bos_id=tok.bos_token_id)
    return (time.time() - t0) / steps


def dense_section(model, tok, exclude, n: int, family: str = "kv_dense") -> dict:
    """kv_dense: one question at each number of pairs (no demonstrations; ``n`` prompts never
    trained on), and the query after four earlier questions on the same four pairs (the pairs in
    the first; ``n`` contexts) against the same query's pairs-free form alone."""
    out = {"by_pairs": {}}
    for d in tasks.get(family).difficulties:
        exs, share = evaluate.heldout_examples(family, d, n, exclude)
        out["by_pairs"][str(d)] = round(evaluate.exact_match(model, tok, exs), 4)
    ctxs = evaluate.in_context_examples(family, 4, n, 4, exclude)
    out["after_4_questions"] = round(evaluate.in_context_accuracy(model, tok, ctxs, False, 4), 4)
    out["n"] = n
    return out


def by_position(model, tok, n: int, shots: int = 6, family: str = "kv_dense") -> dict:
    """kv_dense at four pairs by the question's place in its context (1: the question on the
    pairs' own line; k: after k - 1 earlier questions on the same pairs), split by whether the
    asked key was asked before in the context (then the answer also stands after that earlier
    question) or not (only the pairs hold it); ``n`` contexts of ``shots + 1`` questions."""
    ctxs = tasks.contexts(family, n, shots, seed=777, difficulty=4)
    key = lambda e: e.prompt.split(" ; ")[-1].lstrip("; ")                  # noqa: E731
    ask = ctxs[0][1].prompt[:-1]                  # how a later question starts: "; " or " ; "
    out = {}
    for p in range(1, shots + 2):
        cut = [c[:p] for c in ctxs]
        asked = [key(c[-1]) in {key(e) for e in c[:-1]} for c in cut]
        row = {}
        for name, keep in (("new key", False), ("asked before", True)):
            sub = [c for c, a in zip(cut, asked) if a == keep and (p > 1 or not keep)]
            if sub:
                row[name] = [round(evaluate.in_context_accuracy(model, tok, sub, False), 3),
                             len(sub)]
        out[str(p)] = row
    for d in tasks.get(family).difficulties:    # one question, as drawn and on its own line
        exs = tasks.generate(family, n, 12345, d)
        own = [replace(e, prompt=e.prompt.replace(" ; ", "\n" + ask)) for e in exs]
        out[f"{d} pairs, one question as drawn / on its own line"] = [
            round(evaluate.exact_match(model, tok, exs), 3),
            round(evaluate.exact_match(model, tok, own), 3)]
    return out


def table(card: dict, base: dict, dense: dict) -> str:
    """The variant's card beside the shipped lm-base's (markdown)."""
    rows = ["| column | lm-base (shipped) | kv_dense variant |", "|---|---|---|"]
    for k in ("build_seconds", "tokens_seen", "heldout_ppl"):
        rows.append(f"| {k} | {base[k]:.4g} | {card[k]:.4g} |")
    for f in card["task_accuracy_middle"]:
        rows.append(f"| {f} middle | {base['task_accuracy_middle'][f]:.2f} | "
                    f"{card['task_accuracy_middle'][f]:.2f} |")
    for f, v in card["in_context"]["accuracy"].items():
        b = base["in_context"]["accuracy"][f]
        rows.append(f"| {f} in context 0 -> 4 | {b['0']:.2f} -> {b['4']:.2f} ({b['gain']:+.2f}) | "
                    f"{v['0']:.2f} -> {v['4']:.2f} ({v['gain']:+.2f}) |")
    for d, a in dense["by_pairs"].items():
        rows.append(f"| kv_dense, {d} pairs, one question | - | {a:.3f} |")
    rows.append(f"| kv_dense, 4 pairs, after 4 questions | - | {dense['after_4_questions']:.3f} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--kv-weight", type=float, default=6.0)
    ap.add_argument("--n-task-examples", type=int, default=40000)
    ap.add_argument("--seed", type=int, default=0, help="the build seed (init, data, order)")
    ap.add_argument("--family", choices=("kv_dense", "kv_dense_sp"), default="kv_dense")
    ap.add_argument("--dry", action="store_true", help="print the mix's counts and stop")
    ap.add_argument("--probe", type=int, default=0, help="time this many steps and stop")
    ap.add_argument("--n", type=int, default=200, help="kv_dense prompts per cell")
    ap.add_argument("--out", default=None, help="write the card and kv_dense section here")
    ap.add_argument("--positions", action="store_true",
                    help="kv_dense by the question's place in its context (a built variant)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    r = variant(a.steps, a.kv_weight, a.n_task_examples, a.warmup, a.seed, a.family)
    print("variant key", r.key("smoke"), "cache", cache.root(), flush=True)
    if a.dry:
        print(json.dumps(mix(r), indent=1))
        return
    if a.probe:
        print(f"{probe(r, a.probe):.3f} s/step", flush=True)
        return
    shipped = zoo.model_dir("lm-base")
    if shipped.exists():
        raise SystemExit(f"{cache.root()} holds the shipped zoo ({shipped}): use a scratch cache")
    base = json.loads((cache.shipped_root() / shipped.name / "card.json").read_text())
    model, tok = zoo.load(r.name, "smoke", recipe=r)
    if a.positions:
        print(json.dumps(by_position(model, tok, a.n, family=a.family), indent=1))
        exs = tasks.generate("kv", 4, 12345, 4)          # what it writes for the registry's kv
        for e, c in zip(exs, evaluate.generate(model, tok, [e.prompt for e in exs], 4)):
            print(repr(e.prompt), "->", repr(c), "want", repr(e.completion()))
        return
    card = model.zoo_card
    exclude = {e.prompt for d in training.task_documents(r, r.smoke) for e in d}
    dense = dense_section(model, tok, exclude, a.n, a.family)
    print(table(card, base, dense))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"card": card, "kv_dense": dense, "base_key": base["key"]}, fh, indent=1)


if __name__ == "__main__":
    main()
