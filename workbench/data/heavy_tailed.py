"""Heavy-tailed data with rare modes, seeded (card: ``data/heavy_tailed.md``).

- :func:`stable_mixture`: a 2-D imbalanced mixture of alpha-stable components (notebook 08's smoke
  data): modes on a circle, weights falling geometrically, each component the mode plus
  ``spread`` times two independent symmetric alpha-stable coordinates (scipy's sampler).
- :func:`imbalanced_digits`: scikit-learn's 8x8 digits (shipped, no download) with a long-tailed
  class profile, n_c proportional to ratio^(-c / 9).
- :func:`extreme_field`: smooth Gaussian random fields on a grid plus a few alpha-stable bursts
  (localized extremes), flattened.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy import ndimage, stats
from sklearn.datasets import load_digits

__all__ = ["Mixture", "mixture_weights", "stable_mixture", "imbalanced_digits", "extreme_field"]


@dataclass
class Mixture:
    """A sampled mixture: ``x`` (n, d) float32, ``label`` (n,) its component, and the law."""
    x: np.ndarray
    label: np.ndarray
    centers: np.ndarray
    weights: np.ndarray
    alpha: float
    spread: float
    rare: np.ndarray = field(default=None)

    def __post_init__(self):
        if self.rare is None:
            self.rare = np.flatnonzero(self.weights < 0.05)


def mixture_weights(n_modes: int, ratio: float) -> np.ndarray:
    """Weights proportional to ratio^(-k / (n_modes - 1)): the first mode is ``ratio`` times as
    likely as the last."""
    w = ratio ** (-np.arange(n_modes) / max(n_modes - 1, 1))
    return w / w.sum()


def stable_mixture(n: int, seed: int = 0, n_modes: int = 6, radius: float = 4.0,
                   alpha: float = 1.6, spread: float = 0.3, ratio: float = 40.0) -> Mixture:
    """n points of the imbalanced alpha-stable mixture; modes on a circle of ``radius``.

    Each coordinate of a component is spread * S, S ~ symmetric alpha-stable with unit scale
    (scipy.stats.levy_stable, characteristic function exp(-|u|^alpha)), so the radius ||x|| has
    tail index alpha. Modes with weight below 0.05 are the rare ones.
    """
    if not 0 < alpha <= 2:
        raise ValueError(f"alpha must be in (0, 2], got {alpha}")
    rng = np.random.default_rng(seed)
    ang = 2 * math.pi * np.arange(n_modes) / n_modes
    centers = radius * np.stack([np.cos(ang), np.sin(ang)], 1)
    weights = mixture_weights(n_modes, ratio)
    label = rng.choice(n_modes, size=n, p=weights)
    noise = stats.levy_stable.rvs(alpha, 0.0, size=(n, 2), random_state=rng)
    x = centers[label] + spread * noise
    return Mixture(x.astype(np.float32), label, centers, weights, alpha, spread)


def imbalanced_digits(ratio: float = 20.0, seed: int = 0):
    """Digits with class c kept at a fraction ratio^(-c / 9) of its images (class 0 whole,
    class 9 about 1 / ratio): returns (x in [0, 1], shape (n, 64), labels, per-class fraction)."""
    d = load_digits()
    rng = np.random.default_rng(seed)
    keep, frac = [], ratio ** (-np.arange(10) / 9)
    for c in range(10):
        idx = np.flatnonzero(d.target == c)
        keep.append(rng.permutation(idx)[:max(2, int(round(frac[c] * len(idx))))])
    keep = np.concatenate(keep)
    return (d.data[keep] / 16.0).astype(np.float32), d.target[keep], frac


def extreme_field(n: int, size: int = 12, seed: int = 0, alpha: float = 1.5,
                  smooth: float = 2.0, burst_rate: float = 0.5) -> np.ndarray:
    """n fields on a size x size grid, flattened: a smooth Gaussian field (white noise blurred by
    a Gaussian kernel of width ``smooth`` cells, unit variance) plus, with probability
    ``burst_rate`` per field, one burst at a random cell whose amplitude is |S|, S alpha-stable,
    blurred by the same kernel: extremes with a power-law tail of index alpha."""
    rng = np.random.default_rng(seed)
    white = rng.standard_normal((n, size, size))
    base = ndimage.gaussian_filter(white, sigma=(0, smooth, smooth), mode="wrap")
    base /= base.std()
    bursts = np.zeros((n, size, size))
    hit = rng.random(n) < burst_rate
    cells = rng.integers(0, size, size=(n, 2))
    amp = np.abs(stats.levy_stable.rvs(alpha, 0.0, size=n, random_state=rng))
    bursts[np.arange(n)[hit], cells[hit, 0], cells[hit, 1]] = amp[hit]
    peak = ndimage.gaussian_filter(np.eye(1, size * size).reshape(size, size) * 1.0, smooth,
                                   mode="wrap").max()
    bursts = ndimage.gaussian_filter(bursts, sigma=(0, smooth, smooth), mode="wrap") / peak
    return (base + bursts).reshape(n, -1).astype(np.float32)
