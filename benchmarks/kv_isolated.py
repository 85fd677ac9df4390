"""Is keyed look-up learnable at lm-base's size at all? (docs/zoo-lessons.md)

Trains a fresh Llama of lm-base's smoke shape on ``kv`` alone (no prose, no other family), one
padded example a row and the loss on the answer only, and prints exact match at four pairs on
200 held-out prompts every 250 steps. Options: ``--queries 3`` asks three keys of one context
(three answers a row); ``--repeat-share 0.5`` makes half the rows a dense induction task (random
symbols, then the same symbols again, loss on every repeated one), the data on which induction
heads are known to form.

The token surface: ``--surface`` writes the same pairs another way (``SURFACES``):
``today`` is the registry's ``kv m=7 b=9 u=2 ; u?`` -> `` 2`` (tokens ``Ġm = 7 ... Ġu ? Ġ 2``:
the value two tokens after its key, the answer two after the query key); ``eq`` asks ``; u=`` ->
``2`` (a two-token match, key and ``=``, as the in-context maps' ``d ->``); ``adjacent`` writes
``kv m7 b9 u2 ; u`` -> ``2`` (value token right after its key, the query key the last token);
``spaced`` writes ``kv m 7 b 9 u 2 ; u`` -> `` 2``, which with today's tokenizer is ``Ġm Ġ 7``
again, and with ``--digit-tokens`` (`` 0``..`` 9`` added as single tokens to lm-base's
tokenizer, every other id unchanged) is ``Ġm ␣7``: an offset-1 look-up. ``--family lettermap``
or ``digitmap`` trains an in-context map instead (contexts of 1-6 demonstrations at one symbol,
the loss on every answer; exact match of the query after 4 and after 8 demonstrations), in
``today``'s ``map d -> q`` or ``adjacent``'s ``map d q``. ``--seed`` draws another init and data.
Findings (docs/zoo-lessons.md): no surface leaves the plateau with one answer a row;
with eight (``--queries 8``) ``adjacent`` does, ``today`` does not, at 1500 steps.

    python benchmarks/kv_isolated.py --lr 1e-3 --layers 4 --steps 1500
    python benchmarks/kv_isolated.py --surface adjacent --queries 8 --steps 1500   # 0.86, 0.90
    python benchmarks/kv_isolated.py --family lettermap --surface adjacent --steps 1500
"""
from __future__ import annotations

import argparse
import random
import time

import torch
from tokenizers import AddedToken
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from workbench.cache import shipped_root
from workbench.data import tasks
from workbench.models.recipes import RECIPES

SYMBOLS = "abcdefghijklmnopqrstuvwxyz0123456789"
# kv surfaces: (one pair, the question, the answer); the context is "kv " + pairs joined by " "
SURFACES = {
    "today": ("{k}={v}", " ; {k}?", " {v}"),
    "eq": ("{k}={v}", " ; {k}=", "{v}"),
    "adjacent": ("{k}{v}", " ; {k}", "{v}"),
    "spaced": ("{k} {v}", " ; {k}", " {v}"),
}
MAP_ARROW = {"today": " ->", "adjacent": ""}     # in-context maps: "map d -> q" or "map d q"


def kv_example(e, surface, rng, queries):
    """``(context, [(question, answer), ...])`` of a registry kv example in ``surface``: its own
    question first, then ``queries - 1`` keys of the same context drawn with ``rng``."""
    pair, ask, ans = SURFACES[surface]
    pairs = [kv.split("=") for kv in e.prompt.split(" ; ")[0].split()[1:]]
    asked = [pairs[[k for k, _ in pairs].index(e.prompt.split(" ; ")[1][:-1])]] + [
        rng.choice(pairs) for _ in range(queries - 1)]
    context = "kv " + " ".join(pair.format(k=k, v=v) for k, v in pairs)
    return context, [(ask.format(k=k), ans.format(v=v)) for k, v in asked]


def map_line(e, surface):
    """``(prompt, answer)`` of an in-context map example in ``surface``."""
    return e.prompt[: -len(" ->")] + MAP_ARROW[surface], " " + e.target


def encode(tok, context, qa):
    """ids and labels of ``<bos> context q1 a1 q2 a2 ...``: the loss on the answers only."""
    ids = [tok.bos_token_id] + tok(context)["input_ids"]
    lab = [-100] * len(ids)
    for q, v in qa:
        qi, vi = tok(q)["input_ids"], tok(v)["input_ids"]
        ids, lab = ids + qi + vi, lab + [-100] * len(qi) + vi
    return ids, lab


