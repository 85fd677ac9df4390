"""Forward time of a model of :class:`~workbench.quant.QuantLinear` layers with and without the
dequantized-weight cache.

Before the cache, every forward of a ``QuantLinear`` rebuilt ``scale * (codes - zero)`` for the
whole weight. The model is the zoo's ``lm-tiny`` shape (a Llama, width 128, 4 blocks, FF 384,
vocabulary 512) with random weights, every block linear an RTN ``QuantLinear``; a batch of
(16, 64) tokens under ``torch.no_grad`` (what a perplexity evaluation or a zeroth-order probe
runs). "uncached" sets ``QuantLinear.use_cache = False``: every forward dequantizes, the old
behaviour. Runs alternate between the two so machine load falls on both alike. Usage:

    python benchmarks/quantlinear_cache.py --reps 30 --threads 1 [--d 128 --layers 4]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(d: int, layers: int, ff: int, vocab: int, bits: int, group: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from workbench.quant import QuantLinear, block_linears
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=d, intermediate_size=ff,
                                         num_hidden_layers=layers, num_attention_heads=4,
                                         num_key_value_heads=4, vocab_size=vocab,
                                         max_position_embeddings=64,
                                         tie_word_embeddings=True)).eval()
    mods = dict(model.named_modules())
    for name, lin in block_linears(model).items():
        parent, attr = name.rsplit(".", 1)
        setattr(mods[parent], attr, QuantLinear.from_linear(lin, bits, group))
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--ff", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from workbench.quant import QuantLinear
    model = build(args.d, args.layers, args.ff, 512, 4, 32)
    qls = [m for m in model.modules() if isinstance(m, QuantLinear)]
    x = torch.randint(0, 512, (args.batch, args.ctx), generator=torch.Generator().manual_seed(1))

    def uncached(on: bool):
        QuantLinear.use_cache = not on

    def forward() -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model(input_ids=x)
        return time.perf_counter() - t

    with torch.no_grad():
        ref = model(input_ids=x).logits
    uncached(True)
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, ref), "the cache changed the output"
    times = {"uncached": [], "cached": []}
    for _ in range(3):                              # warm-up, both ways
        for mode in times:
            uncached(mode == "uncached")
            forward()
    for r in range(args.reps):
        order = list(times) if r % 2 == 0 else list(reversed(times))
        for mode in order:
            uncached(mode == "uncached")
            times[mode].append(forward())
    uncached(False)
    deq = []
    for _ in range(args.reps):                      # the dequantization alone, all layers
        t = time.perf_counter()
        with torch.no_grad():
            for m in qls:
                m.dequantized()
        deq.append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{len(qls)} QuantLinear layers, batch {args.batch} x {args.ctx} tokens, "
          f"{args.threads} thread(s), {args.reps} alternating reps (median)")
    print(f"uncached forward {med['uncached'] * 1e3:7.2f} ms")
    print(f"cached forward   {med['cached'] * 1e3:7.2f} ms")
    print(f"dequantization of every layer alone {statistics.median(deq) * 1e3:.2f} ms")
    print(f"saving {100 * (1 - med['cached'] / med['uncached']):.1f}% of the forward time")


if __name__ == "__main__":
    main()
