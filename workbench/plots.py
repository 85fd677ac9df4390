"""House plot style and small plotting helpers. Nothing is set on import: call :func:`style`.

:func:`curves` draws named series (with seed bands) as plotly in a live session and matplotlib
always, the static picture papermill and the HTML report keep. :func:`plotly_twin` redraws a
matplotlib figure of lines and points as plotly (hover, zoom, toggle series), so that a live
session gets an interactive twin of every main figure a notebook saves (``run.savefig``).
"""
from __future__ import annotations

import json

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import plotly.graph_objects as go
from cycler import cycler
from matplotlib.collections import LineCollection, PathCollection, PolyCollection, QuadMesh
from matplotlib.container import BarContainer
from matplotlib.colors import to_hex
from IPython.display import display
from plotly.subplots import make_subplots

from .env import in_ipython, interactive, runner_job

__all__ = ["PALETTE", "PLOTLY_MIME", "style", "subplots", "band", "mark_points", "curves",
           "plotly_twin", "keep_twin", "show_twin", "rounded"]

PLOTLY_MIME = "application/vnd.plotly.v1+json"   # plotly's notebook output type
PALETTE = ["#1f5a96", "#d1495b", "#2e933c", "#edae49", "#6c4f9c", "#00798c", "#8d6a4f"]


def style() -> None:
    """Apply the house matplotlib style (headless-safe: uses the Agg backend outside Jupyter)."""
    if not in_ipython():
        matplotlib.use("Agg")
    plt.rcParams.update({
        "figure.figsize": (6.4, 3.8), "figure.dpi": 100, "axes.grid": True, "grid.alpha": 0.3,
        "axes.spines.top": False, "axes.spines.right": False, "axes.titlesize": 11,
        "axes.labelsize": 10, "legend.fontsize": 8, "legend.frameon": False,
        "axes.prop_cycle": cycler(color=PALETTE), "lines.linewidth": 1.6,
    })


def subplots(nrows: int = 1, ncols: int = 1, **kwargs):
    """``plt.subplots`` with the house style applied and a width that grows with the columns."""
    style()
    kwargs.setdefault("figsize", (4.2 * ncols, 3.4 * nrows))
    kwargs.setdefault("constrained_layout", True)
    return plt.subplots(nrows, ncols, **kwargs)


def band(ax, x, runs, label: str | None = None, color=None, alpha: float = 0.2):
    """Mean line with a +-1 std band over the rows of ``runs`` (seeds x points)."""
    runs = np.atleast_2d(np.asarray(runs, float))
    mean, std = np.nanmean(runs, 0), np.nanstd(runs, 0)
    n = runs.shape[0]
    line, = ax.plot(x, mean, label=f"{label} (n={n})" if label and n > 1 else label, color=color)
    if n > 1:
        ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=alpha, lw=0)
    return line


def mark_points(ax, x, y, label: str = "spike", color="#d1495b", marker="v"):
    """Scatter markers (e.g. detected loss spikes) on top of a curve."""
    if len(x):
        ax.scatter(x, y, color=color, marker=marker, zorder=5, s=28, label=label)


# -- curves: plotly to explore in a live session, matplotlib always -----------------------------
def _series(data, x):
    """``(x values, {label: 1-D or (runs x points) array})`` from a DataFrame or a dict."""
    if hasattr(data, "columns"):                               # a pandas DataFrame
        if x is None:
            xs = np.asarray(data.index)
            cols = list(data.columns)
        elif isinstance(x, str):
            if x not in data.columns:
                raise KeyError(f"x={x!r} is not a column; columns are {list(data.columns)}")
            xs, cols = np.asarray(data[x]), [c for c in data.columns if c != x]
        else:
            xs, cols = np.asarray(x), list(data.columns)
        series = {str(c): np.asarray(data[c], float) for c in cols}
    elif isinstance(data, dict):
        series = {str(k): np.asarray(v, float) for k, v in data.items()}
        if not series:
            raise ValueError("curves() needs at least one series")
        n = next(iter(series.values())).shape[-1]
        xs = np.arange(n) if x is None else np.asarray(x)
    else:
        raise TypeError(f"curves() takes a pandas DataFrame or a dict of series, got "
                        f"{type(data).__name__}")
    for label, y in series.items():
        if y.ndim not in (1, 2) or y.shape[-1] != len(xs):
            raise ValueError(f"series {label!r} has shape {y.shape}; need ({len(xs)},) or "
                             f"(runs, {len(xs)}) to match x")
    return xs, series


def _is_panels(data) -> bool:
    return isinstance(data, dict) and bool(data) and all(
        isinstance(v, dict) or hasattr(v, "columns") for v in data.values())


