"""The zoo's recipes: each shared backbone's architecture, training mix and sizes per scale.

A :class:`Recipe` names an architecture (a ``transformers`` model class), its sizes per scale
(:class:`Size`) and its training mix: Python reference prose (:mod:`workbench.data.corpus`) plus
rendered task examples (:mod:`workbench.data.tasks`) from a subset of families; the other families
are held out for adaptation. :meth:`Recipe.key` hashes everything that changes the built model,
so the cache folder of a build moves when its recipe does. :func:`recipe` is the public lookup.
Importing this module imports neither torch nor transformers.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace

from .. import cache
from ..device import zoo_scale
from ..data.tasks import ALL_FAMILIES, difficulties  # the task constants live with the tasks

__all__ = ["ZOO_VERSION", "ALL_FAMILIES", "Size", "Recipe", "RECIPES", "SMOKE_V2", "SMOKE_V3",
           "FULL_V2", "SMOKE_V4", "SMOKE_V4_KV", "FULL_V4", "recipe", "difficulties"]

ZOO_VERSION = 3   # in every key: moves every build when the task text changes for all recipes
#                   (it last did when each family got its own prompt surface)


@dataclass(frozen=True)
class Size:
    """Model and training sizes of one scale of a recipe."""
    d_model: int = 128          # hidden size
    n_layers: int = 4           # transformer blocks
    n_heads: int = 4            # attention heads
    d_ff: int = 384             # MLP width (a multiple of 32, so GGUF blocks fit)
    ctx: int = 64               # training context, tokens
    vocab: int = 512            # BPE vocabulary
    steps: int = 400            # optimizer steps
    batch: int = 16             # sequences per step
    lr: float = 3e-3            # peak AdamW learning rate (cosine decay, linear warm-up)
    warmup: int = 30            # warm-up steps
    n_task_examples: int = 3000  # rendered examples per trained family
    eval_examples: int = 40     # examples per family for the card's accuracy
    threads: int = 1            # torch CPU threads while training (loop v2 only)


# fields added after v1 recipes were built: left out of the key at these values, so the hashes
# (and cached builds) of v1 recipes such as lm-tiny do not move
_V1_DEFAULTS = {"threads": 1, "loop": "v1", "eval_by_difficulty": False, "context_share": 0.0,
                "max_shots": 0, "icl_shots": 0, "init_from": None, "direct_levels": None,
                "forced_direct_share": 0.0, "extra_eval": (), "trace_only": ()}


@dataclass(frozen=True)
class Recipe:
    """A named backbone: architecture, training mix and sizes per scale."""
    name: str
    description: str
    arch: str = "llama"                       # llama | gpt2 | qwen2
    train_tasks: tuple[str, ...] = ("add", "reverse", "sort", "kv", "count", "pattern")
    task_weights: tuple[float, ...] | None = None   # relative share of each train task (None:
    #                                           equal); examples per family scale with it
    task_fraction: float = 0.5                # share of training sequences that are task text
    with_steps: bool = False                  # render chain-of-thought steps in task text
    easiest: int | None = 1                   # train/evaluate the k easiest difficulties only
    seed: int = 0                             # the build seed (independent of notebook seeds)
    loop: str = "v1"                          # v1: lm-tiny's original loop (kept bit-for-bit);
    #                                           v2: pre-drawn windows, no per-step host syncs;
    #                                           v3: v2 with positions restarting per document
    eval_by_difficulty: bool = False          # card: accuracy at every difficulty, on prompts
    #                                           never trained on
    context_share: float = 0.0               # share of each ordinary family's examples trained
    #                                           in multi-example contexts (one row, no attention
    #                                           reset between them); in-context families (rule
    #                                           set) always come as contexts
    max_shots: int = 0                        # a context holds 1..max_shots examples before its
    #                                           last (contexts that overflow ctx are cut)
    icl_shots: int = 0                        # card: exact match with 0 and with this many
    #                                           demonstrations in the context (0: no such column)
    init_from: str | None = None              # fine-tune this zoo recipe's built model (its
    #                                           weights, tokenizer and sizes; its key enters ours)
    direct_levels: tuple[int, ...] | None = None   # with steps: per train task, how many of its
    #                                           easiest difficulties are rendered as bare answers
    forced_direct_share: float = 0.0          # with steps: share of the other examples rendered
    #                                           " => answer" (the forced-direct form, no steps)
    trace_only: tuple[str, ...] = ()          # with steps: families never rendered forced-direct
    #                                           (the long-trace family keeps every trace)
    extra_eval: tuple[str, ...] = ()          # families beyond ALL_FAMILIES the card evaluates
    compare_direct: str | None = None         # card only (not in the key): the zoo model whose
    #                                           direct answers this one's forced-direct answers
    #                                           are compared with (built if missing)
    smoke: Size = field(default_factory=Size)
    # full: one H100 builds it in at most 10 minutes in bf16 (workbench plan: about
    # 200M tokens, 6000 steps of 64 x 512, ~27M parameters); the smoke sizes key the shipped zoo
    full: Size = field(default_factory=lambda: Size(
        d_model=512, n_layers=8, n_heads=8, d_ff=1408, ctx=512, vocab=2048, steps=6000,
        batch=64, lr=1e-3, warmup=300, n_task_examples=50000, eval_examples=200))

    def size(self, scale: str) -> Size:
        """The sizes at ``scale`` (``mid`` builds nothing of its own: the smoke sizes)."""
        return getattr(self, zoo_scale(scale))

    def key(self, scale: str) -> str:
        """Hash of everything that changes the built model (recipe, this scale's sizes)."""
        scale = zoo_scale(scale)
        d = asdict(self)
        d.pop("smoke"), d.pop("full"), d.pop("description"), d.pop("compare_direct")
        d.update(scale=scale, size=asdict(self.size(scale)), version=ZOO_VERSION)
        if self.init_from is not None:      # a fine-tune moves when its base does
            d["init_key"] = recipe(self.init_from).key(scale)
        for k, v in _V1_DEFAULTS.items():
            if k in d and d[k] == v:
                d.pop(k)
            if k in d["size"] and d["size"][k] == v:
                d["size"].pop(k)
        return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]


