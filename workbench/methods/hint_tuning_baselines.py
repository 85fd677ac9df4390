"""The two published ways of shortening reasoning that paper 06 compares Hint Tuning against.

1. **RL with a length penalty** (Arora & Zanette 2025, "Training Language Models to Reason
   Efficiently", arXiv 2502.04463, section 3). Each prompt x gets a group of sampled answers;
   the reward of answer y is its correctness, reduced by a penalty that grows with its length
   relative to the *correct* answers of the same group:

       r(x, y) = 1{y correct} * (1 - alpha * sigmoid((LEN(y) - MEAN(x)) / STD(x)))

   where MEAN(x), STD(x) are the mean and standard deviation of the lengths of the group's
   correct answers, and alpha in [0, 1) sets how much accuracy may be traded for length (a
   wrong answer gets 0 whatever its length; a correct one never gets less than 1 - alpha, so
   correctness always comes first). :func:`length_penalized_reward`. The notebook optimizes it
   with GRPO through TRL (``trl.GRPOTrainer``), whose group-normalized advantage is the
   group-relative baseline the paper's RLOO estimator also uses.
2. **Distillation of the shortest correct trace** (the rejection-sampling baseline of the
   efficient-reasoning papers, e.g. the "shortest" self-training of Munkhbat et al. 2025,
   "Self-Training Elicits Concise Reasoning", arXiv 2502.20122): sample k answers of the
   reasoning model per training problem, keep the shortest one the verifier accepts, and
   fine-tune on it; problems with no correct sample are left out. :func:`shortest_correct`.

Lengths are in tokens of the model's tokenizer; the sampling, the TRL trainer and the fine-tunes
live in :mod:`workbench.experiments.hint_tuning`.
"""
from __future__ import annotations

import numpy as np

__all__ = ["length_penalized_reward", "shortest_correct"]


def length_penalized_reward(correct, lengths, groups, alpha: float,
                            eps: float = 1e-6) -> np.ndarray:
    """Arora & Zanette's reward of every answer (section 3): ``correct`` (0/1), ``lengths``
    (tokens) and ``groups`` (the prompt each answer belongs to), one entry per answer. The
    length is standardized by the mean and std of the *correct* answers of its group (``eps``
    guards a group whose correct answers all have one length: then every one of them is at the
    mean, penalty alpha / 2)."""
    correct = np.asarray(correct, dtype=float)
    lengths = np.asarray(lengths, dtype=float)
    groups = np.asarray(groups)
    out = np.zeros_like(correct)
    for g in np.unique(groups):
        rows = groups == g
        ok = rows & (correct > 0)
        if not ok.any():
            continue                                         # no correct answer: all 0
        z = (lengths[ok] - lengths[ok].mean()) / (lengths[ok].std() + eps)
        out[ok] = 1.0 - alpha / (1.0 + np.exp(-z))           # 1 - alpha * sigmoid(z)
    return out


def shortest_correct(correct, lengths) -> int | None:
    """The index of the shortest correct sample among one problem's k samples (the first of
    equal lengths), or None where none is correct."""
    best = None
    for i, (ok, n) in enumerate(zip(correct, lengths)):
        if ok and (best is None or n < lengths[best]):
            best = i
    return best