def curves(data, x=None, *, title: str, xlabel: str, ylabel, logy: bool = False, ncols: int = 2,
           run=None, name: str | None = None):
    """Line plots of named series: an interactive plotly figure in a live Jupyter session, and
    always a static matplotlib figure (returned; saved as ``figures/<name>.png`` when ``run`` and
    ``name`` are given), so papermill outputs and the HTML report still show a picture.

    ``data`` is one panel or several:

    - a pandas DataFrame: one line per column, ``x`` a column name (default: the index);
    - a dict ``{label: values}``: ``values`` 1-D (one line) or 2-D (runs x points: the mean with
      a +-1 std band over the runs, as :func:`band`), ``x`` the shared x values (default 0..n-1);
    - a dict ``{panel title: DataFrame or dict}``: one subplot per panel, ``ncols`` per row;
      ``ylabel`` may then be a dict ``{panel title: label}``.

    ``title`` names the figure, ``xlabel``/``ylabel`` the axes (give units). Whether anyone is
    watching is :func:`workbench.env.interactive` (False under papermill, nbval and CI), so
    batch runs never import plotly. Example::

        fig = plots.curves({"standard": runs_a, "HR": runs_b}, x=steps, title="Return",
                           xlabel="environment steps", ylabel="episode return", run=run,
                           name="return")
    """
    panels = data if _is_panels(data) else {None: data}
    parsed = {p: _series(d, x) for p, d in panels.items()}
    ylabels = {p: (ylabel.get(p, "") if isinstance(ylabel, dict) else ylabel) for p in panels}
    n = len(panels)
    cols = min(ncols, n)
    rows = -(-n // cols)
    fig, axes = subplots(rows, cols, squeeze=False)
    for ax, (p, (xs, series)) in zip(axes.flat, parsed.items()):
        for i, (label, y) in enumerate(series.items()):
            band(ax, xs, y, label=label, color=PALETTE[i % len(PALETTE)])
        ax.set(title=p if p is not None else title, xlabel=xlabel, ylabel=ylabels[p])
        if logy:
            ax.set_yscale("log")
        if len(series) > 1:
            ax.legend()
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    if n > 1:
        fig.suptitle(title)
    if run is not None and name:
        run.savefig(fig, name, twin=False)     # the plotly figure below is its twin
    if interactive():
        display(_plotly_curves(parsed, title, xlabel, ylabels, logy, cols, rows))
        plt.close(fig)                 # the live session shows the plotly figure, not both
    elif runner_job() and in_ipython():
        keep_twin(_plotly_curves(parsed, title, xlabel, ylabels, logy, cols, rows))
    return fig


def _plotly_curves(parsed: dict, title: str, xlabel: str, ylabels: dict, logy: bool,
                   cols: int, rows: int):
    """The plotly twin of :func:`curves`' matplotlib figure (hover, zoom, toggle series)."""
    titles = [p for p in parsed if p is not None]
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=titles or None)
    for k, (p, (xs, series)) in enumerate(parsed.items()):
        r, c = k // cols + 1, k % cols + 1
        for i, (label, y) in enumerate(series.items()):
            color = PALETTE[i % len(PALETTE)]
            runs = np.atleast_2d(y)
            mean, std = np.nanmean(runs, 0), np.nanstd(runs, 0)
            show_legend = k == 0
            if runs.shape[0] > 1:            # the +-1 std band: upper edge, then lower filled to it
                fig.add_trace(go.Scatter(x=xs, y=mean + std, line=dict(width=0), hoverinfo="skip",
                                         showlegend=False, legendgroup=label), row=r, col=c)
                fig.add_trace(go.Scatter(x=xs, y=mean - std, line=dict(width=0), fill="tonexty",
                                         fillcolor=_rgba(color, 0.2), hoverinfo="skip",
                                         showlegend=False, legendgroup=label), row=r, col=c)
            n_runs = f" (n={runs.shape[0]})" if runs.shape[0] > 1 else ""
            fig.add_trace(go.Scatter(x=xs, y=mean, name=label + n_runs, legendgroup=label,
                                     line=dict(color=color), showlegend=show_legend), row=r, col=c)
        fig.update_xaxes(title_text=xlabel, row=r, col=c)
        fig.update_yaxes(title_text=ylabels[p], type="log" if logy else None, row=r, col=c)
    fig.update_layout(title=title, template="plotly_white", height=320 * rows + 60,
                      hovermode="x unified")
    return fig


