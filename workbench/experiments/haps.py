"""The harness of notebook 11 (HAPS: hierarchical routing over LLM architectures and parameters,
``docs/papers/11-haps.md``).

The method (query features, the generated per-example LoRA, the two-level router, the objectives
and the training loop) is :mod:`workbench.methods.haps`. Here is what the notebook drives around it:

- :func:`benchmark`, :func:`static_scores`, :func:`bench_table`: a mixed benchmark of task
  families and every candidate's greedy exact match and answer loss on it as a static model,
  computed once and cached (:func:`workbench.cache.build`);
- :func:`router_states`: the frozen router LM's pooled state of every query;
- :func:`cached_ref_haps`: one training of HAPS as the official code structures it
  (:class:`~workbench.methods.haps.RefHAPS`, or one of its ablations), and :func:`cached_haps`:
  one training of our earlier n-gram method (the ablation row), each cached with each candidate's
  test exact match under its generated LoRA (:func:`adapted_completions`);
- :func:`generated_lora_check`: C1, the generated factors against the adapted projections' shapes
  and against ``peft`` with the same A, B;
- :class:`StaticRouter`, :func:`train_static_router`, :func:`routing_scores`: the baselines of C2
  (random, single best, architecture-only routing, RouteLLM's matrix-factorization router
  (:mod:`workbench.methods.mf_router`, :data:`MF`), the oracles) beside HAPS and its ablations;
- :func:`latency`: C5, what routing and generating the LoRA cost against answering alone;
- :func:`two_level_table`: the explorer's table, each level of the hierarchy (which candidate,
  which parameters) switched independently, over the scores already computed.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from .. import cache, evaluate
from ..data import packing, tasks
from ..methods import haps as H
from ..models import zoo

__all__ = ["GROUP", "router_states", "cached_ref_haps", "benchmark", "encode", "max_new_tokens", "teacher_forced", "static_scores",
           "bench_table", "adapted_completions", "cached_haps", "generated_lora_check",
           "StaticRouter", "train_static_router", "MF", "routing_scores", "n_params", "best_of",
           "latency", "summary", "two_level_table"]

GROUP = "haps"          # this notebook's folder under the cache


# -- the benchmark and the static candidates ------------------------------------------------------

def benchmark(families: list[str], n_train: int, n_test: int, seed: int):
    """A mixed benchmark: ``n_train`` training queries per family (every difficulty) and up to
    ``n_test`` test queries per family whose prompts never occur in training."""
    train = [e for f in families for e in tasks.generate(f, n_train, 1000 + seed)]
    seen = {e.prompt for e in train}
    test = []
    for f in families:
        cand = [e for e in tasks.generate(f, 3 * n_test, 2000 + seed) if e.prompt not in seen]
        test += cand[:n_test]
    return train, test


def encode(tok, examples, with_steps: bool):
    """``(ids, labels)`` of each example in a candidate's tokenizer and answer style."""
    return packing.encode(tok, [e.prompt for e in examples],
                          [e.completion(with_steps) for e in examples])


def max_new_tokens(tok, examples, with_steps: bool) -> int:
    """Room for the longest reference completion of ``examples``, plus two tokens."""
    return 2 + max(len(tok(e.completion(with_steps), add_special_tokens=False)["input_ids"])
                   for e in examples)


def teacher_forced(model, tok, examples, with_steps: bool, batch: int = 128):
    """Answer loss and teacher-forced reward of a static candidate on each example."""
    pairs, dev = encode(tok, examples, with_steps), next(model.parameters()).device
    losses, hits = [], []
    with torch.no_grad():
        for i in range(0, len(pairs), batch):
            b = packing.pad(pairs[i: i + batch], tok.pad_token_id)
            loss, hit = H.answer_loss(model(input_ids=b["input_ids"].to(dev)).logits,
                                      b["labels"].to(dev))
            losses += loss.tolist()
            hits += hit.tolist()
    return losses, hits


