"""The task registry: seeded generators of verifiable text tasks and their exact verifiers.

Each family is a :class:`Family` with ``generate(n, seed, difficulty) -> list[Example]`` and
``score(example, completion) -> float`` (1.0 when the final answer matches exactly, else 0.0), so a
verifier doubles as an RL reward. Tasks are the "domains" of LoRA pools, the "task stream" of
continual learning, the reward of RLVR and the traces of data curation (docs/design.md).

Rendering. A prompt ends with its operator (``=``, ``->``, ``?``); the completion is either the
bare answer (``"68"``) or, with chain-of-thought, the steps joined by ``" ; "`` followed by
``" => "`` and the answer (``"8+5=13 c1 ; 2+4+1=7 => 73"``). The verifier reads the first line of a
completion and takes what follows the last ``=>`` (or the whole line when there is none).

Distinct surfaces: every family has its own prompt surface, so skills trained side by side
never contradict each other. String and recall families start with an
operator word (``"sort s t r i n g ->"``, ``"rotate ..."``, ``"kv a=3 b=5 ; a?"``, ``"next a b c a
->"``), which also gives every symbol a leading space, so the first key of ``kv`` (or the first
letter of a string) is the same token as when it is asked for. ``addmod`` reads ``"23(+)49="``.
``addmod`` and ``pattern_skip`` draw the same numbers and motifs as ``add`` and ``pattern`` for
the same seed (``Family.stream``), so the two rules can be compared on the same inputs. ``longadd`` is ``add``'s rule and steps on
6 to 14 digits (the long-trace family; its prompts never look like ``add``'s 1 to 4 digits).

In-context families (``rule`` set): a rule drawn per *context* (a random letter substitution, a
digit->letter code, a position to pick, a tag letter to append), shown by the examples before the
query. Alone, a prompt of such a family cannot be solved (each example draws its own rule);
:func:`contexts` draws ``shots`` demonstrations and a query that share one rule (for ordinary
families, ``shots + 1`` independent examples), :func:`render_context` writes them as one text
(examples separated by ``CONTEXT_SEP``; no ``<bos>`` between them, as pretraining sees a document).

Optional formats (``OPTIONAL``, off by default): families that :func:`get` finds but that
:func:`names`, ``FAMILIES`` and ``ICL_FAMILIES`` do not list, so no card, pool or notebook sees
them unless a recipe names them (lm-base names ``kv_dense_sp``). ``kv_dense`` is ``kv`` with the value token right after its key and several questions on one set of pairs: an
example reads ``"kv m7 b9 u2 ; u"`` -> ``"2"`` (no space before the answer, ``Example.lead``,
so the value is the token after the key in the pairs and in the answer alike); a context is
that example and then questions on the same pairs (the rule), one a line: ``"kv m7 b9 u2 ; u2"``,
``"; m7"``, ``"; u2"``, each answer labelled when trained as a document. ``kv_dense_sp`` writes
the later questions ``" ; m"`` as the first one is (the same ``;`` token after the line break).
Why this form: a keyed look-up is learned at the zoo's size only with many questions per context
and the value token right after its key (docs/zoo-lessons.md).

Characters in string tasks (inputs and answers) are space-separated so that a byte-level BPE
sees one token per symbol. Nothing here imports torch.
"""
from __future__ import annotations

import random
import zlib
from functools import partial
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["ANSWER_MARK", "STEP_SEP", "CONTEXT_SEP", "LETTERS", "ICL_FAMILIES", "Example", "final_answer", "exact_match",
           "Family", "FAMILIES", "OPTIONAL", "names", "get", "generate", "score", "same_surface",
           "problem_split", "draw_problems", "contexts", "render_context"]

ANSWER_MARK = "=>"
STEP_SEP = " ; "
CONTEXT_SEP = "\n"      # between the examples of one context
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass
class Example:
    """One task instance: ``prompt`` + completion, where the completion carries ``target``."""
    family: str
    prompt: str
    target: str
    difficulty: int
    steps: list[str] | None = None
    metadata: dict = field(default_factory=dict)
    lead: str = " "          # between the prompt and a bare answer ("" in kv_dense: the value
    #                          token follows the key token, as in the pairs)

    def completion(self, with_steps: bool = False) -> str:
        """The reference completion: the answer, or the steps then ``=> answer``."""
        if with_steps and self.steps:
            return " " + STEP_SEP.join(self.steps) + f" {ANSWER_MARK} " + self.target
        return self.lead + self.target

    def text(self, with_steps: bool = False) -> str:
        """Prompt and reference completion as one line (what a model is trained on)."""
        return self.prompt + self.completion(with_steps)