def _rgba(hex_color: str, alpha: float) -> str:
    h = hex_color.lstrip("#")
    return f"rgba({int(h[0:2], 16)},{int(h[2:4], 16)},{int(h[4:6], 16)},{alpha})"


_DASH = {"-": "solid", "--": "dash", ":": "dot", "-.": "dashdot"}


def _bar_patches(ax) -> set:
    return {id(b) for c in ax.containers if isinstance(c, BarContainer) for b in c}


def _axes_drawable(ax) -> bool:
    """Whether plotly can redraw ``ax`` faithfully: lines, scatter points, bars, filled bands,
    images, meshes, segments (``vlines``, error bars) and free patches (spans, rectangles);
    anything else (a 3-D surface, a custom collection) would be left out."""
    return all(isinstance(c, _DRAWN_COLLECTIONS) for c in ax.collections)


_DRAWN_COLLECTIONS = (PathCollection, PolyCollection, QuadMesh, LineCollection)


def _label(artist) -> tuple[str, bool]:
    """A trace's name and whether it shows in the legend (matplotlib hides ``_`` labels)."""
    label = str(artist.get_label())
    return ("", False) if label.startswith("_") else (label, True)


def _paths_xy(coll, ax=None) -> tuple[list, list]:
    """The vertices of a collection's paths as one x and one y list, broken by ``None`` between
    paths; in ``ax``'s data coordinates when given (else as stored, data for a band)."""
    xs, ys = [], []
    for path in coll.get_paths():
        v = path.vertices if ax is None else _in_data(ax, coll, path.vertices)
        xs += list(v[:, 0]) + [None]
        ys += list(v[:, 1]) + [None]
    return xs, ys


def _band_trace(coll):
    """A ``fill_between`` band as a filled outline."""
    name, show = _label(coll)
    xs, ys = _paths_xy(coll)
    rgba = coll.get_facecolor()[0] if len(coll.get_facecolor()) else (0.5, 0.5, 0.5, 0.2)
    return go.Scatter(x=xs, y=ys, fill="toself", mode="none", name=name, showlegend=show,
                      hoverinfo="skip", fillcolor=_rgba(to_hex(rgba), float(rgba[3])))


def _bar_trace(container):
    name, show = _label(container)
    bars = list(container)
    color = to_hex(bars[0].get_facecolor()) if bars else None
    return go.Bar(x=[b.get_x() + b.get_width() / 2 for b in bars],
                  y=[b.get_height() for b in bars], width=[b.get_width() for b in bars],
                  name=name, showlegend=show, marker=dict(color=color))


def _image_trace(im):
    z = np.asarray(im.get_array())
    x0, x1, y0, y1 = im.get_extent()
    n_rows, n_cols = z.shape[:2]
    return go.Heatmap(z=z, colorscale="Viridis", showscale=False,
                      x=list(np.linspace(x0, x1, n_cols, endpoint=False) + (x1 - x0) / n_cols / 2),
                      y=list(np.linspace(y1, y0, n_rows, endpoint=False) + (y0 - y1) / n_rows / 2))


def _line_trace(ln):
    style = ln.get_linestyle()
    marker = ln.get_marker() not in (None, "None", "", " ")
    mode = "+".join(m for m, on in (("lines", style not in ("None", "", " ")),
                                    ("markers", marker)) if on) or "lines"
    name, show = _label(ln)
    return go.Scatter(x=list(ln.get_xdata()), y=list(ln.get_ydata()), mode=mode, name=name,
                      showlegend=show,
                      line=dict(color=to_hex(ln.get_color()), dash=_DASH.get(style, "solid")))


def _scatter_trace(coll):
    xy = coll.get_offsets()
    name, show = _label(coll)
    colors = coll.get_facecolors()
    return go.Scatter(x=list(xy[:, 0]), y=list(xy[:, 1]), mode="markers", name=name,
                      showlegend=show,
                      marker=dict(color=to_hex(colors[0]) if len(colors) else None))


def _in_data(ax, artist, xy):
    """Points ``xy`` of ``artist`` (in its own transform: data, axes or blended, as a span's)
    in ``ax``'s data coordinates, as they are drawn now."""
    return ax.transData.inverted().transform(artist.get_transform().transform(xy))


def _patch_trace(ax, patch):
    """A free patch (``axvspan``, ``axhspan``, ``Rectangle``, ``Polygon``) as its outline,
    filled where the patch is."""
    xy = _in_data(ax, patch, patch.get_path().vertices)
    name, show = _label(patch)
    fill = patch.get_fill()
    face, edge = patch.get_facecolor(), patch.get_edgecolor()
    return go.Scatter(x=list(xy[:, 0]), y=list(xy[:, 1]), mode="lines", name=name,
                      showlegend=show, hoverinfo="skip", fill="toself" if fill else None,
                      fillcolor=_rgba(to_hex(face), float(face[3])) if fill else None,
                      line=dict(color=to_hex(edge if edge[3] > 0 else face), width=1))


