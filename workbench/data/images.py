"""Seeded image-caption families for the mini-CLIP (notebooks 03 and 15).

Two families, both ``(N, 3, SIZE, SIZE)`` float images in [0, 1] with a class id and a caption:

* ``digits``: scikit-learn's 8 x 8 handwritten digits (1797 images), upsampled to SIZE x SIZE,
  grey on black; 10 classes ("zero" .. "nine"), split into train / test images by a seeded
  permutation (``split``).
* ``shapes``: procedural images, one shape of one colour filled with one texture on a dark,
  noisy background, at a random position and size. A class is a (texture, colour, shape)
  triple: ``len(TEXTURES) * len(COLOURS) * len(SHAPES)`` = 4 * 6 * 6 = 144 classes. A fixed,
  seeded fifth of the triples is *held out* (:data:`SHAPES_HELDOUT`): never in CLIP's training
  pairs, so zero-shot accuracy on them measures composition of seen words, and few-shot /
  class-incremental notebooks get classes CLIP has not been trained on. Every texture, colour
  and shape value appears in the seen classes.

Class names are strings ("striped red circle", "three"); :func:`caption` renders them with one
of :data:`TEMPLATES` (template 0 is the zero-shot prompt). Nothing is downloaded.
"""
from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits

__all__ = ["SIZE", "SHAPES", "COLOURS", "TEXTURES", "DIGIT_NAMES", "SHAPES_CLASSES",
           "SHAPES_SEEN", "SHAPES_HELDOUT", "TEMPLATES", "classes", "caption", "shapes",
           "digits", "family", "vocabulary", "add_noise"]

SIZE = 16
SHAPES = ("circle", "square", "triangle", "cross", "ring", "diamond")
COLOURS = {"red": (1.0, 0.15, 0.1), "green": (0.1, 0.9, 0.2), "blue": (0.2, 0.35, 1.0),
           "yellow": (1.0, 0.9, 0.1), "magenta": (0.95, 0.2, 0.9), "cyan": (0.1, 0.9, 0.95)}
TEXTURES = ("solid", "striped", "checkered", "dotted")
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TEMPLATES = ("a photo of a {}", "an image of a {}", "a small {}", "a picture showing a {}")

SHAPES_CLASSES = tuple(f"{t} {c} {s}" for t in TEXTURES for c in COLOURS for s in SHAPES)


def _heldout(seed: int = 1234, frac: float = 0.2) -> tuple[str, ...]:
    """A seeded ``frac`` of the shape classes, re-drawn until every attribute value stays seen."""
    rng = np.random.default_rng(seed)
    n = int(round(frac * len(SHAPES_CLASSES)))
    while True:
        pick = sorted(rng.choice(len(SHAPES_CLASSES), n, replace=False))
        seen = [SHAPES_CLASSES[i].split() for i in range(len(SHAPES_CLASSES)) if i not in pick]
        if all({w[k] for w in seen} == set(v) for k, v in enumerate((TEXTURES, COLOURS, SHAPES))):
            return tuple(SHAPES_CLASSES[i] for i in pick)


SHAPES_HELDOUT = _heldout()
SHAPES_SEEN = tuple(c for c in SHAPES_CLASSES if c not in SHAPES_HELDOUT)


def classes(family_name: str, which: str = "all") -> tuple[str, ...]:
    """Class names of ``family_name`` ("digits" | "shapes"); ``which`` = all | seen | heldout
    (digits has no held-out classes)."""
    if family_name == "digits":
        return DIGIT_NAMES if which in ("all", "seen") else ()
    return {"all": SHAPES_CLASSES, "seen": SHAPES_SEEN, "heldout": SHAPES_HELDOUT}[which]


def caption(name: str, template: int = 0) -> str:
    """The caption of class ``name`` with :data:`TEMPLATES` ``[template]``; digits read
    "the digit three"."""
    thing = f"digit {name}" if name in DIGIT_NAMES else name
    return TEMPLATES[template % len(TEMPLATES)].format(thing)


def vocabulary() -> list[str]:
    """Every word any caption can contain (the text encoder's word-level vocabulary)."""
    words = {w for t in TEMPLATES for w in t.replace("{}", "").split()}
    words |= set(SHAPES) | set(COLOURS) | set(TEXTURES) | set(DIGIT_NAMES) | {"digit"}
    return sorted(words)


# -- shapes -------------------------------------------------------------------------------------

def _mask(shape: str, r: float, cx: float, cy: float) -> np.ndarray:
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) + 0.5
    dx, dy = xx - cx, yy - cy
    if shape == "circle":
        return dx ** 2 + dy ** 2 <= r ** 2
    if shape == "ring":
        d = np.sqrt(dx ** 2 + dy ** 2)
        return (d <= r) & (d >= 0.55 * r)
    if shape == "square":
        return (np.abs(dx) <= 0.85 * r) & (np.abs(dy) <= 0.85 * r)
    if shape == "diamond":
        return np.abs(dx) + np.abs(dy) <= 1.1 * r
    if shape == "cross":
        w = 0.38 * r
        return ((np.abs(dx) <= w) & (np.abs(dy) <= r)) | ((np.abs(dy) <= w) & (np.abs(dx) <= r))
    if shape == "triangle":                       # apex up
        return (dy <= 0.8 * r) & (dy >= -r) & (np.abs(dx) <= (dy + r) * 0.6)
    raise ValueError(shape)


