"""The harness of notebook 08: Heavy-Tailed Flow Matching via Random Clocks (HTFM, NeurIPS 2026;
spec in ``docs/papers/08-htfm.md``; the method is :mod:`workbench.methods.htfm`).

What the notebook drives, in its order:

- C1: KS tests of each clock law's terminal value and source marginal against scipy, with
  Gaussian controls of the same interquartile range (:func:`clock_ks_tests`, :func:`c1_summary`);
- C2: the log-signature's level 2 against closed-form areas and esig (:func:`known_area_error`,
  :func:`esig_error`), and its cost against one velocity-network forward (:func:`feature_cost`);
- C3: the three flows trained on the same data and sampled on the same Euler grid
  (:func:`train_models`, :func:`evaluate_models`, :func:`c3_means`), scored by the metrics below;
- C3's reading: where each model sends its largest sources (:func:`transport`);
- C4: the trained HTFM network sampled from other clocks (:func:`tail_sweep`);
- C5 (full scale only): imbalanced digits and heavy-tailed fields (:func:`run_c5`);
- the explorer: the HTFM network sampled from a clock of any tail (:func:`clock_figure`).

Metrics (docs/papers/08-htfm.md): the sliced Wasserstein distance, rare-mode coverage, high quantiles of
the radius, and the Hill tail-index estimator.
"""
from __future__ import annotations

import time

import numpy as np
import pandas as pd
import torch
from matplotlib.patches import Circle
from scipy import stats
from sklearn.datasets import load_digits
from sklearn.neighbors import KNeighborsClassifier

from .. import plots
from ..data.heavy_tailed import extreme_field, imbalanced_digits
from ..methods import htfm as H

__all__ = ["NFE", "HILL_FRAC", "RADIUS", "C1_CLOCKS", "SWEEP", "wasserstein_1d",
           "random_directions", "sliced_wasserstein", "mode_masses", "mode_coverage",
           "high_quantiles", "quantile_error", "hill", "hill_curve", "time_per_call",
           "clock_name", "clock_ks_tests", "c1_summary", "polygon", "known_areas",
           "known_area_error", "esig_error", "feature_cost", "scatter", "train_models",
           "evaluate_models", "metric_table", "c3_means", "transport", "tail_sweep", "run_c5",
           "c5_holds", "summary_metrics", "radius_qq", "clock_figure"]

NFE = (4, 8, 16)            # the Euler step grid every model is sampled on
HILL_FRAC = 0.002           # Hill's k as a fraction of the sample
RADIUS = 1.0                # a sample within 1 of a mode counts for it
# C1: every clock family, at tails heavy and light (the first two heavy ones carry the controls)
C1_CLOCKS = (H.Clock("constant"), H.Clock("inverse_gamma", 1.5), H.Clock("inverse_gamma", 3.0),
             H.Clock("stable", 1.2), H.Clock("stable", 1.5), H.Clock("stable", 1.8))
HEAVY = ("inverse_gamma(1.5)", "stable(1.2)")
# C4: the sampling clocks' tail parameters the trained HTFM network is swept over
SWEEP = {"stable": (1.2, 1.4, 1.6, 1.8, 2.0), "inverse_gamma": (1.2, 1.6, 3.0, 6.0)}
METRICS = ("coverage", "sw", "q_err", "hill_err")


# -- metrics --------------------------------------------------------------------------------------
def wasserstein_1d(u: np.ndarray, v: np.ndarray, p: float = 1.0) -> float:
    """W_p^p between two empirical laws on the line (uniform weights, sizes may differ):
    int_0^1 |F^-1(q) - G^-1(q)|^p dq, exact, on the union of the two quantile grids."""
    u, v = np.sort(u), np.sort(v)
    levels = np.union1d(np.arange(1, len(u) + 1) / len(u), np.arange(1, len(v) + 1) / len(v))
    widths = np.diff(np.concatenate([[0.0], levels]))
    mid = levels - widths / 2
    iu = np.minimum((mid * len(u)).astype(int), len(u) - 1)
    iv = np.minimum((mid * len(v)).astype(int), len(v) - 1)
    return float(np.sum(widths * np.abs(u[iu] - v[iv]) ** p))