def final_answer(completion: str) -> str:
    """The answer a completion commits to: first line, after the last ``=>``, stripped."""
    line = completion.strip().split("\n")[0]
    if ANSWER_MARK in line:
        line = line.rsplit(ANSWER_MARK, 1)[1]
    return line.strip()


def exact_match(example: Example, completion: str) -> float:
    """1.0 when the final answer equals the target exactly, else 0.0 (an RL reward)."""
    return float(final_answer(completion) == example.target)


@dataclass
class Family:
    """A task family: a seeded generator of one example and an exact verifier."""
    name: str
    description: str
    surface: str                          # families with equal surface look alike
    make: Callable[[random.Random, int], Example]
    difficulties: tuple[int, ...]         # the sensible range of ``difficulty``
    has_steps: bool = False
    scorer: Callable[[Example, str], float] = exact_match
    stream: str | None = None             # share another family's random draws (same inputs)
    rule: Callable[[random.Random], object] | None = None   # in-context family: draws the rule
    #                                       of one context; ``make(rng, d, rule)`` then uses it
    make_context: Callable | None = None  # ``(rng, shots, difficulty) -> examples``: a family
    #                                       whose context is not ``shots`` independent demos

    def generate(self, n: int, seed: int = 0, difficulty: int | None = None,
                 rule=None) -> list[Example]:
        """``n`` examples, the same for the same (family, seed, difficulty) on every machine.

        ``difficulty=None`` draws each example's difficulty uniformly from ``difficulties``.
        ``rule``: for an in-context family, one fixed rule for every example (a task that is the
        family under that rule) instead of one drawn per example; its draws are keyed apart.
        """
        if rule is not None and self.rule is None:
            raise ValueError(f"{self.name!r} is not an in-context family: it takes no rule")
        key = f"{self.stream or self.name}:{seed}:{difficulty}" + (":rule" if rule is not None else "")
        rng = random.Random(zlib.crc32(key.encode()))
        out = []
        for _ in range(n):
            d = difficulty if difficulty is not None else rng.choice(self.difficulties)
            out.append(self.make(rng, int(d)) if self.rule is None else
                       self.make(rng, int(d), self.rule(rng) if rule is None else rule))
        return out

    def context(self, rng: random.Random, shots: int, difficulty: int | None = None) -> list[Example]:
        """``shots`` demonstrations then a query, sharing one rule when the family has one."""
        if self.make_context is not None:
            return self.make_context(rng, shots, difficulty)
        pick = lambda: int(difficulty if difficulty is not None else rng.choice(self.difficulties))  # noqa: E731
        if self.rule is None:
            return [self.make(rng, pick()) for _ in range(shots + 1)]
        rule = self.rule(rng)
        demos = [self.make(rng, pick(), rule) for _ in range(shots)]
        seen = {c for e in demos for c in e.metadata["input"]} if shots else None
        return demos + [self.make(rng, pick(), rule, seen)]

    def score(self, example: Example, completion: str) -> float:
        return self.scorer(example, completion)


# -- arithmetic -------------------------------------------------------------------------------

def _num(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1)


def _add_steps(a: int, b: int) -> list[str]:
    """Column addition from the right: ``da+db+carry=s cC`` per column."""
    sa, sb = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(sa), len(sb))):
        da = int(sa[i]) if i < len(sa) else 0
        db = int(sb[i]) if i < len(sb) else 0
        s = da + db + carry
        steps.append(f"{da}+{db}+{carry}={s} c{s // 10}")
        carry = s // 10
    return steps


def _make_add(rng, d):
    a, b = _num(rng, d), _num(rng, d)
    return Example("add", f"{a}+{b}=", str(a + b), d, _add_steps(a, b), {"a": a, "b": b})