def _texture(texture: str, phase: int) -> np.ndarray:
    yy, xx = np.mgrid[0:SIZE, 0:SIZE]
    if texture == "solid":
        return np.ones((SIZE, SIZE), np.float32)
    if texture == "striped":                      # horizontal stripes, period 4
        return (((yy + phase) // 2) % 2 == 0).astype(np.float32)
    if texture == "checkered":
        return ((((yy + phase) // 2) + ((xx + phase) // 2)) % 2 == 0).astype(np.float32)
    if texture == "dotted":
        return ((((yy + phase) % 3) == 0) & (((xx + phase) % 3) == 0)).astype(np.float32)
    raise ValueError(texture)


def _render(name: str, rng: np.random.Generator) -> np.ndarray:
    texture, colour, shape = name.split()
    r = rng.uniform(4.6, 6.8)
    cx, cy = rng.uniform(r, SIZE - r, size=2)
    m = _mask(shape, r, cx, cy).astype(np.float32)
    t = _texture(texture, int(rng.integers(0, 4)))
    # textured shapes keep a dim fill so the outline stays visible
    fill = m * (0.3 + 0.7 * t) if texture != "solid" else m
    col = np.asarray(COLOURS[colour], np.float32) * rng.uniform(0.8, 1.0)
    img = fill[None] * col[:, None, None] + rng.uniform(0, 0.12, (3, SIZE, SIZE)) * (1 - m)
    return np.clip(img, 0, 1).astype(np.float32)


def shapes(names, n_per_class: int, seed: int = 0):
    """``n_per_class`` images of each shape class in ``names``: ``(x, y, captions)`` with
    ``x`` a float32 array (N, 3, SIZE, SIZE), ``y`` the index into ``names``, captions with a
    random template. Deterministic given ``(names, n_per_class, seed)``."""
    names = list(names)
    rng = np.random.default_rng([seed, 7])
    xs, ys, caps = [], [], []
    for k, name in enumerate(names):
        for _ in range(n_per_class):
            xs.append(_render(name, rng))
            ys.append(k)
            caps.append(caption(name, int(rng.integers(0, len(TEMPLATES)))))
    return np.stack(xs), np.asarray(ys, np.int64), caps


# -- digits -------------------------------------------------------------------------------------

def digits(split: str = "train", seed: int = 0, train_frac: float = 0.7, names=DIGIT_NAMES):
    """scikit-learn's digits, upsampled to SIZE x SIZE grey images: ``(x, y, captions)`` of the
    ``split`` ("train" | "test" | "all") of a seeded permutation (seed 0 is CLIP's split), only
    the classes in ``names`` (``y`` indexes ``names``)."""
    d = load_digits()
    perm = np.random.default_rng([seed, 11]).permutation(len(d.target))
    cut = int(train_frac * len(perm))
    idx = {"train": perm[:cut], "test": perm[cut:], "all": perm}[split]
    keep = [i for i in idx if DIGIT_NAMES[d.target[i]] in names]
    img = d.images[keep].astype(np.float32) / 16.0
    img = img.repeat(SIZE // 8, 1).repeat(SIZE // 8, 2)
    x = np.repeat(img[:, None], 3, axis=1)
    labels = [DIGIT_NAMES[d.target[i]] for i in keep]
    y = np.asarray([list(names).index(n) for n in labels], np.int64)
    rng = np.random.default_rng([seed, 13])
    caps = [caption(n, int(rng.integers(0, len(TEMPLATES)))) for n in labels]
    return x, y, caps


def family(name: str, which: str = "seen", n_per_class: int = 20, seed: int = 0,
           split: str = "train"):
    """One family's data by name: ``(x, y, captions, class_names)``. ``shapes`` draws
    ``n_per_class`` fresh images per class of ``classes("shapes", which)`` (a different
    ``seed`` gives different images; CLIP trained on seed 0's); ``digits`` returns the
    ``split`` of CLIP's digit split (its test images were never trained on; ``n_per_class``,
    ``which`` and ``seed`` are ignored)."""
    if name == "digits":
        x, y, caps = digits(split)
        return x, y, caps, DIGIT_NAMES
    names = classes("shapes", which)
    x, y, caps = shapes(names, n_per_class, seed)
    return x, y, caps, names


def add_noise(x, sigma: float, seed: int):
    """A domain shift: ``x`` plus seeded Gaussian pixel noise of std ``sigma``, clipped to [0, 1]
    (a torch tensor; the zoo's CLIP never saw noisy images, so zero-shot accuracy drops)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.as_tensor(x)
    return (x + sigma * torch.randn(x.shape, generator=g)).clamp(0, 1)