def random_directions(dim: int, n: int, seed: int = 0) -> np.ndarray:
    """(dim, n) directions uniform on the sphere."""
    g = np.random.default_rng(seed).standard_normal((dim, n))
    return g / np.linalg.norm(g, axis=0, keepdims=True)


def sliced_wasserstein(x, y, n_projections: int = 128, p: float = 1.0, seed: int = 0,
                       projections: np.ndarray | None = None) -> float:
    """SW_p = (mean over directions theta of W_p^p(theta . x, theta . y))^(1/p).

    p = 1 by default: W_2 is infinite between laws of infinite variance (alpha-stable, alpha < 2),
    W_1 is finite for alpha > 1. Same definition as POT's ``ot.sliced_wasserstein_distance``.
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    proj = random_directions(x.shape[1], n_projections, seed) if projections is None \
        else np.asarray(projections, dtype=np.float64)
    px, py = x @ proj, y @ proj
    return float(np.mean([wasserstein_1d(px[:, k], py[:, k], p)
                          for k in range(proj.shape[1])]) ** (1 / p))


def mode_masses(x, centers, radius: float) -> np.ndarray:
    """Fraction of the samples ``x`` within ``radius`` of each center (a point is counted for its
    nearest center only)."""
    x, c = np.asarray(x, dtype=np.float64), np.asarray(centers, dtype=np.float64)
    dist = np.linalg.norm(x[:, None, :] - c[None], axis=-1)
    near = dist.argmin(1)
    inside = dist[np.arange(len(x)), near] <= radius
    return np.bincount(near[inside], minlength=len(c)) / len(x)


def mode_coverage(x, centers, true_masses, radius: float, rare) -> dict:
    """Rare-mode coverage: per mode, the generated mass near it over the true mass near it
    (capped at 1: an over-filled mode is not extra coverage); ``coverage`` is their mean over the
    rare modes, ``hit`` the fraction of rare modes that get at least half their true mass."""
    ratio = np.minimum(mode_masses(x, centers, radius) / np.asarray(true_masses), 1.0)
    rare = np.asarray(rare)
    return {"ratio": ratio, "coverage": float(ratio[rare].mean()),
            "hit": float((ratio[rare] >= 0.5).mean())}


def high_quantiles(x, qs=(0.99, 0.999)) -> np.ndarray:
    """Quantiles of the radius ||x|| (of |x| for 1-D input) at levels ``qs``."""
    x = np.asarray(x, dtype=np.float64)
    r = np.abs(x) if x.ndim == 1 else np.linalg.norm(x, axis=1)
    return np.quantile(r, qs)


def quantile_error(x, reference, qs=(0.99, 0.999)) -> float:
    """Mean |log(q_gen / q_ref)| over the high quantile levels ``qs`` of the radius."""
    return float(np.mean(np.abs(np.log(high_quantiles(x, qs) / high_quantiles(reference, qs)))))


def hill(x, k: int | None = None, frac: float = 0.01) -> float:
    """Hill's tail-index estimate alpha = 1 / xi, xi = mean_{i <= k} log(X_(i) / X_(k+1)) over the
    k largest values of |x| (of ||x|| for 2-D input); k = frac * n by default (docs/papers/08-htfm.md)."""
    x = np.asarray(x, dtype=np.float64)
    r = np.abs(x) if x.ndim == 1 else np.linalg.norm(x, axis=1)
    k = int(k or max(2, round(frac * len(r))))
    if not 1 <= k < len(r):
        raise ValueError(f"Hill needs 1 <= k < n, got k={k}, n={len(r)}")
    top = np.sort(r)[::-1][:k + 1]
    if top[k] <= 0:
        raise ValueError("Hill needs positive order statistics: X_(k+1) is 0")
    return float(1.0 / np.mean(np.log(top[:k] / top[k])))


def hill_curve(x, ks) -> np.ndarray:
    """The Hill plot: the estimate for each k in ``ks``."""
    return np.array([hill(x, int(k)) for k in ks])


def time_per_call(fn, repeats: int = 30, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in seconds (the median resists other jobs on a shared CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# -- C1: the clock laws are the stated families ---------------------------------------------------
def clock_name(c: H.Clock) -> str:
    """``"stable(1.5)"``, ``"inverse_gamma(3)"`` or ``"constant"``."""
    return f"{c.kind}({c.param:g})" if c.kind != "constant" else "constant"


def clock_ks_tests(clocks, n: int, generator: torch.Generator) -> tuple[list[dict], dict]:
    """KS p-values of each clock's source marginal and terminal value against scipy's law, and
    of a Gaussian control with the sample's interquartile range (heavy-tailed clocks only).
    Returns ``(rows, qq)``, ``qq[name] = (sorted sample, scipy quantiles)`` for a QQ plot."""
    rows, qq = [], {}
    for c in clocks:
        x0, tau = H.sample_source(c, n, 1, generator=generator)
        x0, t1 = x0[:, 0].numpy(), tau[:, -1].numpy()
        name = clock_name(c)
        row = {"clock": name, "marginal_p": stats.kstest(x0, c.marginal_law().cdf).pvalue}
        if c.terminal_law() is not None:
            row["terminal_p"] = stats.kstest(t1, c.terminal_law().cdf).pvalue
        if c.kind != "constant":   # control: a Gaussian with the same interquartile range
            iqr = np.subtract(*np.quantile(x0, [0.75, 0.25]))
            row["control_p"] = stats.kstest(x0, stats.norm(scale=iqr / 1.349).cdf).pvalue
        rows.append(row)
        qq[name] = (np.sort(x0), c.marginal_law().ppf((np.arange(n) + 0.5) / n))
    return rows, qq


def c1_summary(rows: list[dict], family_level: float = 0.001) -> dict:
    """The law tests' p-values, the controls', the Bonferroni level (family-wise
    ``family_level``: a robust claim must not fail by chance) and the two heaviest controls'."""
    pvals = [r[k] for r in rows for k in ("marginal_p", "terminal_p") if k in r]
    return {"pvals": pvals, "controls": [r["control_p"] for r in rows if "control_p" in r],
            "level": family_level / len(pvals),
            "heavy_controls": [r["control_p"] for r in rows if r["clock"] in HEAVY]}


