"""The zoo: small pretrained language models, built once on first use and cached.

Most papers adapt, quantize, route or merge a *pretrained* LM, and nothing may be downloaded, so
the workbench pretrains its own (ZOO.md). The recipes live in :mod:`workbench.models.recipes`,
the training in :mod:`workbench.models.training`, the evaluation in :mod:`workbench.evaluate`;
this module is the cache in front of them.

``load(name, scale)`` returns ``(model, tokenizer)``. The first call trains and saves with
``save_pretrained`` under ``cache.folder("zoo") / f"{name}-{scale}-{key}"``, the key covering the
recipe, the scale's sizes and ``ZOO_VERSION`` (:meth:`Recipe.key`), through :func:`cache.build`:
concurrent callers build once and a half-written model is never read. Beside each model,
``card.json``: parameters, tokens seen, held-out perplexity, unigram-baseline perplexity and
per-task accuracy. ``build``, ``list_built`` and ``clear`` back ``workbench zoo build|list|clear``.
"""
from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from .. import cache
from .recipes import ALL_FAMILIES, RECIPES, Recipe, recipe
from .training import train_and_save

__all__ = ["ALL_FAMILIES", "RECIPES", "recipe", "zoo_dir", "model_dir", "load", "ensure", "build",
           "list_built", "clear"]


def zoo_dir() -> Path:
    """``cache.folder("zoo")``: where the backbones (and the pool, the mini-CLIP) live."""
    return cache.folder("zoo")


def model_dir(name: str, scale: str = "smoke", given: Recipe | None = None) -> Path:
    """The cache folder of zoo model ``name`` at ``scale`` (built or not)."""
    r = recipe(name, given)
    return zoo_dir() / f"{r.name}-{scale}-{r.key(scale)}"


def build_device(scale: str) -> str:
    """Where a zoo build (a backbone, the LoRA pool) trains: CUDA for full-scale builds when it
    is present, else the CPU (smoke builds stay on the CPU, where the shipped ones were built)."""
    import torch
    return "cuda" if scale == "full" and torch.cuda.is_available() else "cpu"


def load(name: str, scale: str = "smoke", recipe: Recipe | None = None, device: str = "cpu"):
    """``(model, tokenizer)`` for zoo model ``name`` at ``scale``, built on first use.

    The model is in eval mode on ``device``; its ``card.json`` is at
    ``model_dir(name, scale) / "card.json"`` (also ``model.zoo_card``).
    """
    path, _ = ensure(name, scale, recipe)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").to(device).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.padding_side = "left"
    model.zoo_card = json.loads((path / "card.json").read_text())
    return model, tok


def ensure(name: str, scale: str = "smoke", given: Recipe | None = None,
           force: bool = False) -> tuple[Path, bool]:
    """Make sure the model is built (:func:`cache.build`); return ``(path, built_now)``."""
    r = recipe(name, given)
    return cache.build(model_dir(name, scale, r),
                       lambda tmp: train_and_save(r, scale, tmp, load=load),
                       ready="card.json", force=force)


def build(name: str, scale: str = "smoke", force: bool = False) -> dict:
    """Build (or with ``force`` rebuild) zoo model ``name`` and return its card."""
    path, _ = ensure(name, scale, force=force)
    return json.loads((path / "card.json").read_text())


def list_built() -> list[dict]:
    """The cards of every finished build in the cache, each with its ``path``."""
    out = []
    for card in sorted(zoo_dir().glob("*/card.json")):
        if card.parent.name.startswith("."):
            continue
        d = json.loads(card.read_text())
        d["path"] = str(card.parent)
        out.append(d)
    return out


def clear(name: str | None = None) -> list[Path]:
    """Delete every build of ``name`` (all builds when None); return the removed paths."""
    if name is not None:
        recipe(name)
    removed = []
    for p in sorted(zoo_dir().iterdir()):
        if not p.is_dir() or p.name.startswith("."):
            continue
        card = p / "card.json"
        model_name = json.loads(card.read_text())["name"] if card.exists() else \
            p.name.rsplit("-", 2)[0]
        if name is None or model_name == name:
            cache.remove(p)
            removed.append(p)
    return removed