def _make_longadd(rng, d):
    """Long addition (6 to 14 digits), the steps of ``add`` column by column: the long-trace
    family (a 12-digit sum writes about 150 tokens, 14 digits about 175, in the zoo's
    tokenizer), regular and verifiable at every step."""
    a, b = _num(rng, d), _num(rng, d)
    return Example("longadd", f"{a}+{b}=", str(a + b), d, _add_steps(a, b), {"a": a, "b": b})


def _make_addmod(rng, d):
    a, b = _num(rng, d), _num(rng, d)
    sa, sb = str(a).zfill(d), str(b).zfill(d)
    digits = [(int(x) + int(y)) % 10 for x, y in zip(sa, sb)]
    steps = [f"{x}+{y}={z}" for x, y, z in zip(sa, sb, digits)]
    return Example("addmod", f"{a}(+){b}=", "".join(map(str, digits)), d, steps, {"a": a, "b": b})


def _make_sub(rng, d):
    a, b = sorted((_num(rng, d), _num(rng, d)), reverse=True)
    sa, sb = str(a)[::-1], str(b)[::-1]
    steps, borrow = [], 0
    for i in range(len(sa)):
        da, db = int(sa[i]), int(sb[i]) if i < len(sb) else 0
        r = da - db - borrow
        nb = int(r < 0)
        steps.append(f"{da}-{db}-{borrow}={r + 10 * nb} b{nb}")
        borrow = nb
    return Example("sub", f"{a}-{b}=", str(a - b), d, steps, {"a": a, "b": b})


def _make_mul(rng, d):
    a, b = _num(rng, d), rng.randint(2, 9) if d == 1 else _num(rng, max(1, d - 1))
    partial, steps = 0, []
    for i, ch in enumerate(str(b)[::-1]):
        p = a * int(ch) * 10 ** i
        partial += p
        steps.append(f"{a}*{ch}e{i}={p} s{partial}")
    return Example("mul", f"{a}*{b}=", str(a * b), d, steps, {"a": a, "b": b})


def _make_chain(rng, d):
    """``d`` operations applied left to right (no precedence), intermediate values in steps."""
    value = rng.randint(1, 9)
    expr, steps = str(value), []
    for _ in range(d):
        op, x = rng.choice("+-*"), rng.randint(1, 9)
        if op == "*" and abs(value) > 20:
            op = "+"
        new = value + x if op == "+" else value - x if op == "-" else value * x
        steps.append(f"{value}{op}{x}={new}")
        expr += f"{op}{x}"
        value = new
    return Example("chain", f"{expr}=", str(value), d, steps, {"ops": d})


# -- string transforms ------------------------------------------------------------------------

def _spaced(chars) -> str:
    return " ".join(chars)


def _string_family(name: str, rule: Callable[[list[str], random.Random], list[str]],
                   alphabet: str = LETTERS[:12], repeats: bool = False):
    def make(rng, d):
        chars = [rng.choice(alphabet) for _ in range(d)] if repeats else \
            rng.sample(alphabet, min(d, len(alphabet)))
        out = rule(chars, rng)
        return Example(name, f"{name} {_spaced(chars)} ->", _spaced(out), d, None,
                       {"input": "".join(chars)})
    return make


def _rotate(chars, rng):
    return chars[1:] + chars[:1]          # rotate left by one


def _dedupe(chars, rng):
    seen, out = set(), []
    for c in chars:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def _swap(chars, rng):
    out = list(chars)
    for i in range(0, len(out) - 1, 2):
        out[i], out[i + 1] = out[i + 1], out[i]
    return out


# -- recall, counting, patterns ---------------------------------------------------------------

def _make_kv(rng, d):
    keys = rng.sample(LETTERS, d)
    vals = [rng.randint(0, 9) for _ in keys]
    q = rng.randrange(d)
    ctx = " ".join(f"{k}={v}" for k, v in zip(keys, vals))
    return Example("kv", f"kv {ctx} ; {keys[q]}?", str(vals[q]), d, None, {"pairs": d})


def _kv_pairs(rng):
    """The rule of one ``kv_dense`` context: five keys and their one-digit values (a context of
    difficulty ``d`` shows the first ``d``)."""
    return {k: str(rng.randint(0, 9)) for k in rng.sample(LETTERS, 5)}