def rows(tok, rng, n, a):
    """``n`` training rows: (ids, labels), labels -100 except on the answers."""
    out = []
    for _ in range(n):
        if rng.random() < a.repeat_share:
            seq = " ".join(rng.choice(SYMBOLS) for _ in range(rng.randint(4, 16)))
            b = tok(" " + seq)["input_ids"]
            out.append(encode(tok, "rep " + seq + " ;", []))
            out[-1] = (out[-1][0] + b, out[-1][1] + b)
        elif a.family == "kv":
            e = tasks.generate("kv", 1, seed=rng.randrange(10**9),
                               difficulty=rng.choice((2, 3, 4, 5)))[0]
            out.append(encode(tok, *kv_example(e, a.surface, rng, a.queries)))
        else:                       # an in-context map: 1-6 demonstrations and a query, one rule
            ctx = tasks.get(a.family).context(rng, rng.randint(1, 6), difficulty=1)
            lines = [map_line(e, a.surface) for e in ctx]
            qa = [("", lines[0][1])] + [("\n" + p, v) for p, v in lines[1:]]
            out.append(encode(tok, lines[0][0], qa))
    width = max(len(i) for i, _ in out)
    pad = tok.pad_token_id
    return (torch.tensor([i + [pad] * (width - len(i)) for i, _ in out]),
            torch.tensor([la + [-100] * (width - len(la)) for _, la in out]))


def held_out(a, shots):
    """``(context, question, answer)`` triples: 200 prompts never drawn by ``rows``' seeds."""
    if a.family == "kv":
        rng = random.Random(1)
        return [(c, *qa[0]) for c, qa in (kv_example(e, a.surface, rng, 1) for e in
                                           tasks.generate("kv", 200, seed=99_999, difficulty=4))]
    out = []
    for ctx in tasks.contexts(a.family, 200, shots, seed=99_999, difficulty=1):
        lines = [map_line(e, a.surface) for e in ctx]
        out.append(("\n".join(p + v for p, v in lines[:-1]) + "\n", *lines[-1]))
    return out


def accuracy(model, tok, items):
    """Greedy exact match of the answer's last token, its earlier tokens (today's lone space
    before a digit) given: the answer of every surface and family here ends in one symbol token."""
    model.eval()
    ok = 0
    with torch.no_grad():
        for context, q, v in items:
            ids, lab = encode(tok, context, [(q, v)])
            want = lab[-1]
            nxt = model(torch.tensor([ids[:-1]])).logits[0, -1].argmax().item()
            ok += nxt == want
    model.train()
    return ok / len(items)


def load_tokenizer(digit_tokens: bool):
    key = RECIPES["lm-base"].key("smoke")
    tok = PreTrainedTokenizerFast.from_pretrained(shipped_root() / f"lm-base-smoke-{key}")
    if digit_tokens:            # " 0".." 9" as single tokens; ids 0..511 keep their meaning
        tok.add_tokens([AddedToken(f" {d}", normalized=False) for d in "0123456789"])
    return tok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--queries", type=int, default=1)
    ap.add_argument("--repeat-share", type=float, default=0.0)
    ap.add_argument("--family", choices=("kv", "lettermap", "digitmap"), default="kv")
    ap.add_argument("--surface", choices=tuple(SURFACES), default="today")
    ap.add_argument("--digit-tokens", action="store_true")
    ap.add_argument("--seed", type=int, default=0, help="the model's init and the training draws")
    a = ap.parse_args()
    if a.family != "kv" and a.surface not in MAP_ARROW:
        ap.error(f"--family {a.family} takes --surface {' or '.join(MAP_ARROW)}")
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    tok = load_tokenizer(a.digit_tokens)
    evals = {"kv@4": held_out(a, 4)} if a.family == "kv" else {
        f"{a.family}@{s}shots": held_out(a, s) for s in (4, 8)}
    c, q, v = evals[next(iter(evals))][0]
    print("held-out item:", repr(c + q), "->", repr(v), tok.convert_ids_to_tokens(
        encode(tok, c, [(q, v)])[0][1:]), flush=True)
    d = a.d_model
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=d, intermediate_size=3 * d, num_hidden_layers=a.layers, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=True,
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng, t0 = random.Random(a.seed), time.time()
    for step in range(a.steps):
        x, y = rows(tok, rng, a.batch, a)
        loss = model(input_ids=x, labels=y).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 250 == 0 or step == a.steps - 1:
            accs = "  ".join(f"{k} {accuracy(model, tok, it):.3f}" for k, it in evals.items())
            print(f"step {step}  loss {loss.item():.3f}  {accs}  {time.time() - t0:.0f} s",
                  flush=True)


if __name__ == "__main__":
    main()
