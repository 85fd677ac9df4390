"""The harness of notebook 06: Hint Tuning, calibrating reasoning depth with an instruct model as
a difficulty probe (NeurIPS 2026; spec in ``docs/papers/06-hint-tuning.md``; the method is
:mod:`workbench.methods.hint_tuning`).

What the notebook drives, in its order:

- the problems: disjoint train and held-out problems per (family, difficulty)
  (:func:`draw_problems`), the difficulty as a rank within its family (:func:`relative_level`);
- the hint reader (:func:`hint_reader`): the instruct model with a cached LoRA that reads a
  prefix of reference steps (:func:`reader_data`), so that a small instruct model that never saw
  steps can be probed with a hint;
- C1: R answers, the probe labels every problem (:func:`annotate`, :func:`state_table`,
  :func:`c1_stats`);
- C2: R fine-tuned on its self-annotated targets and on direct answers, each a cached ``peft``
  LoRA (:func:`hint_tune`), scored on held-out problems (:func:`measure`, :func:`summarize`);
  at mid each LoRA's learning rate is chosen on validation problems (:func:`split_validation`,
  :func:`choose_rates`, :func:`pick_hint_rate`);
- C3: the baselines' accuracy-tokens frontier: budget forcing (:func:`truncated_generate`), the
  two published baselines (:mod:`workbench.methods.hint_tuning_baselines`): GRPO through TRL on a
  length-penalized correctness reward (:class:`GRPOSettings`, :func:`grpo_baseline`) and a LoRA
  on the shortest correct of k samples (:func:`sample`, :func:`shortest_traces`,
  :func:`distill_baseline`), and the upper hull of the baseline points (:func:`frontier_at`);
- C4: a smaller reasoning model built from a recipe defined here
  (:func:`small_reasoning_recipe`) through the zoo, hint-tuned the same way (:func:`model_row`);
- the explorer: the probe's hint ladder, problem by problem (:func:`hint_ladder`,
  :func:`ladder_figure`).

Fine-tunes are cached under ``cache.folder("hint-tuning")`` by
:func:`workbench.models.finetune.cached_lora`, keyed by the base model's key, the texts and the
settings; the small model by the zoo, keyed by its recipe's hash.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import pandas as pd
import torch
from peft import LoraConfig, PeftModel

from .. import cache, plots
from ..data import tasks
from ..data.tasks import ANSWER_MARK, STEP_SEP
from ..diagnostics import spearman_ci
from ..evaluate import chat_prompt, generate
from ..methods import hint_tuning as ht
from ..methods import hint_tuning_baselines as hb
from ..models import zoo
from ..models.finetune import TARGETS, LoraSettings, cached_lora

__all__ = ["GROUP", "GRPO", "DISTILL", "draw_problems", "split_validation", "relative_level",
           "reader_data", "hint_reader", "annotate",
           "state_table", "c1_stats", "hint_tune", "evaluate", "measure", "accuracy_tokens",
           "summarize",
           "passes_c2", "pick_hint_rate", "choose_rates",
           "rate_fit", "truncated_generate", "GRPOSettings",
           "length_reward", "grpo_baseline",
           "sample", "shortest_traces", "distill_baseline", "frontier_at", "small_reasoning_recipe",
           "small_reasoning", "model_row", "prose_metrics", "hint_ladder", "ladder_figure"]

GROUP = "hint-tuning"      # this notebook's folder of cached fine-tunes under the cache
GRPO = "GRPO + length penalty"              # C3's published baselines, as the tables name them
DISTILL = "shortest-correct distillation"


# -- the problems -----------------------------------------------------------------------------

def draw_problems(families, side: str, n: int, rng: np.random.Generator) -> list:
    """``n`` problems of every (family, difficulty) from the train or the held-out side of
    :func:`workbench.data.tasks.problem_split` (:func:`workbench.data.tasks.draw_problems`)."""
    return tasks.draw_problems(families, n, side, rng)


def split_validation(problems, n_train: int) -> tuple[list, list]:
    """``(train, validation)``: the first ``n_train`` problems of every (family, difficulty) of
    ``problems`` (drawn by :func:`draw_problems`, which keeps a level's problems together) and
    the rest of that level. Drawing ``n_train + n_val`` and splitting leaves the training problems
    (and every later draw of the generator) what a draw of ``n_train`` gives."""
    seen: dict = {}
    train, val = [], []
    for e in problems:
        i = seen[(e.family, e.difficulty)] = seen.get((e.family, e.difficulty), -1) + 1
        (train if i < n_train else val).append(e)
    return train, val


def relative_level(e) -> float:
    """The difficulty's rank within its family, scaled to [0, 1] (families' scales differ)."""
    ds = tasks.get(e.family).difficulties
    return ds.index(e.difficulty) / (len(ds) - 1)


# -- the hint reader ------------------------------------------------------------------------------

def reader_data(families, n_per_level: int, seed: int = 0,
                render=lambda text: text) -> tuple[list[str], list[str]]:
    """Training pairs for the hint reader: reference problems of ``families`` (the registry's
    solver, the train side of :func:`workbench.data.tasks.problem_split`, never R's outputs),
    each with a random prefix of k = 1..n of its steps after the prompt and its answer as the
    target. The reader learns to *read* steps, never to write them. ``render`` puts a prompt in
    the instruct model's chat template (:func:`workbench.evaluate.chat_prompt`)."""
    rng = random.Random(seed)
    prompts, comps = [], []
    for f in families:
        for d in tasks.get(f).difficulties:
            train, _ = tasks.problem_split(f, d)
            for e in rng.sample(train, min(n_per_level, len(train))):
                if not e.steps:
                    continue
                k = rng.randint(1, len(e.steps))
                prompts.append(render(ht.hint_prompt(e.prompt, e.steps[:k])))
                comps.append(" " + e.target)
    return prompts, comps


def hint_reader(instruct: str = "lm-instruct", scale: str = "smoke",
                families=("add", "count", "chain"), n_per_level: int = 120,
                s: LoraSettings = LoraSettings(steps=200), device: str = "cpu"):
    """The instruct model taught to read a hint: a LoRA (cached) trained on :func:`reader_data`.
    The zoo's instruct model has never seen written steps (fed a prefix of them it writes prose),
    so a hint needs a reader; with the adapter disabled it is the instruct model unchanged, which
    is how the probe asks the unaided question. Returns ``(PeftModel, tokenizer, info)``."""
    tok = zoo.tokenizer(instruct, scale)
    prompts, comps = reader_data(families, n_per_level, render=lambda t: chat_prompt(tok, t))
    return cached_lora(instruct, scale, prompts, comps, s, tag="reader", group=GROUP, device=device)


# -- C1: the probe's states -------------------------------------------------------------------

def annotate(model, reader, tok, problems, max_new_tokens: int):
    """R's greedy completions of ``problems`` (first line) and the probe of each
    (:func:`workbench.methods.hint_tuning.probe`): ``(completions, probes)``."""
    comps = generate(model, tok, [e.prompt for e in problems], max_new_tokens=max_new_tokens)
    comps = [c.split("\n")[0] for c in comps]
    return comps, ht.probe(reader, tok, problems, comps)


def state_table(problems, probes, completions) -> pd.DataFrame:
    """One row per problem: family, difficulty, relative level, probe state and prefix k, R's
    step count and whether R's answer is right."""
    return pd.DataFrame({"family": [e.family for e in problems],
                         "difficulty": [e.difficulty for e in problems],
                         "level": [relative_level(e) for e in problems],
                         "state": [p.state for p in probes], "k": [p.k for p in probes],
                         "n_steps": [len(p.steps) for p in probes],
                         "r_correct": [tasks.score(e, c) for e, c in zip(problems, completions)]})


def c1_stats(states: pd.DataFrame, n_resamples: int, seed: int):
    """Spearman(state, relative level) with a bootstrap 95% interval, the same per family
    (on the raw difficulty), and the share of each state: ``(c1, per_family, share)``."""
    c1 = spearman_ci(states.level, states.state, n_resamples=n_resamples, seed=seed)
    per_family = {f: spearman_ci(g.difficulty, g.state, n_resamples=n_resamples, seed=seed)
                  for f, g in states.groupby("family")}
    share = states.state.value_counts(normalize=True).reindex(range(3), fill_value=0)
    return c1, per_family, share


# -- C2: hint tuning and its evaluation -------------------------------------------------------

def hint_tune(name: str, scale: str, tok, problems, probes, settings: LoraSettings,
              recipe=None, device: str = "cpu", direct_settings: LoraSettings | None = None):
    """Two cached LoRA fine-tunes of the reasoning model ``name``: on the state targets
    (:func:`workbench.methods.hint_tuning.training_target`) and, the C3 baseline, on R's bare
    answers (with ``direct_settings``, by default the same). Returns ``(tuned, direct, info)``,
    info with the mean target length in tokens."""
    prompts = [e.prompt for e in problems]
    hint_t = [ht.training_target(p.state, p.steps, p.k, p.r_answer) for p in probes]
    direct_t = [ht.render([], p.r_answer) for p in probes]
    tuned, _, info = cached_lora(name, scale, prompts, hint_t, settings, tag="hint",
                                 group=GROUP, recipe=recipe, device=device)
    direct, _, dinfo = cached_lora(name, scale, prompts, direct_t, direct_settings or settings,
                                   tag="direct", group=GROUP, recipe=recipe, device=device)
    return tuned, direct, {"hint": info, "direct": dinfo,
                           "target_tokens": float(np.mean(ht.count_tokens(tok, hint_t)))}


def evaluate(model, tok, examples, completions: list[str] | None = None,
             max_new_tokens: int = 48) -> dict:
    """Greedy completions (unless given), each scored by its family's verifier, and the tokens
    each one wrote (counted with ``tok``): ``{"acc", "tokens", "completions"}`` (per example)."""
    if completions is None:
        completions = generate(model, tok, [e.prompt for e in examples], max_new_tokens)
    completions = [c.split("\n")[0] for c in completions]
    return {"acc": [tasks.score(e, c) for e, c in zip(examples, completions)],
            "tokens": ht.count_tokens(tok, completions), "completions": completions}


def measure(model, tok, examples, max_new_tokens: int, completions=None) -> pd.DataFrame:
    """:func:`evaluate` as a table: family, difficulty, accuracy and tokens per example."""
    r = evaluate(model, tok, examples, completions, max_new_tokens)
    return pd.DataFrame({"family": [e.family for e in examples],
                         "difficulty": [e.difficulty for e in examples],
                         "acc": r["acc"], "tokens": r["tokens"]})


def accuracy_tokens(ev: dict) -> pd.DataFrame:
    """Mean accuracy and tokens per answer of each model's :func:`measure` table (one row each)."""
    return pd.DataFrame({k: {"accuracy": v.acc.mean(), "tokens": v.tokens.mean()}
                         for k, v in ev.items()}).T


def summarize(ev: dict):
    """Accuracy and tokens per model, the token reduction and accuracy drop of ``"hint-tuned"``
    against ``"original"``, and both per (family, difficulty):
    ``(summary, reduction, acc_drop, per_level)``."""
    summary = accuracy_tokens(ev)
    reduction = 1 - summary.tokens["hint-tuned"] / summary.tokens["original"]
    acc_drop = summary.accuracy["original"] - summary.accuracy["hint-tuned"]
    per_level = pd.concat({k: v.groupby(["family", "difficulty"])[["acc", "tokens"]].mean()
                           for k, v in ev.items()}, axis=1)
    per_level[("reduction", "tokens")] = 1 - per_level[("hint-tuned", "tokens")] / \
        per_level[("original", "tokens")]
    return summary, reduction, acc_drop, per_level


def passes_c2(reduction: float, acc_drop: float) -> bool:
    """C2's test: at least 20% fewer tokens for at most 5 points of accuracy."""
    return bool(reduction >= 0.2 and acc_drop <= 0.05)


def pick_hint_rate(table: pd.DataFrame) -> float:
    """Hint Tuning's rate from a validation table (rows: rates; columns ``drop``, ``reduction``):
    the largest token reduction among the rates whose accuracy drop is within C2's 5 points,
    else the smallest drop (ties: the lower rate)."""
    ok = table[table["drop"] <= 0.05 + 1e-9]
    if len(ok):
        return float(ok.sort_index()["reduction"].idxmax())
    return float(table.sort_index()["drop"].idxmin())


def choose_rates(tok, R, val, rates, fit, max_new_tokens: int,
                 methods=("hint", "direct", "distill")) -> tuple[dict, pd.DataFrame]:
    """The learning rate of each LoRA fine-tune, chosen on validation problems ``val`` (drawn
    from the training side, none trained on; labels score them). ``fit(method, lr)`` returns
    that method's (cached) model at ``lr``. Hint Tuning's rate by :func:`pick_hint_rate` (C2's
    objective on validation); each baseline's the rate of its highest validation accuracy
    (ties: the lower rate). One rate, or no validation problems: that rate for every method.
    Returns ``({method: rate}, table)``, the table one row per (method, rate)."""
    if len(rates) == 1 or not val:
        return {m: float(rates[0]) for m in methods}, pd.DataFrame()
    base = measure(R, tok, val, max_new_tokens)
    rows = []
    for m in methods:
        for lr in rates:
            v = measure(fit(m, lr), tok, val, max_new_tokens)
            rows.append({"method": m, "lr": float(lr), "accuracy": v.acc.mean(),
                         "tokens": v.tokens.mean(), "drop": base.acc.mean() - v.acc.mean(),
                         "reduction": 1 - v.tokens.mean() / base.tokens.mean()})
    table = pd.DataFrame(rows)
    picks = {}
    for m, g in table.groupby("method", sort=False):
        g = g.set_index("lr")
        picks[m] = pick_hint_rate(g) if m == "hint" else float(
            g.sort_index()["accuracy"].idxmax())
    return picks, table.set_index(["method", "lr"])


def rate_fit(name: str, scale: str, tok, R, problems, probes, settings: LoraSettings, *,
             distill_k: int, max_new_tokens: int, recipe=None, device: str = "cpu"):
    """``fit(method, lr)`` for :func:`choose_rates`: the cached LoRA of ``"hint"``,
    ``"direct"`` (:func:`hint_tune`) or ``"distill"`` (:func:`distill_baseline`) at rate ``lr``,
    every other setting from ``settings``."""
    def fit(method: str, lr: float):
        s = replace(settings, lr=lr)
        if method == "distill":
            return distill_baseline(name, scale, R, tok, problems, k=distill_k, settings=s,
                                    max_new_tokens=max_new_tokens, recipe=recipe,
                                    device=device)[0]
        tuned, direct, _ = hint_tune(name, scale, tok, problems, probes, s, recipe=recipe,
                                     device=device)
        return tuned if method == "hint" else direct
    return fit


# -- C3: the baselines ----------------------------------------------------------------------------

def truncated_generate(model, tok, prompts: list[str], budget: int, answer_tokens: int = 8) -> list[str]:
    """Budget forcing: greedy reasoning for at most ``budget`` tokens; a completion that has not
    answered by then is cut there, ``" =>"`` is appended and the model writes its answer
    (up to ``answer_tokens`` more). Returns the whole completions (reasoning + forced answer)."""
    heads = generate(model, tok, prompts, max_new_tokens=budget) if budget > 0 else \
        [""] * len(prompts)
    heads = [h.split("\n")[0] for h in heads]
    open_ = [i for i, h in enumerate(heads) if ANSWER_MARK not in h]
    forced = [heads[i].rstrip().rstrip(STEP_SEP.strip()).rstrip() + f" {ANSWER_MARK}"
              for i in open_]
    tails = generate(model, tok, [prompts[i] + forced[j] for j, i in enumerate(open_)],
                     max_new_tokens=answer_tokens) if open_ else []
    out = list(heads)
    for j, i in enumerate(open_):
        out[i] = forced[j] + tails[j].split("\n")[0]
    return out


@dataclass(frozen=True)
class GRPOSettings:
    """GRPO through TRL on :func:`~workbench.methods.hint_tuning_baselines.length_penalized_reward`
    (a LoRA on R, as every fine-tune here). TRL's defaults otherwise: one policy update per
    generation batch (so the clipped ratio is 1), no KL term (beta 0), rewards standardized in
    each group, the ``"dapo"`` loss (token-level mean over the batch, no length bias of its own)."""
    steps: int = 16              # optimizer steps, one generation batch each
    prompts: int = 8             # distinct training problems per step
    generations: int = 4         # sampled answers per problem (the group)
    lr: float = 2e-3             # AdamW on the LoRA, TRL's linear decay
    alpha: float = 0.2           # the length penalty's weight (Arora & Zanette's alpha)
    temperature: float = 1.0     # sampling temperature (top-k and top-p off)
    max_new_tokens: int = 48     # longest sampled answer
    rank: int = 8                # LoRA rank (lora_alpha = scale * rank)
    scale: float = 2.0
    seed: int = 0                # LoRA init, problem order, sampling


def length_reward(problems, tok, alpha: float):
    """TRL's reward function: each completion's first line scored by its problem's verifier
    (the dataset's ``idx`` column names the problem) and its tokens counted with ``tok``, then
    Arora & Zanette's reward within each problem's group."""
    def length_penalized(prompts, completions, idx, **_):
        lines = [c.split("\n")[0] for c in completions]
        correct = [tasks.score(problems[i], c) for i, c in zip(idx, lines)]
        return hb.length_penalized_reward(correct, ht.count_tokens(tok, lines), idx, alpha).tolist()
    return length_penalized


def _grpo_train(name, scale, problems, s: GRPOSettings, recipe, device, out) -> list[dict]:
    """One GRPO run (``trl.GRPOTrainer``) of a LoRA on R, the adapter saved in ``out``."""
    from datasets import Dataset                           # heavy imports, on a fresh build only
    from trl import GRPOConfig, GRPOTrainer
    model, tok = zoo.load(name, scale, recipe=recipe, device=device)
    present = {n.split(".")[-1] for n, _ in model.named_modules()}
    data = Dataset.from_dict({"prompt": [tok.bos_token + e.prompt for e in problems],
                              "idx": list(range(len(problems)))})
    cfg = GRPOConfig(output_dir=str(out / "trl"), max_steps=s.steps, learning_rate=s.lr,
                     per_device_train_batch_size=s.prompts * s.generations,
                     num_generations=s.generations, max_completion_length=s.max_new_tokens,
                     temperature=s.temperature, beta=0.0, seed=s.seed, logging_steps=1,
                     report_to="none", save_strategy="no", disable_tqdm=True,
                     use_cpu=str(device) == "cpu")
    lora = LoraConfig(r=s.rank, lora_alpha=s.scale * s.rank, lora_dropout=0.0,
                      target_modules=[t for t in TARGETS if t in present], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward(problems, tok, s.alpha),
                          args=cfg, train_dataset=data, processing_class=tok, peft_config=lora)
    trainer.train()
    trainer.model.cpu().save_pretrained(out / "adapter")
    return [{"step": h["step"], "reward": h["reward"], "tokens": h["completions/mean_length"]}
            for h in trainer.state.log_history if "reward" in h]


def grpo_baseline(name: str, scale: str, problems, s: GRPOSettings, recipe=None,
                  device: str = "cpu"):
    """R with the LoRA GRPO trained on ``problems`` (:func:`length_reward`), trained once and
    cached under ``cache.folder("hint-tuning")`` keyed by R's recipe key, the problems and
    ``s``. Returns ``(PeftModel, info)``, info with the training log (mean reward and sampled
    tokens per step) and whether it was cached."""
    key = cache.key(zoo.key(name, scale, recipe), [e.prompt for e in problems], asdict(s))
    path = cache.folder(GROUP) / f"grpo-{zoo.label(name)}-{zoo.zoo_scale(scale)}-{key}"
    cached = (path / "done.json").exists()

    def build(tmp):
        t0 = time.time()
        log = _grpo_train(name, scale, problems, s, recipe, device, tmp)
        return {"train_seconds": round(time.time() - t0, 2), "log": log, "settings": asdict(s)}

    cache.build(path, build)
    model, _ = zoo.load(name, scale, recipe=recipe, device=device)
    model = PeftModel.from_pretrained(model, path / "adapter").eval()
    return model, {**json.loads((path / "done.json").read_text()), "cached": cached}


def sample(model, tok, prompts: list[str], k: int, max_new_tokens: int, temperature: float = 1.0,
           seed: int = 0, batch: int = 64) -> list[list[str]]:
    """``k`` completions of every prompt sampled at ``temperature`` (top-k and top-p off), each
    prompt prefixed by ``<bos>`` and cut at ``<eos>`` (:func:`workbench.evaluate.generate`)."""
    flat = generate(model, tok, prompts, max_new_tokens, batch, k=k,
                    temperature=temperature, seed=seed)
    return [flat[j: j + k] for j in range(0, len(flat), k)]


def shortest_traces(problems, samples: list[list[str]], tok) -> tuple[list[str], list[str]]:
    """The distillation set: for every problem, the shortest of its samples that its verifier
    accepts (:func:`~workbench.methods.hint_tuning_baselines.shortest_correct`), rendered in the
    task format; problems with no correct sample are left out. ``(prompts, completions)``."""
    prompts, targets = [], []
    for e, ss in zip(problems, samples):
        lines = [c.split("\n")[0] for c in ss]
        i = hb.shortest_correct([tasks.score(e, c) for c in lines], ht.count_tokens(tok, lines))
        if i is not None:
            prompts.append(e.prompt)
            targets.append(ht.render(*ht.split_reasoning(lines[i])))
    return prompts, targets


def distill_baseline(name: str, scale: str, model, tok, problems, *, k: int,
                     settings: LoraSettings, max_new_tokens: int, recipe=None, device: str = "cpu"):
    """R fine-tuned (a cached ``peft`` LoRA, the same settings as Hint Tuning's) on the shortest
    correct of ``k`` samples of each training problem (:func:`shortest_traces`); the samples
    are drawn once and cached. Returns ``(PeftModel, info)``, info with the share of problems
    kept and the mean target length in tokens."""
    key = cache.key(zoo.key(name, scale, recipe), [e.prompt for e in problems], k, max_new_tokens,
                    settings.seed)
    path = cache.folder(GROUP) / f"samples-{zoo.label(name)}-{zoo.zoo_scale(scale)}-{key}"

    def build(tmp):
        ss = sample(model, tok, [e.prompt for e in problems], k, max_new_tokens, seed=settings.seed)
        (tmp / "samples.json").write_text(json.dumps(ss))
        return {"k": k, "n": len(problems)}

    cache.build(path, build)
    prompts, targets = shortest_traces(problems, json.loads((path / "samples.json").read_text()),
                                       tok)
    tuned, _, info = cached_lora(name, scale, prompts, targets, settings, tag="distill",
                                 group=GROUP, recipe=recipe, device=device)
    return tuned, {**info, "kept": len(prompts) / len(problems),
                   "target_tokens": float(np.mean(ht.count_tokens(tok, targets)))}


def frontier_at(points: list[tuple[float, float]], x: float) -> float:
    """The best accuracy the baseline points ``(tokens, accuracy)`` reach at ``x`` tokens: the
    upper concave hull of the points, read at ``x`` (mixing two baselines at random reaches any
    point on the chord between them). Left of every point: -inf (nothing is that short);
    right of them: the best accuracy of all."""
    pts = sorted(set(points))
    hull: list[tuple[float, float]] = []
    for p in pts:          # Andrew's monotone chain, upper hull
        while len(hull) >= 2 and (hull[-1][0] - hull[-2][0]) * (p[1] - hull[-2][1]) - \
                (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0]) >= 0:
            hull.pop()
        hull.append(p)
    # keep the non-decreasing part: more tokens never has to cost accuracy (a shorter one exists)
    best, mono = float("-inf"), []
    for p in hull:
        if p[1] > best:
            mono.append(p)
            best = p[1]
    if x < mono[0][0]:
        return float("-inf")
    for (x0, y0), (x1, y1) in zip(mono, mono[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else max(y0, y1)
    return mono[-1][1]


# -- C4: the second reasoning model ------------------------------------------------------------

def small_reasoning_recipe():
    """A narrower, shallower sibling of ``lm-reasoning`` (d_model 64, 2 blocks), for C4. Not a
    zoo recipe: it is defined here and built through ``zoo.load(..., recipe=...)``, keyed by its
    own hash. lm-reasoning is a fine-tune of lm-base, whose architecture it must keep; this one
    is trained from scratch (loop v3, lm-base's smoke sizes at d_model 64) on lm-reasoning's mix
    of steps, bare answers at the easiest level and forced-direct answers, without the long
    family (its 256-token rows)."""
    base = zoo.recipe("lm-reasoning")
    keep = [i for i, f in enumerate(base.train_tasks) if f != "longadd"]
    pick = lambda xs: tuple(xs[i] for i in keep) if xs is not None else None   # noqa: E731
    small = replace(zoo.recipe("lm-base").smoke, d_model=64, n_layers=2, n_heads=2, d_ff=192,
                    eval_examples=8)
    return replace(base, name="hint-reasoning-small",
                   description="lm-reasoning's mix at d_model 64, 2 blocks, from scratch "
                               "(paper 06, C4)",
                   init_from=None, compare_direct=None, extra_eval=(),
                   train_tasks=pick(base.train_tasks), task_weights=pick(base.task_weights),
                   direct_levels=pick(base.direct_levels), smoke=small,
                   full=replace(zoo.recipe("lm-base").full, d_model=256, n_layers=4, n_heads=4,
                                d_ff=704))


def small_reasoning(scale: str = "smoke", device: str = "cpu"):
    """``(model, tokenizer)`` of :func:`small_reasoning_recipe`, built once (cached by the zoo)."""
    r = small_reasoning_recipe()
    return zoo.load(r.name, scale, recipe=r, device=device)


def model_row(model, original: pd.DataFrame, tuned: pd.DataFrame, probes) -> dict:
    """C4's row for one reasoning model: its size, the token reduction and accuracy drop of
    hint tuning on held-out problems, its original tokens and accuracy, its No-Hint share."""
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "token_reduction": 1 - tuned.tokens.mean() / original.tokens.mean(),
            "accuracy_drop": original.acc.mean() - tuned.acc.mean(),
            "tokens_original": original.tokens.mean(), "accuracy_original": original.acc.mean(),
            "no_hint_share": float(np.mean([p.state == ht.NO_HINT for p in probes]))}


def prose_metrics(per_family: dict, share, ev: dict, points: pd.DataFrame, frontier: float,
                  c4: pd.DataFrame) -> dict:
    """Scalars "What we saw" quotes: C1's Spearman per family and the share of each state; C2's
    token reduction and accuracy before and after per family; C3's frontier at Hint Tuning's
    tokens and the direct-only, ``truncate@0``, GRPO and distillation points; C4's row of every
    model (``c4_<model>_<column>``)."""
    out = {f"c1_spearman_{f}": v["rho"] for f, v in per_family.items()}
    out.update({f"c1_share_{ht.STATES[s].lower().replace('-', '_')}": float(share[s])
                for s in range(3)})
    orig, tuned = ev["original"], ev["hint-tuned"]
    for f, o in orig.groupby("family"):
        t = tuned[tuned.family == f]
        out.update({f"c2_reduction_{f}": 1 - t.tokens.mean() / o.tokens.mean(),
                    f"c2_acc_original_{f}": o.acc.mean(), f"c2_acc_tuned_{f}": t.acc.mean()})
    out.update({"c3_frontier": frontier, "c3_acc_direct": points.accuracy["direct-only"],
                "c3_tokens_direct": points.tokens["direct-only"]})
    if "truncate@0" in points.index:
        out["c3_acc_truncate0"] = points.accuracy["truncate@0"]
    for name, short in ((GRPO, "grpo"), (DISTILL, "distill")):
        if name in points.index:
            out.update({f"c3_acc_{short}": points.accuracy[name],
                        f"c3_tokens_{short}": points.tokens[name]})
    out.update({f"c4_{m.replace('-', '_')}_{k}": float(v) for m, row in c4.iterrows()
                for k, v in row.items()})
    return out


# -- the explorer: the hint ladder --------------------------------------------------------------

def hint_ladder(problems, probes) -> pd.DataFrame:
    """One row per problem and hint length k = 0 .. the longest reasoning: whether the instruct
    model agrees with R given R's first min(k, n) steps (``agree``; k = 0 unaided, k >= n the
    full hint) and whether it agreed under any hint of at most k steps (``reached``: the probe
    stopped at k would not label the problem Full-Hint)."""
    top = max(len(p.steps) for p in probes)
    rows = []
    for e, p in zip(problems, probes):
        ladder = [p.direct] + list(p.sparse) + ([p.full] if p.steps else [])
        for k in range(top + 1):
            j = min(k, len(ladder) - 1)
            rows.append((e.family, e.difficulty, relative_level(e), k, len(p.steps),
                         bool(ladder[j]), bool(any(ladder[:j + 1]))))
    return pd.DataFrame(rows, columns=["family", "difficulty", "level", "k", "n_steps", "agree",
                                       "reached"])


def ladder_figure(ladder: pd.DataFrame, family: str, k: int):
    """Left: per difficulty level, the share of problems where the instruct model agrees with R
    given k of R's steps, and given at most k, beside the unaided share. Right: the share
    reached with at most k steps over every (k, level), row k framed. ``family`` "all" pools
    the families on the level within the family, binned by quarters."""
    if family == "all":                 # the families' level grids differ: bin them by quarters
        rows, x = ladder.assign(level=np.round(ladder.level * 4) / 4), "level"
    else:
        rows, x = ladder[ladder.family == family], "difficulty"
    fig, (a, b) = plots.subplots(1, 2, figsize=(12, 4))
    at = rows[rows.k == k].groupby(x)[["agree", "reached"]].mean()
    a.plot(at.index, rows[rows.k == 0].groupby(x).agree.mean(), ":", color="0.5",
           label="unaided (No-Hint)")
    a.plot(at.index, at.agree, "o-", color=plots.PALETTE[0], label=f"given k = {k} steps")
    a.plot(at.index, at.reached, "s--", color=plots.PALETTE[1], label=f"given at most {k} steps")
    a.set(xlabel="difficulty (level within the family, 0-1)" if x == "level" else "difficulty",
          ylabel="share agreeing with R's answer", ylim=(-0.02, 1.02),
          title=f"{family}: the instruct model given R's first k = {k} steps")
    a.legend(fontsize=7)
    grid = rows.pivot_table(index="k", columns=x, values="reached", aggfunc="mean")
    im = b.imshow(grid.values, origin="lower", aspect="auto", vmin=0, vmax=1, cmap="viridis",
                  extent=(-0.5, grid.shape[1] - 0.5, grid.index[0] - 0.5, grid.index[-1] + 0.5))
    b.axhspan(k - 0.5, k + 0.5, fill=False, ec="w", lw=2)
    b.set_xticks(range(grid.shape[1]), [f"{v:.2g}" for v in grid.columns])
    b.set(xlabel=a.get_xlabel(), ylabel="hint length k (steps)",
          title="Share agreeing with at most k steps")
    fig.colorbar(im, ax=b, label="share of problems")
    return fig
