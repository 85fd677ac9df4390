"""The zoo: small pretrained language models, built once on first use and cached.

Most papers adapt, quantize, route or merge a *pretrained* LM, and nothing may be downloaded, so
the workbench pretrains its own (docs/zoo.md). The recipes live in :mod:`workbench.models.recipes`,
the training in :mod:`workbench.models.training`, the evaluation in :mod:`workbench.evaluate`;
this module is the cache in front of them.

``load(name, scale)`` returns ``(model, tokenizer)``. The first call trains and saves with
``save_pretrained`` under ``cache.folder("zoo") / f"{name}-{scale}-{key}"``, the key covering the
recipe, the scale's sizes and ``ZOO_VERSION`` (:meth:`Recipe.key`), through :func:`cache.build`:
concurrent callers build once and a half-written model is never read. Beside each model,
``card.json``: parameters, tokens seen, held-out perplexity, unigram-baseline perplexity and
per-task accuracy. ``build``, ``list_built`` and ``clear`` back ``workbench zoo build|list|clear``.

A user's own model: wherever a notebook passes a zoo name, a local checkpoint directory does too
(:mod:`workbench.models.checkpoint`). ``load(path)`` reads it with ``AutoModelForCausalLM`` /
``AutoTokenizer``, local files only; :func:`key` is then the checkpoint's content hash (what the
caches of things built from it are keyed by), :func:`with_steps` and ``model.zoo_card`` come from
its ``card.json`` when it has one (:func:`export` writes a zoo model as such a directory).
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from .. import cache
from ..data.tasks import ALL_FAMILIES
from ..device import zoo_scale
from . import checkpoint
from .recipes import RECIPES, Recipe, recipe
from .training import train_and_save

__all__ = ["ALL_FAMILIES", "RECIPES", "recipe", "zoo_dir", "model_dir", "load", "ensure", "build",
           "list_built", "clear", "key", "with_steps", "label", "export", "zoo_scale"]


def zoo_dir() -> Path:
    """``cache.folder("zoo")``: where the backbones (and the pool, the mini-CLIP) live."""
    return cache.folder("zoo")


def model_dir(name: str, scale: str = "smoke", given: Recipe | None = None) -> Path:
    """The cache folder of zoo model ``name`` at ``scale`` (built or not)."""
    r, scale = recipe(name, given), zoo_scale(scale)
    return zoo_dir() / f"{r.name}-{scale}-{r.key(scale)}"


def build_device(scale: str) -> str:
    """Where a zoo build (a backbone, the LoRA pool) trains: CUDA for full-scale builds when it
    is present, else the CPU (smoke builds stay on the CPU, where the shipped ones were built)."""
    import torch
    return "cuda" if scale == "full" and torch.cuda.is_available() else "cpu"


def key(name: str, scale: str = "smoke", given: Recipe | None = None) -> str:
    """What keys the caches of things built from model ``name``: a zoo recipe's key at
    ``scale``, or a checkpoint directory's content hash (the scale does not change it)."""
    if given is None and checkpoint.is_checkpoint(name):
        return checkpoint.content_hash(name)
    return recipe(name, given).key(scale)


def with_steps(name: str, given: Recipe | None = None) -> bool:
    """Whether model ``name`` writes the steps of a task (its recipe's, or for a checkpoint its
    card's; False for a checkpoint without a card)."""
    if given is None and checkpoint.is_checkpoint(name):
        return bool(checkpoint.card(name)["recipe"].get("with_steps"))
    return recipe(name, given).with_steps


def label(name: str) -> str:
    """The model's name in folder names and tables (a checkpoint: its directory's name)."""
    return checkpoint.label(name)


def export(name: str, dest, scale: str = "smoke") -> Path:
    """Write zoo model ``name`` as a plain Hugging Face directory ``dest`` (``save_pretrained``
    of the model and the tokenizer) with its ``card.json`` beside them; return the path."""
    dest = Path(dest)
    model, tok = load(name, scale)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    shutil.copy(model_dir(name, scale) / "card.json", dest / "card.json")
    return dest


def _tokenizer(d: Path):
    """The checkpoint's tokenizer: ``AutoTokenizer``, except that a plain ``tokenizer.json``
    saved as such (class ``PreTrainedTokenizerFast`` / ``TokenizersBackend``, as the zoo's) is
    read as it is: ``AutoTokenizer`` would otherwise pick the class of the model type (a Qwen2
    checkpoint gets Qwen2's own pre-tokenizer in place of the one the model was trained with)."""
    cfg = d / "tokenizer_config.json"
    cls = json.loads(cfg.read_text()).get("tokenizer_class") if cfg.exists() else None
    if cls in ("PreTrainedTokenizerFast", "TokenizersBackend") and (d / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(d, local_files_only=True)
    return AutoTokenizer.from_pretrained(d, local_files_only=True)


def _checkpoint_tokenizer(d: Path):
    """:func:`_tokenizer` with left padding, pad = eos and bos = eos (each with a warning) where
    the tokenizer has none: every notebook pads batches and starts prompts with ``<bos>``."""
    tok = _tokenizer(d)
    tok.padding_side = "left"
    if tok.pad_token is None:
        warnings.warn(checkpoint.pad_warning(d), stacklevel=4)
        tok.pad_token = tok.eos_token
    if tok.bos_token is None:
        warnings.warn(checkpoint.bos_warning(d), stacklevel=4)
        tok.bos_token = tok.eos_token
    return tok


def _load_checkpoint(path, device: str):
    """``(model, tokenizer)`` from a local checkpoint directory (float32, eval; the tokenizer
    as :func:`_checkpoint_tokenizer` sets it up)."""
    d = Path(path).expanduser().resolve()
    checkpoint.validate(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype="float32", local_files_only=True)
    model = model.to(device).eval()
    tok = _checkpoint_tokenizer(d)
    model.zoo_card = checkpoint.card(d, model)
    return model, tok


def tokenizer(name: str, scale: str = "smoke"):
    """Model ``name``'s tokenizer alone (a zoo model is built on first use), as :func:`load`
    gives it."""
    if checkpoint.is_checkpoint(name):
        return _checkpoint_tokenizer(Path(name).expanduser().resolve())
    tok = PreTrainedTokenizerFast.from_pretrained(ensure(name, scale)[0])
    tok.padding_side = "left"
    return tok


def load(name: str, scale: str = "smoke", recipe: Recipe | None = None, device: str = "cpu"):
    """``(model, tokenizer)`` for zoo model ``name`` at ``scale``, built on first use, or for a
    local checkpoint directory ``name`` (the scale is then not used).

    The model is in eval mode on ``device``; its ``card.json`` is at
    ``model_dir(name, scale) / "card.json"`` (also ``model.zoo_card``).
    """
    if recipe is None and checkpoint.is_checkpoint(name):
        return _load_checkpoint(name, device)
    path, _ = ensure(name, scale, recipe)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").to(device).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.padding_side = "left"
    model.zoo_card = json.loads((path / "card.json").read_text())
    return model, tok


def ensure(name: str, scale: str = "smoke", given: Recipe | None = None,
           force: bool = False) -> tuple[Path, bool]:
    """Make sure the model is built (:func:`cache.build`); return ``(path, built_now)`` (a
    checkpoint directory is there already: its path, False)."""
    if given is None and checkpoint.is_checkpoint(name):
        return Path(name).expanduser().resolve(), False
    r, scale = recipe(name, given), zoo_scale(scale)
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
