"""Explorers: controls over the knob that carries a paper's idea, redrawing a picture as they move.

A notebook declares what to vary and how to draw one state; this module builds the controls.
:func:`explore` takes ``draw(**values) -> figure`` (matplotlib or plotly) and one control per
knob, declared by its values:

- a list or tuple of choices: a dropdown (strings) or a selection slider (numbers), the first
  the default; ``choice_(options, value)`` starts at another;
- ``range_(low, high, step)``: a slider (whole numbers when all three are ints);
- a bool: a checkbox. In a live Jupyter session
(:func:`workbench.env.interactive`) the controls appear above the picture and every move redraws
it: a draw should take under a second on two cores, so it reads cached results or recomputes
something cheap. Under papermill, nbval and CI (and in a plain script) nothing interactive is
built: the default state is drawn once, a static picture the executed notebook, the report and
the book keep, with a line naming the knobs a live session would offer.

:func:`explore_table` is the common case of a cached table: pick rows by the knobs' columns and
draw ``y`` against ``x``, one line per ``by`` value.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Callable

import ipywidgets as widgets
import matplotlib.pyplot as plt
import pandas as pd
import plotly.graph_objects as go
from IPython.display import Image, display

from . import plots
from .env import interactive

__all__ = ["range_", "choice_", "explore", "explore_table", "defaults"]


@dataclass(frozen=True)
class range_:          # noqa: N801 - reads like a declaration: range_(0.0, 1.0, 0.05)
    """A continuous knob: a slider from ``low`` to ``high`` in steps of ``step``."""
    low: float
    high: float
    step: float
    value: float | None = None

    def __post_init__(self):
        if not self.low < self.high or self.step <= 0:
            raise ValueError(f"range_ needs low < high and step > 0, got {self}")
        v = self.low if self.value is None else self.value
        if not self.low <= v <= self.high:
            raise ValueError(f"range_ value {v} lies outside [{self.low}, {self.high}]")


@dataclass(frozen=True)
class choice_:         # noqa: N801 - a declaration like range_
    """Choices with a default other than the first: ``choice_([0.0, 0.1, 0.5], 0.1)``."""
    options: tuple
    value: object

    def __post_init__(self):
        object.__setattr__(self, "options", tuple(self.options))
        if self.value not in self.options:
            raise ValueError(f"choice_ value {self.value!r} is not one of {list(self.options)}")


def _check(name: str, spec) -> None:
    if isinstance(spec, (list, tuple)) and len(spec) == 0:
        raise ValueError(f"knob {name!r} has no values to choose from")
    if not isinstance(spec, (list, tuple, range_, choice_, bool)):
        raise TypeError(f"knob {name!r}: give a list of choices, choice_(options, value), "
                        f"range_(low, high, step) or a bool, not {type(spec).__name__}")


def defaults(knobs: dict) -> dict:
    """The default value of every knob: the first choice, ``range_``'s value (or low), the bool."""
    for name, spec in knobs.items():
        _check(name, spec)
    return {n: (s.low if s.value is None else s.value) if isinstance(s, range_)
            else s.value if isinstance(s, choice_) else s if isinstance(s, bool) else s[0]
            for n, s in knobs.items()}


def _control(name: str, spec):
    if isinstance(spec, bool):
        return widgets.Checkbox(value=spec, description=name)
    if isinstance(spec, range_):
        whole = all(isinstance(v, int) for v in (spec.low, spec.high, spec.step))
        slider = widgets.IntSlider if whole else widgets.FloatSlider   # a block size stays an int
        return slider(value=defaults({name: spec})[name], min=spec.low, max=spec.high,
                      step=spec.step, description=name, continuous_update=False)
    options, value = (spec.options, spec.value) if isinstance(spec, choice_) else (spec, spec[0])
    if all(isinstance(v, str) for v in options):
        return widgets.Dropdown(options=list(options), value=value, description=name)
    return widgets.SelectionSlider(options=list(options), value=value, description=name,
                                   continuous_update=False)