def static_scores(names, zoo_scale: str, models: dict, toks: dict, splits: dict) -> dict:
    """Per candidate, per split, per example: greedy exact match (the family's verifier) and the
    answer loss of the static model, computed once and cached (``cache.build``)."""
    key = cache.key([zoo.key(n, zoo_scale) for n in names],
                    {s: [e.prompt for e in ex] for s, ex in splits.items()})
    path = cache.folder(GROUP) / f"static-{zoo.zoo_scale(zoo_scale)}-{key}"

    def build(tmp):
        out = {}
        for n in names:
            ws = zoo.with_steps(n)
            out[n] = {}
            for split, ex in splits.items():
                comps = evaluate.generate(models[n], toks[n], [e.prompt for e in ex],
                                          max_new_tokens(toks[n], ex, ws))
                loss, _ = teacher_forced(models[n], toks[n], ex, ws)
                out[n][split] = {"correct": [tasks.score(e, c) for e, c in zip(ex, comps)],
                                 "loss": loss}
        (tmp / "scores.json").write_text(json.dumps(out))
        return {"names": list(names)}

    cache.build(path, build)
    return json.loads((path / "scores.json").read_text())


def bench_table(correct: np.ndarray, families: np.ndarray, fams: list[str],
                names: list[str]) -> pd.DataFrame:
    """Test exact match per family (rows) and candidate (columns) from ``correct`` (n, K), the
    best candidate per family, and a last row over all families."""
    bench = pd.DataFrame({n: {f: correct[families == f, k].mean() for f in fams}
                          for k, n in enumerate(names)})
    bench["best"] = bench[names].idxmax(1)
    bench.loc["all families"] = list(correct.mean(0)) + [names[int(correct.mean(0).argmax())]]
    return bench


# -- HAPS, trained once ---------------------------------------------------------------------------

def adapted_completions(model, tok, haps: H.HAPS, name: str, prompts: list[str],
                        x: torch.Tensor, scale: float, max_new_tokens: int,
                        batch: int = 64) -> list[str]:
    """Greedy completions of candidate ``name`` with each prompt's own generated LoRA (on the
    modules that ``haps`` adapts, ``haps.modules_of``)."""
    mods = [m for _, m, _, _ in haps.modules_of(model)]
    device = next(model.parameters()).device
    outs = []
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            with H.lora_hooks(mods, haps.lora(x[i: i + batch].to(device), name), scale):
                outs += evaluate.generate(model, tok, prompts[i: i + batch], max_new_tokens,
                                          batch=batch)
    return outs


def _load_trained(path, make, build, device):
    """Train once into ``path`` with ``build`` (it saves the state dict as ``haps.pt``), then
    ``make()`` the model and load it: ``(model on device in eval mode, the build's record)``."""
    cache.build(path, build)
    model = make()
    model.load_state_dict(torch.load(path / "haps.pt"))
    return model.to(device).eval(), json.loads((path / "done.json").read_text())


def cached_haps(names, zoo_scale: str, models: dict, toks: dict, train, test, *,
                labels: torch.Tensor, s: H.Settings, feat_dim: int, device="cpu"):
    """A trained :class:`~workbench.methods.haps.HAPS` and its record (training log, seconds,
    each candidate's greedy exact match on ``test`` with its generated LoRA), trained once and
    cached under ``cache.folder("haps")`` keyed by the candidates' recipe keys, the settings and
    the prompts."""
    shapes = {n: [(i, o) for _, _, i, o in H.target_modules(models[n])] for n in names}
    key = cache.key([zoo.key(n, zoo_scale) for n in names], asdict(s), feat_dim,
                    [e.prompt for e in train], [e.prompt for e in test])
    tag = f"{'shared' if s.shared else 'separate'}-{s.objective}"
    path = cache.folder(GROUP) / f"haps-{tag}-{zoo.zoo_scale(zoo_scale)}-{key}"

    def make():
        return H.HAPS(names, shapes, feat_dim, s.d_h, s.rank, s.shared)

    def build(tmp):
        t0 = time.time()
        torch.manual_seed(s.seed)
        haps = make().to(device)
        pairs = {n: encode(toks[n], train, zoo.with_steps(n)) for n in names}
        x = H.prompt_features([e.prompt for e in train], feat_dim)
        log = H.train_haps(haps, models, pairs, {n: toks[n].pad_token_id for n in names}, x,
                           labels, s)
        seconds = time.time() - t0
        haps.eval()
        xt = H.prompt_features([e.prompt for e in test], feat_dim)
        adapted = {}
        for n in names:
            ws = zoo.with_steps(n)
            comps = adapted_completions(models[n], toks[n], haps, n, [e.prompt for e in test], xt,
                                        s.scale, max_new_tokens(toks[n], test, ws))
            adapted[n] = [tasks.score(e, c) for e, c in zip(test, comps)]
        torch.save(haps.cpu().state_dict(), tmp / "haps.pt")
        return {"train_seconds": round(seconds, 1), "log": log, "adapted_test": adapted,
                "settings": asdict(s)}

    return _load_trained(path, make, build, device)