def _make_kv_dense(rng, d, rule, seen=None, question_only=False, name="kv_dense", ask="; "):
    """``kv m7 b9 u2 ; u`` -> ``2``: the first ``d`` pairs of ``rule``, the value token right
    after its key, one key asked (drawn with ``rng``), the answer without a leading space;
    ``question_only`` writes just ``ask`` and the key, ``; u`` (a later question of a context,
    the pairs above it; ``kv_dense_sp``: `` ; u``, the first question's tokens)."""
    pairs = list(rule.items())[:d]
    k, v = pairs[rng.randrange(d)]
    prompt = f"{ask}{k}" if question_only else f"kv {' '.join(a + b for a, b in pairs)} ; {k}"
    return Example(name, prompt, v, d, None, {"pairs": d, "rule": dict(pairs)}, lead="")


def _kv_dense_context(rng, shots, difficulty=None, name="kv_dense", ask="; "):
    """One set of pairs (the rule) and ``shots + 1`` questions on it: the first example carries
    the pairs, each later one is a bare question ``; k`` (so with no demonstrations the query is
    an ordinary ``kv_dense`` example)."""
    d = int(difficulty if difficulty is not None else rng.choice(KV_DENSE_DIFFICULTIES))
    rule = _kv_pairs(rng)
    return [_make_kv_dense(rng, d, rule, question_only=i > 0, name=name, ask=ask)
            for i in range(shots + 1)]


KV_DENSE_DIFFICULTIES = (2, 3, 4, 5)


def _make_count(rng, d):
    alphabet = LETTERS[:4]
    chars = [rng.choice(alphabet) for _ in range(d)]
    c = rng.choice(alphabet)
    steps = [f"{ch}{'+' if ch == c else '.'}" for ch in chars]
    return Example("count", f"count {c} in {_spaced(chars)} ->", str(chars.count(c)), d,
                   steps, {"char": c})


def _pattern_family(name: str, skip: bool):
    """A motif of ``d`` symbols repeated; ``pattern`` asks for the next symbol, ``pattern_skip``
    for the one after it (same surface form, different rule)."""
    def make(rng, d):
        motif = rng.sample(LETTERS[:10], d)
        n = 2 * d + rng.randrange(d)
        seq = [motif[i % d] for i in range(n)]
        target = motif[(n + int(skip)) % d]
        word = "skip" if skip else "next"
        return Example(name, f"{word} {_spaced(seq)} ->", target, d, None,
                       {"motif": "".join(motif)})
    return make


# -- in-context rules (drawn per context) ------------------------------------------------------

def _query_chars(rng, alphabet, d, seen, repeats=True):
    """``d`` input symbols: from the ones the demonstrations used (``seen``) when given."""
    pool = sorted(seen) if seen else list(alphabet)
    if repeats or len(pool) < d:
        return [rng.choice(pool) for _ in range(d)]
    return rng.sample(pool, d)


def _make_lettermap(rng, d, rule, seen=None):
    """A random substitution of 6 letters (the rule), applied letter by letter."""
    chars = _query_chars(rng, LETTERS[:6], d, seen)
    return Example("lettermap", f"map {_spaced(chars)} ->", _spaced(rule[c] for c in chars), d,
                   None, {"input": "".join(chars), "rule": dict(rule)})


def _make_digitmap(rng, d, rule, seen=None):
    """A random code digit -> letter for the digits 0-5 (the rule)."""
    chars = _query_chars(rng, "012345", d, seen)
    return Example("digitmap", f"code {_spaced(chars)} ->", _spaced(rule[c] for c in chars), d,
                   None, {"input": "".join(chars), "rule": dict(rule)})


def _make_pick(rng, d, rule, seen=None):
    """The letter at position ``rule`` (0-based, fixed per context) of ``d + 2`` letters."""
    chars = rng.sample(LETTERS[:12], d + 2)
    return Example("pick", f"pick {_spaced(chars)} ->", chars[rule], d, None,
                   {"input": "".join(chars), "rule": rule})


def _make_tag(rng, d, rule, seen=None):
    """The letters, then a tag letter fixed per context (the rule)."""
    chars = rng.sample(LETTERS[:12], d)
    return Example("tag", f"tag {_spaced(chars)} ->", _spaced(chars + [rule]), d, None,
                   {"input": "".join(chars), "rule": rule})


