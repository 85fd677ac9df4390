"""The one cache: where built things live, how they are keyed, and how one is built safely.

Everything the workbench builds once and reuses (zoo backbones, the LoRA pool, fine-tunes, the
mini-CLIP, a method's or a notebook's cached runs) lives under :func:`root` (``$WORKBENCH_CACHE``
or ``data/cache``), in a folder named by a content :func:`key` of whatever changes the result.
:func:`build` makes an entry exactly once: under a file lock, into a hidden temporary folder that
is renamed into place when finished, so two builders build once and a half-written entry is never
read. An entry is finished when its ``ready`` file exists.

Shipped entries. The checkout ships the zoo's smoke builds in ``data/zoo`` (:func:`shipped_root`),
laid out as ``root()/zoo``. :func:`build` copies a shipped entry into the cache instead of making
it, so every machine starts from the same weights; ``force`` makes it anew from the recipe.

This module sits on the ground floor: it imports nothing from the package but :mod:`env`, and
neither torch nor transformers.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from filelock import FileLock

from .env import cache_dir, project_root

__all__ = ["root", "folder", "key", "build", "is_built", "remove", "shipped_root", "shipped",
           "note_use", "used"]


def root() -> Path:
    """The cache root: ``$WORKBENCH_CACHE`` or ``<checkout>/data/cache`` (created on first use)."""
    return cache_dir()


def folder(*parts: str) -> Path:
    """``root() / parts...``, created: the folder one kind of entry lives in (``zoo``,
    ``zoo/adapters``, a notebook's slug)."""
    p = root().joinpath(*parts)
    p.mkdir(parents=True, exist_ok=True)
    return p


def key(*parts, length: int = 12) -> str:
    """A content key: the first ``length`` hex digits of the sha1 of the JSON of ``parts``
    (settings, model keys, training texts; anything JSON can write, the rest by ``str``)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha1(blob).hexdigest()[:length]


def shipped_root() -> Path:
    """The entries the checkout ships (``data/zoo``), laid out as ``root() / "zoo"``."""
    return project_root() / "data" / "zoo"


def shipped(path: Path, ready: str = "done.json") -> Path | None:
    """The finished shipped copy of the cache entry at ``path``, or None (not a zoo entry, or
    not shipped at this key)."""
    try:
        rel = Path(path).resolve().relative_to((root() / "zoo").resolve())
    except ValueError:
        return None
    src = shipped_root() / rel
    return src if is_built(src, ready) else None


def is_built(path: Path, ready: str = "done.json") -> bool:
    """Whether the entry at ``path`` is finished (its ``ready`` file exists)."""
    return (Path(path) / ready).exists()


def build(path: Path, make: Callable[[Path], dict | None], ready: str = "done.json",
          force: bool = False) -> tuple[Path, bool]:
    """Build the entry at ``path`` once; return ``(path, built_now)``.

    ``make(tmp)`` writes the entry into the empty folder ``tmp``. If it did not write ``ready``
    itself, the dict it returns is written there as JSON. Under a file lock, a finished entry is
    looked for again (somebody may have built it while we waited); otherwise ``tmp`` is filled
    and renamed to ``path`` (atomic on one filesystem): with the :func:`shipped` copy when there
    is one (``built_now`` is then False: nothing was trained), else by ``make``. ``force`` makes
    it again with ``make`` and replaces a finished entry, which is moved aside only once the new
    one is done.
    """
    path = Path(path)
    if is_built(path, ready) and not force:
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if is_built(path, ready) and not force:
            return path, False
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        src = None if force else shipped(path, ready)
        try:
            if src is not None:
                shutil.copytree(src, tmp)
            else:
                tmp.mkdir(parents=True)
                info = make(tmp)
                if not (tmp / ready).exists():
                    (tmp / ready).write_text(json.dumps(info or {}, indent=2, default=str))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.rename(path, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, path)
    return path, src is None


_USED: set[str] = set()


def note_use(name: str) -> None:
    """Note that this process used the zoo entry ``name`` (a recipe, ``lora-pool``, the
    mini-CLIP): a run's ``metrics.json`` lists them, so its recorded results go stale when one
    of *these* keys moves, not when any entry of the zoo does."""
    _USED.add(name)


def used() -> list[str]:
    """The zoo entries this process used (:func:`note_use`), sorted."""
    return sorted(_USED)


def remove(path: Path) -> None:
    """Delete the entry at ``path`` and its lock file."""
    path = Path(path)
    shutil.rmtree(path, ignore_errors=True)
    lock = Path(str(path) + ".lock")
    if lock.exists():
        lock.unlink()
