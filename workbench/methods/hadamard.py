"""Hadamard Representation (HR): a hidden layer as the element-wise product of two layers.

Paper 09 (NeurIPS 2026): "Hadamard Representation against dormant neurons and rank collapse in
deep RL"; public code: Jacobkooi/Hadamax ``purejaxql/networks.py`` (two parallel branches,
each optionally LayerNorm then activation, multiplied element-wise).

The standard hidden layer is

    h = act(W x + b)                                                   (standard)

and HR replaces it by two independently parameterized branches multiplied element-wise:

    h = act(W1 x + b1) * act(W2 x + b2)                                (HR)

A tanh unit "saturates" when |W x + b| is large for every input: its output is then +-1 for
every state, its gradient 1 - tanh^2 vanishes, and its outgoing weights act as a fixed bias
downstream. An HR unit needs both of its branches to saturate before it does, so if each
branch saturates with probability p, the product does with about p^2. Independently of that,
the product carries second-order feature interactions, which spreads the representation over
more singular directions (a higher effective rank).

HR doubles the weights of the layer it replaces, so the fair control is a standard layer made
wide enough to hold as many parameters: :func:`matched_width`.

This module holds the HR layer, the three torsos the notebook compares (standard, HR,
parameter-matched wide) for vector, MinAtar and Atari observations, and the representation
diagnostics. The agents (``workbench.rl``) take a torso factory and know nothing of HR.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from workbench import diagnostics as dx

__all__ = ["TORSOS", "ACTIVATIONS", "HadamardLinear", "StandardLinear", "matched_width", "Torso",
           "torso_factory", "rep_param_count", "representation_stats"]

TORSOS = ("standard", "hadamard", "wide")
ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}


def _init(layer: nn.Module, gain: float = math.sqrt(2)) -> nn.Module:
    """CleanRL's ``layer_init``: orthogonal weights with ``gain``, zero bias."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class HadamardLinear(nn.Module):
    """h = act(W1 x + b1) * act(W2 x + b2): the Hadamard representation (HR) layer.

    ``norm=True`` puts a LayerNorm on each branch before its activation, as the Hadamax
    networks do; off by default (the CleanRL baselines here have no normalization).
    """

    def __init__(self, in_dim: int, out_dim: int, act: str = "tanh", norm: bool = False):
        super().__init__()
        self.branch1 = _init(nn.Linear(in_dim, out_dim))          # W1, b1
        self.branch2 = _init(nn.Linear(in_dim, out_dim))          # W2, b2, independent of W1
        self.norm1 = nn.LayerNorm(out_dim) if norm else nn.Identity()
        self.norm2 = nn.LayerNorm(out_dim) if norm else nn.Identity()
        self.act = ACTIVATIONS[act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a1 = self.act(self.norm1(self.branch1(x)))                # act(W1 x + b1)
        a2 = self.act(self.norm2(self.branch2(x)))                # act(W2 x + b2)
        return a1 * a2                                            # Hadamard (element-wise) product


class StandardLinear(nn.Sequential):
    """h = act(W x + b), the layer HR replaces (same init and optional LayerNorm)."""

    def __init__(self, in_dim: int, out_dim: int, act: str = "tanh", norm: bool = False):
        super().__init__(_init(nn.Linear(in_dim, out_dim)),
                         nn.LayerNorm(out_dim) if norm else nn.Identity(), ACTIVATIONS[act]())


def matched_width(in_dim: int, width: int, head_dim: int, norm: bool = False) -> int:
    """Width H' of a standard layer whose parameters, with the linear heads that read it, equal
    those of an HR layer of width H (so parameter count cannot explain a difference).

    HR layer + heads:    2 (m + 1) H [+ 4 H norm] + (H + 1) A
    wide layer + heads:    (m + 1) H' [+ 2 H' norm] + (H' + 1) A
    Setting them equal:  H' = H (2 (m + 1) + A [+ 4]) / (m + 1 + A [+ 2]), rounded,
    with m = ``in_dim`` (the layer's input), A = ``head_dim`` (total outputs of the heads).
    """
    n = 4 if norm else 0
    return round(width * (2 * (in_dim + 1) + head_dim + n) / (in_dim + 1 + head_dim + n / 2))


def _encoder(family: str, obs_shape: tuple, act: str) -> tuple[nn.Module, int]:
    """The layers below the representation layer, identical for the three torsos; returns the
    module and its output size m. Vector: one dense layer of 64 (CleanRL ppo.py); MinAtar: one
    3x3 conv of 16 channels (Young & Tian 2019); Atari: the Nature-DQN convolutions."""
    A = ACTIVATIONS[act]
    if family == "classic":
        return nn.Sequential(_init(nn.Linear(int(math.prod(obs_shape)), 64)), A()), 64
    if family == "minatar":
        c, h, w = obs_shape
        return nn.Sequential(_init(nn.Conv2d(c, 16, 3, 1)), A(), nn.Flatten()), 16 * (h - 2) * (w - 2)
    if family == "ale":
        return nn.Sequential(
            _init(nn.Conv2d(obs_shape[0], 32, 8, 4)), A(), _init(nn.Conv2d(32, 64, 4, 2)), A(),
            _init(nn.Conv2d(64, 64, 3, 1)), A(), nn.Flatten()), 3136
    raise ValueError(f"unknown observation family {family!r}")


class Torso(nn.Module):
    """encoder -> representation layer (standard, HR or wide); ``forward`` returns the
    representation h, which the agent's heads read and the diagnostics measure."""

    def __init__(self, kind: str, family: str, obs_shape: tuple, head_dim: int,
                 width: int = 64, act: str = "tanh", norm: bool = False):
        super().__init__()
        if kind not in TORSOS:
            raise ValueError(f"unknown torso {kind!r}; choose one of {TORSOS}")
        if act not in ACTIVATIONS:
            raise ValueError(f"unknown activation {act!r}; choose one of {tuple(ACTIVATIONS)}")
        self.kind, self.scale_input = kind, 255.0 if family == "ale" else 1.0
        self.encoder, m = _encoder(family, obs_shape, act)
        if kind == "hadamard":
            self.out_dim = width
            self.rep = HadamardLinear(m, width, act, norm)
        else:
            self.out_dim = matched_width(m, width, head_dim, norm) if kind == "wide" else width
            self.rep = StandardLinear(m, self.out_dim, act, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rep(self.encoder(x.float() / self.scale_input))


def torso_factory(kind: str, family: str, width: int = 64, act: str = "tanh",
                  norm: bool = False) -> Callable[[tuple, int], Torso]:
    """What the agents take: ``factory(obs_shape, head_dim) -> Torso`` (with ``.out_dim``)."""
    return lambda obs_shape, head_dim: Torso(kind, family, obs_shape, head_dim, width, act, norm)


def rep_param_count(torso: Torso, head_dim: int) -> int:
    """Parameters of the representation layer plus the linear heads that read it."""
    return sum(p.numel() for p in torso.rep.parameters()) + (torso.out_dim + 1) * head_dim


@torch.no_grad()
def representation_stats(torso: Torso, states: torch.Tensor, tau: float = 0.1,
                         activity_tau: float = 0.1) -> dict:
    """Diagnostics of the representation h on a batch of states.

    - ``inactive``: fraction of units whose spread across states, over the layer's mean spread,
      is <= ``activity_tau`` (dead *or* saturated units), ``diagnostics.inactive_fraction``;
      what C1 is measured with, since a saturated tanh unit is not tau-dormant;
    - ``dormant``: fraction of tau-dormant units (Sokar et al. 2023, eq. 1; mean |h| normalized by
      the layer mean, ``tau`` as given), ``workbench.diagnostics.dormant_fraction``;
    - ``saturated``: fraction of units acting as constants (|mean| >= 0.95, std <= 0.05 across
      states), ``diagnostics.saturated_fraction``;
    - ``srank`` (Kumar et al. 2021, delta = 0.01) and ``erank`` (Roy & Vetterli 2007) of the
      (states x units) matrix, and its singular values ``sv``.
    """
    h = torso(states)
    sv = dx.singular_values(h)
    return {"inactive": dx.inactive_fraction(h, activity_tau), "dormant": dx.dormant_fraction(h, tau),
            "saturated": dx.saturated_fraction(h),
            "srank": dx.srank(sv, is_sv=True), "erank": dx.erank(sv, is_sv=True),
            "sv": sv.float().cpu().numpy()}
