"""The harness of notebook 18 (paper 18, "Predicting reasoning-data quality from low-rank loss
signatures", ``docs/papers/18-loss-signature-curation.md``).

What the notebook drives around the method (:mod:`workbench.methods.loss_signature`):

- the trace pool: problems drawn per (family, difficulty) level from the disjoint train and
  held-out sides (:func:`draw_problems`), three teachers of controlled quality writing one trace
  each (:func:`solver_traces`, :func:`model_traces`, :func:`teacher_pool`), as a table
  (:func:`pool_frame`);
- the brief adaptation of the student (:func:`adapt`) and the signatures of the whole pool in
  pool order, read on several token fractions from the same forward passes
  (:func:`pool_signatures`);
- the difficulty correlations of C1 (:func:`difficulty_correlations`), and for C2 the NMI's
  bootstrap interval over problems (:func:`nmi_interval`) and the 2-d view of the clustered
  signatures (:func:`signature_embedding`);
- the long bed of C1 and C3 at mid (:func:`long_bed`, a :class:`Bed`): long traces of one
  family from one teacher, difficulty by the family's levels, with the student's loss before and
  past its pretraining context (:func:`position_losses`);
- the generate-then-filter baseline of curation cost (:func:`generate_then_filter`, judged by
  :func:`sequence_scores`);
- the downstream students: cached ``peft`` LoRA SFT on a subset of the pool, scored by exact
  match on held-out problems (:func:`student_accuracy`, :func:`subset_students`, per item for
  paired comparisons);
- the explorer: the difficulty proxy read at one fixed scale against the inflection point
  (:func:`sigma_correlations`, :func:`sigma_figure`).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import pandas as pd
import torch
from scipy.stats import spearmanr
from sklearn.decomposition import PCA
from sklearn.metrics import normalized_mutual_info_score as nmi

from .. import evaluate, plots
from ..data import packing, tasks
from ..data.tasks import STEP_SEP
from ..diagnostics import spearman_ci
from ..methods import loss_signature as ls
from ..models import finetune, zoo

__all__ = ["Trace", "draw_problems", "solver_traces", "model_traces", "teacher_pool",
           "pool_frame", "adapt", "pool_signatures", "difficulty_correlations", "nmi_interval",
           "signature_embedding", "Bed", "room", "position_losses", "long_bed",
           "sequence_scores", "generate_then_filter", "student_accuracy", "subset_students",
           "sigma_correlations", "sigma_figure"]

CACHE_GROUP = "loss-signature"      # cache.folder of the downstream students' LoRA fine-tunes


# -- the trace pool -----------------------------------------------------------------------------

@dataclass
class Trace:
    """One reasoning trace in the pool: a problem, a teacher's completion and what we know."""
    prompt: str
    completion: str
    family: str          # the latent category
    difficulty: int
    teacher: str
    correct: bool        # the verifier's verdict on the completion's final answer


def draw_problems(families, n: int, side: str, rng: np.random.Generator) -> list:
    """``n`` problems per (family, difficulty) level from one side (``"train"`` or ``"test"``)
    of ``tasks.problem_split``: :func:`workbench.data.tasks.draw_problems`."""
    return tasks.draw_problems(families, n, side, rng)


def _corrupt(text: str, rng: random.Random) -> str:
    """Change one digit of ``text`` (a step's result or the answer) to another digit."""
    pos = [i for i, c in enumerate(text) if c.isdigit()]
    if not pos:
        return text + "1"
    i = rng.choice(pos)
    return text[:i] + rng.choice([d for d in "0123456789" if d != text[i]]) + text[i + 1:]


def solver_traces(examples, noise: float, seed: int, name: str | None = None) -> list[Trace]:
    """The rule-based solver's traces (the registry's reference steps); a share ``noise`` of them
    corrupted: one step's result after its ``=`` and the final answer altered (a plausible,
    wrong trace)."""
    rng = random.Random(seed)
    out = []
    for e in examples:
        steps, answer = list(e.steps or []), e.target
        if rng.random() < noise:
            if steps:
                j = rng.randrange(len(steps))
                head, _, tail = steps[j].rpartition("=")
                steps[j] = (head + "=" + _corrupt(tail, rng)) if head else _corrupt(steps[j], rng)
            answer = _corrupt(answer, rng)
        comp = (" " + STEP_SEP.join(steps) + " => " + answer) if steps else " " + answer
        out.append(Trace(e.prompt, comp, e.family, e.difficulty, name or f"solver-{noise:g}",
                         bool(tasks.score(e, comp))))
    return out


