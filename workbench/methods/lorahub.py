"""LoraHub: a pool of LoRAs composed by weights searched without gradients on a few examples.

Huang et al. 2023, "LoraHub: Efficient Cross-Task Generalization via Dynamic LoRA Composition"
(arXiv 2307.13269; reference code: github.com/sail-sg/lorahub, ``lorahub/algorithm.py``). Our
reading, at small size:

1. *Compose.* Weights w_1..w_N combine the pool's LoRA modules element-wise, A' = sum_j w_j A_j
   and B' = sum_j w_j B_j, into one LoRA of the same rank (the paper's Eq. 2; the reference code
   sums every ``lora_A`` and ``lora_B`` tensor this way). Its update is B' A', which has the cross
   terms w_j w_l B_j A_l: not the weighted sum of the updates that whole-LoRA averaging adds.
   :func:`compose`, :class:`ComposedLora`.
2. *Search.* The weights minimise the cross-entropy of a few labelled examples of the target
   (completion tokens only) plus an L1 penalty, ``alpha * mean_j |w_j|`` (alpha 0.05 in the
   reference code), by a gradient-free optimiser within bounds [-1.5, 1.5], starting at w = 0,
   for a budget of 40 loss evaluations (the reference code's defaults). The paper uses nevergrad's
   Shiwa/NGOpt; nevergrad is not installed here, so :func:`search` is a seeded (1 + lambda)
   evolution strategy with a one-fifth-success step size (Rechenberg 1973), within the same
   bounds, start and budget. :func:`lorahub_loss`.

Nothing is trained by gradient; the examples only score candidate weights.
"""
from __future__ import annotations

import numpy as np
import torch

from ..data import packing

__all__ = ["compose", "ComposedLora", "lorahub_loss", "search", "L1_ALPHA", "BOUND", "BUDGET"]

L1_ALPHA = 0.05     # the reference code's default_l1_regularization weight
BOUND = 1.5         # weights live in [-BOUND, BOUND]
BUDGET = 40         # loss evaluations (the reference code's max_inference_step)


def compose(factors: list[dict], w) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (B', A')}`` with B' = sum_j w_j B_j and A' = sum_j w_j A_j over the LoRAs'
    ``factors`` (one ``{module: (B, A)}`` each, scaling folded into B)."""
    w = [float(x) for x in w]
    return {name: (sum(wj * f[name][0] for wj, f in zip(w, factors)),
                   sum(wj * f[name][1] for wj, f in zip(w, factors))) for name in factors[0]}


class ComposedLora:
    """Forward hooks that add the composed LoRA's update B' A' x to the plain base model's
    linears. :meth:`set_weights` recomposes; ``remove()`` restores the model."""

    def __init__(self, model, factors: list[dict]):
        self.factors, self.cur, self.handles = factors, None, []
        for name in factors[0]:
            self.handles.append(model.get_submodule(name).register_forward_hook(self._hook(name)))

    def set_weights(self, w) -> None:
        self.cur = compose(self.factors, w)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _hook(self, name):
        def hook(mod, inputs, out):
            if self.cur is None:
                return out
            b, a = self.cur[name]
            return out + (inputs[0] @ a.T) @ b.T
        return hook


def lorahub_loss(model, tok, hooks: ComposedLora, examples: list, w, with_steps: bool = False,
                 alpha: float = L1_ALPHA) -> float:
    """Mean cross-entropy of the ``examples``' completions (and ``<eos>``) under the LoRA
    composed with ``w``, plus ``alpha * mean |w|``."""
    hooks.set_weights(w)
    batch = packing.pad(packing.encode(tok, [e.prompt for e in examples],
                                       [e.completion(with_steps) for e in examples]),
                        tok.pad_token_id)
    batch = {k: v.to(model.device) for k, v in batch.items()}
    with torch.no_grad():
        ce = float(model(**batch).loss)
    return ce + alpha * float(np.mean(np.abs(w)))


def search(loss, n: int, seed: int, budget: int = BUDGET, bound: float = BOUND,
           lam: int = 4, sigma: float = 0.5) -> tuple[np.ndarray, list[float]]:
    """Minimise ``loss(w)`` over w in [-bound, bound]^n with ``budget`` evaluations: a seeded
    (1 + lam) evolution strategy from w = 0. Each generation draws ``lam`` Gaussian mutations,
    each of the best point so far (step ``sigma``, clipped to the bounds), keeping any that
    lowers the loss; sigma grows by 1.5 after a generation that improved and shrinks by 1.5^-1/4 after
    one that did not (the one-fifth rule's balance). Returns the best w and the best loss after
    each evaluation."""
    rng = np.random.default_rng(seed)
    best_w = np.zeros(n)
    best = loss(best_w)
    trace = [best]
    while len(trace) < budget:
        improved = False
        for _ in range(min(lam, budget - len(trace))):
            cand = np.clip(best_w + sigma * rng.standard_normal(n), -bound, bound)
            val = loss(cand)
            if val < best:
                best_w, best, improved = cand, val, True
            trace.append(best)
        sigma *= 1.5 if improved else 1.5 ** -0.25
    return best_w, trace
