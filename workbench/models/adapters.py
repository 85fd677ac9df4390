"""A cached pool of ``peft`` LoRA adapters on a zoo LM: one per task family, and mixtures.

Papers 07, 13, 11, 18 and 01 adapt, route or merge per-task LoRAs; training them in every
notebook would cost minutes, so the zoo trains them once. ``adapters(base, families, rank=...,
scale=...)`` returns a :class:`Pool`: each adapter is a ``peft`` LoRA (every attention and MLP
projection of the blocks, ``lora_alpha = scale * rank``, so ``scale`` is the LoRA multiplier
alpha / r of Hu et al. 2021, eq. 3) trained on one family's completions at all its difficulties
(or on a mixture: ``"add+sub"``, or a name in :data:`MIXTURES`), saved with ``save_pretrained``
under ``zoo_dir()/adapters/<base>-<scale>-<hash>/<family>``. The hash covers the base model's key,
the pool's settings and :data:`POOL_VERSION`; :func:`workbench.cache.build` makes concurrent callers
build once, and a half-written pool is never read.

``init`` says where each adapter starts. LoRA starts B at zero and draws A (peft's Kaiming-uniform)
from torch's generator: ``"shared"`` seeds it with 0 for every adapter, so every adapter starts
from the same A and their factors share a gauge; ``"per_adapter"`` seeds it from the adapter's
name (:func:`init_seed`), so the adapters start from different A and their factors share no
gauge (the misalignment a merge on the LoRA quotient, notebook 13, exists to undo). Everything
else, the training prompts and their order included, is the same. The shipped pools
(:data:`SHIPPED_POOLS`): every family from the shared init (:data:`POOL_NAME`), and the families
that gain there, each from its own init (:data:`INIT_POOL_NAME`).

``card.json`` holds each adapter's exact match (greedy, the family's verifier, held-out prompts at
the family's middle difficulty, :data:`workbench.evaluate.MIDDLE`) on its own family and on the
others, the base model's score on each, and the train seconds. Load one adapter with
``PeftModel.from_pretrained(model, pool.path(f))`` or several with ``pool.load([...])``
(``load_adapter`` under each family's name, then ``model.set_adapter(name)``).
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from peft import PeftModel

from .. import cache, evaluate
from ..device import zoo_scale
from ..data import packing, tasks
from ..env import torch_threads
from ..progress import progress
from . import checkpoint, clip, zoo
from .finetune import lora_model, train_steps

__all__ = ["POOL_VERSION", "MIXTURES", "PoolSize", "POOL_SIZES", "Pool", "members", "pool_key",
           "adapters", "recipe_key", "pool_dir", "list_built", "build_all", "POOL_BASE", "POOL_NAME", "CLIP_NAME",
           "BUILD_ORDER", "INITS", "init_seed", "fresh_lora", "INIT_POOL_NAME",
           "INIT_POOL_FAMILIES", "SHIPPED_POOLS"]

POOL_VERSION = 2   # 2: the card's cat merges of every pair of gaining adapters
MERGE_GAIN = 0.3   # an adapter "gains" (and enters the pairwise merges) at this own-minus-base
MIXTURES = {"strings": ("reverse", "sort", "rotate", "swap", "dedupe"),
            "arith": ("add", "sub", "mul"),
            "recall": ("kv", "count", "pattern")}
INITS = ("shared", "per_adapter")   # where each adapter's LoRA A starts (module docstring)


@dataclass(frozen=True)
class PoolSize:
    """Training sizes of one pool scale."""
    steps: int = 120           # optimizer steps per adapter
    batch: int = 32            # examples per step
    # AdamW, linear decay to 10%. 8e-3: at 4e-3 the 120 steps left sub at 0.12 (0.46 at 8e-3) and
    # dedupe at 0.79 (0.92); add, mul, chain and kv scored the same at both (benchmarks/pool_lr.py)
    lr: float = 8e-3
    n_train: int = 4000        # training examples per adapter (all difficulties)
    eval_examples: int = 24    # held-out examples per family in the card


POOL_SIZES = {"smoke": PoolSize(), "full": PoolSize(steps=1500, batch=64, lr=1e-3,
                                                    n_train=40000, eval_examples=200)}


def members(name: str) -> tuple[str, ...]:
    """The task families an adapter named ``name`` trains on (a family, ``a+b`` or a mixture)."""
    fams = MIXTURES.get(name) or tuple(name.split("+"))
    for f in fams:
        tasks.get(f)          # a clear KeyError for a misspelt family
    return tuple(fams)


@dataclass
class Pool:
    """A built adapter pool: its directory and card."""
    base: str
    scale: str
    dir: Path
    card: dict

    @property
    def names(self) -> list[str]:
        return list(self.card["adapters"])

    def path(self, name: str) -> Path:
        if name not in self.card["adapters"]:
            raise KeyError(f"no adapter {name!r} in this pool; it has {self.names}")
        return self.dir / name

    def load(self, names=None, device: str = "cpu"):
        """``(PeftModel, tokenizer)``: the base LM with the adapters ``names`` (all when None)
        loaded under their own names; the first is active (``model.set_adapter(name)``)."""
        names = list(names or self.names)
        model, tok = zoo.load(self.base, self.scale, device=device)
        model = PeftModel.from_pretrained(model, self.path(names[0]), adapter_name=names[0])
        for n in names[1:]:
            model.load_adapter(self.path(n), adapter_name=n)
        model.set_adapter(names[0])
        return model.eval(), tok


def init_seed(name: str, init: str = "shared") -> int:
    """The torch seed adapter ``name`` draws its LoRA A from: 0 for every adapter under
    ``"shared"``, one from the adapter's name under ``"per_adapter"``."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    return 0 if init == "shared" else int(cache.key("lora-init", name, length=8), 16)