SMOKE_V2 = Size(d_model=128, n_layers=4, n_heads=4, d_ff=384, ctx=96, vocab=512, steps=600,
                batch=24, lr=3e-3, warmup=40, n_task_examples=20000, eval_examples=40,
                threads=1)
# full sizes: each build within 10 minutes on one H100 in bf16 (about 200M tokens; `workbench
# plan` prints the estimate). Only these rows may change here: the smoke sizes key the shipped zoo.
FULL_V2 = Size(d_model=512, n_layers=8, n_heads=8, d_ff=1408, ctx=512, vocab=2048, steps=6000,
               batch=64, lr=1e-3, warmup=300, n_task_examples=200000, eval_examples=200)
_V2 = dict(loop="v2", eval_by_difficulty=True, smoke=SMOKE_V2, full=FULL_V2)
# loop v3: per-example attention in packed task rows, 1200 steps (about 2.6M tokens, ~4 minutes
# on one thread), families of distinct surfaces per model (two families that share a prompt
# surface, such as reverse and sort, would contradict each other). At these sizes direct answers
# reach >= 0.8 at the middle difficulty on reverse, pattern and count, not on 3-digit add
# (0.00-0.03, also alone), which needs its chain-of-thought steps (0.97 with them).
SMOKE_V3 = replace(SMOKE_V2, steps=1200, warmup=60)
_V3 = dict(loop="v3", eval_by_difficulty=True, easiest=None, smoke=SMOKE_V3, full=FULL_V2)
# lm-base reads its context: loop v3 (a <bos> per document), but half of each ordinary family's
# examples come as documents of 2..7 examples of that family in one row (no attention reset
# between them), and four in-context families whose rule is drawn per context (lettermap,
# digitmap, pick, tag) always come as contexts; 128-token rows. This mix teaches copying by
# position (tag) but not by key, at any step count tried (docs/zoo-lessons.md).
SMOKE_V4 = replace(SMOKE_V2, ctx=128, steps=1600, warmup=80)
# kv is learned inside lm-base's mix only in its dense form (kv_dense_sp: the value token right
# after its key, several questions on one set of pairs a context, every question written ' ; k'),
# at 43% of the task tokens and about 585k answers drawn: weight 20, 4000 steps, 60000 task
# examples per unit of weight (1.000 and 0.975 at four pairs on two build seeds; the registry's
# `kv` surface, which it does not train, reads 0.07-0.10; docs/zoo-lessons.md). The card
# evaluates kv_dense_sp at every number of pairs.
SMOKE_V4_KV = replace(SMOKE_V4, steps=4000, warmup=150, n_task_examples=60000)
FULL_V4 = replace(FULL_V2, ctx=1024, batch=32)      # the same tokens a step, longer contexts

