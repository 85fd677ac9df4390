"""Is keyed look-up learnable at lm-base's size at all? (issue 31, docs/zoo-v4-a.md, session 17)

Trains a fresh Llama of lm-base's smoke shape on ``kv`` alone (no prose, no other family), one
padded example a row and the loss on the answer only, and prints exact match at four pairs on
200 held-out prompts every 250 steps. Options: ``--queries 3`` asks three keys of one context
(three answers a row); ``--repeat-share 0.5`` makes half the rows a dense induction task (random
symbols, then the same symbols again, loss on every repeated one), the data on which induction
heads are known to form.

    python benchmarks/kv_isolated.py --lr 1e-3 --layers 4 --steps 1500
"""
from __future__ import annotations

import argparse
import random
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from workbench.cache import shipped_root
from workbench.data import tasks
from workbench.models.recipes import RECIPES

SYMBOLS = "abcdefghijklmnopqrstuvwxyz0123456789"


def rows(tok, rng, n, queries, repeat_share):
    """``n`` training rows: (ids, labels), labels -100 except on the answers."""
    out = []
    for _ in range(n):
        if rng.random() < repeat_share:
            seq = " ".join(rng.choice(SYMBOLS) for _ in range(rng.randint(4, 16)))
            a, b = tok("rep " + seq + " ;")["input_ids"], tok(" " + seq)["input_ids"]
            out.append(([tok.bos_token_id] + a + b, [-100] * (1 + len(a)) + b))
            continue
        e = tasks.generate("kv", 1, seed=rng.randrange(10**9), difficulty=rng.choice((2, 3, 4, 5)))[0]
        context = e.prompt.split(" ; ")[0]
        pairs = [kv.split("=") for kv in context.split()[1:]]
        asked = [(e.prompt[len(context):], e.target)] + [
            (f" ; {k}?", v) for k, v in (rng.choice(pairs) for _ in range(queries - 1))]
        ids = [tok.bos_token_id] + tok(context)["input_ids"]
        lab = [-100] * len(ids)
        for q, v in asked:
            qi, vi = tok(q)["input_ids"], tok(" " + v)["input_ids"]
            ids, lab = ids + qi + vi, lab + [-100] * len(qi) + vi
        out.append((ids, lab))
    width = max(len(i) for i, _ in out)
    pad = tok.pad_token_id
    return (torch.tensor([i + [pad] * (width - len(i)) for i, _ in out]),
            torch.tensor([la + [-100] * (width - len(la)) for _, la in out]))


def accuracy(model, tok, held_out):
    """Greedy exact match of the value digit after the prompt and its space token."""
    model.eval()
    space = tok(" 0")["input_ids"][0]            # a digit's lone leading-space token
    ok = 0
    with torch.no_grad():
        for e in held_out:
            ids = [tok.bos_token_id] + tok(e.prompt)["input_ids"] + [space]
            nxt = model(torch.tensor([ids])).logits[0, -1].argmax().item()
            ok += tok.decode([nxt]).strip() == e.target
    model.train()
    return ok / len(held_out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--queries", type=int, default=1)
    ap.add_argument("--repeat-share", type=float, default=0.0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    key = RECIPES["lm-base"].key("smoke")
    tok = PreTrainedTokenizerFast.from_pretrained(shipped_root() / f"lm-base-smoke-{key}")
    d = a.d_model
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=d, intermediate_size=3 * d, num_hidden_layers=a.layers, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=True,
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    held_out = tasks.generate("kv", 200, seed=99_999, difficulty=4)
    rng, t0 = random.Random(0), time.time()
    for step in range(a.steps):
        x, y = rows(tok, rng, a.batch, a.queries, a.repeat_share)
        loss = model(input_ids=x, labels=y).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 250 == 0 or step == a.steps - 1:
            print(f"step {step}  loss {loss.item():.3f}  kv@4 {accuracy(model, tok, held_out):.3f}"
                  f"  {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