def pool_key(base: str, scale: str, names, rank: int, lora_scale: float, size: PoolSize,
             init: str = "shared") -> str:
    d = dict(base=zoo.key(base, zoo_scale(scale)), names=list(names), rank=rank,
             scale=lora_scale, size=asdict(size), version=POOL_VERSION)
    if init != "shared":            # the shared-init pools keep the keys they were shipped at
        d["init"] = init
    return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]


def recipe_key(model_scale: str = "smoke") -> str:
    """What every pool at ``model_scale`` shares beside its base and families: the version and
    the training sizes (a run that used a pool goes stale when this moves)."""
    return cache.key(POOL_VERSION, asdict(POOL_SIZES[zoo_scale(model_scale)]))


def pool_dir(base: str = "lm-base", model_scale: str = "smoke", families=None, rank: int = 8,
             scale: float = 2.0, init: str = "shared") -> Path:
    """The cache folder of the pool :func:`adapters` builds with these arguments."""
    names, model_scale = tuple(families or zoo.ALL_FAMILIES), zoo_scale(model_scale)
    key = pool_key(base, model_scale, names, rank, scale, POOL_SIZES[model_scale], init)
    return zoo.zoo_dir() / "adapters" / f"{zoo.label(base)}-{model_scale}-{key}"


def adapters(base: str = "lm-base", families=None, rank: int = 8, scale: float = 2.0,
             model_scale: str = "smoke", force: bool = False, init: str = "shared") -> Pool:
    """The LoRA pool on zoo model ``base``: one adapter per name in ``families`` (task families,
    ``"a+b"`` mixtures or :data:`MIXTURES` names; default every family), each starting from the
    LoRA init ``init`` (:data:`INITS`), built on first use."""
    names, model_scale = tuple(families or zoo.ALL_FAMILIES), zoo_scale(model_scale)
    for n in names:
        members(n)
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    init_seed(names[0], init)               # a clear error for an unknown init
    if not checkpoint.is_checkpoint(base):
        zoo.recipe(base).size(model_scale)      # clear errors for a bad base or scale
    size = POOL_SIZES[model_scale]
    path = pool_dir(base, model_scale, names, rank, scale, init)
    cache.note_use("lora-pool")             # the base was noted by its recipe lookup
    cache.build(path, lambda tmp: _build(base, model_scale, names, rank, scale, size, tmp, init),
                ready="card.json", force=force)
    return Pool(base, model_scale, path, json.loads((path / "card.json").read_text()))