# -- C2: the log-signature is right and cheap ----------------------------------------------------
def polygon(n_sides: int, r: float = 1.0) -> torch.Tensor:
    """A closed regular polygon of radius ``r`` as a (1, n_sides + 1, 2) path."""
    th = torch.linspace(0, 2 * np.pi, n_sides + 1, dtype=torch.float64)
    return torch.stack([r * torch.cos(th), r * torch.sin(th)], 1)[None]


def known_areas() -> dict:
    """Paths whose Levy area is known in closed form: ``{name: (path, area)}``."""
    known = {"unit square": (torch.tensor([[[0., 0.], [1., 0.], [1., 1.], [0., 1.], [0., 0.]]],
                                          dtype=torch.float64), 1.0),
             "straight line": (torch.linspace(0, 1, 9, dtype=torch.float64)[None, :, None]
                               * torch.tensor([1.0, 3.0], dtype=torch.float64), 0.0)}
    for n_sides in (3, 7, 64):   # area of a regular n-gon of radius r: (n / 2) r^2 sin(2 pi / n)
        known[f"{n_sides}-gon"] = (polygon(n_sides, 2.0),
                                   n_sides / 2 * 4.0 * np.sin(2 * np.pi / n_sides))
    return known


def known_area_error() -> float:
    """The largest |level 2 - closed-form area| over :func:`known_areas`."""
    return max(abs(H.log_signature(p)[0, 2].item() - a) for p, a in known_areas().values())


def esig_error(tail: float, generator: torch.Generator, n: int = 200) -> dict:
    """Our log-signature against esig's on ``n`` stable-clock paths: the largest absolute and
    relative difference."""
    path = H.time_augmented(H.Clock("stable", tail).sample_paths(n, 16, generator))
    ours = H.log_signature(path)
    err = (ours - H.log_signature(path, backend="esig")).abs().max().item()
    return {"abs": err, "rel": err / ours.abs().max().item()}