def _mesh_trace(mesh):
    """A ``pcolormesh`` as a heatmap at its cells' centres."""
    corners = np.asarray(mesh.get_coordinates())           # (rows + 1, cols + 1, 2)
    centres = (corners[:-1, :-1] + corners[1:, 1:]) / 2
    z = np.asarray(mesh.get_array()).reshape(centres.shape[:2])
    return go.Heatmap(z=z, x=list(centres[0, :, 0]), y=list(centres[:, 0, 1]),
                      colorscale="Viridis", showscale=False)


def _segments_trace(ax, coll):
    """Line segments (``vlines``, ``hlines``, error bars) as one trace broken between them."""
    xs, ys = _paths_xy(coll, ax)
    name, show = _label(coll)
    colors = coll.get_colors()
    return go.Scatter(x=xs, y=ys, mode="lines", name=name, showlegend=show,
                      line=dict(color=to_hex(colors[0]) if len(colors) else None))


def _collection_trace(ax, coll):
    if isinstance(coll, QuadMesh):
        return _mesh_trace(coll)
    if isinstance(coll, LineCollection):
        return _segments_trace(ax, coll)
    return _band_trace(coll) if isinstance(coll, PolyCollection) else _scatter_trace(coll)


def plotly_twin(fig):
    """A plotly figure redrawing the matplotlib ``fig``'s lines, scatter points, bars, bands,
    images, meshes, segments and free patches (spans, rectangles) with axis labels, log scales
    and titles, one subplot per visible axes at its grid place (colour bars and text left out);
    ``None`` when an axes holds anything else, so a twin never silently leaves a part out."""
    axes = [ax for ax in fig.axes if ax.get_visible() and ax.get_subplotspec() is not None
            and not hasattr(ax, "_colorbar")]
    if not axes or not all(_axes_drawable(ax) for ax in axes):
        return None
    rows, cols = axes[0].get_subplotspec().get_geometry()[:2]
    twin = make_subplots(rows=rows, cols=cols,
                         subplot_titles=[ax.get_title() for ax in axes] if rows * cols > 1 else None)
    for ax in axes:
        spec = ax.get_subplotspec()
        r, c = spec.rowspan.start + 1, spec.colspan.start + 1
        traces = [_image_trace(im) for im in ax.images]
        traces += [_collection_trace(ax, cl) for cl in ax.collections]
        traces += [_bar_trace(b) for b in ax.containers if isinstance(b, BarContainer)]
        bars = _bar_patches(ax)
        traces += [_patch_trace(ax, p) for p in ax.patches if id(p) not in bars]
        traces += [_line_trace(ln) for ln in ax.get_lines()]
        for t in traces:
            twin.add_trace(t, row=r, col=c)
        if ax.images and ax.images[0].origin == "upper":
            twin.update_yaxes(autorange="reversed", row=r, col=c)
        twin.update_xaxes(title_text=ax.get_xlabel(), row=r, col=c,
                          type="log" if ax.get_xscale() == "log" else None)
        twin.update_yaxes(title_text=ax.get_ylabel(), row=r, col=c,
                          type="log" if ax.get_yscale() == "log" else None)
    title = fig.get_suptitle() or (axes[0].get_title() if len(axes) == 1 else "")
    return twin.update_layout(title=title, template="plotly_white", height=320 * rows + 60)


def rounded(value, digits: int = 4):
    """A JSON-like ``value`` with every float at ``digits`` significant digits, for reading (the
    book's evidence) or for size (the plotly twins a run keeps)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, digits) for v in value]
    return value


def keep_twin(twin) -> None:
    """Put the plotly figure ``twin`` into the executed notebook as plotly's own output type
    (beside the static PNG, with a plain-text note in its place where plotly cannot draw): a
    ``workbench run`` job does this for every twin, so that the book and JupyterLab show the
    executed notebook's figures interactive without re-running it."""
    if twin is not None:
        display({PLOTLY_MIME: rounded(json.loads(twin.to_json()), 5),
                 "text/plain": "(the interactive version of the figure: JupyterLab or the book)"},
                raw=True)


def show_twin(fig) -> bool:
    """Display :func:`plotly_twin` of ``fig`` in a live session; whether there was one."""
    twin = plotly_twin(fig) if interactive() else None
    if twin is not None:
        display(twin)
    return twin is not None