# lm-instruct and lm-reasoning are fine-tunes of one base (init_from), as the papers' instruct
# and thinking models are. Same architecture as the base (init_model checks it); a lower learning
# rate; lm-reasoning trains at ctx 256 so that a 14-digit longadd trace (about 200 tokens with its
# prompt) fits a row. Its forced-direct share trades direct answers against long traces: 0.4
# keeps longadd at 12 digits at 0.90 (0.95 at 0.3) and lifts the direct ratio to 0.81 (0.78 at
# 0.3), a gain within build-to-build noise (docs/zoo-lessons.md).
SMOKE_V4_FT = replace(SMOKE_V3, steps=600, lr=1e-3, warmup=30)
SMOKE_V4_LONG = replace(SMOKE_V3, ctx=256, steps=800, lr=1e-3, warmup=30)
FULL_V4_FT = replace(FULL_V2, steps=2000, lr=3e-4, warmup=100)
FULL_V4_LONG = replace(FULL_V4_FT, ctx=512)
# lm-hybrid: lm-reasoning's mix trained twice as long, so that its no-think mode (' =>' right
# after the prompt, 40% of the examples: thinking stays the first move) sees twice the examples;
# its card checks that mode against lm-instruct's direct answers (docs/zoo.md)
SMOKE_V4_HYBRID = replace(SMOKE_V4_LONG, steps=1600)
FULL_V4_HYBRID = replace(FULL_V4_LONG, steps=4000)

# lm-reasoning, named here because lm-hybrid is the same recipe at other sizes
_REASONING = Recipe(
    "lm-reasoning", "Llama fine-tuned from lm-base like lm-instruct, but writes the steps of add, "
    "count and chain where they are hard (bare answers at their easiest level, a share answered "
    "' => a' directly) and the long column sums of longadd (paper 06; long traces for 18 and 04)",
    train_tasks=("reverse", "pattern", "count", "add", "chain", "longadd"),
    task_weights=(1, 1, 1.5, 1.5, 1.5, 2), task_fraction=0.85, with_steps=True,
    init_from="lm-base", direct_levels=(0, 0, 1, 1, 1, 0), forced_direct_share=0.4,
    extra_eval=("longadd",), compare_direct="lm-instruct",
    **{**_V3, "smoke": SMOKE_V4_LONG, "full": FULL_V4_LONG})

