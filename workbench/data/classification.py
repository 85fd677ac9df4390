"""Small in-memory classification tasks, full batch: generated modular addition and scikit-learn's
handwritten digits (shipped with the package; no download). Card: ``data/classification.md``."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

__all__ = ["Task", "modular_addition", "digits"]


@dataclass
class Task:
    """A classification task held in memory, full batch: inputs float32, labels int64."""
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int


def modular_addition(p: int = 23, train_frac: float = 0.5, seed: int = 0) -> Task:
    """(a + b) mod p for all p^2 pairs, inputs one-hot(a) ++ one-hot(b); a seeded random split."""
    a, b = torch.meshgrid(torch.arange(p), torch.arange(p), indexing="ij")
    a, b = a.flatten(), b.flatten()
    x = torch.cat([F.one_hot(a, p), F.one_hot(b, p)], 1).float()
    y = (a + b) % p
    perm = torch.randperm(p * p, generator=torch.Generator().manual_seed(seed))
    n = int(round(train_frac * p * p))
    return Task(f"mod-add-{p}", x[perm[:n]], y[perm[:n]], x[perm[n:]], y[perm[n:]], p)


def digits(train_frac: float = 0.5, seed: int = 0, n_max: int | None = None) -> Task:
    """scikit-learn's 8x8 handwritten digits (1797 images, shipped with the package), pixels / 16;
    ``n_max`` keeps a seeded subset."""
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    if n_max:
        perm = perm[:n_max]
    n = int(round(train_frac * len(perm)))
    return Task("digits", x[perm[:n]], y[perm[:n]], x[perm[n:]], y[perm[n:]], 10)
