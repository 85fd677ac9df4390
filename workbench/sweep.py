"""Sweeps: every method on the same grid of one knob (a learning rate), each judged at its best.

A comparison decided at one hand-picked learning rate credits whoever the rate suits (in
15, Adam at 1e-3 for 25 steps cannot collapse; in 04, rsLoRA and PiSSA are unstable at 3e-3).
:func:`sweep` runs ``run(method, value) -> metrics`` for every method and value, picks each
method's value on a *selection* metric (a validation split, never the test set), and returns
a :class:`Sweep`: the whole table, the best row per method, and a plot of the grid. A run whose
selection metric is NaN or infinite (diverged) is never selected; ties go to the first value in
grid order. With ``cache_dir`` every run is kept as JSON through
:func:`workbench.cache.build`, so a re-run or a wider grid trains only what is new.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd

from . import cache, plots
from .progress import progress

__all__ = ["Sweep", "sweep"]


@dataclass
class Sweep:
    """The runs of a sweep (``table``: one row per method and value) and its selection rule."""
    knob: str
    select: str
    mode: str
    table: pd.DataFrame

    def best(self) -> pd.DataFrame:
        """One row per method: the run at its selected value (methods in the order swept)."""
        rows = [self.at_best(m) for m in self.table["method"].unique()]
        return pd.DataFrame(rows).reset_index(drop=True)

    def at_best(self, method: str) -> dict:
        """The selected run of ``method`` as a dict (its metrics, the knob's value)."""
        runs = self.table[self.table["method"] == method]
        if runs.empty:
            raise KeyError(f"no runs of {method!r}; methods are {list(self.table['method'].unique())}")
        score = runs[self.select].map(lambda v: v if _finite(v) else math.nan)
        if score.isna().all():
            return {**runs.iloc[0].to_dict(), "selected": False}
        i = score.idxmax() if self.mode == "max" else score.idxmin()
        return {**runs.loc[i].to_dict(), "selected": True}

    def plot(self, metric: str | None = None, ax=None, logx: bool = True):
        """``metric`` (default the selection metric) against the knob, a line per method, each
        method's selected value ringed."""
        metric = metric or self.select
        if ax is None:
            _, ax = plots.subplots()
        for i, (method, runs) in enumerate(self.table.groupby("method", sort=False)):
            color = plots.PALETTE[i % len(plots.PALETTE)]
            style = ("-", "--", ":")[i // len(plots.PALETTE) % 3]     # more methods than colours
            ax.plot(runs[self.knob], runs[metric], marker="o", ls=style, color=color, label=method)
            b = self.at_best(method)
            if b["selected"]:
                ax.plot([b[self.knob]], [b[metric]], "o", ms=12, mfc="none", color=color)
        if logx:
            ax.set_xscale("log")
        ax.set_xlabel(self.knob)
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} over the {self.knob} grid (ringed: selected on {self.select})")
        ax.legend(fontsize=8)
        return ax


def _finite(v) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _run_cached(run, method: str, value, where: Path) -> dict:
    def make(tmp: Path) -> None:
        (tmp / "result.json").write_text(json.dumps(run(method, value), default=float))
    cache.build(where, make, ready="result.json")
    return json.loads((where / "result.json").read_text())


def sweep(run: Callable[[str, float], dict], methods: Sequence[str], values: Sequence[float],
          select: str, mode: str = "max", knob: str = "lr", cache_dir: Path | None = None,
          desc: str = "sweep") -> Sweep:
    """Run ``run(method, value)`` (a dict of metrics holding ``select``) for every method and
    value of the grid; ``mode`` says whether ``select`` is better high (``"max"``) or low.

    ``cache_dir`` (a folder whose name carries a key of everything else ``run`` depends on, e.g.
    ``cache.folder(slug) / cache.key(settings)``) keeps each run; ``None`` runs everything."""
    if mode not in ("max", "min"):
        raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
    if not methods or not values:
        raise ValueError("a sweep needs at least one method and one value")
    rows = []
    for method, value in progress([(m, v) for m in methods for v in values], desc=desc):
        out = _run_cached(run, method, value, Path(cache_dir) / f"{method}-{knob}{value!r}") \
            if cache_dir is not None else run(method, value)
        if select not in out:
            raise KeyError(f"run({method!r}, {value!r}) returned no {select!r}; it returned "
                           f"{sorted(out)}")
        rows.append({"method": method, knob: value, **out})
    return Sweep(knob, select, mode, pd.DataFrame(rows))