RECIPES: dict[str, Recipe] = {r.name: r for r in [
    # Most task text goes to add and pattern (easiest difficulty): spread evenly over six
    # families, 400 smoke steps solved none of them; weighted, add and pattern are solved.
    Recipe("lm-tiny", "Llama, ~1M parameters at smoke: prose + six task families (mostly add "
           "and pattern), direct answers; the other families are held out for adaptation",
           task_weights=(5, 0.5, 0.5, 1, 0.5, 3), task_fraction=0.75,
           smoke=Size(lr=5e-3, eval_examples=100)),
    Recipe("lm-base", "Llama, the base for adaptation that reads its context: prose + reverse, "
           "pattern, count, add at every difficulty (arithmetic and counting with their "
           "steps), half of them in multi-example contexts, kv in its dense form (kv_dense_sp, "
           "several questions on one set of pairs), and four in-context rules drawn per "
           "context (lettermap, digitmap, pick, tag); sub, mul, chain, addmod, sort, rotate, "
           "swap, dedupe and pattern_skip held out",
           train_tasks=("reverse", "pattern", "count", "add", "kv_dense_sp", "lettermap",
                        "digitmap", "pick", "tag"),
           task_weights=(1.5, 1, 1, 1, 20, 1.5, 1.5, 1.5, 1.5), task_fraction=0.8,
           with_steps=True, loop="v3", eval_by_difficulty=True, easiest=None, context_share=0.5,
           max_shots=6, icl_shots=4, extra_eval=("kv_dense_sp",), smoke=SMOKE_V4_KV,
           full=FULL_V4),
    Recipe("lm-instruct", "Llama fine-tuned from lm-base, answers directly: reverse, pattern, "
           "count, add, chain (paper 06's probe)",
           train_tasks=("reverse", "pattern", "count", "add", "chain"),
           task_weights=(1, 1, 1.5, 1.5, 1.5), task_fraction=0.85, init_from="lm-base",
           **{**_V3, "smoke": SMOKE_V4_FT, "full": FULL_V4_FT}),
    _REASONING,
    # lm-hybrid: the same mix, twice the steps (SMOKE_V4_HYBRID says why)
    replace(_REASONING, name="lm-hybrid", description="Llama fine-tuned from lm-base on "
            "lm-reasoning's mix, twice as long: a hybrid-thinking model whose no-think mode "
            "(' =>' at once) its card checks against lm-instruct's direct answers (paper 06)",
            smoke=SMOKE_V4_HYBRID, full=FULL_V4_HYBRID),
    Recipe("lm-gpt2", "GPT-2 architecture, string and recall skills: reverse, pattern, kv, "
           "direct answers (paper 11 routes between it and lm-qwen2)", arch="gpt2",
           train_tasks=("reverse", "pattern", "kv"), task_weights=(1, 1, 1.5),
           task_fraction=0.85, **_V3),
    Recipe("lm-qwen2", "Qwen2 architecture, arithmetic and counting with steps, and the skip "
           "rule of patterns: add, count, pattern_skip (paper 11)", arch="qwen2",
           train_tasks=("add", "count", "pattern_skip"), task_weights=(1.5, 1, 1),
           task_fraction=0.85, with_steps=True, **_V3),
    # the quantization bed for 14: mostly prose (perplexity is what 14 measures), trained long
    # enough that its block weights carry the prediction
    Recipe("lm-qbed", "Llama, mostly prose (30% task text), the quantization-sensitive bed for "
           "paper 14", train_tasks=("add", "reverse", "kv", "count", "pattern"),
           task_fraction=0.3, easiest=None, **_V2),
    Recipe("lm-micro", "A seconds-to-build Llama for tests of the zoo machinery (loop v3, "
           "card at every difficulty)", train_tasks=("pattern", "kv"), loop="v3",
           eval_by_difficulty=True,
           smoke=Size(d_model=32, n_layers=1, n_heads=2, d_ff=64, ctx=32, vocab=300, steps=8,
                      batch=4, warmup=2, n_task_examples=50, eval_examples=4),
           full=Size(d_model=32, n_layers=1, n_heads=2, d_ff=64, ctx=32, vocab=300, steps=8,
                     batch=4, warmup=2, n_task_examples=50, eval_examples=4)),
]}



def recipe(name: str, given: Recipe | None = None) -> Recipe:
    """The recipe named ``name`` (or ``given``, when a caller passes its own); a clear error
    listing the known recipes otherwise. A lookup by name notes the use (``cache.note_use``)."""
    if given is not None:
        return given
    if name not in RECIPES:
        raise KeyError(f"unknown zoo model {name!r}; recipes are {sorted(RECIPES)}")
    cache.note_use(name)        # loads and cache keys of derived runs all look their recipe up
    return RECIPES[name]
