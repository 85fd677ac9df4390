"""Exact match of one LoRA-pool adapter per (family, learning rate, steps): the sweep behind the
pool's smoke learning rate (``workbench.models.adapters.PoolSize.lr``).

Each run trains a fresh rank-8 ``peft`` LoRA on ``lm-base`` exactly as the pool does (the pool's
training pairs, ``finetune.lora_model`` and ``finetune.train_steps``, seed 0) and scores it the
way the pool's card does (greedy, the family's verifier, 24 held-out prompts at the family's middle
difficulty). Measured on this 2-core machine, one thread, 120 steps of 32 examples:

    family   lr 4e-3   lr 8e-3        family   lr 4e-3   lr 8e-3
    sub      0.125     0.458          dedupe   0.792     0.917
    mul      0.125     0.125          kv       0.458     0.458
    addmod   0.000     0.042          add      1.000     1.000
    chain    0.000     0.000

(240 steps at 4e-3 also lifts sub, to 0.79, but takes 57 s, over the pool's 30 s an adapter.)
Usage:

    python benchmarks/pool_lr.py --families sub mul dedupe --lrs 4e-3 8e-3 [--steps 120]
"""
from __future__ import annotations

import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", nargs="+", default=["sub", "mul", "addmod", "dedupe"])
    ap.add_argument("--lrs", nargs="+", type=float, default=[4e-3, 8e-3])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    from workbench.models import adapters, zoo
    from workbench import evaluate
    from workbench.models.finetune import lora_model, train_steps
    torch.set_num_threads(args.threads)
    size = adapters.POOL_SIZES["smoke"]
    _, tok = zoo.load(adapters.POOL_BASE)
    with_steps = zoo.recipe(adapters.POOL_BASE).with_steps
    print(f"{'family':8} {'lr':>8} {'steps':>5} {'exact':>6} {'loss':>6} {'train s':>7}")
    for fam in args.families:
        held = evaluate.heldout_examples(fam, evaluate.MIDDLE[fam], size.eval_examples, seed=999)[0]
        banned = {e.prompt for e in held}
        exs, pairs = adapters._train_pairs((fam,), size.n_train, with_steps, tok)
        pairs = [p for e, p in zip(exs, pairs) if e.prompt not in banned]
        for lr in args.lrs:
            torch.manual_seed(0)            # before the load, as the pool does
            model, _ = zoo.load(adapters.POOL_BASE)
            peft_model = lora_model(model, args.rank, 2.0)
            t0 = time.time()
            losses = train_steps(peft_model, pairs, args.steps, size.batch, lr, 0, tok.pad_token_id)
            seconds = time.time() - t0
            peft_model.eval()
            acc = evaluate.exact_match(peft_model, tok, held, with_steps)
            print(f"{fam:8} {lr:8.0e} {args.steps:5d} {acc:6.3f} {losses[-1]:6.3f} {seconds:7.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