def _show(fig) -> None:
    """Display a matplotlib figure as a PNG (whatever the backend: under nbval's Agg a figure
    object would show as its repr) and close it, so nothing draws it twice; a plotly one as is."""
    if isinstance(fig, plt.Figure):
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        display(Image(data=buf.getvalue()))
    else:
        display(fig)


def _offer(spec) -> str:
    """What a live control would offer, in words."""
    if isinstance(spec, bool):
        return "on or off"
    if isinstance(spec, range_):
        return f"{spec.low}..{spec.high} in steps of {spec.step}"
    options = spec.options if isinstance(spec, choice_) else spec
    return "{" + ", ".join(repr(v) if isinstance(v, str) else str(v) for v in options) + "}"


def explore(draw: Callable[..., object], **knobs) -> None:
    """Controls for ``knobs`` over the picture ``draw(**values)`` (see the module docstring),
    displayed here: live, the controls above the picture; otherwise the default state, drawn
    once. Returns nothing, so a cell that ends with the call shows one picture."""
    if not knobs:
        raise ValueError("explore needs at least one knob to vary")
    start = defaults(knobs)
    if not interactive():
        offered = "; ".join(f"{n} {_offer(s)}" for n, s in knobs.items())
        state = ", ".join(f"{n}={v}" for n, v in start.items())
        print(f"Explorer, drawn at its default ({state}). In a live session: {offered}.")
        _show(draw(**start))
        return
    controls = {n: _control(n, s) for n, s in knobs.items()}
    out = widgets.interactive_output(lambda **v: _show(draw(**v)), controls)
    display(widgets.VBox([widgets.HBox(list(controls.values())), out]))


def _table_figure(rows: pd.DataFrame, x: str, y: str, by: str | None, title: str,
                  ylabel: str):
    """A plotly figure live (hover, zoom, toggle lines), a matplotlib one otherwise."""
    groups = rows.groupby(by, sort=False) if by else [(y, rows)]
    if interactive():
        fig = go.Figure([go.Scatter(x=g[x], y=g[y], name=str(k), mode="lines+markers",
                                    line=dict(color=plots.PALETTE[i % len(plots.PALETTE)]))
                         for i, (k, g) in enumerate(groups)])
        return fig.update_layout(title=title, xaxis_title=x, yaxis_title=ylabel,
                                 template="plotly_white", hovermode="x unified")
    fig, ax = plots.subplots()
    for i, (k, g) in enumerate(groups):
        ax.plot(g[x], g[y], "o-", color=plots.PALETTE[i % len(plots.PALETTE)], label=str(k))
    ax.set(xlabel=x, ylabel=ylabel)
    ax.set_title(title, fontsize=9, wrap=True)
    if by:
        ax.legend(fontsize=8)
    return fig


def explore_table(table: pd.DataFrame, x: str, y: str, knobs: list[str], by: str | None = None,
                  title: str = "", ylabel: str | None = None) -> None:
    """An explorer over a cached table: one control per column in ``knobs`` (its distinct
    values, in the table's order), drawing ``y`` (axis label ``ylabel``, default the column's
    name) against ``x`` for the rows that match, one line per ``by`` value."""
    missing = [c for c in [x, y, *knobs, *([by] if by else [])] if c not in table.columns]
    if missing:
        raise KeyError(f"explore_table: no column(s) {missing}; the table has "
                       f"{list(table.columns)}")

    def draw(**values):
        rows = table
        for k, v in values.items():
            rows = rows[rows[k] == v]
        label = ", ".join(f"{k}={v}" for k, v in values.items())
        return _table_figure(rows.sort_values(x), x, y, by,
                             f"{title} ({label})" if title else label, ylabel or y)

    explore(draw, **{k: list(pd.unique(table[k])) for k in knobs})