def feature_cost(hidden: int, tail: float, generator: torch.Generator, device,
                 batch: int = 4096) -> dict:
    """Median time of the clock features of ``batch`` stable-clock paths, of one forward of a
    width-``hidden`` velocity network on the same batch, and of esig one path at a time (timed
    on 256 paths, scaled to the batch); their ratios to the forward."""
    net = H.VelocityMLP(2, 2, hidden).to(device)
    tau_b = H.Clock("stable", tail).sample_paths(batch, 16, generator)
    xb, tb = torch.randn(batch, 2, device=device), torch.full((1, 1), 0.5, device=device)
    cb = H.clock_features(tau_b).float().to(device)
    with torch.no_grad():
        t_net = time_per_call(lambda: net(xb, tb, cb))
    t_feat = time_per_call(lambda: H.clock_features(tau_b))
    t_esig = time_per_call(lambda: H.log_signature(H.time_augmented(tau_b[:256]), backend="esig"),
                           repeats=3, warmup=1) * batch / 256
    return {"net_s": t_net, "feat_s": t_feat, "esig_s": t_esig, "ratio": t_feat / t_net,
            "esig_ratio": t_esig / t_net, "batch": batch}


# -- C3: three flows, same network, same steps --------------------------------------------------
def scatter(ax, x, ref, title: str, n: int = 4000, lim: float = 12, radius: float = RADIUS):
    """The first ``n`` samples on ``ax``, with a circle of ``radius`` around each mode of the
    mixture ``ref`` (the rare ones in red)."""
    x = x[:n]
    ax.plot(x[:, 0], x[:, 1], ".", ms=1.5, alpha=0.5, label="samples")
    for k, c in enumerate(ref.centers):
        rare = k in ref.rare
        ax.add_patch(Circle(c, radius, fill=False, lw=1.5 if rare else 0.6,
                            color="#d1495b" if rare else "k",
                            label="rare mode" if rare and k == ref.rare[0] else None))
    ax.set(xlim=(-lim, lim), ylim=(-lim, lim), title=title, xlabel="x1", ylabel="x2",
           aspect="equal")


def train_models(data: torch.Tensor, tail: float, S: dict, generator: torch.Generator, device,
                 progress=None) -> tuple[dict, dict]:
    """Gaussian FM, the fixed Student-t source and HTFM (:func:`methods_for`), trained in that
    order on ``data`` with the scale's steps, batch and width: ``(models, losses)``."""
    models, losses = {}, {}
    for name, m in H.methods_for(tail).items():
        models[name], losses[name] = H.train_fm(data, m, steps=S["steps"], batch=S["batch"],
                                                hidden=S["hidden"], generator=generator,
                                                device=device, progress=progress)
    return models, losses


def evaluate_models(models: dict, methods: dict, ref, true_masses, *, n_eval: int,
                    generator: torch.Generator, device, seed: int) -> tuple[list[dict], dict]:
    """Sample every model from its training clock at every step count of :data:`NFE` and score
    it against the reference ``ref``: rare-mode coverage, sliced W1 (10k points, 32 directions),
    high-quantile error and Hill index. Returns ``(rows, samples)``, ``samples[name, nfe]``."""
    rows, samples = [], {}
    sw_ref = ref.x[:10_000]
    for name, model in models.items():
        for nfe in NFE:
            x = H.sample(model, methods[name].clock, n_eval, nfe, generator=generator,
                         device=device).numpy()
            samples[name, nfe] = x
            cov = mode_coverage(x, ref.centers, true_masses, RADIUS, ref.rare)
            rows.append({"method": name, "nfe": nfe, "coverage": cov["coverage"],
                         "rare_hit": cov["hit"],
                         "sw": sliced_wasserstein(x[:10_000], sw_ref, n_projections=32, seed=seed),
                         "q_err": quantile_error(x, ref.x), "hill": hill(x, frac=HILL_FRAC)})
    return rows, samples


def metric_table(rows: list[dict], alpha: float):
    """The rows as a DataFrame with the Hill error |hill - alpha| added."""
    table = pd.DataFrame(rows)
    table["hill_err"] = (table["hill"] - alpha).abs()
    return table