def _substitution(source: str):
    return lambda rng: dict(zip(source, rng.sample(LETTERS, len(source))))


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("add", "a+b with d-digit operands (steps: column sums and carries)", "arith+",
           _make_add, (1, 2, 3, 4), True),
    Family("addmod", "digit-wise sum modulo 10, no carries (the operands of add)", "addmod",
           _make_addmod, (1, 2, 3, 4), True, stream="add"),
    Family("sub", "a-b, a >= b, d-digit operands (steps: columns and borrows)", "arith-",
           _make_sub, (1, 2, 3, 4), True),
    Family("mul", "a*b, d-digit by (d-1)-digit (steps: shifted partial products)", "arith*",
           _make_mul, (1, 2, 3), True),
    Family("chain", "d operations applied left to right (steps: running value)", "chain",
           _make_chain, (1, 2, 3, 4, 5), True),
    Family("reverse", "reverse the letters", "string", _string_family("reverse",
           lambda c, r: c[::-1]), (3, 4, 5, 6)),
    Family("sort", "sort the letters", "sort", _string_family("sort",
           lambda c, r: sorted(c)), (3, 4, 5, 6)),
    Family("rotate", "rotate the letters left by one", "rotate",
           _string_family("rotate", _rotate), (3, 4, 5, 6)),
    Family("swap", "swap adjacent pairs of letters", "swap",
           _string_family("swap", _swap), (3, 4, 5, 6)),
    Family("dedupe", "drop repeated letters, keep first occurrences", "dedupe",
           _string_family("dedupe", _dedupe, alphabet=LETTERS[:5], repeats=True), (4, 5, 6, 7)),
    Family("kv", "recall the value of a key given d key=value pairs", "kv", _make_kv,
           (2, 3, 4, 5)),
    Family("count", "count a letter in a string of length d", "count", _make_count,
           (3, 4, 5, 6, 7, 8), True),
    Family("pattern", "next symbol of a repeated motif of length d", "pattern",
           _pattern_family("pattern", False), (2, 3, 4)),
    Family("pattern_skip", "the symbol after next of a repeated motif (the motifs of pattern)",
           "pattern_skip", _pattern_family("pattern_skip", True), (2, 3, 4), stream="pattern"),
    Family("lettermap", "in context: a random substitution of 6 letters, fixed per context",
           "lettermap", _make_lettermap, (1, 2, 3), rule=_substitution(LETTERS[:6])),
    Family("digitmap", "in context: a random digit -> letter code, fixed per context",
           "digitmap", _make_digitmap, (1, 2, 3), rule=_substitution("012345")),
    Family("pick", "in context: the letter at a position fixed per context, of d+2 letters",
           "pick", _make_pick, (2, 3, 4), rule=lambda rng: rng.randrange(4)),
    Family("tag", "in context: the letters then a tag letter fixed per context", "tag",
           _make_tag, (2, 3, 4, 5), rule=lambda rng: rng.choice(LETTERS[12:])),
    # add's rule and steps on 6 to 14 digits: prompts never look like add's (1 to 4 digits)
    Family("longadd", "a+b with 6 to 14 digits, add's column steps (the long-trace family)",
           "arith+long", _make_longadd, (6, 8, 10, 12, 14), True),
]}
ICL_FAMILIES = tuple(f for f, fam in FAMILIES.items() if fam.rule is not None)
# the families every zoo card evaluates (and the tokenizer samples); longadd, the long-trace
# family, is evaluated by the recipes that name it in ``extra_eval``
ALL_FAMILIES = ("add", "addmod", "sub", "mul", "chain", "reverse", "sort", "rotate", "swap",
                "dedupe", "kv", "count", "pattern", "pattern_skip")
