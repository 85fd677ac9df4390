"""Zoo training throughput against the machine's matmul speed.

Prints, for the zoo's layer shapes, the fp32 matmul GFLOP/s (forward + backward: three matmuls
per linear) on the chosen threads, and for each training loop configuration its tokens/s and
achieved GFLOP/s = (6 * matmul parameters + attention) * tokens/s, as a share of the matmul
figure. Every figure is the median of ``--reps`` repeats (the machine is shared: medians, and the
best repeat beside them).

    python benchmarks/zoo_throughput.py [--reps 5] [--steps 8] [--compile] [--invariance] [--write]

``--invariance`` trains each architecture (Llama, GPT-2, Qwen2) 15 steps on 1 and on 2 threads
and prints the largest weight difference (0.0: the thread count does not change the build).
With ``--write`` what it prints becomes the section ``zoo-throughput`` (``zoo-invariance``) of
docs/benchmarks.md (``page.py``), where the measured figures are.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import replace

import torch

import page
from workbench.data import corpus
from workbench.models import zoo
from workbench.models import training


def matmul_gflops(tokens: int, d: int, d_ff: int, threads: int, reps: int) -> tuple[float, float]:
    """GFLOP/s of y = x W^T with its two backward matmuls, at (tokens, d) x (d, d_ff)."""
    torch.set_num_threads(threads)
    x, w, gy = torch.randn(tokens, d), torch.randn(d_ff, d), torch.randn(tokens, d_ff)
    flops = 3 * 2 * tokens * d * d_ff
    ts = []
    for _ in range(reps + 2):
        t = time.perf_counter()
        for _ in range(5):
            x @ w.t()
            gy.t() @ x          # dW
            gy @ w              # dX
        ts.append((time.perf_counter() - t) / 5)
    ts = ts[2:]
    return flops / statistics.median(ts) / 1e9, flops / min(ts) / 1e9


def step_flops(model, s) -> float:
    """Training FLOPs per token: 6 x (block + head matmul parameters) + attention (12 L ctx d)."""
    n = sum(p.numel() for name, p in model.named_parameters()
            if p.dim() == 2 and "embed" not in name and "wte" not in name and "wpe" not in name)
    n += model.get_output_embeddings().weight.numel()      # the head's matmul (tied or not)
    return 6 * n + 12 * s.n_layers * s.ctx * s.d_model


def training_data(recipe, s):
    """The tokenizer, prose token ids and packed task rows a build of ``recipe`` trains on."""
    tok = corpus.train_tokenizer(s.vocab, extra_text=corpus.task_lines(zoo.ALL_FAMILIES, 100, 2, True))
    text_ids = torch.tensor(corpus.encode_documents(tok, corpus.train_text()), dtype=torch.long)
    task_x, task_y = training.task_rows(recipe, s, tok)
    return tok, text_ids, task_x, task_y


def loop_tps(recipe, s, threads: int, steps: int, reps: int, compile_: bool = False):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    tok, text_ids, task_x, task_y = training_data(recipe, s)
    model = training.make_model(recipe.arch, s, tok)
    if compile_:
        model = torch.compile(model)
    opt, sched = training.optimizer(model, s)
    loop = training.LOOPS[recipe.loop]
    args = (model, opt, sched, text_ids, task_x, task_y, recipe, s, tok.pad_token_id, "cpu")
    loop = functools.partial(loop, bos_id=tok.bos_token_id)   # loop v3: per-example positions
    loop(*args, steps=3, desc="warm-up")
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        _, tokens = loop(*args, steps=steps, desc="bench")
        rates.append(tokens / (time.perf_counter() - t))
    base = model._orig_mod if compile_ else model
    return statistics.median(rates), max(rates), step_flops(base, s)


def invariance(names=("lm-base", "lm-qwen2", "lm-gpt2"), steps: int = 15):
    """Largest weight difference between a 1-thread and a 2-thread run of ``steps`` steps."""
    out = {}
    for name in names:
        r = zoo.RECIPES[name]
        s = replace(r.smoke, steps=steps)
        tok, text_ids, task_x, task_y = training_data(r, s)   # the same for both runs
        states = []
        for th in (1, 2):
            torch.set_num_threads(th)
            torch.manual_seed(r.seed)
            model = training.make_model(r.arch, s, tok)
            opt, sched = training.optimizer(model, s)
            training.LOOPS[r.loop](model, opt, sched, text_ids, task_x, task_y, r, s, tok.pad_token_id,
                              "cpu", desc="invariance", bos_id=tok.bos_token_id)
            states.append(model.state_dict())
        out[name] = max(float((states[0][k] - states[1][k]).abs().max()) for k in states[0])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (slow start)")
    ap.add_argument("--invariance", action="store_true",
                    help="only check that 1 and 2 threads build the same weights")
    ap.add_argument("--write", action="store_true", help="make it docs/benchmarks.md's section")
    a = ap.parse_args()
    with page.recorded("zoo-invariance" if a.invariance else "zoo-throughput", a.write):
        measure(a)


def measure(a) -> None:
    """Print the matmul rates, then each loop's tokens/s against them (or the invariance)."""
    import os
    os.environ.setdefault("WORKBENCH_PROGRESS", "0")
    if a.invariance:
        for name, d in invariance().items():
            print(f"{name}: largest weight difference, 1 vs 2 threads: {d:.3g}")
        return
    tiny = zoo.RECIPES["lm-tiny"]
    base = zoo.RECIPES["lm-base"]
    configs = [("lm-tiny loop v1 (16x64, 1 thread)", tiny, tiny.smoke, 1, False),
               ("lm-tiny loop v1 (16x64, 2 threads)", tiny, tiny.smoke, 2, False),
               ("lm-tiny sizes, loop v2 (16x64, 1 thread)", replace(tiny, loop="v2"), tiny.smoke, 1, False),
               ("lm-base sizes, loop v2, 1 thread", replace(base, loop="v2"), base.smoke, 1, False),
               (f"lm-base loop {base.loop}, 1 thread", base, base.smoke, 1, False),
               (f"lm-base loop {base.loop}, 2 threads", base, base.smoke, 2, False)]
    if a.compile:
        configs.append((f"lm-base loop {base.loop}, 2 threads, torch.compile", base, base.smoke,
                        2, True))
    print(f"{'matmul (tokens x d x d_ff), threads':48s} {'GFLOP/s median':>15s} {'best':>8s}")
    peaks = {}
    for name, r, s, th, _ in configs:
        key = (s.batch * s.ctx, s.d_model, s.d_ff, th)
        if key not in peaks:
            peaks[key] = matmul_gflops(*key, a.reps)
            print(f"{str(key):48s} {peaks[key][0]:15.1f} {peaks[key][1]:8.1f}")
    print()
    print(f"{'training loop':48s} {'tokens/s':>10s} {'best':>8s} {'GFLOP/s':>8s} {'% matmul':>9s}")
    for name, r, s, th, comp in configs:
        med, best, fpt = loop_tps(r, s, th, a.steps, a.reps, comp)
        peak = peaks[(s.batch * s.ctx, s.d_model, s.d_ff, th)][0]
        print(f"{name:48s} {med:10.0f} {best:8.0f} {med * fpt / 1e9:8.1f} {100 * med * fpt / 1e9 / peak:8.0f}%")


if __name__ == "__main__":
    main()
