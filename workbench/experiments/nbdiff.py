"""The experiments of notebook 19 (NBDIFF: adapting an autoregressive LM into a block-diffusion
LM, :mod:`workbench.methods.nbdiff`).

The mask checks of C1 (a table over block sizes and prompt offsets, and the 4D mask through the
zoo's Llama), the training, validation and test problems and corpus rows, the three adaptation
paths of C3 trained once per seed and learning rate and cached (:func:`workbench.cache.build`),
each path's rate selected on the validation problems (:func:`lr_sweep`), C3's per-item scores
and paired intervals, the one-pass vs two-pass loss of C2, task accuracy of a decoder, and the
parallel-decoding grid of C4 (ours: a fixed number of tokens a pass, no cache; the reference's:
confidence threshold, causal first token, KV cache) and tokens per second of the reference
decoder against the AR model's cached ``generate``, like for like, timed in interleaved rounds
with the FLOP and byte counts beside them (:mod:`workbench.costs`); for the explorer, one
problem decoded with the pass that wrote each token, drawn under its block mask.
"""
from __future__ import annotations

import time

import numpy as np
import pandas as pd
import torch
from transformers import AutoModelForCausalLM

from .. import cache, costs, diagnostics, evaluate, plots, sweep
from ..data import corpus, tasks
from ..methods import nbdiff as nd
from ..models import zoo

__all__ = ["GROUP", "mask_table", "mask_reaches_model", "problems", "training_rows",
           "SETTINGS", "adapted", "adapt_all", "lr_sweep", "one_vs_two_pass", "prompt_ids",
           "item_accuracy", "accuracy", "path_scores", "c3_intervals", "parallel_grid",
           "ar_baseline", "threshold_grid", "ar_generate", "speed_compare", "speed_counts",
           "decode_sample", "sample_figure"]

GROUP = "nbdiff"        # cache.folder("nbdiff"): the adapted models
SETTINGS = ("n_corpus", "steps", "batch", "lr", "ar_weight", "final_block", "ctx")  # in the key


# -- C1: the masks ------------------------------------------------------------------------------

def mask_table(n: int = 24, sizes=(1, 2, 3, 4, 8), starts=(0, 5)) -> pd.DataFrame:
    """For each block size and prompt offset: whether the block mask equals the causal mask,
    keeps every causal link, how many links it adds, and whether they all lie inside a block."""
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    rows = {}
    for size in sizes:
        for start in starts:
            ids = nd.block_ids(n, size, start)
            m = nd.block_mask(ids)
            extra = (m & ~causal).nonzero()
            rows[(size, start)] = {
                "equals_causal": bool(torch.equal(m, causal)),
                "keeps_causal": bool(torch.equal(m | causal, m)),
                "extra_links": len(extra),
                "extra_inside_blocks": bool(all(ids[i] == ids[j] for i, j in extra.tolist()))}
    return pd.DataFrame(rows).T


def mask_reaches_model(model, x: torch.Tensor, ctx: int) -> dict:
    """The largest logit change when ``model`` gets the block mask as a 4D additive
    ``attention_mask`` instead of its default causal one: at block size 1 (should be 0) and at
    block size 4 (should not)."""
    def with_mask(size):
        mask = nd.additive(nd.block_mask(nd.block_ids(ctx, size))).to(x.device)
        return model(input_ids=x, attention_mask=mask.expand(len(x), -1, -1, -1)).logits

    with torch.no_grad():
        ref = model(input_ids=x).logits
        via4d, blk4d = with_mask(1), with_mask(4)
    return {"max_diff_causal_4d": float((ref - via4d).abs().max()),
            "max_diff_block4_4d": float((ref - blk4d).abs().max())}


# -- the data and the three adaptation paths ------------------------------------------------------