def router_states(encoder: str, zoo_scale: str, splits: dict, device="cpu") -> dict:
    """The frozen router LM ``encoder`` and its mean-pooled last hidden state of every prompt
    (:func:`~workbench.methods.haps.pooled_state`), per split: ``{"model", "tok", split: (n, d)}``."""
    model, tok = zoo.load(encoder, zoo_scale, device=str(device))
    model.requires_grad_(False).eval()
    out = {"model": model, "tok": tok}
    for split, ex in splits.items():
        out[split] = H.pooled_state(model, tok, [e.prompt for e in ex])
    return out


def cached_ref_haps(names, zoo_scale: str, models: dict, toks: dict, train, test, *,
                    labels: torch.Tensor, s: H.RefSettings, encoder: str, h_tr: torch.Tensor,
                    h_te: torch.Tensor, device="cpu"):
    """A trained :class:`~workbench.methods.haps.RefHAPS` (the reference's structure on the
    router LM ``encoder``'s pooled states ``h_tr``, ``h_te``) and its record, as
    :func:`cached_haps`: trained once, cached by the candidates' and the encoder's recipe keys,
    the settings and the prompts."""
    dims = {n: H.official_targets(models[n], s.layers)[0][2:] for n in names}
    key = cache.key([zoo.key(n, zoo_scale) for n in names + [encoder]], asdict(s),
                    [e.prompt for e in train], [e.prompt for e in test])
    path = cache.folder(GROUP) / f"ref-{'shared' if s.shared else 'separate'}-{s.objective}-{zoo.zoo_scale(zoo_scale)}-{key}"

    def make():
        return H.RefHAPS(names, dims, h_tr.shape[1], s.rank, s.layers, s.shared, s.d_hidden,
                         s.n_layers)

    def build(tmp):
        t0 = time.time()
        torch.manual_seed(s.seed)
        ref = make().to(device)
        ws = {n: zoo.with_steps(n) for n in names}
        pairs = {n: encode(toks[n], train, ws[n]) for n in names}
        mx = {n: max_new_tokens(toks[n], train, ws[n]) for n in names}
        log = H.train_reference(ref, models, toks, train, pairs, h_tr.to(device), labels.to(device),
                                mx, s)
        seconds = time.time() - t0
        adapted = {}
        for n in names:
            comps = adapted_completions(models[n], toks[n], ref.eval(), n, [e.prompt for e in test],
                                        h_te, s.alpha, max_new_tokens(toks[n], test, ws[n]))
            adapted[n] = [tasks.score(e, c) for e, c in zip(test, comps)]
        torch.save(ref.cpu().state_dict(), tmp / "haps.pt")
        return {"train_seconds": round(seconds, 1), "log": log, "adapted_test": adapted,
                "settings": asdict(s)}

    return _load_trained(path, make, build, device)


# -- C1: the generated factors are a LoRA of the chosen architecture ------------------------------

