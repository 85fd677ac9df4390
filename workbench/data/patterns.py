"""Sequences with a latent algebraic pattern (AAB, ABA, ...) over a split alphabet.

A *pattern* is a word over placeholder letters in canonical form (a restricted growth string):
letters appear in order of first use, so ``ABA`` is a pattern and ``BAB`` is not (it is the same
pattern written differently). A *sequence* instantiates a pattern by giving each distinct letter
a distinct token: ``ABA`` -> ``(7, 3, 7)``. The alphabet is split into *train* tokens and *novel*
tokens never seen in training, so a model that classifies the pattern of novel-token sequences has
learnt an identity-independent rule (Marcus et al. 1999 style "algebraic" generalisation).

Labels a sequence carries:

- ``label``: index of its pattern in the family (what the classifier is trained on);
- ``transitions``: for t = 1..L-1, 1 when token t equals token t-1 ("same"), 0 otherwise. These are
  never used for training; probes decode them from hidden states;
- ``prefix``: for each step t, the index of the canonical prefix of length t among the family's
  distinct prefixes of that length -- the node of the pattern's generative tree reached at step t.

Everything is generated from a ``torch.Generator``: nothing is downloaded. Dataset card:
``data/patterns.md``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["LETTERS", "canonical", "all_patterns", "transitions", "distinct_indices",
           "PatternTask", "make_task"]

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def canonical(seq) -> str:
    """The pattern of a sequence: each token is replaced by a letter in order of first use.

    >>> canonical([5, 5, 2])
    'AAB'
    >>> canonical("cdc")
    'ABA'
    """
    names: dict = {}
    out = []
    for tok in seq:
        tok = tok.item() if hasattr(tok, "item") else tok
        if tok not in names:
            names[tok] = LETTERS[len(names)]
        out.append(names[tok])
    return "".join(out)


def all_patterns(length: int) -> tuple[str, ...]:
    """Every canonical pattern of a length (restricted growth strings; Bell(length) of them).

    Length 3 gives the five patterns AAA, AAB, ABA, ABB, ABC; length 4 gives fifteen.
    """
    if not 1 <= length <= len(LETTERS):
        raise ValueError(f"length must be in 1..{len(LETTERS)}, got {length}")
    words = ["A"]
    for _ in range(length - 1):
        words = [w + LETTERS[i] for w in words for i in range(len(set(w)) + 1)]
    return tuple(sorted(words))


def transitions(seq) -> list[int]:
    """Same (1) / different (0) label of each consecutive pair: ``[x1 == x0, x2 == x1, ...]``."""
    seq = [t.item() if hasattr(t, "item") else t for t in seq]
    return [int(a == b) for a, b in zip(seq[:-1], seq[1:])]


def distinct_indices(n: int, size: int, k: int, generator: torch.Generator | None = None):
    """``n`` rows of ``k`` distinct indices in ``[0, size)``, uniform over ordered k-tuples.

    Sequential sampling without replacement: draw ``r`` in ``[0, size - m)``, then step it over
    the ``m`` indices already taken (in increasing order) so it lands on a free one.
    """
    if k > size:
        raise ValueError(f"cannot draw {k} distinct indices from {size}")
    out = torch.empty(n, k, dtype=torch.long)
    for m in range(k):
        r = torch.randint(0, size - m, (n,), generator=generator)
        taken = out[:, :m].sort(dim=1).values
        for j in range(m):
            r = r + (r >= taken[:, j]).long()
        out[:, m] = r
    return out


@dataclass
class PatternTask:
    """A pattern family over a vocabulary split into train and novel tokens."""

    patterns: tuple[str, ...]
    train_tokens: torch.Tensor
    novel_tokens: torch.Tensor
    prefixes: list[tuple[str, ...]] = field(init=False)

    def __post_init__(self):
        lengths = {len(p) for p in self.patterns}
        if len(lengths) != 1:
            raise ValueError(f"all patterns need one length, got {sorted(lengths)}")
        for p in self.patterns:
            if canonical(p) != p:
                raise ValueError(f"pattern {p!r} is not canonical (write it as {canonical(p)!r})")
        if len(set(self.patterns)) != len(self.patterns):
            raise ValueError("patterns repeat")
        k = self.max_letters
        for name, toks in (("train", self.train_tokens), ("novel", self.novel_tokens)):
            if len(toks) < k:
                raise ValueError(f"{name} alphabet has {len(toks)} tokens; patterns need {k}")
        if set(self.train_tokens.tolist()) & set(self.novel_tokens.tolist()):
            raise ValueError("train and novel tokens overlap")
        # the generative tree: distinct canonical prefixes at each depth t = 1..L
        self.prefixes = [tuple(sorted({p[:t] for p in self.patterns}))
                         for t in range(1, self.length + 1)]
        # a pattern's letters as slot indices ("ABA" -> [0, 1, 0]) and its prefix ids per step
        self._slots = torch.tensor([[LETTERS.index(c) for c in p] for p in self.patterns])
        self._prefix_table = torch.tensor([[self.prefixes[t].index(p[:t + 1])
                                            for t in range(self.length)] for p in self.patterns])

    @property
    def length(self) -> int:
        return len(self.patterns[0])

    @property
    def n_classes(self) -> int:
        return len(self.patterns)

    @property
    def max_letters(self) -> int:
        return max(len(set(p)) for p in self.patterns)

    @property
    def vocab_size(self) -> int:
        return int(max(self.train_tokens.max(), self.novel_tokens.max())) + 1

    def tokens(self, split: str) -> torch.Tensor:
        if split not in ("train", "novel"):
            raise ValueError(f"split must be 'train' or 'novel', got {split!r}")
        return self.train_tokens if split == "train" else self.novel_tokens

    def label(self, seq) -> int:
        """Pattern index of one sequence (ValueError when its pattern is not in the family)."""
        p = canonical(seq)
        if p not in self.patterns:
            raise ValueError(f"sequence {list(seq)} has pattern {p!r}, not in {self.patterns}")
        return self.patterns.index(p)

    def sample(self, n: int, split: str = "train", generator: torch.Generator | None = None,
               pattern_ids: torch.Tensor | None = None) -> dict:
        """``n`` sequences of the split's tokens, patterns uniform (or ``pattern_ids``).

        Returns tensors ``tokens`` (n, L) long, ``label`` (n,), ``transitions`` (n, L-1) and
        ``prefix`` (n, L): see the module docstring.
        """
        alphabet = self.tokens(split)
        if pattern_ids is None:
            pattern_ids = torch.randint(0, self.n_classes, (n,), generator=generator)
        chosen = alphabet[distinct_indices(n, len(alphabet), self.max_letters, generator)]
        tokens = torch.gather(chosen, 1, self._slots[pattern_ids])  # (n, L)
        trans = (tokens[:, 1:] == tokens[:, :-1]).long()
        return {"tokens": tokens, "label": pattern_ids.clone(), "transitions": trans,
                "prefix": self._prefix_table[pattern_ids]}


def make_task(n_train_tokens: int = 40, n_novel_tokens: int = 20, length: int = 3,
              patterns: tuple[str, ...] | None = None,
              generator: torch.Generator | None = None) -> PatternTask:
    """Split a vocabulary of ``n_train_tokens + n_novel_tokens`` ids at random into the two sets.

    ``patterns`` defaults to every canonical pattern of ``length``.
    """
    patterns = tuple(patterns) if patterns else all_patterns(length)
    vocab = n_train_tokens + n_novel_tokens
    perm = torch.randperm(vocab, generator=generator)
    return PatternTask(patterns, perm[:n_train_tokens].sort().values,
                       perm[n_train_tokens:].sort().values)
