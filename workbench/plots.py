"""House plot style and small plotting helpers. Nothing is set on import: call :func:`style`."""
from __future__ import annotations

import numpy as np

PALETTE = ["#1f5a96", "#d1495b", "#2e933c", "#edae49", "#6c4f9c", "#00798c", "#8d6a4f"]


def style() -> None:
    """Apply the house matplotlib style (headless-safe: uses the Agg backend outside Jupyter)."""
    import matplotlib
    import matplotlib.pyplot as plt
    from cycler import cycler
    try:
        from IPython import get_ipython
        in_kernel = get_ipython() is not None
    except ImportError:
        in_kernel = False
    if not in_kernel:
        matplotlib.use("Agg")
    plt.rcParams.update({
        "figure.figsize": (6.4, 3.8), "figure.dpi": 100, "axes.grid": True, "grid.alpha": 0.3,
        "axes.spines.top": False, "axes.spines.right": False, "axes.titlesize": 11,
        "axes.labelsize": 10, "legend.fontsize": 8, "legend.frameon": False,
        "axes.prop_cycle": cycler(color=PALETTE), "lines.linewidth": 1.6,
    })


def subplots(nrows: int = 1, ncols: int = 1, **kwargs):
    """``plt.subplots`` with the house style applied and a width that grows with the columns."""
    import matplotlib.pyplot as plt
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