def generated_lora_check(haps, models: dict, toks: dict, probe: list, x_probe: torch.Tensor, *,
                         rank: int, scale: float, device, per_candidate: int = 3) -> pd.DataFrame:
    """Per candidate and the first ``per_candidate`` probe queries: whether the generated A, B
    have the adapted projections' shapes, the largest |hooked - peft| logit with the same A, B,
    the largest change against the static candidate, and how much Delta W = B A varies across
    the probe queries (relative). ``x_probe``: the probe queries' router input (features or
    pooled states); ``haps``: either structure (its ``modules_of`` names the adapted modules)."""
    rows = []
    x_probe = x_probe.to(device)
    with torch.no_grad():
        for n, model in models.items():
            mods = haps.modules_of(model)
            facs = haps.lora(x_probe, n)
            shapes_ok = all(A.shape == (len(probe), rank, i) and B.shape == (len(probe), o, rank)
                            for (_, _, i, o), (A, B) in zip(mods, facs))
            dw = [torch.einsum("bor,bri->boi", B, A) for A, B in facs]
            vary = max(float((d[1:] - d[:1]).norm() / d[:1].norm().clamp_min(1e-12)) for d in dw)
            for q, e in enumerate(probe[:per_candidate]):
                b = packing.pad(encode(toks[n], [e], zoo.with_steps(n)), toks[n].pad_token_id)
                ids = b["input_ids"].to(device)
                one = [(A[q: q + 1], B[q: q + 1]) for A, B in facs]
                with H.lora_hooks([m for _, m, _, _ in mods], one, scale):
                    ours = model(input_ids=ids).logits
                own = model(input_ids=ids).logits
                ref = H.peft_with(model, [nm for nm, _, _, _ in mods],
                                  [(A[0], B[0]) for A, B in one], scale)(input_ids=ids).logits
                rows.append({"candidate": n, "arch": model.config.model_type, "family": e.family,
                             "modules": len(mods), "shapes_ok": shapes_ok,
                             "max |hooked - peft|": float((ours - ref).abs().max()),
                             "max |hooked - static|": float((ours - own).abs().max()),
                             "dW varies across queries (rel.)": vary})
    return pd.DataFrame(rows)


# -- C2-C4: routing against the baselines ---------------------------------------------------------

class StaticRouter(nn.Module):
    """Architecture-only routing: a classifier over the candidates as black boxes."""

    def __init__(self, n: int, d_in: int, d_h: int):
        super().__init__()
        self.net = nn.Sequential(H.trunk(d_in, d_h), nn.Linear(d_h, n))

    def forward(self, x):
        return self.net(x)