def model_traces(model, tok, examples, name: str, max_new_tokens: int = 48) -> list[Trace]:
    """A zoo model's greedy traces of the problems (``transformers`` ``generate``)."""
    comps = [c.split("\n")[0] for c in evaluate.generate(model, tok, [e.prompt for e in examples],
                                                         max_new_tokens=max_new_tokens)]
    return [Trace(e.prompt, " " + c.strip(), e.family, e.difficulty, name, bool(tasks.score(e, c)))
            for e, c in zip(examples, comps)]


def teacher_pool(problems, teacher_lm, tok, noise: float, seed: int, teacher_name: str) -> list[Trace]:
    """One trace per problem from each of the three teachers, in this order: the clean solver
    (``solver``), the solver with a share ``noise`` corrupted (``solver-noisy``) and the model
    ``teacher_lm`` (named ``teacher_name``), greedy with :func:`room` for the longest reference
    completion (a trace cut before its answer would count against the teacher)."""
    return (solver_traces(problems, 0.0, seed, "solver")
            + solver_traces(problems, noise, seed + 1, "solver-noisy")
            + model_traces(teacher_lm, tok, problems, teacher_name,
                           max_new_tokens=room(tok, problems)))


def pool_frame(traces: list[Trace]) -> pd.DataFrame:
    """The pool as a table, one row per trace, with ``level``: the true difficulty, the rank of
    the trace's difficulty within its family, scaled to [0, 1]."""
    pool = pd.DataFrame([t.__dict__ for t in traces])
    pool["level"] = [tasks.get(f).difficulties.index(d) / (len(tasks.get(f).difficulties) - 1)
                     for f, d in zip(pool.family, pool.difficulty)]
    return pool


# -- adaptation and signatures ------------------------------------------------------------------