def c3_means(table) -> tuple:
    """Each metric's mean over the step counts, per method, and whether HTFM wins each one
    (coverage: at least every baseline's; the errors: below every baseline's)."""
    mean = table.groupby("method")[list(METRICS)].mean()
    wins = {"coverage": bool(mean.loc["htfm", "coverage"] >= mean.drop("htfm")["coverage"].max()),
            **{k: bool(mean.loc["htfm", k] < mean.drop("htfm")[k].min()) for k in METRICS[1:]}}
    return mean, wins


def transport(models: dict, methods: dict, ref, *, n: int, nfe: int, generator: torch.Generator,
              device) -> tuple:
    """Where the largest sources go: per model, ``n`` sources of its training clock integrated in
    ``nfe`` Euler steps; the Spearman correlation of source radius with sample radius, the share of
    the top 1 % of sources (by radius) whose sample lands beyond the data's 0.99 radius quantile
    (a source tail carried through), and their median radius ratio sample / source.
    Returns ``(table, pairs)``, ``pairs[name] = (source radii, sample radii)``."""
    r99 = np.quantile(np.linalg.norm(ref.x, axis=1), 0.99)
    rows, pairs = {}, {}
    for name, model in models.items():
        x0, tau = H.sample_source(methods[name].clock, n, model.dim, generator=generator)
        r0 = np.linalg.norm(x0.numpy(), axis=1)
        r1 = np.linalg.norm(H.integrate(model, x0, tau, nfe, device).numpy(), axis=1)
        top = r0 >= np.quantile(r0, 0.99)
        rows[name] = {"spearman": float(stats.spearmanr(r0, r1).statistic),
                      "top1_beyond_r99": float((r1[top] > r99).mean()),
                      "top1_ratio": float(np.median(r1[top] / r0[top]))}
        pairs[name] = (r0, r1)
    return pd.DataFrame(rows).T, pairs


# -- C4: tail control at sampling time ------------------------------------------------------------
def tail_sweep(model, sweep: dict, n: int, generator: torch.Generator, device,
               nfe: int = 8) -> tuple[dict, dict]:
    """The Hill index of ``n`` samples of ``model`` from each clock of ``sweep`` (family ->
    tail parameters), and each family's Spearman correlation of index with parameter."""
    hills = {fam: [hill(H.sample(model, H.Clock(fam, p), n, nfe, generator=generator,
                                 device=device).numpy(), frac=HILL_FRAC) for p in ps]
             for fam, ps in sweep.items()}
    rho = {fam: stats.spearmanr(sweep[fam], v).statistic for fam, v in hills.items()}
    return hills, rho


# -- C5 (full scale): imbalanced digits and a heavy-tailed field -----------------------------------
def run_c5(S: dict, tail: float, generator: torch.Generator, seed: int, device) -> dict:
    """Each method trained on 20:1-imbalanced digits and on heavy-tailed fields: the coverage of
    the three rarest classes (a 3-NN classifier fit on all digits labels the samples; generated
    share over training share, capped at 1) and the high-quantile error of the per-field max."""
    xd, yd, _ = imbalanced_digits(ratio=20.0, seed=seed)
    d_all = load_digits()
    knn = KNeighborsClassifier(3).fit(d_all.data / 16.0, d_all.target)
    share = np.bincount(yd, minlength=10) / len(yd)
    rare_cls = np.argsort(share)[:3]
    fields = extreme_field(S["c5_fields"], seed=seed)
    fields_ref = extreme_field(max(S["c5_fields"], 20_000), seed=20_000 + seed)
    c5 = {}
    for name, m in H.methods_for(tail).items():
        md_, _ = H.train_fm(torch.tensor(xd * 2 - 1), m, steps=S["c5_steps"], batch=S["batch"],
                            hidden=S["c5_hidden"], generator=generator, device=device)
        gen = (H.sample(md_, m.clock, 5000, 8, generator=generator, device=device).numpy() + 1) / 2
        gshare = np.bincount(knn.predict(np.clip(gen, 0, 1)), minlength=10) / len(gen)
        mf, _ = H.train_fm(torch.tensor(fields), m, steps=S["c5_steps"], batch=S["batch"],
                           hidden=S["c5_hidden"], generator=generator, device=device)
        fgen = H.sample(mf, m.clock, len(fields_ref), 8, generator=generator, device=device).numpy()
        c5[name] = {"rare_class_coverage": float(np.minimum(gshare[rare_cls] / share[rare_cls],
                                                            1).mean()),
                    "field_max_q_err": quantile_error(fgen.max(1), fields_ref.max(1),
                                                      (0.99, 0.999))}
    return c5


