"""Hint Tuning: calibrating reasoning depth with an instruct model as a difficulty probe (paper 06,
``papers/06-hint-tuning.md``).

A reasoning model R writes its steps before answering; the matching instruct model I answers
directly. The paper turns "how hard is this problem?" into a consistency check between them:

1. R solves the problem: steps ``s_1 ; ... ; s_n => a_R`` (:func:`split_reasoning`).
2. I is probed under growing guidance: no hint, a *sparse* hint (the first k steps of R's
   reasoning, k = 1, ..., n - 1, :func:`sparse_hints`) and the *full* hint (all n steps), each
   rendered after the prompt and followed by the answer mark (:func:`hint_prompt`). A small
   instruct model that has never seen steps cannot read them, so the hinted questions go to a
   *hint reader* (:func:`hint_reader`): the instruct model with a LoRA trained on reference
   problems with a random prefix of their steps and the bare answer as target.
3. The problem's state is the least guidance under which I's answer equals a_R
   (:func:`label_state`): **No-Hint** (I agrees unaided), **Sparse-Hint** (the minimal prefix
   k* that makes it agree), **Full-Hint** (nothing shorter than the whole reasoning does).
4. R is fine-tuned (``peft`` LoRA) on its own problems with a target per state
   (:func:`training_target`): the bare answer, the minimal prefix then the answer, or the full
   reasoning. No label is used: the set is self-annotated from R's and I's answers.

Baselines (:func:`truncated_generate`): the same problems trained on direct answers only, and
R's reasoning cut to a fixed token budget and then forced to answer (``=>``). The comparison is an
accuracy-tokens Pareto frontier (:func:`frontier_at`). Tokens are always counted with the model's
tokenizer (:func:`count_tokens`).

Fine-tuned adapters are cached under ``cache_dir()/hint-tuning/`` keyed by a hash of the base
model's key, the training texts and the settings
(:func:`workbench.models.finetune.cached_lora`), so a notebook never retrains what it has
trained before; so is the smaller reasoning model of C4 (:func:`small_reasoning`), built by the
zoo's own machinery from a recipe defined here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..data.tasks import ANSWER_MARK, STEP_SEP, final_answer
from ..models.finetune import LoraSettings, cached_lora

GROUP = "hint-tuning"      # this notebook's folder of cached fine-tunes under the cache

NO_HINT, SPARSE_HINT, FULL_HINT = 0, 1, 2
STATES = ("No-Hint", "Sparse-Hint", "Full-Hint")


# -- reasoning text ---------------------------------------------------------------------------

def split_reasoning(completion: str) -> tuple[list[str], str]:
    """``(steps, answer)`` of a completion ``" s1 ; s2 => a"``: the first line, steps before the
    last ``=>`` split on ``" ; "``; no ``=>`` means no steps (a direct answer)."""
    line = completion.strip().split("\n")[0]
    if ANSWER_MARK not in line:
        return [], line.strip()
    head, ans = line.rsplit(ANSWER_MARK, 1)
    steps = [s.strip() for s in head.split(STEP_SEP.strip()) if s.strip()]
    return steps, ans.strip()


def render(steps: list[str], answer: str) -> str:
    """A completion in the task registry's format: ``" s1 ; s2 => a"`` or ``" a"``."""
    if not steps:
        return " " + answer
    return " " + STEP_SEP.join(steps) + f" {ANSWER_MARK} " + answer


def sparse_hints(steps: list[str]) -> list[list[str]]:
    """The proper prefixes of the reasoning, shortest first: ``steps[:1], ..., steps[:n-1]``
    (the candidates for the minimal prefix; the full hint is ``steps`` itself)."""
    return [steps[:k] for k in range(1, len(steps))]


def hint_prompt(prompt: str, hint: list[str]) -> str:
    """The probe's input: the prompt, then the hint steps and the answer mark, so that the
    instruct model answers right after them (no hint: the bare prompt)."""
    if not hint:
        return prompt
    return prompt + " " + STEP_SEP.join(hint) + f" {ANSWER_MARK}"


def label_state(direct: bool, sparse: list[bool], full: bool) -> tuple[int, int | None]:
    """The state of one problem from the probe outcomes (does I's answer equal R's?) under no
    hint, each sparse prefix (shortest first) and the full hint: ``(state, k)`` where ``k`` is
    the number of hint steps the target keeps (0 for No-Hint, the minimal matching prefix for
    Sparse-Hint, None for Full-Hint: all of them). Full-Hint is also the state when even the
    full hint does not make I agree (``full`` is kept for the record, it does not change the
    state: nothing shorter than the whole reasoning sufficed)."""
    if direct:
        return NO_HINT, 0
    for i, ok in enumerate(sparse):
        if ok:
            return SPARSE_HINT, i + 1
    return FULL_HINT, None


def training_target(state: int, steps: list[str], k: int | None, answer: str) -> str:
    """The fine-tuning completion for a labelled problem: the bare answer (No-Hint), the minimal
    prefix then the answer (Sparse-Hint), or R's full reasoning (Full-Hint)."""
    if state == NO_HINT:
        return render([], answer)
    if state == SPARSE_HINT:
        return render(steps[:k], answer)
    return render(steps, answer)


def count_tokens(tok, texts: list[str]) -> list[int]:
    """Tokens of each text under ``tok`` (no special tokens): what "generated tokens" means."""
    return [len(ids) for ids in tok(list(texts), add_special_tokens=False)["input_ids"]]


# -- probing ----------------------------------------------------------------------------------