def problems(families, n_train: int, n_test: int, seed: int,
             n_val: int = 0) -> tuple[list, list, list]:
    """Training, validation and held-out problems: per family and difficulty, ``n_train``
    (``n_val``, ``n_test``) divided over the difficulties, with one numpy generator seeded
    ``seed``. Training and validation problems come from the task's train split (validation: the
    next ones of the same permutation, so the training problems do not depend on ``n_val``; a
    difficulty whose split is used up gives fewer), test problems from its test split."""
    rng = np.random.default_rng(seed)
    train, val, test = [], [], []
    for f in families:
        diffs = tasks.get(f).difficulties
        for d in diffs:
            tr, te = tasks.problem_split(f, d)
            k, order = max(1, n_train // len(diffs)), rng.permutation(len(tr))
            train += [tr[i] for i in order[:k]]
            val += [tr[i] for i in order[k:k + n_val // len(diffs)]]
            test += [te[i] for i in rng.permutation(len(te))[:max(1, n_test // len(diffs))]]
    return train, val, test


def training_rows(tok, train, ctx: int, n_corpus: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x0, start)``: the problems as rows (:func:`~workbench.methods.nbdiff.task_rows`), then
    ``n_corpus`` corpus text rows (all but ``<bos>`` noised), so the adapted model keeps its text
    and the diffusion bound means something."""
    x0, start = nd.task_rows(tok, train, ctx)
    text = corpus.blocks(tok, corpus.train_text(), ctx, max_blocks=n_corpus)
    return torch.cat([x0, text]), torch.cat([start, torch.ones(len(text), dtype=torch.long)])


def adapted(base: str, zoo_scale: str, path: str, x0, start, S: dict, seed: int, train,
            device: str):
    """The zoo model ``base`` adapted along ``path`` (:func:`~workbench.methods.nbdiff.adapt`,
    full fine-tuning) on ``(x0, start)``, trained once and cached, keyed by the base model's
    key, the path, the sizes in :data:`SETTINGS`, the seed and the training prompts. Returns
    ``(model in eval mode, every step's loss, whether it came from the cache)``."""
    settings = {k: S[k] for k in SETTINGS}
    key = cache.key(zoo.key(base, zoo_scale), path, settings, seed, [e.prompt for e in train])
    where = cache.folder(GROUP) / f"{path}-{zoo.label(base)}-{zoo.zoo_scale(zoo_scale)}-{key}"
    cached = cache.is_built(where)

    def build(tmp):
        m, t = zoo.load(base, zoo_scale, device=device)
        mid = nd.add_mask_token(m, t)
        t0 = time.time()
        losses = nd.adapt(m, x0, start, path, S["steps"], S["final_block"], mid, S["lr"],
                          S["batch"], S["ar_weight"], seed)
        m.cpu().save_pretrained(tmp / "model")
        t.save_pretrained(tmp / "model")
        np.save(tmp / "losses.npy", np.array(losses))
        return {"train_seconds": round(time.time() - t0, 1)}

    cache.build(where, build)
    m = AutoModelForCausalLM.from_pretrained(where / "model").to(device).eval()
    return m, np.load(where / "losses.npy"), cached


def adapt_all(base: str, zoo_scale: str, x0, start, S: dict, *, seed: int, train, device: str,
              lrs: dict):
    """Every path of :data:`~workbench.methods.nbdiff.PATHS`, in order, through :func:`adapted`,
    each at its learning rate ``lrs[path]``. Returns ``(models, losses, cached)``, each by path."""
    models, losses, cached = {}, {}, {}
    for path in nd.PATHS:
        models[path], losses[path], cached[path] = adapted(
            base, zoo_scale, path, x0, start, {**S, "lr": lrs[path]}, seed, train, device)
    return models, losses, cached


def lr_sweep(base: str, zoo_scale: str, x0, start, S: dict, *, seed: int, train, val, tok,
             mask_id: int, device: str, grid) -> sweep.Sweep:
    """Every path on the same learning-rate ``grid`` (:func:`workbench.sweep.sweep`): each
    fine-tune through :func:`adapted` (cached), scored on the validation problems ``val``
    (``val_accuracy``: decoding at the final block size, one token a pass, as C3 judges) and by
    its last 20 steps' training loss; each path's rate is selected on ``val_accuracy`` (ties to
    the lower rate), never on the test problems. The scores are kept in the sweep's cache."""
    prompts = prompt_ids(tok, val)

    def run(path, lr):
        m, losses, _ = adapted(base, zoo_scale, path, x0, start, {**S, "lr": lr}, seed, train,
                               device)
        acc, _ = accuracy(m, tok, prompts, val, S["gen_len"], S["final_block"], 1, mask_id,
                          path == "nbdiff")
        return {"val_accuracy": acc, "final_loss": float(np.mean(losses[-20:]))}

    settings = {k: S[k] for k in SETTINGS if k != "lr"}
    where = cache.folder(GROUP) / ("sweep-" + cache.key(
        zoo.key(base, zoo_scale), settings, S["gen_len"], seed,
        [e.prompt for e in train], [e.prompt for e in val]))
    return sweep.sweep(run, list(nd.PATHS), sorted(grid), "val_accuracy", cache_dir=where,
                       desc="learning-rate sweep")


# -- C2: one pass against two --------------------------------------------------------------------

def one_vs_two_pass(models: dict, x0, start, *, ctx: int, size: int, mask_id: int,
                    seed: int) -> pd.DataFrame:
    """The diffusion loss of the one-pass ``[x_t ; x_0]`` formulation and of the two-pass
    reference on the same noise (one generator seeded ``seed``), for the context-causal clean copy
    (the nbdiff model) and the block-causal one (the direct model)."""
    g = torch.Generator().manual_seed(seed)
    rows = {}
    for cc, m in (("context-causal", models["nbdiff"]), ("block-causal", models["direct"])):
        ids = torch.stack([nd.block_ids(ctx, size, int(s)) for s in start])
        noisable = ids >= 0
        xt, masked, p = nd.noise(x0, ids, noisable, mask_id, g)
        pos = torch.arange(ctx).expand(len(x0), -1)
        with torch.no_grad():
            a, _ = nd.one_pass(m, x0, xt, ids, pos, cc == "context-causal")
            b, _ = nd.two_pass(m, x0, xt, ids, pos, cc == "context-causal")
        la = float(nd.diffusion_loss(a.cpu(), x0, masked, p, noisable))
        lb = float(nd.diffusion_loss(b.cpu(), x0, masked, p, noisable))
        rows[cc] = {"one_pass": la, "two_pass": lb, "abs_diff": abs(la - lb)}
    return pd.DataFrame(rows).T


# -- C3, C4: decoding ------------------------------------------------------------------------------

def prompt_ids(tok, examples) -> list[list[int]]:
    """``<bos>`` and each example's prompt tokens."""
    return [[tok.bos_token_id] + tok(e.prompt, add_special_tokens=False).input_ids for e in examples]


def item_accuracy(model, tok, prompts, examples, gen_len: int, size: int, per_pass: int,
                  mask_id: int, context_causal: bool) -> tuple[np.ndarray, int]:
    """Per-example exact match (0/1) of block-diffusion decoding
    (:func:`~workbench.methods.nbdiff.decode`, the first line of each completion) on
    ``examples``, and the forward passes it took."""
    out, passes = nd.decode(model, prompts, gen_len, size, per_pass, mask_id, context_causal,
                            tok.pad_token_id)
    comps = [tok.decode(o, skip_special_tokens=True).split("\n")[0] for o in out]
    return np.array([float(tasks.score(e, c)) for e, c in zip(examples, comps)]), passes


def accuracy(model, tok, prompts, examples, gen_len: int, size: int, per_pass: int, mask_id: int,
             context_causal: bool) -> tuple[float, int]:
    """The mean of :func:`item_accuracy`, and the forward passes it took."""
    items, passes = item_accuracy(model, tok, prompts, examples, gen_len, size, per_pass, mask_id,
                                  context_causal)
    return float(items.mean()), passes


def path_scores(models: dict, tok, prompts, examples, held, S: dict, *, mask_id: int,
                seed: int) -> dict:
    """C3's scores per path, on the same items for every path: ``items``, the exact match of each
    test problem (final block size, one token a pass), and ``rows``, the diffusion bound per
    token of each held-out corpus row (:func:`~workbench.methods.nbdiff.nelbo_rows`, the same
    noise draws for every path)."""
    out = {}
    for path, m in models.items():
        cc = path == "nbdiff"
        items, _ = item_accuracy(m, tok, prompts, examples, S["gen_len"], S["final_block"], 1,
                                 mask_id, cc)
        tot, cnt = nd.nelbo_rows(m, held, torch.ones(len(held), dtype=torch.long),
                                 S["final_block"], mask_id, cc, S["nelbo_draws"], seed)
        out[path] = {"items": items, "rows": (tot / cnt).numpy()}
    return out


def c3_intervals(scores: dict, method: str = "nbdiff", seed: int = 0) -> pd.DataFrame:
    """Paired bootstrap intervals (:func:`workbench.diagnostics.paired_table`) of ``method``
    against each other path, oriented so that ``method`` is better where low > 0: accuracy
    ``method`` minus rival over the test problems, diffusion bound rival minus ``method`` over
    the held-out rows."""
    pairs = {}
    for rival in (p for p in scores if p != method):
        pairs[f"accuracy: {method} - {rival}"] = (scores[method]["items"], scores[rival]["items"])
        pairs[f"nelbo: {rival} - {method}"] = (scores[rival]["rows"], scores[method]["rows"])
    return diagnostics.paired_table(pairs, seed=seed)


def parallel_grid(model, tok, prompts, examples, *, gen_len: int, mask_id: int,
                  sizes=(1, 2, 4, 8)) -> pd.DataFrame:
    """Context-causal decoding at each block size with one token per pass and with the whole
    block in one pass: accuracy, tokens per forward pass and tokens per second (wall)."""
    rows = {}
    for size in sizes:
        for per_pass in sorted({1, size}):
            t0 = time.time()
            acc, passes = accuracy(model, tok, prompts, examples, gen_len, size, per_pass, mask_id,
                                   True)
            dt = time.time() - t0
            rows[(size, per_pass)] = {"accuracy": acc, "tokens_per_pass": gen_len / passes,
                                      "tokens_per_s": len(prompts) * gen_len / dt}
    return pd.DataFrame(rows).T


def ar_baseline(model, tok, examples, gen_len: int) -> tuple[float, float]:
    """The AR model's greedy ``generate`` (KV cache) on the same prompts: exact match and tokens
    per second, counting ``gen_len`` tokens per prompt (an upper bound)."""
    t0 = time.time()
    comps = evaluate.generate(model, tok, [e.prompt for e in examples], gen_len)
    dt = time.time() - t0
    acc = float(np.mean([tasks.score(e, c.split("\n")[0]) for e, c in zip(examples, comps)]))
    return acc, len(examples) * gen_len / dt


def threshold_grid(model, tok, prompts, examples, *, gen_len: int, mask_id: int, sizes=(1, 2, 4, 8),
                   threshold: float = 0.9) -> pd.DataFrame:
    """The reference decoder (:func:`~workbench.methods.nbdiff.decode_threshold`, KV cache) at
    each block size: accuracy (first line of each completion), tokens per forward pass (the
    prefill and the storing passes counted) and the passes."""
    rows = {}
    for size in sizes:
        out, passes = nd.decode_threshold(model, prompts, gen_len, size, mask_id, threshold,
                                          True, tok.pad_token_id)
        comps = [tok.decode(o, skip_special_tokens=True).split("\n")[0] for o in out]
        rows[size] = {"accuracy": float(np.mean([tasks.score(e, c) for e, c in zip(examples, comps)])),
                      "tokens_per_pass": gen_len / passes, "passes": passes}
    return pd.DataFrame(rows).T.rename_axis("block")


def ar_generate(model, tok, prompts, gen_len: int) -> torch.Tensor:
    """The AR model's greedy ``generate`` with its KV cache on the left-padded ``prompts`` (token
    ids), exactly ``gen_len`` new tokens each (no early stop, as the diffusion decoder)."""
    dev = next(model.parameters()).device
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (L - len(p)) + p for p in prompts])
    att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev), do_sample=False,
                             max_new_tokens=gen_len, min_new_tokens=gen_len, use_cache=True,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return out[:, L:]


def _decoders(ar, model, tok, prompts, gen_len: int, size: int, mask_id: int,
              threshold: float) -> dict:
    """C4's two decoders as callables on the same prompts: the AR model's cached
    :func:`ar_generate` and the reference decoder with its cache at block ``size``."""
    return {"AR generate": lambda: ar_generate(ar, tok, prompts, gen_len),
            "diffusion": lambda: nd.decode_threshold(model, prompts, gen_len, size, mask_id,
                                                     threshold, True, tok.pad_token_id)}


def speed_compare(ar, model, tok, prompts, *, gen_len: int, size: int, mask_id: int,
                  threshold: float = 0.9, repeats: int = 7) -> pd.DataFrame:
    """Tokens per second, like for like: the two decoders of :func:`_decoders` on the same
    prompts in one batch, the same ``gen_len`` tokens each, timed in ``repeats`` interleaved
    rounds (:func:`workbench.costs.interleaved`: ABBA, after an untimed warm-up of each). One
    row per round: both rates and their ratio (diffusion / AR)."""
    t = costs.interleaved(_decoders(ar, model, tok, prompts, gen_len, size, mask_id, threshold),
                          repeats)
    rate = len(prompts) * gen_len / t
    return pd.DataFrame({"ar_tokens_per_s": rate["AR generate"],
                         "diffusion_tokens_per_s": rate["diffusion"],
                         "ratio": rate["diffusion"] / rate["AR generate"]})


def speed_counts(ar, model, tok, prompts, *, gen_len: int, size: int, mask_id: int,
                 threshold: float = 0.9) -> pd.DataFrame:
    """The counts no load can move, per generated token, for one run of each decoder of
    :func:`_decoders`: floating-point operations (:func:`workbench.costs.flops`: matrix products
    and attention) and bytes read and written (:func:`workbench.costs.bytes_moved`)."""
    dec = _decoders(ar, model, tok, prompts, gen_len, size, mask_id, threshold)
    n = len(prompts) * gen_len
    return pd.DataFrame({name: {"flops_per_token": costs.flops(f) / n,
                                "bytes_per_token": costs.bytes_moved(f) / n}
                         for name, f in dec.items()}).T


# -- the explorer: one problem decoded, under its mask ---------------------------------------------

class _Passes(torch.nn.Module):
    """``model`` as :func:`~workbench.methods.nbdiff.decode` calls it, keeping each pass's input."""

    def __init__(self, model):
        super().__init__()
        self.model, self.inputs = model, []

    def forward(self, input_ids, **kw):
        self.inputs.append(input_ids[0].detach().cpu().clone())   # decode fills x in place
        return self.model(input_ids=input_ids, **kw)


def decode_sample(model, tok, example, *, gen_len: int, size: int, per_pass: int,
                  mask_id: int) -> dict:
    """One problem decoded context-causally at block ``size``, ``per_pass`` tokens a pass: the
    prompt's and the output's tokens, the pass (1, 2, ...) that wrote each output token, the
    completion (first line), whether it scores and the number of passes."""
    prompt = prompt_ids(tok, [example])
    rec = _Passes(model)
    out, passes = nd.decode(rec, prompt, gen_len, size, per_pass, mask_id, True, tok.pad_token_id)
    L, written = len(prompt[0]), torch.zeros(gen_len, dtype=torch.long)
    for k, x in enumerate(rec.inputs[1:], start=1):         # pass k's input shows passes < k+1
        new = (x[L:] != mask_id) & (written[:len(x) - L] == 0)
        written[:len(x) - L][new] = k
    written[written == 0] = passes                          # the last pass's tokens
    completion = tok.decode(out[0], skip_special_tokens=True).split("\n")[0]
    return {"prompt": tok.convert_ids_to_tokens(prompt[0]), "output": tok.convert_ids_to_tokens(
        out[0].tolist()), "written_in_pass": written.tolist(), "completion": completion,
        "target": example.target, "correct": bool(tasks.score(example, completion)),
        "passes": passes}


def sample_figure(sample: dict, size: int, accuracy: float | None = None):
    """The decoding mask at block ``size`` over the prompt and the output of
    :func:`decode_sample` (dark: the query sees the key; lines: block edges), and the output
    tokens coloured by the pass that wrote them (one colour a block when a block takes one pass)."""
    toks = [t[1:-1] if t.startswith("<") and t.endswith(">") else t.replace("\u0120", "_")
            for t in sample["prompt"] + sample["output"]]
    L, n = len(sample["prompt"]), len(toks)
    fig, (ax, strip) = plots.subplots(2, 1, figsize=(5.6, 6.4), height_ratios=[n, 2.5])
    ax.imshow(nd.block_mask(nd.block_ids(n, size, L)).numpy(), cmap="Greys", vmin=0, vmax=1.3)
    for b in range(L, n + 1, size):
        ax.axvline(b - 0.5, color=plots.PALETTE[1], lw=0.6)
        ax.axhline(b - 0.5, color=plots.PALETTE[1], lw=0.6)
    ax.set_xticks(range(n), toks, rotation=90, fontsize=7)
    ax.set_yticks(range(n), toks, fontsize=7)
    acc = "" if accuracy is None else f"; accuracy on all problems {accuracy:.2f}"
    ax.set(xlabel="key (prompt | output)", ylabel="query", title=f"block size {size}: "
           f"{sample['passes']} forward passes{acc}")
    strip.imshow([sample["written_in_pass"]], cmap="viridis", aspect="auto")
    for i, (t, k) in enumerate(zip(toks[L:], sample["written_in_pass"])):
        strip.text(i, 0, f"{t}\n{k}", ha="center", va="center", fontsize=7, color="w")
    verdict = "right" if sample["correct"] else "wrong"
    strip.set(yticks=[], xlabel="output position (token, the pass that wrote it)",
              title=f"decoded {sample['completion'].strip()!r}, target {sample['target']!r}: {verdict}")
    ax.grid(False)
    strip.grid(False)
    return fig