def c5_holds(c5: dict) -> bool:
    """HTFM covers the rare classes at least as well as both baselines and has a smaller
    field-max quantile error than both."""
    return bool(all(c5["htfm"]["rare_class_coverage"] >= c5[b]["rare_class_coverage"]
                    and c5["htfm"]["field_max_q_err"] < c5[b]["field_max_q_err"]
                    for b in ("gaussian", "student_t")))


def summary_metrics(c1: dict, mean, hills: dict) -> dict:
    """Scalars "What we saw" quotes: C1's smallest law p-value and largest heavy-control
    p-value, each method's C3 means over the step counts (``c3_<method>_<metric>``), and C4's
    Hill index at every point of each sweep (``c4_<family>_hill_<10 x parameter>``)."""
    out = {"c1_min_p": min(c1["pvals"]), "c1_max_heavy_control_p": max(c1["heavy_controls"])}
    out.update({f"c3_{m}_{k}": float(mean.loc[m, k]) for m in mean.index for k in METRICS})
    out.update({f"c4_{fam}_hill_{round(10 * p)}": h for fam, v in hills.items()
                for p, h in zip(SWEEP[fam], v)})
    return out


# -- the explorer: the sampling clock against the generated tail -----------------------------------
def radius_qq(x: np.ndarray, ref_x: np.ndarray, levels=None) -> tuple[np.ndarray, np.ndarray]:
    """The tail QQ of the radius: the data's (``ref_x``) and the samples' quantiles of ||x|| at
    ``levels`` (by default 40 levels from 0.9 to 0.9999, as the notebook's tail figure)."""
    levels = 1 - np.logspace(-4, -1, 40) if levels is None else levels
    return (np.quantile(np.linalg.norm(ref_x, axis=1), levels),
            np.quantile(np.linalg.norm(x, axis=1), levels))


def clock_figure(model, ref, kind: str, param: float, baseline: np.ndarray, n: int = 10_000,
                 nfe: int = 8, seed: int = 0, device="cpu"):
    """The explorer's picture (C4's tail control): the trained HTFM network sampled from the clock
    ``kind`` at tail ``param`` (``n`` seeded sources, ``nfe`` Euler steps). Left, the samples over
    the mixture's modes; right, the tail QQ of their radius against the data, beside the first
    ``n`` of ``baseline`` (the network's samples from its training clock: the same sample size,
    so the two Hill indices compare), each with its Hill index."""
    clock = H.Clock(kind, param)
    x = H.sample(model, clock, n, nfe, generator=torch.Generator().manual_seed(seed),
                 device=device).numpy()
    name = clock_name(clock)
    fig, (a0, a1) = plots.subplots(1, 2, figsize=(11, 4.2))
    scatter(a0, x, ref, f"HTFM from the {name} clock, {nfe} Euler steps")
    for i, (label, xs) in enumerate([("training clock", baseline[:n]), (f"{name} clock", x)]):
        r_ref, r = radius_qq(xs, ref.x)
        a1.loglog(r_ref, r, ".-", ms=3, color=plots.PALETTE[i],
                  label=f"{label}: Hill {hill(xs, frac=HILL_FRAC):.2f}")
    a1.loglog(r_ref, r_ref, "k--", lw=0.8, label=f"y = x (data: alpha {ref.alpha:g})")
    a1.set(title="tail QQ of the radius (levels 0.9 to 0.9999)", xlabel="data quantile of ||x||",
           ylabel="generated quantile of ||x||")
    a1.legend(fontsize=7)
    return fig