@dataclass
class Probe:
    """One problem's probe: R's reasoning and answer, I's outcome under each guidance, the state."""
    steps: list[str]
    r_answer: str
    direct: bool
    sparse: list[bool]
    full: bool
    state: int
    k: int | None


def probe(reader, tok, examples, r_completions: list[str], max_new_tokens: int = 8) -> list[Probe]:
    """Label every problem (:func:`label_state`) from R's completions and the instruct model's
    greedy answers: unaided (``reader`` with its adapter disabled: the instruct model itself) and
    under every sparse prefix and the full hint (the hint reader, :func:`hint_reader`), each in one
    batched ``generate``."""
    from ..evaluate import generate
    parsed = [split_reasoning(c) for c in r_completions]
    with reader.disable_adapter():
        direct = generate(reader, tok, [e.prompt for e in examples], max_new_tokens)
    inputs, owner = [], []
    for i, (e, (steps, _)) in enumerate(zip(examples, parsed)):
        for h in sparse_hints(steps) + ([steps] if steps else []):
            inputs.append(hint_prompt(e.prompt, h))
            owner.append(i)
    hinted = generate(reader, tok, inputs, max_new_tokens) if inputs else []
    agree: list[list[bool]] = [[final_answer(d) == a and a != ""]
                               for d, (_, a) in zip(direct, parsed)]
    for i, o in zip(owner, hinted):
        agree[i].append(final_answer(o) == parsed[i][1] and parsed[i][1] != "")
    res = []
    for (steps, ans), a in zip(parsed, agree):
        sparse, full = (a[1:-1], a[-1]) if steps else ([], a[0])
        state, k = label_state(a[0], sparse, full)
        res.append(Probe(steps, ans, a[0], sparse, full, state, k))
    return res


def reader_data(families, n_per_level: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """Training pairs for the hint reader: reference problems of ``families`` (the registry's
    solver, the train side of :func:`workbench.data.tasks.problem_split`, never R's outputs),
    each with a random prefix of k = 1..n of its steps after the prompt and its answer as the
    target. The reader learns to *read* steps, never to write them."""
    import random
    from ..data import tasks
    rng = random.Random(seed)
    prompts, comps = [], []
    for f in families:
        for d in tasks.get(f).difficulties:
            train, _ = tasks.problem_split(f, d)
            for e in rng.sample(train, min(n_per_level, len(train))):
                if not e.steps:
                    continue
                k = rng.randint(1, len(e.steps))
                prompts.append(hint_prompt(e.prompt, e.steps[:k]))
                comps.append(" " + e.target)
    return prompts, comps


# -- decoding and evaluation ------------------------------------------------------------------

def truncated_generate(model, tok, prompts: list[str], budget: int, answer_tokens: int = 8) -> list[str]:
    """Budget forcing: greedy reasoning for at most ``budget`` tokens; a completion that has not
    answered by then is cut there, ``" =>"`` is appended and the model writes its answer
    (up to ``answer_tokens`` more). Returns the whole completions (reasoning + forced answer)."""
    from ..evaluate import generate
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


def evaluate(model, tok, examples, completions: list[str] | None = None,
             max_new_tokens: int = 48) -> dict:
    """Greedy completions (unless given), each scored by its family's verifier, and the tokens
    each one wrote (counted with ``tok``): ``{"acc", "tokens", "completions"}`` (per example)."""
    from ..data import tasks
    from ..evaluate import generate
    if completions is None:
        completions = generate(model, tok, [e.prompt for e in examples], max_new_tokens)
    completions = [c.split("\n")[0] for c in completions]
    return {"acc": [tasks.score(e, c) for e, c in zip(examples, completions)],
            "tokens": count_tokens(tok, completions), "completions": completions}


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


def hint_reader(instruct: str = "lm-instruct", scale: str = "smoke",
                families=("add", "count", "chain"), n_per_level: int = 120,
                s: LoraSettings = LoraSettings(steps=200), device: str = "cpu"):
    """The instruct model taught to read a hint: a LoRA (cached) trained on :func:`reader_data`.
    The zoo's instruct model has never seen written steps (fed a prefix of them it writes prose),
    so a hint needs a reader; with the adapter disabled it is the instruct model unchanged, which
    is how the probe asks the unaided question. Returns ``(PeftModel, tokenizer, info)``."""
    prompts, comps = reader_data(families, n_per_level)
    return cached_lora(instruct, scale, prompts, comps, s, tag="reader", group=GROUP, device=device)


# -- the second reasoning model of C4 ---------------------------------------------------------

def small_reasoning_recipe():
    """A narrower, shallower sibling of ``lm-reasoning`` (the same data mix, tokenizer settings
    and loop; d_model 64, 2 blocks, about 1/6 of the parameters), for C4. Not a zoo recipe: it
    is defined here and built through ``zoo.load(..., recipe=...)``, keyed by its own hash."""
    from ..models import zoo
    base = zoo.RECIPES["lm-reasoning"]
    return replace(base, name="hint-reasoning-small",
                   description="lm-reasoning at d_model 64, 2 blocks (paper 06, C4)",
                   smoke=replace(base.smoke, d_model=64, n_layers=2, n_heads=2, d_ff=192,
                                 eval_examples=8),
                   full=replace(base.full, d_model=256, n_layers=4, n_heads=4, d_ff=704))


def small_reasoning(scale: str = "smoke", device: str = "cpu"):
    """``(model, tokenizer)`` of :func:`small_reasoning_recipe`, built once (cached by the zoo)."""
    from ..models import zoo
    r = small_reasoning_recipe()
    return zoo.load(r.name, scale, recipe=r, device=device)
