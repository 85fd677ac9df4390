"""The harness of notebook 07 (HiLoRA, Han et al., arXiv 2510.12266): routing over the zoo's pool.

The method (ROCs, the Gaussians, selection, allocation, the routed hooks) is
:mod:`workbench.methods.hilora`. Here is what the notebook drives around it:

- :func:`load_bed`: the zoo's LoRA pool on one base model, loaded into one ``PeftModel``, and a
  plain copy of the base carrying :class:`~workbench.methods.hilora.RocHooks` (C1 compares them,
  :func:`lora_equivalence`);
- :func:`fit_and_eval_examples`, :func:`features`: each LoRA's fitting inputs (its own training
  distribution) and the held-out evaluation prompts, as the base model's pooled features;
- :func:`selection_curve`: in-domain selection accuracy against the number of fitting inputs (C2);
- :func:`method_gates`, :func:`method_scores`, :func:`unseen_table`, :func:`budget_sweep`: HiLoRA
  against the base, uniform, single-best, top-k, Arrow, trained-router and oracle routings, each
  through the same hooks (C3);
- :func:`unseen_domains`, :func:`lorahub_shots`, :func:`lorahub_scores`: the LoraHub baseline
  (:mod:`workbench.methods.lorahub`), its weights searched per unseen domain on a few labelled
  examples; :func:`unseen_weights`, :func:`domain_accuracy`, :func:`unseen_items`,
  :func:`c3_intervals`: C3 as paired-bootstrap intervals over the same unseen prompts;
- :func:`throughput`, :func:`flops_per_token`, :func:`active_rocs`: tokens/s of routed
  generation against one ``peft`` LoRA in alternating repeats, and floating-point operations
  per generated token, on the zoo model; and which ROCs a prompt switches on;
- :func:`wide_bed`, :func:`routing_gates`, :func:`wide_cost`: the same two paths on a random Llama of realistic width
  (the pool's LoRA shapes, seeded random factors, the same hooks and the notebook's routing),
  where matrix products dominate a step as on the paper's LLMs: CPU seconds of each path in
  alternating repeats, and FLOPs per generated token (C4);
- :func:`selection_variants`, :func:`at_threshold`, :func:`threshold_curve`,
  :func:`threshold_figure`: the explorer over the selection threshold (each prompt scored once per
  number of selected LoRAs, so any threshold's accuracy is a lookup).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from sklearn.linear_model import LogisticRegression

from .. import costs, diagnostics, evaluate, plots
from ..data import tasks
from ..methods import hilora as hl
from ..methods import lorahub as lh
from ..models import adapters, zoo

__all__ = ["Bed", "load_bed", "lora_equivalence", "train_inputs", "fit_and_eval_examples",
           "features", "selection_curve", "pad_pool", "trained_router", "single_best",
           "method_gates", "longest_answer", "score", "method_scores", "unseen_domains",
           "unseen_table", "lorahub_shots", "lorahub_scores", "unseen_weights", "domain_accuracy",
           "unseen_items",
           "c3_intervals", "flops_per_token", "WideBed", "wide_bed", "routing_gates", "wide_cost",
           "budget_sweep", "throughput", "active_rocs", "summary", "selection_variants",
           "at_threshold", "threshold_curve", "threshold_figure"]

FIT_SEED = 7                # the pool's own training-data seed: fitting inputs come from it


@dataclass
class Bed:
    """The pool and the two models: ``peft_model`` carries every adapter of ``families`` (the
    routing pool first, then the held-out families' adapters, which only the oracle uses);
    ``lm`` is a plain copy of the base model with ``hooks`` on it."""
    pool: adapters.Pool
    peft_model: object
    tok: object
    lm: object
    hooks: hl.RocHooks
    pool_families: list
    families: list
    with_steps: bool

    @property
    def rank(self) -> int:
        return self.pool.card["rank"]

    @property
    def n_pool(self) -> int:
        return len(self.pool_families)

    @property
    def n_all(self) -> int:
        return len(self.families)


def load_bed(base: str, scale: str, pool_families: list, heldout: list,
             device="cpu") -> Bed:
    """The zoo's pool on ``base`` at ``scale``: every adapter of ``pool_families + heldout`` in
    one ``PeftModel``, and the plain base model with the ROC hooks of the same adapters, both
    on ``device``."""
    families = list(pool_families) + list(heldout)
    pool = adapters.adapters(base, model_scale=scale)
    peft_model, tok = pool.load(families, device=device)
    lm, _ = zoo.load(base, scale, device=device)
    hooks = hl.RocHooks(lm, [hl.lora_factors(peft_model, f) for f in families])
    return Bed(pool, peft_model, tok, lm, hooks, list(pool_families), families,
               zoo.with_steps(base))


def lora_equivalence(bed: Bed, seed: int) -> tuple[dict, float]:
    """C1: per pool LoRA, max |hooked base - peft| of the logits with that LoRA's gates fully
    open (w = 1, k = r) on a few probe prompts; and how far the last LoRA moves the logits from
    the base model's (so that a zero difference means something)."""
    probe = tasks.generate("count", 4, seed, 6) + tasks.generate("sort", 4, seed, 5)
    tok, lm = bed.tok, bed.lm
    enc = tok([tok.bos_token + e.prompt for e in probe], return_tensors="pt", padding=True,
              add_special_tokens=False).to(lm.device)
    diffs = {}
    with torch.no_grad():
        for j, f in enumerate(bed.pool_families):
            bed.peft_model.set_adapter(f)
            want = bed.peft_model(**enc).logits
            bed.hooks.set_gates(*hl.whole_gates(np.full(len(probe), j), bed.n_all, bed.rank))
            diffs[f] = float((lm(**enc).logits - want).abs().max())
        bed.hooks.off()
        base_gap = float((lm(**enc).logits - want).abs().max())
    return diffs, base_gap


def train_inputs(bed: Bed, family: str, n: int, rng: np.random.Generator) -> tuple[list, set]:
    """``n`` of the prompts ``family``'s LoRA was trained on (the pool's generator, seed 7, every
    difficulty), drawn by ``rng``; and the set of all its training prompts."""
    ds = tasks.get(family).difficulties
    per = -(-bed.pool.card["size"]["n_train"] // len(ds))
    exs = [e for d in ds for e in tasks.generate(family, per, FIT_SEED, d)]
    return [exs[i] for i in rng.choice(len(exs), n, replace=False)], {e.prompt for e in exs}


def fit_and_eval_examples(bed: Bed, n_fit: int, n_eval: int, seed: int) -> tuple[dict, dict]:
    """Per family: ``n_fit`` fitting inputs (:func:`train_inputs`, drawn with ``seed``) and
    ``n_eval`` held-out prompts at the family's middle difficulty, never among its training
    prompts."""
    rng = np.random.default_rng(seed)
    fit, evals = {}, {}
    for f in bed.families:
        fit[f], seen = train_inputs(bed, f, n_fit, rng)
        evals[f], _ = evaluate.heldout_examples(f, evaluate.MIDDLE[f], n_eval, exclude=seen,
                                                seed=2000 + seed)
    return fit, evals


def features(bed: Bed, fit: dict, evals: dict) -> tuple[dict, list, np.ndarray, torch.Tensor]:
    """The base model's pooled features of every pool LoRA's fitting inputs, and of all
    evaluation prompts: ``(fit_x, eval_examples, eval_families, eval_x)``."""
    fit_x = {f: hl.prompt_features(bed.lm, bed.tok, [e.prompt for e in fit[f]])
             for f in bed.pool_families}
    bed.hooks.off()
    eval_ex = [e for f in bed.families for e in evals[f]]
    eval_fam = np.array([e.family for e in eval_ex])
    return fit_x, eval_ex, eval_fam, hl.prompt_features(bed.lm, bed.tok, [e.prompt for e in eval_ex])


def selection_curve(fit_x: dict, eval_x, eval_fam: np.ndarray, pool_families: list, sizes, *,
                    temperature: float, threshold: float, k_max: int) -> pd.DataFrame:
    """C2: for the Gaussians fitted on the first n fitting inputs (n in ``sizes``), the share of
    in-domain prompts whose most likely LoRA is their own, the share whose own LoRA is among the
    selected, and the mean number selected."""
    in_dom = np.isin(eval_fam, pool_families)
    truth = np.array([pool_families.index(f) if f in pool_families else -1 for f in eval_fam])
    rows = []
    for n in sizes:
        g_n = hl.fit_gaussians([fit_x[f][:n] for f in pool_families])
        post_n = hl.posterior(hl.log_likelihoods(eval_x, g_n), temperature)
        mask_n = hl.select(post_n, threshold, k_max)
        rows.append({"n_fit": n,
                     "top1_accuracy": float((post_n.argmax(1) == truth)[in_dom].mean()),
                     "selected_contains_true": float(mask_n[in_dom, truth[in_dom]].mean()),
                     "mean_selected": float(mask_n[in_dom].sum(1).mean())})
    return pd.DataFrame(rows)


def pad_pool(w: np.ndarray, n_all: int) -> np.ndarray:
    """Gates over the pool LoRAs, padded with zeros for the held-out (oracle-only) LoRAs."""
    return np.concatenate([w, np.zeros((len(w), n_all - w.shape[1]), dtype=w.dtype)], 1)


def trained_router(fit_x: dict, pool_families: list) -> LogisticRegression:
    """The training-based peer: logistic regression on the same features and fitting inputs."""
    x = torch.cat([fit_x[f] for f in pool_families]).numpy()
    y = np.repeat(np.arange(len(pool_families)), [len(fit_x[f]) for f in pool_families])
    return LogisticRegression(max_iter=2000).fit(x, y)


def single_best(card: dict, pool_families: list) -> str:
    """The pool LoRA with the best mean accuracy over the pool families, from the pool's card
    (its own evaluation prompts, not the notebook's)."""
    acc = {f: np.mean([card["adapters"][f]["accuracy"][g] for g in pool_families])
           for f in pool_families}
    return max(acc, key=acc.get)


def method_gates(bed: Bed, post: np.ndarray, mask: np.ndarray, kroc: np.ndarray,
                 eval_fam: np.ndarray, *, router_choice: np.ndarray, single: str,
                 top_k: int) -> dict:
    """Per-prompt gates ``(w, k)`` over all LoRAs of every routing that uses whole gates:
    base, oracle, uniform, single best, top-k, trained router and HiLoRA (Arrow routes per
    token: :meth:`RocHooks.set_arrow`)."""
    n, P, N, r = len(post), bed.n_pool, bed.n_all, bed.rank
    w_topk = np.zeros((n, P))
    np.put_along_axis(w_topk, np.argsort(-post, 1)[:, :top_k], 1.0 / top_k, 1)
    oracle_idx = np.array([bed.families.index(f) for f in eval_fam])
    return {
        "base": (np.zeros((n, N)), np.zeros((n, N), int)),
        "oracle": hl.whole_gates(oracle_idx, N, r),
        "uniform": (pad_pool(np.full((n, P), 1.0 / P), N), np.full((n, N), r)),
        "single best": hl.whole_gates(np.full(n, bed.pool_families.index(single)), N, r),
        "top-k": (pad_pool(w_topk, N), np.full((n, N), r)),
        "trained router": hl.whole_gates(router_choice, N, r),
        "HiLoRA": (pad_pool(mask.astype(float), N), pad_pool(kroc, N)),
    }


def longest_answer(bed: Bed, examples: list) -> int:
    """Tokens in the longest reference completion (with steps where the base writes them)."""
    return max(len(bed.tok(e.completion(bed.with_steps), add_special_tokens=False)["input_ids"])
               for e in examples)


def score(examples: list, completions: list[str]) -> np.ndarray:
    """The family verifier's score of each completion."""
    return np.array([tasks.score(e, c) for e, c in zip(examples, completions)])


def method_scores(bed: Bed, examples: list, gates: tuple | None, max_new_tokens: int,
                  arrow_top: int = 1) -> np.ndarray:
    """Per-prompt scores of greedy routed generation: under ``gates`` (w, k), or the Arrow
    router over the pool LoRAs when ``gates`` is None."""
    prompts = [e.prompt for e in examples]
    if gates is None:
        bed.hooks.set_arrow(arrow_top, allowed=np.arange(bed.n_all) < bed.n_pool)
        comps = hl.generate_routed(bed.lm, bed.tok, prompts, bed.hooks,
                                   max_new_tokens=max_new_tokens)
    else:
        comps = hl.generate_routed(bed.lm, bed.tok, prompts, bed.hooks, *gates,
                                   max_new_tokens=max_new_tokens)
    return score(examples, comps)


def unseen_domains(pool_families: list, heldout: list) -> dict:
    """The unseen domains: each held-out family, and mixtures of pool families."""
    domains = {f"held-out {f}": [f] for f in heldout}
    domains.update({"mix sort+dedupe+pattern_skip": ["sort", "dedupe", "pattern_skip"],
                    "mix sort+count+kv": ["sort", "count", "kv"], "mix all pool": list(pool_families)})
    return domains


def unseen_table(per_family: pd.DataFrame, pool_families: list, heldout: list,
                 per_domain: dict | None = None) -> pd.DataFrame:
    """Accuracy per unseen domain (each held-out family; mixtures of pool families, scored as
    the mean of their members' per-prompt scores) and their mean, per method; ``per_domain``
    adds methods scored per domain (``{method: {domain: accuracy}}``, LoraHub's weights are
    searched per domain)."""
    domains = unseen_domains(pool_families, heldout)
    unseen = pd.DataFrame({d: per_family.loc[fs].mean() for d, fs in domains.items()}).T
    for m, acc in (per_domain or {}).items():
        unseen[m] = pd.Series(acc)
    unseen.loc["mean over unseen domains"] = unseen.mean()
    return unseen


# -- LoraHub: weights searched per unseen domain on a few labelled examples ----------

def lorahub_shots(domains: dict, n_shots: int, exclude: set, seed: int) -> dict:
    """Per domain, ``n_shots`` labelled examples at its families' middle difficulty (a mixture's
    members in turn), none of them among the evaluation prompts ``exclude``."""
    out = {}
    for d, fams in domains.items():
        pools = {f: [e for e in tasks.generate(f, 4 * n_shots, 3000 + seed, evaluate.MIDDLE[f])
                     if e.prompt not in exclude] for f in fams}
        out[d] = [pools[fams[i % len(fams)]][i // len(fams)] for i in range(n_shots)]
    return out


def lorahub_scores(bed: Bed, domains: dict, shots: dict, eval_ex: list, eval_fam: np.ndarray, *,
                   seed: int, max_new_tokens: int) -> tuple[np.ndarray, pd.DataFrame, dict]:
    """LoraHub per unseen domain: weights over the pool LoRAs searched on the domain's ``shots``
    (:func:`~workbench.methods.lorahub.search`), then greedy generation of the domain's
    evaluation prompts with the composed LoRA. Returns scores (domains, items; NaN outside the
    domain), the weights (domain x pool LoRA) and each search's loss trace."""
    bed.hooks.off()
    hub = lh.ComposedLora(bed.lm, [hl.lora_factors(bed.peft_model, f) for f in bed.pool_families])
    S = np.full((len(domains), len(eval_ex)), np.nan)
    weights, traces = {}, {}
    for i, (d, fams) in enumerate(domains.items()):
        w, traces[d] = lh.search(lambda v: lh.lorahub_loss(bed.lm, bed.tok, hub, shots[d], v,
                                                           bed.with_steps), bed.n_pool, seed + i)
        hub.set_weights(w)
        rows = np.flatnonzero(np.isin(eval_fam, fams))
        comps = evaluate.generate(bed.lm, bed.tok, [eval_ex[j].prompt for j in rows],
                                  max_new_tokens)
        S[i, rows], weights[d] = score([eval_ex[j] for j in rows], comps), w
    hub.remove()
    return S, pd.DataFrame(weights, index=bed.pool_families).T, traces


def unseen_weights(eval_fam: np.ndarray, domains: dict) -> np.ndarray:
    """(domains, items) weights W such that the mean over items of ``(W * S).sum(0)`` is what
    :func:`unseen_table` reports for per-item scores ``S``: the mean over domains of each
    domain's mean over its families of the family's mean score (items are scaled so that their
    plain mean gives it)."""
    W = np.zeros((len(domains), len(eval_fam)))
    for i, fams in enumerate(domains.values()):
        for f in fams:
            W[i, eval_fam == f] = 1.0 / (len(fams) * (eval_fam == f).sum())
    return W * len(eval_fam) / len(domains)


def domain_accuracy(S: np.ndarray, eval_fam: np.ndarray, domains: dict) -> dict:
    """Per domain, the mean over its families of the family's mean in row ``S[d]`` (a method
    scored per domain, as LoraHub is), as :func:`unseen_table` averages the others."""
    return {d: float(np.mean([np.nanmean(S[i, eval_fam == f]) for f in fams]))
            for i, (d, fams) in enumerate(domains.items())}


def unseen_items(results: dict, per_domain: dict, W: np.ndarray) -> dict:
    """Per method, each evaluation prompt's share of the unseen-domain mean (:func:`unseen_weights`):
    a prompt of a pool family counts once per mixture it is in. ``results``: per-prompt scores
    (routing per prompt, whatever the domain); ``per_domain``: (domains, items) scores of the
    methods routed per domain (LoraHub)."""
    out = {m: (W * np.asarray(r, float)[None]).sum(0) for m, r in results.items()}
    out.update({m: (W * np.nan_to_num(S)).sum(0) for m, S in per_domain.items()})
    return out


def c3_intervals(items: dict, rivals: list, method: str = "HiLoRA") -> pd.DataFrame:
    """``method`` minus each rival on the same unseen items: ``paired_bootstrap``'s mean
    difference and 95% interval (one row per rival)."""
    return diagnostics.paired_table({r: (items[method], items[r]) for r in rivals})


def budget_sweep(bed: Bed, examples: list, rows: np.ndarray, post: np.ndarray, mask: np.ndarray,
                 *, budgets, max_new_tokens: int) -> pd.DataFrame:
    """HiLoRA's accuracy on the prompts ``rows`` for each ROC budget K per token and module."""
    out = []
    w = pad_pool(mask.astype(float), bed.n_all)[rows]
    for K in budgets:
        kk = pad_pool(hl.allocate(post, mask, K, bed.rank), bed.n_all)
        comps = hl.generate_routed(bed.lm, bed.tok, [examples[i].prompt for i in rows], bed.hooks,
                                   w, kk[rows], max_new_tokens=max_new_tokens)
        out.append({"budget": K, "accuracy": float(np.mean(
            [tasks.score(examples[i], c) for i, c in zip(rows, comps)]))})
    return pd.DataFrame(out)


def _route(lm, tok, prompts: list[str], gauss: list, temperature: float, threshold: float,
           k_max: int, budget: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """HiLoRA's sequence-level routing: features, likelihoods, posterior, the selection ``m``
    and the budget's allocation ``k`` over the pool (hooks off while the features are read)."""
    x = hl.prompt_features(lm, tok, prompts)
    p = hl.posterior(hl.log_likelihoods(x, gauss), temperature)
    m = hl.select(p, threshold, k_max)
    return m, hl.allocate(p, m, budget, rank)


def _paths(bed: Bed, prompts: list[str], gauss: list, new_tokens: int, temperature: float,
           threshold: float, k_max: int, budget: int, adapter: str) -> dict:
    """C4's two paths as callables: one unmerged ``peft`` LoRA (``adapter``), and HiLoRA's full
    path (features, likelihoods, selection, allocation, the hooked generation); each generates
    exactly ``new_tokens`` tokens per prompt."""
    def single_lora():
        bed.peft_model.set_adapter(adapter)
        return hl.generate_routed(bed.peft_model, bed.tok, prompts, None,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens)

    def hilora_path():
        bed.hooks.off()
        m, k = _route(bed.lm, bed.tok, prompts, gauss, temperature, threshold, k_max, budget,
                      bed.rank)
        return hl.generate_routed(bed.lm, bed.tok, prompts, bed.hooks,
                                  pad_pool(m.astype(float), bed.n_all), pad_pool(k, bed.n_all),
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return {"single peft LoRA": single_lora, "HiLoRA": hilora_path}


def throughput(bed: Bed, prompts: list[str], gauss: list, new_tokens: int, repeats: int,
               temperature: float, threshold: float, k_max: int, budget: int,
               adapter: str = "sort") -> pd.DataFrame:
    """C4: tokens/s of both paths (:func:`_paths`) over ``repeats`` alternating repeats
    (:func:`workbench.costs.interleaved`: the order flips every repeat, ABBA, so that neither
    path always runs second, after one untimed run of each), and per repeat the ratio HiLoRA /
    single LoRA of the two runs side by side: a burst of load hits a pair alike."""
    paths = _paths(bed, prompts, gauss, new_tokens, temperature, threshold, k_max, budget, adapter)
    out = len(prompts) * new_tokens / costs.interleaved(paths, repeats)     # tokens/s
    out["ratio"] = out["HiLoRA"] / out["single peft LoRA"]
    return out


def flops_per_token(bed: Bed, prompts: list[str], gauss: list, new_tokens: int,
                    temperature: float, threshold: float, k_max: int, budget: int,
                    adapter: str = "sort") -> dict:
    """C4's machine-independent side: floating-point operations per generated token of each
    path, routing included, counted by ``torch.utils.flop_counter.FlopCounterMode`` (matrix
    products and attention) on one run of each, plus the likelihoods' numpy work counted by hand
    (per Gaussian: a Cholesky, d^3 / 3, and a triangular solve per prompt, d^2). Comparisons (the
    token-level ranking's sort) are not floating-point operations and are not counted."""
    paths = _paths(bed, prompts, gauss, new_tokens, temperature, threshold, k_max, budget, adapter)
    out = {}
    for name, fn in paths.items():
        out[name] = costs.flops(fn)
    d = len(gauss[0][0])
    out["HiLoRA"] += len(gauss) * (d ** 3 / 3 + len(prompts) * (d ** 2 + 2 * d))
    return {name: f / (len(prompts) * new_tokens) for name, f in out.items()}


@dataclass
class WideBed:
    """A random Llama of realistic width carrying the pool's LoRA shapes: ``lm`` (plain, with
    ``hooks`` over ``n`` seeded random LoRAs of rank ``rank``) and ``peft_model`` (a copy with one
    such LoRA, unmerged, as ``peft`` serves it)."""
    lm: object
    peft_model: object
    hooks: hl.RocHooks
    tok: object
    rank: int
    n: int
    config: dict


def wide_bed(bed: Bed, hidden: int, intermediate: int, layers: int, heads: int,
             seed: int = 0) -> WideBed:
    """C4's model where matrix products dominate: the zoo LM's architecture and tokenizer at
    ``hidden`` / ``intermediate`` width with ``layers`` blocks, seeded random weights, and
    ``bed.n_all`` random LoRAs of the pool's rank on the pool's target projections (what costs
    time does not depend on the weights' values: the routing decisions come from the pool)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    cfg = copy.deepcopy(bed.lm.config)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = hidden, intermediate, layers
    cfg.num_attention_heads = cfg.num_key_value_heads = heads
    cfg.head_dim = hidden // heads
    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_config(cfg).to(bed.lm.device).eval()
    targets = sorted({n.rsplit(".", 1)[-1] for n in hl.lora_factors(bed.peft_model, bed.pool_families[0])})
    g = torch.Generator().manual_seed(seed + 1)
    mods = {n: m for n, m in lm.named_modules()
            if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in targets}
    factors = [{n: ((torch.randn(m.out_features, bed.rank, generator=g) * 0.02).to(lm.device),
                    (torch.randn(bed.rank, m.in_features, generator=g) / m.in_features ** 0.5).to(lm.device))
                for n, m in mods.items()} for _ in range(bed.n_all)]
    single = get_peft_model(copy.deepcopy(lm), LoraConfig(r=bed.rank, lora_alpha=2 * bed.rank,
                                                           target_modules=targets)).eval()
    with torch.no_grad():
        for n, m in single.named_modules():
            if hasattr(m, "lora_B") and "default" in m.lora_B:
                m.lora_B["default"].weight.normal_(0, 0.02, generator=g)
    hooks = hl.RocHooks(lm, factors)
    n_params = sum(p.numel() for p in lm.parameters())
    return WideBed(lm, single, hooks, bed.tok, bed.rank, bed.n_all,
                   {"hidden": hidden, "intermediate": intermediate, "layers": layers,
                    "heads": heads, "params": n_params, "targets": targets})


def _cpu_interleaved(fns: dict, repeats: int, cuda: bool = False, warmup: int = 1) -> pd.DataFrame:
    """As :func:`workbench.costs.interleaved` (ABBA order, after ``warmup`` untimed calls), but
    in the process's CPU seconds (other jobs' load does not enter them; torch runs on the
    threads the run set), or in synchronized wall seconds when ``cuda``."""
    def clock():
        if cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()
    from threadpoolctl import threadpool_limits
    with threadpool_limits(torch.get_num_threads()):    # numpy's BLAS on torch's threads
        return costs.interleaved(fns, repeats, warmup, clock=clock)


def routing_gates(bed: Bed, prompts: list[str], gauss: list, temperature: float,
                  threshold: float, k_max: int, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """HiLoRA's sequence-level routing of ``prompts`` on the zoo model (features, likelihoods,
    selection, allocation), as (n, ``bed.n_all``) gates ``w, k`` for :func:`wide_cost`."""
    bed.hooks.off()
    m, k = _route(bed.lm, bed.tok, prompts, gauss, temperature, threshold, k_max, budget, bed.rank)
    return pad_pool(m.astype(float), bed.n_all), pad_pool(k, bed.n_all)


def wide_cost(wb: WideBed, prompts: list[str], w: np.ndarray, k: np.ndarray, temperature: float,
              threshold: float, k_max: int, budget: int, *, new_tokens: int, repeats: int,
              n_gauss: int, n_fit: int = 32, seed: int = 0) -> dict:
    """C4 at width: one unmerged ``peft`` LoRA against HiLoRA's full path on :func:`wide_bed`'s
    model: the routing forward for the features (``d`` = hidden), the likelihoods of ``d``-dim
    Gaussians, one per pool LoRA (``n_gauss``, fitted on seeded random features: their cost, not
    their values, matters here; factored once at fit time, so a prompt costs a triangular solve),
    selection and allocation, then the hooked generation under the notebook's routing of these
    prompts (``w``, ``k``: (n, N) gates). Returns per repeat the seconds of each path
    (:func:`_cpu_interleaved`) and the ratio of throughputs (single / HiLoRA seconds), and the
    FLOPs per generated token of each path (:func:`flops_per_token`'s count) and their ratio."""
    d = wb.lm.config.hidden_size
    rng = np.random.default_rng([seed, 77])
    gauss = hl.factor_gaussians(hl.fit_gaussians([rng.standard_normal((n_fit, d))
                                                  + rng.standard_normal(d) for _ in range(n_gauss)]))

    def single_lora():
        return hl.generate_routed(wb.peft_model, wb.tok, prompts, None,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens)

    def hilora_path():
        wb.hooks.off()
        # routed at this width for its cost; the pool's routing of these prompts (w, k) decides
        _route(wb.lm, wb.tok, prompts, gauss, temperature, threshold, k_max, budget, wb.rank)
        return hl.generate_routed(wb.lm, wb.tok, prompts, wb.hooks, w, k,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    paths = {"single peft LoRA": single_lora, "HiLoRA": hilora_path}
    secs = _cpu_interleaved(paths, repeats, cuda=next(wb.lm.parameters()).is_cuda)
    secs["ratio"] = secs["single peft LoRA"] / secs["HiLoRA"]
    n_tok = len(prompts) * new_tokens
    flops = {name: costs.flops(fn) / n_tok for name, fn in paths.items()}
    flops["HiLoRA"] += len(gauss) * len(prompts) * (d ** 2 + 2 * d) / n_tok   # the solves
    return {"seconds": secs, "flops_per_token": flops,
            "flop_ratio": flops["single peft LoRA"] / flops["HiLoRA"]}


def active_rocs(bed: Bed, gates: tuple, mask: np.ndarray, prompts: list[str],
                module: str = "layers.1.mlp.up_proj") -> dict:
    """Which ROCs are on, token by token, in one ``module`` for one prompt under ``gates``: the
    first prompt whose routing selected two LoRAs (else the first prompt). Returns the prompt's
    index, the full module name, ``on`` (LoRA x ROC, tokens), the row names and the tokens."""
    two = np.flatnonzero(mask.sum(1) > 1)
    i0 = int(two[0]) if len(two) else 0
    bed.hooks.set_gates(gates[0][i0: i0 + 1], gates[1][i0: i0 + 1])
    ids = bed.tok(bed.tok.bos_token + prompts[i0], return_tensors="pt",
                  add_special_tokens=False).to(bed.lm.device)
    with torch.no_grad():
        bed.lm(**ids)
    name = [n for n in bed.hooks.active if module in n][0]
    on = bed.hooks.active[name][0]                                  # (tokens, LoRAs in use, r)
    return {"prompt": i0, "module": name,
            "on": on.reshape(on.shape[0], -1).T.float().cpu().numpy(),   # (LoRA x ROC, tokens)
            "rows": [f"{bed.families[j]} #{i}" for j in bed.hooks.sel.tolist()
                     for i in range(bed.rank)],
            "tokens": bed.tok.convert_ids_to_tokens(ids["input_ids"][0].tolist())}


def summary(c2: pd.DataFrame, unseen: pd.DataFrame, per_family: pd.DataFrame,
            budgets: pd.DataFrame, heldout: list) -> dict:
    """The scalars "What we saw" quotes: top-1 selection accuracy per number of fitting inputs,
    each method's mean over the unseen domains, the held-out families' best non-oracle score,
    HiLoRA and the oracle on ``sort``, and the accuracy at the smallest and largest ROC budget."""
    out = {f"c2_top1_n{int(r.n_fit)}": float(r.top1_accuracy) for r in c2.itertuples()}
    mean = unseen.loc["mean over unseen domains"]
    out.update({"c3_unseen_" + m.lower().replace(" ", "_").replace("-", "_"): float(v)
                for m, v in mean.items()})
    others = per_family.loc[heldout].drop(columns="oracle").mean()
    out.update(c3_heldout_hilora=float(others["HiLoRA"]), c3_heldout_best_other=float(others.max()),
               c3_sort_hilora=float(per_family.loc["sort", "HiLoRA"]),
               c3_sort_oracle=float(per_family.loc["sort", "oracle"]),
               c3_budget_lowest=float(budgets.accuracy.iloc[0]),
               c3_budget_highest=float(budgets.accuracy.iloc[-1]))
    return out


# -- the explorer: accuracy against the selection threshold ---------------------------------------

def selection_variants(bed: Bed, examples: list, post: np.ndarray, mask: np.ndarray,
                       scores: np.ndarray, *, budget: int, k_max: int,
                       max_new_tokens: int) -> pd.DataFrame:
    """Each prompt's score with its ``n`` most likely LoRAs selected, for ``n = 1..k_max``
    (columns ``1..k_max``), the budget split as :func:`~workbench.methods.hilora.allocate` does.
    A threshold only changes how many LoRAs a prompt gets, so these columns give HiLoRA's score
    at any threshold. ``scores`` (HiLoRA's at ``mask``) fill the column each prompt already
    has; the others are generated under ``bed.hooks``, or fresh hooks (removed after) once the
    notebook has removed those."""
    order = np.argsort(-post, 1)
    out = pd.DataFrame(index=range(len(post)), columns=range(1, k_max + 1), dtype=float)
    own = bool(bed.hooks.handles)
    hooks = bed.hooks if own else None
    for n in range(1, k_max + 1):
        top = np.zeros_like(mask)
        np.put_along_axis(top, order[:, :n], True, 1)
        have = mask.sum(1) == n
        out.loc[have, n] = scores[have]
        todo = np.flatnonzero(~have)
        if len(todo):
            hooks = hooks or hl.RocHooks(bed.lm, [hl.lora_factors(bed.peft_model, f)
                                                  for f in bed.families])
            w = pad_pool(top.astype(float), bed.n_all)[todo]
            k = pad_pool(hl.allocate(post, top, budget, bed.rank), bed.n_all)[todo]
            comps = hl.generate_routed(bed.lm, bed.tok, [examples[i].prompt for i in todo],
                                       hooks, w, k, max_new_tokens=max_new_tokens)
            out.loc[todo, n] = score([examples[i] for i in todo], comps)
    if hooks is not None and not own:
        hooks.remove()
    return out


def at_threshold(variants: pd.DataFrame, post: np.ndarray, families, threshold: float,
                 k_max: int) -> tuple[pd.Series, np.ndarray]:
    """HiLoRA's mean score per family at ``threshold`` (read from :func:`selection_variants`),
    and how many LoRAs each prompt selects there."""
    mass = np.cumsum(-np.sort(-post, 1), 1)                 # hl.select's count, all rows at once
    n = np.minimum((mass < threshold).sum(1) + 1, k_max)
    got = variants.to_numpy()[np.arange(len(n)), n - 1]
    return pd.Series(got).groupby(np.asarray(families)).mean(), n


def threshold_curve(variants: pd.DataFrame, post: np.ndarray, families, thresholds, *,
                    k_max: int, pool_families: list, heldout: list) -> pd.DataFrame:
    """Per threshold: HiLoRA's mean over the unseen domains (:func:`unseen_table`), over the
    pool families and over the held-out ones, and the share of prompts given more than one
    LoRA."""
    rows = []
    for t in thresholds:
        fam, n = at_threshold(variants, post, families, t, k_max)
        unseen = unseen_table(fam.to_frame("HiLoRA"), pool_families, heldout)
        rows.append({"threshold": float(t), "unseen domains": unseen.HiLoRA.iloc[-1],
                     "pool families": fam[pool_families].mean(),
                     "held-out families": fam[heldout].mean(), "share with 2+ LoRAs": (n > 1).mean()})
    return pd.DataFrame(rows)


def threshold_figure(curve: pd.DataFrame, per_family: pd.DataFrame, at: pd.Series,
                     threshold: float, share: float):
    """Left: HiLoRA's accuracy against the threshold (a line at ``threshold``) and the share of
    prompts given a second LoRA. Right: accuracy per family at ``threshold`` (``at``) beside
    the recorded methods' (``per_family``: top-k, trained router, oracle)."""
    at = at.reindex(per_family.index)
    fig, (ax, bx) = plots.subplots(1, 2, figsize=(11, 3.8))
    for i, col in enumerate(["unseen domains", "pool families", "held-out families"]):
        ax.plot(curve.threshold, curve[col], color=plots.PALETTE[i], label=col)
    ax.plot(curve.threshold, curve["share with 2+ LoRAs"], "k:", label="share with 2+ LoRAs")
    ax.axvline(threshold, color="grey", lw=1)
    ax.set(xlabel="threshold on the posterior mass", ylabel="exact match (HiLoRA) / share",
           ylim=(-0.02, 1.02), title=f"threshold {threshold:.2f}: {share:.0%} of prompts get 2+ LoRAs")
    ax.legend(fontsize=7)
    xs = np.arange(len(at))
    others = ["top-k", "trained router", "oracle"]
    bx.bar(xs - 0.3, at.to_numpy(), 0.2, color=plots.PALETTE[0], label=f"HiLoRA at {threshold:.2f}")
    for j, m in enumerate(others):
        bx.bar(xs - 0.1 + 0.2 * j, per_family.loc[at.index, m], 0.2, color=plots.PALETTE[j + 3],
               label=m, hatch="//" if m == "oracle" else None)
    bx.set_xticks(xs, at.index, rotation=20, ha="right", fontsize=8)
    bx.set(ylabel="exact match", title="Accuracy per family at this threshold")
    bx.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig
