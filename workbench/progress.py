"""One progress helper for the whole workbench (docs/design.md: tqdm.auto, quiet when not interactive)."""
from __future__ import annotations

import sys
from typing import Iterable

from tqdm.auto import tqdm

from .env import batch_mode, interactive

__all__ = ["progress"]


def progress(iterable: Iterable | None = None, total: int | None = None, desc: str = "",
             **kwargs):
    """A live bar in Jupyter or a terminal; in papermill/CI logs, a line every ~10 percent."""
    live = interactive() or (sys.stderr.isatty() and not batch_mode())
    if not live:
        # mininterval in seconds is what keeps logs short; miniters bounds the update count too.
        n = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        kwargs.setdefault("mininterval", 5.0)
        kwargs.setdefault("miniters", max(1, (n or 10) // 10))
        kwargs.setdefault("ascii", True)
        kwargs.setdefault("file", sys.stdout)
    return tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, **kwargs)