# formats off by default: get() finds them, names()/FAMILIES/ICL_FAMILIES (and so every card,
# pool and notebook) do not list them; a recipe that names one trains on it
OPTIONAL: dict[str, Family] = {f.name: f for f in [
    Family("kv_dense", "kv with the value token right after its key (kv m7 b9 u2 ; u -> 2) and "
           "several questions on one set of pairs per context (the rule)", "kv_dense",
           _make_kv_dense, KV_DENSE_DIFFICULTIES, rule=_kv_pairs, make_context=_kv_dense_context),
    # kv_dense's first question reads " ; u" (Ġ;), its later ones "; u" (;), and the look-up forms
    # on the form trained most; here every question is " ; u", so the standalone item is that form
    Family("kv_dense_sp", "kv_dense with every question written ' ; k' (the later ones too)",
           "kv_dense_sp", partial(_make_kv_dense, name="kv_dense_sp", ask=" ; "),
           KV_DENSE_DIFFICULTIES, rule=_kv_pairs,
           make_context=partial(_kv_dense_context, name="kv_dense_sp", ask=" ; ")),
]}


def names() -> list[str]:
    return list(FAMILIES)


def get(name: str) -> Family:
    if name in OPTIONAL:
        return OPTIONAL[name]
    if name not in FAMILIES:
        raise KeyError(f"unknown task family {name!r}; families are {names()}")
    return FAMILIES[name]


def difficulties(family: str, easiest: int | None) -> tuple[int, ...]:
    """The difficulties of ``family`` a recipe trains on: its ``easiest`` ones (all when None)."""
    d = get(family).difficulties
    return d if easiest is None else d[:easiest]


def generate(name: str, n: int, seed: int = 0, difficulty: int | None = None,
             rule=None) -> list[Example]:
    """``n`` seeded examples of family ``name`` (see :meth:`Family.generate`)."""
    return get(name).generate(n, seed, difficulty, rule)


def score(example: Example, completion: str) -> float:
    """The exact verifier of the example's family: 1.0 or 0.0."""
    return get(example.family).score(example, completion)


def same_surface(name: str) -> list[str]:
    """The other families whose prompts look exactly like ``name``'s (none: every family has
    its own surface)."""
    s = get(name).surface
    return [f for f, fam in FAMILIES.items() if fam.surface == s and f != name]


def problem_split(family: str, difficulty: int, heldout_fraction: float = 0.3,
                  pool: int = 4000) -> tuple[list, list]:
    """Disjoint (train, held-out) *problems* of a task family: unique prompts split by a fixed
    crc32 of the prompt, so no held-out question is ever trained on (at difficulty 1 a family
    can have only a few dozen distinct problems)."""
    seen, train, held = set(), [], []
    for e in generate(family, pool, seed=4242, difficulty=difficulty):
        if e.prompt in seen:
            continue
        seen.add(e.prompt)
        (held if zlib.crc32(e.prompt.encode()) % 1000 < heldout_fraction * 1000
         else train).append(e)
    if not train or not held:
        raise ValueError(f"{family} at difficulty {difficulty} has too few distinct problems")
    return train, held


def draw_problems(families, n: int, side: str, rng) -> list:
    """``n`` problems per (family, difficulty) from one side of :func:`problem_split`
    (``"train"`` or ``"test"``: disjoint), drawn without replacement by the numpy generator
    ``rng`` (families, then difficulties, in the registry's order)."""
    out = []
    for f in families:
        for d in get(f).difficulties:
            pool = problem_split(f, d)[0 if side == "train" else 1]
            out += [pool[i] for i in rng.permutation(len(pool))[:n]]
    return out


def contexts(name: str, n: int, shots: int, seed: int = 0,
             difficulty: int | None = None) -> list[list[Example]]:
    """``n`` seeded contexts of family ``name``: ``shots`` demonstrations then a query each,
    sharing one rule for an in-context family (its query then uses only symbols the
    demonstrations showed), independent examples otherwise."""
    fam = get(name)
    rng = random.Random(zlib.crc32(f"ctx:{name}:{seed}:{shots}:{difficulty}".encode()))
    return [fam.context(rng, shots, difficulty) for _ in range(n)]


def render_context(examples: list[Example], with_steps: bool = False) -> tuple[str, str]:
    """``(prompt, completion)`` of a context: the demonstrations' full text and the query's
    prompt, separated by :data:`CONTEXT_SEP`; the completion is the query's."""
    *demos, query = examples
    prompt = CONTEXT_SEP.join([e.text(with_steps) for e in demos] + [query.prompt])
    return prompt, query.completion(with_steps)
