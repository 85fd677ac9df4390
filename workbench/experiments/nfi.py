"""Numerical Feature Inflation (paper 12, ``docs/papers/12-nfi.md``): the harness of notebook 12-nfi.

The method (the absorption threshold, the absorbed and collapsed masks, the two global means, the
zero-sum-preserving cross-entropy) lives in :mod:`workbench.methods.nfi`. Here is what the
notebook runs with it: an instrumented full-batch trainer of a bias-free ReLU MLP in three
variants (float32, float64, float32 with the zero-sum backward) from the same initial weights,
the loss-spike detector, the inflation window and the exponential growth fits over it, how much
faster a norm grows in float32 than in its controls step by step over the window (C5), and the
story of a spike (norm growth before, gradients back after).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from matplotlib.colors import ListedColormap
from torch.nn.utils import get_total_norm

from workbench import plots
from workbench.data.classification import Task
from workbench.diagnostics import Tracker, growth_rate
from workbench.methods.nfi import (DTYPES, absorbed_mask, absorption_threshold,
                                   classifier_mean_norm, collapsed_mask, feature_mean_norm,
                                   gap_sweep, logit_gaps, zero_sum_cross_entropy)
from workbench.progress import progress

__all__ = ["VARIANTS", "TRACKED", "MLP", "TrainConfig", "init_model", "train", "train_variants",
           "detect_spikes", "spikes_of", "inflation_window", "growth_fit", "window_fits",
           "fit_curve", "fit_metrics", "increase_ratio", "separation_step", "spike_story",
           "spike_stories", "log_doubling", "gap_gradients", "gap_states",
           "gap_figure"]

VARIANTS = ("float32", "float64", "zero_sum")   # zero_sum: float32 with ZeroSumCrossEntropy


# -- model and trainer ---------------------------------------------------------------------------
class MLP(nn.Module):
    """ReLU MLP without biases (as in Prieto et al.'s grokking MLP); ``forward`` returns
    (logits, penultimate features) so the feature mean is tracked without a second pass."""

    def __init__(self, d_in: int, hidden: int, depth: int, num_classes: int):
        super().__init__()
        dims = [d_in] + [hidden] * depth
        self.body = nn.Sequential(*[m for i in range(depth) for m in
                                    (nn.Linear(dims[i], dims[i + 1], bias=False), nn.ReLU())])
        self.head = nn.Linear(hidden, num_classes, bias=False)

    def forward(self, x):
        h = self.body(x)
        return self.head(h), h


@dataclass
class TrainConfig:
    """Settings of one training run (full batch, Adam, no weight decay, no regularizer)."""
    steps: int = 1500           # optimizer steps (= epochs: full batch)
    lr: float = 1e-2            # Adam learning rate; large, so the fit and the gap growth are fast
    hidden: int = 64            # width of each hidden layer
    depth: int = 2              # hidden layers
    beta2: float = 0.98         # Adam beta2 (beta1 = 0.9), as in Prieto et al.
    adam_eps: float = 1e-8      # Adam epsilon (PyTorch's default)
    eval_every: int = 1         # test accuracy every this many steps (NaN in between)
    fused_adam: bool = True     # Adam's fused kernel (CPU, CUDA): the same update, fewer ops


TRACKED = ("loss", "train_acc", "test_acc", "absorbed", "collapse", "gap_max", "gap_min",
           "cls_mean", "feat_mean", "cls_mean_grad", "grad_norm", "param_norm")


def init_model(task: Task, cfg: TrainConfig, seed: int) -> dict:
    """The initial weights every variant starts from: one float32 MLP drawn from ``seed``."""
    torch.manual_seed(seed)
    return MLP(task.x_train.shape[1], cfg.hidden, cfg.depth, task.num_classes).state_dict()


def train(task: Task, cfg: TrainConfig, variant: str = "float32", init: dict | None = None,
          seed: int = 0, device="cpu", progress=None) -> Tracker:
    """Train one variant full batch; track at every step, from the step's own forward/backward:

    ``loss``, ``train_acc``, ``test_acc``; ``absorbed`` (fraction of training samples whose
    correct-class gradient, as used in the update, is exactly 0) and ``collapse`` (Prieto et al.);
    ``gap_max``, ``gap_min`` (of z_y - max_{c != y} z_c); ``cls_mean``, ``feat_mean`` (the two
    global means); ``cls_mean_grad`` (||mean_c grad w_c||, ~0 while zero-sum holds);
    ``grad_norm`` and ``param_norm`` (over all parameters). Everything is measured before the
    step's update.

    ``variant``: "float32", "float64" (model and data in float64) or "zero_sum" (float32 with
    :class:`ZeroSumCrossEntropy`). Pass the same ``init`` (see :func:`init_model`) to compare
    variants from identical weights: the float32 values are exact in float64.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    dtype = torch.float64 if variant == "float64" else torch.float32
    loss_fn = zero_sum_cross_entropy if variant == "zero_sum" else F.cross_entropy
    model = MLP(task.x_train.shape[1], cfg.hidden, cfg.depth, task.num_classes)
    model.load_state_dict(init if init is not None else init_model(task, cfg, seed))
    model.to(device=device, dtype=dtype)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=cfg.lr, betas=(0.9, cfg.beta2), eps=cfg.adam_eps,
                           weight_decay=0.0, fused=cfg.fused_adam)
    x, y = task.x_train.to(device, dtype), task.y_train.to(device)
    xt, yt = task.x_test.to(device, dtype), task.y_test.to(device)
    nan = torch.tensor(float("nan"), dtype=dtype, device=device)
    tr = Tracker()
    steps = range(cfg.steps) if progress is None else progress(range(cfg.steps))
    for step in steps:
        logits, feats = model(x)
        logits.retain_grad()
        loss = loss_fn(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():             # all from this step's tensors, one device sync
            gap_min, gap_max = torch.aminmax(logit_gaps(logits, y))
            test_acc = ((model(xt)[0].argmax(1) == yt).to(dtype).mean()
                        if step % cfg.eval_every == 0 or step == cfg.steps - 1 else nan)
            row = torch.stack([
                loss.detach(), (logits.argmax(1) == y).to(dtype).mean(), test_acc,
                absorbed_mask(logits.grad, y).to(dtype).mean(),
                collapsed_mask(logits).to(dtype).mean(), gap_max, gap_min,
                classifier_mean_norm(model.head.weight), feature_mean_norm(feats),
                model.head.weight.grad.mean(0).norm(),
                get_total_norm([p.grad for p in params]), get_total_norm(params)])
            tr.log(step, **dict(zip(TRACKED, row.tolist())))
        opt.step()
    return tr


def train_variants(task: Task, cfg: TrainConfig, init: dict, device="cpu",
                   desc: str = "") -> dict[str, Tracker]:
    """Train every variant of :data:`VARIANTS` in turn from the same ``init`` (same data, same
    seed): the experiment (float32) and its two controls, each with its own progress bar."""
    return {v: train(task, cfg, v, init, device=device,
                     progress=lambda it, v=v: progress(it, total=cfg.steps, desc=f"{desc} {v}"))
            for v in VARIANTS}


# -- loss spikes ---------------------------------------------------------------------------------
def detect_spikes(loss, window: int = 50, min_rise: float = 2.0, min_loss: float = 1e-3,
                  floor: float = 1e-12) -> np.ndarray:
    """Indices of loss spikes: the peak of each run of steps where the loss is at least
    ``min_rise`` decades above its minimum over the preceding ``window`` steps and at least
    ``min_loss``. Zeros (a fully absorbed float32 loss is exactly 0) count as ``floor``.

    Flagged steps closer than ``window`` merge into one spike, so a ragged spike counts once.
    """
    raw = np.asarray(loss, float)
    y = np.log10(np.maximum(np.nan_to_num(raw, nan=floor), floor))
    if len(y) < 2:
        return np.zeros(0, int)
    padded = np.concatenate([np.full(window - 1, np.inf), y[:-1]])
    base = np.lib.stride_tricks.sliding_window_view(padded, window).min(1)   # [t-1]: min y[t-w:t]
    flagged = np.flatnonzero((y[1:] - base >= min_rise) & (raw[1:] >= min_loss)) + 1
    if not len(flagged):
        return np.zeros(0, int)
    runs = np.split(flagged, np.flatnonzero(np.diff(flagged) > window) + 1)
    return np.asarray([r[0] + int(np.argmax(y[r[0]:r[-1] + 1])) for r in runs], int)


def spikes_of(runs: dict[str, Tracker]) -> dict[str, np.ndarray]:
    """:func:`detect_spikes` on the loss of every run."""
    return {v: detect_spikes(tr["loss"]) for v, tr in runs.items()}


def spike_story(tr: Tracker, k: int, before: int = 200) -> dict:
    """What happens around the spike at step ``k`` (C3): the loss at its peak, how much the
    classifier mean grew over the ``before`` steps leading to it, how far the gradient norm jumps
    above its quiet level (median of steps k-100 .. k-10), and the absorbed fraction just before
    the spike and at its lowest in the 20 steps from it."""
    quiet = np.median(tr["grad_norm"][max(0, k - 100):max(1, k - 10)])
    return {"step": int(k), "peak_loss": tr["loss"][k],
            "cls_mean_growth_before": tr["cls_mean"][k] / tr["cls_mean"][max(0, k - before)],
            "grad_norm_jump": tr["grad_norm"][k - 5:k + 20].max() / quiet,
            "absorbed_before": tr["absorbed"][k - 10],
            "absorbed_after": tr["absorbed"][k:k + 20].min()}


def spike_stories(tr: Tracker, spikes) -> list[dict]:
    """:func:`spike_story` of every spike with room around it (from step 100 to 20 before the
    end)."""
    return [spike_story(tr, k) for k in spikes if 100 <= k < len(tr.steps) - 20]


# -- growth over the inflation window ------------------------------------------------------------
def growth_fit(steps, values) -> dict[str, float]:
    """How a tracked norm grew over a window: ``factor`` (last / first), ``rate`` and ``r2`` of the
    exponential fit (:func:`workbench.diagnostics.growth_rate`, a line on a log axis) and
    ``linear_r2``, the R^2 of a straight line on a linear axis, for comparison."""
    s, v = np.asarray(steps, float), np.asarray(values, float)
    rate, r2 = growth_rate(s, v)
    lin_r2 = float(np.corrcoef(s, v)[0, 1] ** 2) if len(s) > 2 and v.std() > 0 else float("nan")
    return {"factor": float(v[-1] / v[0]), "rate": rate, "r2": r2, "linear_r2": lin_r2}


def inflation_window(absorbed, spikes=(), level: float = 0.5) -> tuple[int, int] | None:
    """Steps [start, end) where absorbed samples dominate: from the first step with an absorbed
    fraction >= ``level`` up to the first spike after it (or the end); None if never reached."""
    absorbed = np.asarray(absorbed)
    hit = np.flatnonzero(absorbed >= level)
    if not len(hit):
        return None
    start = int(hit[0])
    later = [int(k) for k in spikes if k > start]
    return start, (later[0] if later else len(absorbed))


def window_fits(runs: dict[str, Tracker], window, keys=("cls_mean", "feat_mean", "param_norm")
                ) -> dict[str, dict[str, dict]]:
    """``{variant: {key: growth_fit}}`` of every run's tracked ``keys`` over the steps
    [start, end) of ``window``; ``{}`` when there is no window."""
    if not window:
        return {}
    st = np.arange(*window)
    return {v: {k: growth_fit(st, tr[k][slice(*window)]) for k in keys} for v, tr in runs.items()}


def fit_curve(values, window, rate: float) -> tuple[np.ndarray, np.ndarray]:
    """The fitted exponential over ``window``, for drawing: steps and exp(a + rate * step), with
    a the least-squares intercept of log(values) at that rate."""
    st = np.arange(*window)
    a = np.log(np.asarray(values)[slice(*window)]).mean() - rate * st.mean()
    return st, np.exp(a + rate * st)


def fit_metrics(fits: dict[str, dict[str, dict]], prefix: str) -> dict[str, float]:
    """The fits as flat scalar metrics, ``<prefix>_<key>_<factor|rate|r2>_<variant>`` (what the
    recorded results and the prose read)."""
    return {f"{prefix}_{k}_{stat}_{v}": f[stat] for v, d in fits.items() for k, f in d.items()
            for stat in ("factor", "rate", "r2")}


def increase_ratio(runs: dict[str, Tracker], window, key: str = "param_norm",
                   controls=("float64", "zero_sum")) -> np.ndarray:
    """At every step s of ``window``: float32's increase of ``key`` since the window's start,
    ``x(s) / x(start) - 1``, over the larger of the ``controls``' increases (C5's measure; > 1 is
    faster growth in float32). NaN where no control has grown yet."""
    inc = {v: runs[v][key][slice(*window)] / runs[v][key][window[0]] - 1
           for v in ("float32", *controls)}
    ref = np.max([inc[v] for v in controls], axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ref > 0, inc["float32"] / ref, np.nan)


def separation_step(ratio, window, margin: float = 1.1) -> int | None:
    """The first step of ``window`` from which ``ratio`` (:func:`increase_ratio`) stays above
    ``margin`` to the window's end: when float32's norm pulls away from the controls for good.
    None when it is not above ``margin`` at the end."""
    above = np.nan_to_num(np.asarray(ratio, float), nan=0.0) > margin
    if not len(above) or not above[-1]:
        return None
    below = np.flatnonzero(~above)
    return int(window[0] + (below[-1] + 1 if len(below) else 0))


def log_doubling(rate: float) -> float:
    """Steps to double at an exponential ``rate`` per step: ln 2 / rate (NaN unless rate > 0)."""
    return math.log(2) / rate if rate and rate > 0 else float("nan")


# -- the explorer: which gradients vanish at a gap, per precision --------------------------------
def gap_gradients(gap: float, num_classes: int = 2) -> pd.DataFrame:
    """The cross-entropy gradient of one row [0, -g, ..., -g] in every dtype: the correct class's
    p_y - 1, one wrong class's p_c and the row sum over classes (added in float64). ``absorbed``:
    p_y - 1 is exactly 0 while the row sum is not, the broken zero-sum that drives the drift;
    ``underflow``: e^{-g} itself rounds to 0, so every gradient of the row is 0 (no drift)."""
    rows = []
    for name in DTYPES:
        sw = gap_sweep(name, num_classes, [gap])
        one = {k: float(sw[k][0]) for k in ("gap", "grad_y", "grad_other", "grad_sum")}
        rows.append({"dtype": name, **one, "threshold": absorption_threshold(name, num_classes),
                     "absorbed": one["grad_y"] == 0 and one["grad_sum"] != 0,
                     "underflow": one["grad_other"] == 0})
    return pd.DataFrame(rows)


def _gap_bars(ax, table: pd.DataFrame) -> None:
    """|p_y - 1| and |row sum| per dtype on a log axis; an exact 0 is written, not drawn."""
    x = np.arange(len(table))
    for j, (key, label) in enumerate([("grad_y", "|p_y - 1|"), ("grad_sum", "|row sum|")]):
        v = table[key].abs().to_numpy()
        ax.bar(x + (j - 0.5) * 0.38, np.where(v > 0, v, np.nan), 0.38, label=label,
               color=plots.PALETTE[j])
        for xi in x[v == 0]:
            ax.text(xi + (j - 0.5) * 0.38, 1e-44, "0", ha="center", va="bottom", fontsize=9)
    state = np.where(table.absorbed, "absorbed", np.where(table.underflow, "underflow", ""))
    ax.set_xticks(x, [f"{d}\n{s}" for d, s in zip(table.dtype, state)])
    ax.set(yscale="log", ylim=(1e-45, 2), xlim=(-0.7, len(table) - 0.3),
           ylabel="gradient magnitude")


def gap_states(sweep: dict[str, np.ndarray]) -> np.ndarray:
    """Per swept gap: 0 while p_y - 1 is non-zero (the zero-sum holds), 1 once it is exactly 0 but
    the wrong classes' p_c are not (absorbed, the broken zero-sum), 2 once e^{-g} underflows too."""
    return np.where(sweep["grad_other"] == 0, 2, np.where(sweep["grad_y"] == 0, 1, 0))


@functools.lru_cache(maxsize=16)
def _all_states(num_classes: int, step: float) -> np.ndarray:
    """:func:`gap_states` of every dtype over the gaps 0..45 in ``step`` (cached: a move of the
    explorer's gap redraws without sweeping again)."""
    gaps = np.arange(0.0, 45.0, step)
    return np.stack([gap_states(gap_sweep(name, num_classes, gaps)) for name in DTYPES])


def gap_figure(gap: float, num_classes: int = 2, step: float = 0.025):
    """The explorer's picture (C1): left, for each dtype, where along the gap the correct-class
    gradient is exact, absorbed (exactly 0 while the others are not) or underflowed, with the
    analytic threshold ln(2/eps) + ln(C - 1) marked and a line at ``gap``; right, the gradients of
    the row at ``gap`` per dtype, the ones rounded to exactly 0 written as 0."""
    fig, (a0, a1) = plots.subplots(1, 2, figsize=(13, 3.6), width_ratios=[3, 2])
    gaps = np.arange(0.0, 45.0, step)
    states = _all_states(num_classes, step)
    cmap = ListedColormap([plots.PALETTE[2], plots.PALETTE[1], "0.8"])
    a0.imshow(states, aspect="auto", cmap=cmap, vmin=0, vmax=2, interpolation="nearest",
              extent=(gaps[0], gaps[-1], len(DTYPES) - 0.5, -0.5))
    for i, name in enumerate(DTYPES):
        a0.plot([absorption_threshold(name, num_classes)] * 2, [i - 0.45, i + 0.45], "k:", lw=1)
    a0.axvline(gap, color="k", lw=1.5)
    a0.grid(False)
    a0.set_yticks(range(len(DTYPES)), list(DTYPES))
    a0.set(xlabel="logit gap g = z_y - z_c", title=f"C = {num_classes}: green exact, red absorbed "
           "(p_y - 1 = 0, row sum > 0), grey underflow; dotted: analytic g*")
    a0.title.set_fontsize(9)
    table = gap_gradients(gap, num_classes)
    _gap_bars(a1, table)
    a1.set_title(f"the row [0, -g, ..., -g] at g = {gap:g}", fontsize=9)
    a1.legend(loc="upper right", fontsize=8)
    return fig
