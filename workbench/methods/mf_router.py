"""RouteLLM's matrix-factorization router: a published router design, the baseline of paper 11.

Ong et al. 2024, "RouteLLM: Learning to Route LLMs with Preference Data" (arXiv 2406.18665,
section 4.1, "Matrix factorization"); reference code: github.com/lm-sys/RouteLLM,
``routellm/routers/matrix_factorization/model.py`` (``MFModel``) and
``train_matrix_factorization.py`` (``MFModel_Train``, ``train_loops``). The definition:

1. *Score.* A learned embedding v_m per model, L2-normalized, meets a linear projection of the
   prompt's embedding, and a linear head without bias reads their element-wise product:

       delta(m, q) = w^T (v_m / ||v_m||_2  *  W e(q))

   (``P``, ``text_proj``, ``classifier`` in the reference, none with a bias: "bias should be
   False!"). The score is bilinear in (the normalized v_m, e(q)). :func:`MFRouter.score`.
2. *Preference.* The chance that model a beats model b on q is a Bradley-Terry probability,
   P(a > b | q) = sigmoid(delta(a, q) - delta(b, q)) (``pred_win_rate``). :func:`MFRouter.win_prob`.
3. *Training.* Battles (winner, loser, prompt) are fitted by binary cross-entropy of
   delta(winner) - delta(loser) against 1, with Gaussian noise of std ``noise`` (``alpha`` = 0.1
   in the reference script) added to the prompt embedding during training only; Adam, lr 3e-4,
   weight decay 1e-5, batches of 64, dim 128 (the reference script's values). :func:`train_mf`.

Our reading, at small size: the prompt embedding e(q) is the frozen router LM's mean-pooled last
hidden state (the reference calls OpenAI's ``text-embedding-3-small``), the same input as
notebook 11's architecture-only MLP router; the battles come from the same static routing
labels that router trains on (:func:`battles`: the label candidate beats every other one); with
K candidates the router picks argmax_m delta(m, q) (RouteLLM routes between two by thresholding
the win rate; with K = 2 the argmax is the threshold at 0.5).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MFRouter", "MFSettings", "battles", "battle_loss", "train_mf"]


class MFRouter(nn.Module):
    """delta(m, q) = w^T (normalize(v_m) * W e(q)) for ``n_models`` models (RouteLLM's MFModel)."""

    def __init__(self, n_models: int, text_dim: int, dim: int = 128):
        super().__init__()
        self.P = nn.Embedding(n_models, dim)                     # v_m, one row per model
        self.text_proj = nn.Linear(text_dim, dim, bias=False)    # W
        self.classifier = nn.Linear(dim, 1, bias=False)          # w

    def score(self, e: torch.Tensor, models: torch.Tensor | None = None) -> torch.Tensor:
        """delta of every model (columns) for every prompt embedding ``e`` (rows): (n, K); or,
        with ``models`` (n,), the score of each row's own model: (n,)."""
        v = F.normalize(self.P.weight, p=2, dim=1)               # v_m / ||v_m||
        q = self.text_proj(e)                                    # W e(q)
        if models is not None:
            return self.classifier(v[models] * q).squeeze(-1)
        return self.classifier(v[None, :, :] * q[:, None, :]).squeeze(-1)

    def win_prob(self, e: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """P(model a beats model b | q) = sigmoid(delta(a, q) - delta(b, q)) (Bradley-Terry)."""
        s = self.score(e)
        return torch.sigmoid(s[:, a] - s[:, b])

    def route(self, e: torch.Tensor) -> torch.Tensor:
        """The routing scores, (n, K): the router picks their argmax."""
        return self.score(e)


def battles(labels: torch.Tensor, n_models: int) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor]:
    """Pairwise battles from routing labels: on query i, candidate ``labels[i]`` beats every
    other candidate. Returns ``(winner, loser, query)`` index tensors, one entry per battle."""
    win, lose, query = [], [], []
    for i, w in enumerate(labels.tolist()):
        for m in range(n_models):
            if m != w:
                win.append(w)
                lose.append(m)
                query.append(i)
    return torch.tensor(win), torch.tensor(lose), torch.tensor(query)


def battle_loss(router: MFRouter, e: torch.Tensor, win: torch.Tensor,
                lose: torch.Tensor) -> torch.Tensor:
    """BCE(delta(winner, q) - delta(loser, q), 1), averaged: the reference's training loss."""
    d = router.score(e, win) - router.score(e, lose)
    return F.binary_cross_entropy_with_logits(d, torch.ones_like(d))


@dataclass(frozen=True)
class MFSettings:
    """The reference training script's settings (``train_matrix_factorization.py``)."""
    dim: int = 128               # the model and projected prompt embeddings' width
    lr: float = 3e-4             # Adam
    weight_decay: float = 1e-5   # Adam's L2
    noise: float = 0.1           # std of the Gaussian noise on prompt embeddings (training only)
    epochs: int = 100            # passes over the battles
    batch: int = 64              # battles per step
    seed: int = 0                # init, noise and battle order


def train_mf(e: torch.Tensor, labels: torch.Tensor, n_models: int, s: MFSettings) -> MFRouter:
    """An :class:`MFRouter` fitted on the battles of ``labels`` (:func:`battles`) over prompt
    embeddings ``e`` (n, text_dim): shuffled mini-batches, noise on the embeddings, Adam. The
    router trains where ``e`` lives."""
    torch.manual_seed(s.seed)
    router = MFRouter(n_models, e.shape[1], s.dim).to(e.device)
    opt = torch.optim.Adam(router.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    win, lose, query = (t.to(e.device) for t in battles(labels, n_models))
    for _ in range(s.epochs):
        for idx in torch.randperm(len(win)).split(s.batch):
            q = e[query[idx]]
            loss = battle_loss(router, q + s.noise * torch.randn_like(q), win[idx], lose[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return router.eval()