def adapt(student_lm, tok, traces: list[Trace], rng: np.random.Generator, *, rank: int, steps: int,
          seed: int, batch: int = 16):
    """The brief adaptation: a ``peft`` LoRA trained for ``steps`` on a random quarter of the
    traces (at least 32, drawn by ``rng``), merged into the weights. ``peft`` wraps
    ``student_lm`` in place, so the returned model is ``student_lm`` itself, adapted."""
    warm = rng.permutation(len(traces))[: max(32, len(traces) // 4)]
    adapted, _ = finetune.train_lora(student_lm, tok, [traces[i].prompt for i in warm],
                                     [traces[i].completion for i in warm],
                                     finetune.LoraSettings(rank=rank, steps=steps, batch=batch,
                                                           seed=seed))
    return adapted.merge_and_unload().eval()


def pool_signatures(model, tok, traces: list[Trace], fractions, *, n_dirs: int, dir_rank: int,
                    scales, seed: int, device, batch: int = 128) -> tuple[dict, dict]:
    """The loss signatures of every trace, ``{fraction: (n_traces, n_dirs, n_scales)}`` in pool
    order, each fraction of the labelled tokens read from the same forward passes; and the
    token counts ``{fraction: (read, labelled)}``."""
    pairs = packing.encode(tok, [t.prompt for t in traces], [t.completion for t in traces])
    batches, order = ls.length_batches(pairs, batch, tok.pad_token_id, device)
    masks = {f: [ls.subsample_mask(b["labels"].cpu(), f, seed + i).to(device)
                 for i, b in enumerate(batches)] for f in dict.fromkeys(fractions)}
    dirs = ls.low_rank_directions(model, n_dirs, dir_rank, seed)
    sigs = {}
    for f, v in ls.signatures(model, batches, masks, dirs, scales).items():
        sigs[f] = np.empty_like(v)
        sigs[f][order] = v                      # back from length order to pool order
    n_label = int(sum((b["labels"] != -100).sum() for b in batches))
    return sigs, {f: (int(sum(m.sum() for m in ms)), n_label) for f, ms in masks.items()}


def difficulty_correlations(pool: pd.DataFrame, sig, sig_few, scales, n_resamples: int,
                            seed: int) -> dict:
    """C1's Spearman correlations with the level (``spearman_ci``, bootstrap interval): of the
    inflection-point loss ``pool.pred`` (``main``), of the unperturbed loss (sigma = 0,
    ``unperturbed``), of the inflection loss read on fewer tokens (``sig_few``, ``few``), and
    within each teacher and family (``within``: rho only)."""
    ci = partial(spearman_ci, n_resamples=n_resamples, seed=seed)
    within = {k: ci(g.level, g.pred)["rho"] for k, g in pool.groupby("teacher")}
    within.update({k: ci(g.level, g.pred)["rho"] for k, g in pool.groupby("family")})
    return {"main": ci(pool.level, pool.pred), "unperturbed": ci(pool.level, sig[:, :, 0].mean(1)),
            "few": ci(pool.level, ls.inflection_losses(sig_few, scales)), "within": within}


def nmi_interval(clusters, categories, groups, n_resamples: int, seed: int,
                 confidence: float = 0.95) -> dict:
    """The NMI of ``clusters`` against ``categories`` with a percentile bootstrap interval that
    resamples the ``groups`` with replacement, all the items of a group together (a problem's
    traces from every teacher: the same prompt and category, not independent draws), the
    clusters held as found. Returns ``{"nmi", "low", "high", "n_groups"}``."""
    clusters, cats = np.asarray(clusters), np.asarray(categories)
    _, gid = np.unique(np.asarray(groups), return_inverse=True)
    members = [np.flatnonzero(gid == g) for g in range(gid.max() + 1)]
    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(n_resamples):
        idx = np.concatenate([members[g] for g in rng.integers(0, len(members), len(members))])
        boot.append(nmi(cats[idx], clusters[idx]))
    q = (1 - confidence) / 2
    return {"nmi": float(nmi(cats, clusters)), "low": float(np.quantile(boot, q)),
            "high": float(np.quantile(boot, 1 - q)), "n_groups": len(members)}


def signature_embedding(features, seed: int) -> np.ndarray:
    """The clustered signature features projected on their first two principal components
    (``sklearn`` PCA), for the C2 scatter plots."""
    return PCA(2, random_state=seed).fit_transform(features)


# -- the long bed of C1 and C3 -------------------------------------------------------------------

@dataclass
class Bed:
    """What C1 and C3 read: a trace pool (with ``pred`` and ``cluster``), its problems and
    held-out problems, the adapted student (also the judge of generate-then-filter) and its
    signatures ``{fraction: array}`` with the token counts, the curation wall-clock (adaptation
    and signatures), the room for new tokens of any generation on these problems, the SFT steps
    of C3's students where the bed sets them (else the scale's), and facts for the record."""
    problems: list
    test: list
    traces: list
    pool: pd.DataFrame
    student: object
    sigs: dict
    tokens: dict
    seconds: float
    max_new_tokens: int = 48
    sft_steps: int | None = None
    info: dict = field(default_factory=dict)


def room(tok, examples) -> int:
    """New tokens a generation on ``examples`` needs: :func:`workbench.evaluate.room` with the
    steps (the longest reference trace plus 2, the cards' rule)."""
    return evaluate.room(tok, examples, with_steps=True)


def position_losses(model, tok, traces: list[Trace], edge: int, batch: int = 64) -> dict:
    """The mean next-token loss of the traces' labelled tokens at positions before ``edge`` and
    from ``edge`` on (a student's pretraining context: are the positions past it read as well?),
    with the token counts; ``None`` where a side has no token."""
    pairs = packing.encode(tok, [t.prompt for t in traces], [t.completion for t in traces])
    device = next(model.parameters()).device
    tot = np.zeros((2, 2))
    for b in ls.length_batches(pairs, batch, tok.pad_token_id, device)[0]:
        nll, lab = ls.token_losses(model, b), b["labels"] != -100
        past = torch.arange(nll.shape[1], device=nll.device)[None] >= edge
        for k, side in enumerate((lab & ~past, lab & past)):
            tot[k] += [float(nll[side].sum()), int(side.sum())]
    mean = [s / n if n else None for s, n in tot]
    return {"edge": edge, "before": mean[0], "past": mean[1],
            "tokens_before": int(tot[0, 1]), "tokens_past": int(tot[1, 1])}


def long_bed(spec: dict, S: dict, teacher_lm, tok, teacher: str, student: str, scale: str,
             fractions, seed: int, device) -> Bed:
    """C1's and C3's bed at mid: ``spec["n_per_level"]`` train problems at each of
    ``spec["family"]``'s levels (``spec["levels"]`` where given) and ``S["n_test"]`` held-out
    ones, one greedy trace each from ``teacher_lm`` with :func:`room`; a fresh ``student``
    adapted (:func:`adapt`) and probed (:func:`pool_signatures`) at ``S``'s sizes, ``pred`` its
    inflection losses on ``S["token_fraction"]``; ``cluster`` k-means on the signature features
    with k = the number of levels; ``spec["sft_steps"]``, where given, C3's SFT steps. Draws
    come from a generator of their own (seeded by ``seed`` and 18), so the main pool draws as it
    does without this bed."""
    rng = np.random.default_rng([seed, 18])
    fam = tasks.get(spec["family"])
    levels = spec.get("levels") or fam.difficulties
    problems, test = ([e for e in draw_problems([fam.name], n, side, rng) if e.difficulty in levels]
                      for n, side in ((spec["n_per_level"], "train"), (S["n_test"], "test")))
    new = room(tok, problems + test)
    traces = model_traces(teacher_lm, tok, problems, teacher, max_new_tokens=new)
    pool = pool_frame(traces)
    if spec.get("levels"):                      # the level spans the levels of this bed
        pool["level"] = [sorted(levels).index(d) / (len(levels) - 1) for d in pool.difficulty]
    t0 = time.time()
    lm, _ = zoo.load(student, scale, device=device)
    adapted = adapt(lm, tok, traces, rng, rank=S["lora_rank"], steps=S["adapt_steps"], seed=seed)
    sigs, tokens = pool_signatures(adapted, tok, traces, fractions, n_dirs=S["n_dirs"],
                                   dir_rank=S["dir_rank"], scales=S["scales"], seed=seed,
                                   device=device)
    pool["pred"] = ls.inflection_losses(sigs[S["token_fraction"]], S["scales"])
    seconds = time.time() - t0
    feats = ls.signature_features(sigs[S["token_fraction"]])
    pool["cluster"] = ls.kmeans_clusters(feats, len(levels), seed)
    edge = adapted.config.max_position_embeddings
    info = {"family": fam.name, "levels": list(levels), "teacher": teacher, "student": student,
            "traces": len(traces), "test_problems": len(test), "max_new_tokens": new,
            "correct_by_level": {int(d): float(v) for d, v
                                 in pool.groupby("difficulty").correct.mean().items()},
            "tokens_read_per_trace": {f: n / len(traces) for f, (n, _) in tokens.items()},
            "student_loss_by_position": position_losses(adapted, tok, traces, edge)}
    return Bed(problems, test, traces, pool, adapted, sigs, tokens, seconds, new,
               spec.get("sft_steps"), info)


# -- the generate-then-filter baseline ----------------------------------------------------------

def sequence_scores(model, tok, prompts: list[str], completions: list[str],
                    batch: int = 128) -> np.ndarray:
    """A judge's score of each completion: its mean token log-likelihood under ``model``."""
    pairs = packing.encode(tok, prompts, completions)
    device = next(model.parameters()).device
    batches, order = ls.length_batches(pairs, batch, tok.pad_token_id, device)
    out = np.zeros(len(pairs))
    out[order] = np.concatenate([-ls.masked_losses(model, b, b["labels"] != -100)
                                 for b in batches])
    return out


def generate_then_filter(teacher, judge, tok, examples, n_candidates: int, seed: int,
                         max_new_tokens: int = 48, batch: int = 64) -> list[str]:
    """The costly pipeline: ``n_candidates`` sampled traces per problem from ``teacher``
    (``generate(do_sample=True)``), each scored by ``judge`` (:func:`sequence_scores`); the best
    per problem is kept."""
    torch.manual_seed(seed)
    tok.padding_side = "left"
    cands: list[list[str]] = []
    with torch.no_grad():
        for i in range(0, len(examples), batch):
            chunk = [tok.bos_token + e.prompt for e in examples[i: i + batch]]
            enc = tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = {k: v.to(next(teacher.parameters()).device) for k, v in enc.items()}
            gen = teacher.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True,
                                   top_k=0, num_return_sequences=n_candidates,
                                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            cands += [[" " + t.split("\n")[0].strip() for t in texts[k: k + n_candidates]]
                      for k in range(0, len(texts), n_candidates)]
    flat_p = [e.prompt for e, cs in zip(examples, cands) for _ in cs]
    flat_c = [c for cs in cands for c in cs]
    sc = sequence_scores(judge, tok, flat_p, flat_c).reshape(len(examples), n_candidates)
    return [cs[int(np.argmax(s))] for cs, s in zip(cands, sc)]


# -- downstream students ------------------------------------------------------------------------

def student_accuracy(student: str, scale: str, traces: list[Trace], idx, tok, test, *,
                     sft: finetune.LoraSettings, tag: str, device,
                     per_item: bool = False) -> tuple[float | np.ndarray, bool]:
    """A student (the zoo model ``student`` with a cached ``peft`` LoRA SFT on the traces
    ``idx``) scored by exact match, with steps, on the held-out problems ``test`` (with
    ``per_item``, each problem's score, 1.0 or 0.0, in ``test`` order, for paired comparisons);
    and whether the fine-tune came from the cache."""
    model, _, info = finetune.cached_lora(student, scale, [traces[i].prompt for i in idx],
                                          [traces[i].completion for i in idx], sft, tag=tag,
                                          group=CACHE_GROUP, device=device)
    scores = evaluate.item_scores(model, tok, test, with_steps=True)
    return (scores if per_item else float(scores.mean())), info["cached"]


def subset_students(student: str, scale: str, traces: list[Trace], subsets: dict, tok, test, *,
                    sft: finetune.LoraSettings, tag: str, device, per_item: bool = False) -> dict:
    """:func:`student_accuracy` of one student per named subset of the traces, in order (with
    ``per_item``, each one's per-problem scores)."""
    return {name: student_accuracy(student, scale, traces, idx, tok, test, sft=sft, tag=tag,
                                   device=device, per_item=per_item)[0]
            for name, idx in subsets.items()}


# -- the explorer: one fixed scale against the inflection point ---------------------------------

def sigma_correlations(sig, level, scales) -> pd.DataFrame:
    """Per perturbation scale sigma: Spearman between the level and the mean (over directions)
    loss at that sigma, the share of traces whose inflection point sigma* lies in [sigma, the
    next sigma) (a curve with no sign change falls back to its steepest rise, see
    :func:`workbench.methods.loss_signature.inflection`), and (every row) the Spearman of the
    inflection-point loss itself."""
    curves = np.asarray(sig).mean(1)                               # (traces, scales)
    star = np.array([ls.inflection(scales, c)[0] for c in curves])
    interval = np.clip(np.searchsorted(scales, star, side="right") - 1, 0, len(scales) - 1)
    proxy = spearmanr(level, [ls.inflection(scales, c)[1] for c in curves])[0]
    return pd.DataFrame({"sigma": scales,
                         "spearman at sigma": [spearmanr(level, curves[:, j])[0]
                                               for j in range(len(scales))],
                         "share of inflection points": np.bincount(interval, minlength=len(scales))
                         / len(curves),
                         "spearman, inflection loss": proxy})


def sigma_figure(table: pd.DataFrame, sig, pool: pd.DataFrame, sigma: float, fraction: float):
    """Left: Spearman with the level of the loss at each fixed sigma, against the inflection
    proxy's, with where the inflection points lie; ``sigma`` marked. Right: the loss at
    ``sigma`` against the true level, one colour per teacher, with each teacher's mean over the
    levels binned by quarters (the families' level grids differ)."""
    fig, (a, b) = plots.subplots(1, 2, figsize=(12, 4))
    edges = table.sigma.to_numpy()
    a.bar(edges[:-1], table["share of inflection points"].iloc[:-1], width=np.diff(edges),
          align="edge", color="0.85", ec="0.6", label="share of traces with σ* in the interval")
    a.plot(table.sigma, table["spearman at sigma"], "o-", color=plots.PALETTE[0],
           label="loss at a fixed σ")
    a.axhline(table["spearman, inflection loss"].iloc[0], color=plots.PALETTE[1], ls="--",
              label="loss at the inflection point σ*")
    a.axvline(sigma, color="k", ls=":", lw=1)
    a.set(xlabel="perturbation scale σ", ylabel="Spearman with the level / share",
          title=f"Which σ reads difficulty ({fraction:.0%} of the tokens)")
    a.legend(fontsize=7)
    loss = np.asarray(sig).mean(1)[:, list(table.sigma).index(sigma)]
    jit = np.random.default_rng(0).normal(0, 0.015, len(pool))
    for i, t in enumerate(pool.teacher.unique()):
        sel = (pool.teacher == t).values
        b.scatter(pool.level[sel] + jit[sel], loss[sel], s=8, alpha=0.5, color=plots.PALETTE[i])
        binned = np.round(pool.level.values[sel] * 4) / 4       # families' levels on one grid
        m = pd.Series(loss[sel]).groupby(binned).mean()
        b.plot(m.index, m.values, "-", color=plots.PALETTE[i], label=f"{t} (mean, levels binned)")
    rho = table.loc[table.sigma == sigma, "spearman at sigma"].item()
    b.set(xlabel="true difficulty (level within family, 0-1)", ylabel="mean masked loss (nats)",
          title=f"Loss at σ = {sigma}: Spearman {rho:.2f}")
    b.legend(fontsize=7)
    return fig