def _train_pairs(names: tuple[str, ...], n: int, with_steps: bool, tok, seed: int = 7):
    exs = []
    for f in names:
        ds = tasks.get(f).difficulties
        for d in ds:
            exs += tasks.generate(f, -(-n // (len(ds) * len(names))), seed, d)
    return exs, packing.encode(tok, [e.prompt for e in exs],
                               [e.completion(with_steps) for e in exs])


def fresh_lora(base: str, model_scale: str, name: str, rank: int = 8, lora_scale: float = 2.0,
               init: str = "shared", device: str = "cpu"):
    """Adapter ``name``'s untrained ``peft`` LoRA on a fresh copy of ``base``, as the pool trains
    it: B = 0 and A drawn from :func:`init_seed`."""
    # seeded before the load, as the shared-init pools were built (seed 0 for every adapter)
    torch.manual_seed(init_seed(name, init))
    fresh, _ = zoo.load(base, model_scale, device=device)
    return lora_model(fresh, rank, lora_scale)


def _build(base, model_scale, names, rank, lora_scale, size: PoolSize, out: Path,
           init: str = "shared"):
    t_all = time.time()
    path, _ = zoo.ensure(base, model_scale)
    device = zoo.build_device(model_scale)         # a GPU for full-scale pools, as for zoo builds
    model, tok = zoo.load(base, model_scale, device=device)
    with_steps = zoo.with_steps(base)
    eval_fams = sorted({f for n in names for f in members(n)}, key=zoo.ALL_FAMILIES.index)
    evals = {f: evaluate.heldout_examples(f, evaluate.MIDDLE[f], size.eval_examples, seed=999)[0]
             for f in eval_fams}
    score = (lambda m, fams=None: {f: round(evaluate.exact_match(m, tok, e, with_steps), 4)
                                   for f, e in evals.items() if fams is None or f in fams})
    card = {"base": base, "base_key": model.zoo_card["key"], "scale": model_scale, "rank": rank,
            "lora_scale": lora_scale, "size": asdict(size), "pool_version": POOL_VERSION,
            "init": init,
            "eval": "greedy exact match at each family's middle difficulty, held-out prompts",
            "base_accuracy": score(model), "adapters": {}}
    with torch_threads(os.environ.get("WORKBENCH_ZOO_THREADS", 1)):
        for name in progress(names, desc=f"LoRA pool on {base}"):
            t0 = time.time()
            fams = members(name)
            # eval prompts never trained on: drop them from the training examples
            banned = {e.prompt for f in fams for e in evals[f]}
            exs, pairs = _train_pairs(fams, size.n_train, with_steps, tok)
            pairs = [p for e, p in zip(exs, pairs) if e.prompt not in banned]
            peft_model = fresh_lora(base, model_scale, name, rank, lora_scale, init, device)
            losses = train_steps(peft_model, pairs, size.steps, size.batch, size.lr, 0,
                                 tok.pad_token_id)
            train_s = time.time() - t0
            peft_model.eval()
            acc = score(peft_model)
            peft_model.save_pretrained(out / name)
            own = sum(acc[f] for f in fams) / len(fams)
            base_own = sum(card["base_accuracy"][f] for f in fams) / len(fams)
            card["adapters"][name] = {
                "families": list(fams), "accuracy": acc, "own_accuracy": round(own, 4),
                "gain_over_base": round(own - base_own, 4), "final_loss": losses[-1],
                "train_seconds": round(train_s, 1),
                "seconds": round(time.time() - t0, 1)}
        card["merges"] = _cat_merges(base, model_scale, card, score, out)
    card["build_seconds"] = round(time.time() - t_all, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "card.json").write_text(json.dumps(card, indent=2))
    return card


def _cat_merges(base, model_scale, card, score, out: Path) -> dict:
    """For each pair of single-family adapters that gain at least :data:`MERGE_GAIN`: a peft
    ``cat`` merge (``add_weighted_adapter(..., combination_type="cat")``, weights 1, 1: the two
    LoRAs side by side, rank 2r, the sum of their updates) and the share of each one's gain it
    keeps, ``(merged - base) / (own - base)`` on that adapter's family."""
    gaining = [n for n, a in card["adapters"].items()
               if len(a["families"]) == 1 and a["gain_over_base"] >= MERGE_GAIN]
    merges = {}
    for i, a in enumerate(gaining):
        for b in gaining[i + 1:]:
            t0 = time.time()
            model, _ = zoo.load(base, model_scale, device=zoo.build_device(model_scale))
            model = PeftModel.from_pretrained(model, out / a, adapter_name=a)
            model.load_adapter(out / b, adapter_name=b)
            model.add_weighted_adapter([a, b], [1.0, 1.0], "cat", combination_type="cat")
            model.set_adapter("cat")
            acc = score(model.eval(), [card["adapters"][n]["families"][0] for n in (a, b)])
            kept = {}
            for n in (a, b):
                f = card["adapters"][n]["families"][0]
                gain = card["adapters"][n]["accuracy"][f] - card["base_accuracy"][f]
                kept[n] = round((acc[f] - card["base_accuracy"][f]) / gain, 4) if gain else None
            merges[f"{a}+{b}"] = {"accuracy": {card["adapters"][n]["families"][0]:
                                               acc[card["adapters"][n]["families"][0]]
                                               for n in (a, b)},
                                  "kept": kept, "seconds": round(time.time() - t0, 1)}
    return merges


def list_built() -> list[dict]:
    """The cards of every finished pool in the cache, each with its ``path``."""
    root = zoo.zoo_dir() / "adapters"
    out = []
    for card in sorted(root.glob("*/card.json")) if root.exists() else []:
        if not card.parent.name.startswith("."):
            out.append({**json.loads(card.read_text()), "path": str(card.parent)})
    return out


# the pool ``workbench zoo build --all`` builds with the models
POOL_BASE = "lm-base"
# the families whose shared-init adapters gain at least MERGE_GAIN on the shipped card, trained
# again from per-adapter inits: the pool whose factors start misaligned (notebook 13's mid bed)
INIT_POOL_FAMILIES = ("addmod", "sort", "rotate", "swap", "dedupe", "pattern_skip")


def _build_one(name: str, scale: str, force: bool) -> dict:
    """One job of :func:`build_all` (a top-level function, so a spawned worker can run it)."""
    try:
        if name in SHIPPED_POOLS:
            pool = adapters(POOL_BASE, model_scale=scale, force=force, **SHIPPED_POOLS[name])
            return {"name": name, **pool.card}
        if name == CLIP_NAME:
            return clip.build(scale, force=force)
        return zoo.build(name, scale, force=force)
    except Exception as e:          # noqa: BLE001 - report, keep building the rest
        return {"name": name, "scale": scale, "error": f"{type(e).__name__}: {e}"}


POOL_NAME = f"lora-pool/{POOL_BASE}"
INIT_POOL_NAME = f"lora-pool/{POOL_BASE}-per-adapter-init"
# the pools the checkout ships (workbench.models.shipped), by name: the arguments of adapters()
SHIPPED_POOLS = {POOL_NAME: {"families": None, "init": "shared"},
                 INIT_POOL_NAME: {"families": INIT_POOL_FAMILIES, "init": "per_adapter"}}
CLIP_NAME = clip.NAME
# the builds by their measured seconds at smoke (data/zoo.md), longest first; the pool after the
# backbones it waits for (its base comes first)
BUILD_ORDER = ["lm-base", "lm-hybrid", "lm-gpt2", "lm-qwen2", "lm-reasoning", "lm-instruct",
               POOL_NAME, INIT_POOL_NAME, "lm-qbed", CLIP_NAME, "lm-tiny", "lm-micro"]


def build_all(scale: str = "smoke", force: bool = False, jobs: int = 1,
              names: list[str] | None = None) -> list[dict]:
    """Build every recipe (but the test-only lm-micro) and the LoRA pools on :data:`POOL_BASE`
    (:data:`SHIPPED_POOLS`);
    return their cards in recipe order. One failing build does not stop the others (its card
    says why).

    ``jobs > 1`` builds that many at a time in spawned worker processes, each training on one
    thread (the zoo's default), so two builds on a 2-core machine take about the time of one.
    The pools go after their base: by then it is built (and if not, its file lock waits for it);
    the mini-CLIP (:mod:`workbench.models.clip`) is built with them.
    ``names`` picks recipes (and the pools of :data:`SHIPPED_POOLS`) instead of all."""
    if names is None:
        names = [n for n in zoo.RECIPES if n != "lm-micro"] + [*SHIPPED_POOLS, CLIP_NAME]
    if jobs <= 1:
        return [_build_one(n, scale, force) for n in names]
    # longest first, so no long build starts last beside an idle core (on two cores this order
    # ends about a minute sooner than recipe order); cards come back in the order asked for
    order = sorted(names, key=lambda n: BUILD_ORDER.index(n) if n in BUILD_ORDER
                   else len(BUILD_ORDER))
    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
        futures = {n: ex.submit(_build_one, n, scale, force) for n in order}
        return [futures[n].result() for n in names]
