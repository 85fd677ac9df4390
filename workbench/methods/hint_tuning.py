"""Hint Tuning: calibrating reasoning depth with an instruct model as a difficulty probe (paper 06,
``docs/papers/06-hint-tuning.md``).

A reasoning model R writes its steps before answering; the matching instruct model I answers
directly. The paper turns "how hard is this problem?" into a consistency check between them:

1. R solves the problem: steps ``s_1 ; ... ; s_n => a_R`` (:func:`split_reasoning`).
2. I is probed under growing guidance: no hint, a *sparse* hint (the first k steps of R's
   reasoning, k = 1, ..., n - 1, :func:`sparse_hints`) and the *full* hint (all n steps), each
   rendered after the prompt and followed by the answer mark (:func:`hint_prompt`). A small
   instruct model that has never seen steps cannot read them, so the hinted questions go to a
   *hint reader*: the instruct model with a LoRA trained on reference problems with a random
   prefix of their steps and the bare answer as target.
3. The problem's state is the least guidance under which I's answer equals a_R
   (:func:`label_state`): **No-Hint** (I agrees unaided), **Sparse-Hint** (the minimal prefix
   k* that makes it agree), **Full-Hint** (nothing shorter than the whole reasoning does).
4. R is fine-tuned (``peft`` LoRA) on its own problems with a target per state
   (:func:`training_target`): the bare answer, the minimal prefix then the answer, or the full
   reasoning. No label is used: the set is self-annotated from R's and I's answers.

Tokens are always counted with the model's tokenizer (:func:`count_tokens`). The baselines
(budget forcing, direct answers), the accuracy-tokens frontier, the hint reader's training data,
the cached fine-tunes and the second reasoning model of C4 live in
:mod:`workbench.experiments.hint_tuning`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..data.tasks import ANSWER_MARK, STEP_SEP, final_answer
from ..evaluate import chat_prompt, generate

__all__ = ["NO_HINT", "SPARSE_HINT", "FULL_HINT", "STATES", "split_reasoning", "render",
           "sparse_hints", "hint_prompt", "label_state", "training_target", "count_tokens",
           "Probe", "probe"]

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
    under every sparse prefix and the full hint (the hint reader), each in one batched
    ``generate``. The instruct model reads each question in its chat template where its
    tokenizer has one (:func:`workbench.evaluate.chat_prompt`)."""
    parsed = [split_reasoning(c) for c in r_completions]
    with reader.disable_adapter():
        direct = generate(reader, tok, [chat_prompt(tok, e.prompt) for e in examples],
                          max_new_tokens)
    inputs, owner = [], []
    for i, (e, (steps, _)) in enumerate(zip(examples, parsed)):
        for h in sparse_hints(steps) + ([steps] if steps else []):
            inputs.append(chat_prompt(tok, hint_prompt(e.prompt, h)))
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