def train_static_router(x, labels, n: int, *, d_h: int, steps: int, lr: float, seed: int):
    """Architecture-only router: cross-entropy on the static routing labels, full batch, where
    ``x`` lives."""
    torch.manual_seed(seed)
    net = StaticRouter(n, x.shape[1], d_h).to(x.device)
    labels = labels.to(x.device)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    for _ in range(steps):
        loss = F.cross_entropy(net(x), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net.eval()


def routing_scores(static_test: np.ndarray, static_train: np.ndarray, adapted: dict,
                   arch_choice: np.ndarray, choice: dict, names: list[str], *,
                   static_routers: dict | None = None) -> dict:
    """Per-query test scores of every routing: random (expected), the single best candidate (by
    training exact match), architecture-only routing, any other router over the static
    candidates (``static_routers``: name -> chosen candidate per query, such as RouteLLM's
    matrix-factorization router), the static oracle, each HAPS variant (its router's argmax
    answered with its generated LoRA), and the oracle over HAPS's adapted candidates.
    ``adapted[v]``: (n_test, K) exact match of the candidates adapted by variant v."""
    rows = np.arange(len(static_test))
    single = int(static_train.mean(0).argmax())
    scores = {"random routing": static_test.mean(1),
              f"single best ({names[single]})": static_test[:, single],
              "architecture-only router": static_test[rows, arch_choice],
              **{m: static_test[rows, ch] for m, ch in (static_routers or {}).items()},
              "oracle (static)": static_test.max(1)}
    for v in choice:
        scores[v] = adapted[v][rows, choice[v]]
    scores["oracle (HAPS candidates)"] = adapted["HAPS"].max(1)
    return scores


# -- C5: cost -------------------------------------------------------------------------------------

def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def best_of(fn, reps: int = 3) -> float:
    """The fastest of ``reps`` calls of ``fn``, in seconds."""
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def latency(haps, models: dict, toks: dict, queries: list, featurize, *, scale: float,
            device) -> pd.DataFrame:
    """Per candidate, best of three: ``featurize`` (prompts -> router input: the router LM's
    pooled states, or n-gram features), routing and generating the LoRA factors; the
    candidate's greedy answers alone; its answers with the generated LoRA's hooks on; and the
    overhead (route + hooked - alone) / alone."""
    prompts = [e.prompt for e in queries]
    cost = []
    with torch.no_grad():
        for n, model in models.items():
            mx = max_new_tokens(toks[n], queries, zoo.with_steps(n))

            def route_and_generate():
                x = featurize(prompts).to(device)
                haps.route(x).softmax(1)
                haps.lora(x, n)

            t_route = best_of(route_and_generate)
            xq = featurize(prompts)
            t_plain = best_of(lambda: evaluate.generate(model, toks[n], prompts, mx))
            t_hooked = best_of(lambda: adapted_completions(model, toks[n], haps, n, prompts, xq,
                                                           scale, mx))
            cost.append({"candidate": n, "candidate params": n_params(model),
                         "route + generate LoRA (s)": t_route, "answer alone (s)": t_plain,
                         "answer with hooks (s)": t_hooked,
                         "latency overhead": (t_route + t_hooked - t_plain) / t_plain})
    return pd.DataFrame(cost).set_index("candidate")


MF = "matrix-factorization router (RouteLLM)"     # the published router design of C2

SHORT = {"random routing": "random", "architecture-only router": "arch_only", MF: "mf",
         "oracle (static)": "oracle_static", "HAPS": "haps", "HAPS, separate tops": "separate",
         "HAPS, supervised answers": "supervised", "ours (n-gram router, eq. 1)": "ours",
         "oracle (HAPS candidates)": "oracle_haps"}


def summary(per_family: pd.DataFrame, c1: pd.DataFrame, cost: pd.DataFrame, agreement: dict,
            haps_params: int) -> dict:
    """The scalars "What we saw" quotes: every routing's test exact match over all families
    (``acc_<method>``) and on ``kv``, C1's smallest change against the static model and
    smallest variation of Delta W, the routers' agreement with architecture-only routing, and
    C5's parameter count (the latency overhead is read off the clock: the notebook records it
    with ``run.clock``)."""
    out = {}
    for m, row in per_family.iterrows():
        key = "single_best" if m.startswith("single best") else SHORT[m]
        out[f"acc_{key}"] = float(row["all"])
        if "kv" in per_family.columns:
            out[f"kv_{key}"] = float(row["kv"])
    out.update(c1_min_change_vs_static=float(c1["max |hooked - static|"].min()),
               c1_min_dw_variation=float(c1["dW varies across queries (rel.)"].min()),
               c5_haps_params=int(haps_params))
    out.update({f"c4_agreement_{SHORT[v]}": float(a) for v, a in agreement.items()})
    return out


# -- the explorer ----------------------------------------------------------------------------------

def two_level_table(static_test: np.ndarray, adapted: dict, arch_choice: np.ndarray,
                    choice: dict, families: np.ndarray, fams: list[str]) -> pd.DataFrame:
    """Test exact match with HAPS's two levels taken apart: for every trained variant
    (``generators``), the candidates answer with their generated LoRA or as static models
    (``parameters``), chosen by the variant's own router, the architecture-only router, the
    oracle (any candidate right) or at random (expected). Columns generators, parameters,
    router, family (``fams`` then "all"), exact match; every value is a lookup in the scores
    the notebook already has, so a redraw costs nothing."""
    rows, idx = [], np.arange(len(static_test))
    for v in choice:
        for params, m in (("generated LoRA", adapted[v]), ("static", static_test)):
            per_query = {"its own router": m[idx, choice[v]],
                         "architecture-only router": m[idx, arch_choice],
                         "oracle": m.max(1), "random": m.mean(1)}
            for router, s in per_query.items():
                rows += [(v, params, router, f, float(s[families == f].mean())) for f in fams]
                rows.append((v, params, router, "all", float(s.mean())))
    return pd.DataFrame(rows, columns=["generators", "parameters", "router", "family",
                                       "exact match"])
