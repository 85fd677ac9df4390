"""The one cache: where built things live, how they are keyed, and how one is built safely.

Everything the workbench builds once and reuses (zoo backbones, the LoRA pool, fine-tunes, the
mini-CLIP, a method's or a notebook's cached runs) lives under :func:`root` (``$WORKBENCH_CACHE``
or ``data/cache``), in a folder named by a content :func:`key` of whatever changes the result.
:func:`build` makes an entry exactly once: under a file lock, into a hidden temporary folder that
is renamed into place when finished, so two builders build once and a half-written entry is never
read. An entry is finished when its ``ready`` file exists.

Shipped entries. The checkout ships the zoo's smoke builds in ``data/zoo`` (:func:`shipped_root`),
laid out as ``root()/zoo``, and the entries the notebooks' smoke runs derive from them (fine-tunes,
sweeps, routers: seed 0, what ``make run`` and ``make test`` use) in ``data/smoke``
(:func:`smoke_root`), laid out as ``root()``. :func:`build` copies a shipped entry into the cache
instead of making it, so every machine starts from the same weights and a fresh clone trains
nothing at smoke; ``force`` makes it anew. Each entry a process asks for is noted
(:func:`entries`): a run lists them, how each was got (built, copied, already there), in its
``metrics.json``, which is what ``workbench zoo ship --smoke RUN`` ships.

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

__all__ = ["root", "folder", "key", "build", "is_built", "remove", "shipped_root", "smoke_root",
           "shipped", "note_use", "used", "entries"]


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


def smoke_root() -> Path:
    """The notebooks' derived smoke entries the checkout ships (``data/smoke``), laid out as
    ``root()``."""
    return project_root() / "data" / "smoke"


def _relative(path: Path) -> Path | None:
    """``path`` relative to the cache root, or None when it lies outside."""
    try:
        return Path(path).resolve().relative_to(root().resolve())
    except ValueError:
        return None


def shipped(path: Path, ready: str = "done.json") -> Path | None:
    """The finished shipped copy of the cache entry at ``path``: the zoo's (``data/zoo``) for an
    entry under ``root()/zoo``, else a smoke run's (``data/smoke``); None when neither ships it
    at this key (or ``path`` is outside the cache)."""
    rel = _relative(path)
    if rel is None:
        return None
    places = [smoke_root() / rel]
    if rel.parts[:1] == ("zoo",):
        places.insert(0, shipped_root() / rel.relative_to("zoo"))
    return next((src for src in places if is_built(src, ready)), None)


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
        _note(path, ready, "there")
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if is_built(path, ready) and not force:
            _note(path, ready, "there")
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
    _note(path, ready, "copied" if src is not None else "built")
    return path, src is None


_ENTRIES: dict[str, dict] = {}


def _note(path: Path, ready: str, how: str) -> None:
    rel = _relative(path)
    if rel is not None:                  # an entry outside the cache (a test's folder) is not one
        _ENTRIES.setdefault(rel.as_posix(), {"entry": rel.as_posix(), "ready": ready, "how": how})


def entries() -> list[dict]:
    """The cache entries this process asked :func:`build` for, in order: ``{"entry": path
    relative to the cache root, "ready": its ready file, "how": "built" | "copied" (from a shipped
    copy) | "there" (already in the cache)}``, the first time each was asked for."""
    return list(_ENTRIES.values())


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
