"""Low-rank recurrent scaffolds for temporal abstraction in RNNs (NeurIPS 2026, paper 17).

A vanilla tanh RNN, ``h_t = tanh(W_ih e(x_t) + b_ih + W_hh h_{t-1} + b_hh)``, reads a sequence of
tokens and classifies its latent algebraic pattern (AAB, ABA, ...; ``workbench.data.patterns``)
from ``h_L`` with a linear readout. It is never told whether consecutive tokens are the same or
different; the paper's claims are about what it builds anyway:

- identity-independent generalisation to tokens never seen in training (C1);
- hidden states that cluster by the pattern prefix, following the generative tree (C2);
- a recurrent matrix whose leading singular component ``s_1 u_1 v_1^T`` integrates the
  same/different transition signal over time (C3), and whose ablation,
  ``W_hh - s_1 u_1 v_1^T``, erases memory of the first transition but not of the last (C4);
- a next-token RNN that does not build the abstraction (C5), but learns faster from the
  classifier's rank-k scaffold than from random init or an equal-norm control scaffold (C6).

Implementation choices (say which and why, docs/papers/17-rnn-abstraction.md):

- the input pathway (token embeddings, N(0, 1) entries, and ``W_ih``) is *fixed*: novel tokens get
  no gradient, so a trained table would drift the train tokens away from the novel ones and
  confound C1; and a fixed, shared pathway gives every model the same hidden coordinates, which a
  transferred ``W_hh`` scaffold needs (C6);
- the next-token readout maps ``h_t`` into embedding space and scores the candidate tokens by a dot
  product with that fixed table (tied output), restricted to the alphabet of the sequence's split:
  that is what makes next-token *generalisation to novel tokens* measurable at all;
- probes are logistic regressions on standardised states, scored by balanced accuracy on a held-out
  half, so chance is 0.5 for a transition whatever its base rate.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.cluster import KMeans
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.metrics import balanced_accuracy_score, silhouette_score
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from workbench.data.patterns import PatternTask

__all__ = ["PatternRNN", "states_with", "train_classifier", "accuracy", "next_token_loss",
           "train_next_token", "optimal_next_token_loss", "probe_accuracy", "fixed_probe",
           "prefix_purity", "identity_residual", "best_k", "participation_ratio", "leading_projection", "corr",
           "bulk_edge", "n_outliers", "stable_rank", "scaffold", "add_scaffold"]


# -- the model ---------------------------------------------------------------------------------
class PatternRNN(nn.Module):
    """Fixed embedding -> ``torch.nn.RNN`` (tanh, one layer) -> linear readout.

    The input pathway (embedding table and ``W_ih``) is fixed, drawn from ``input_seed``: novel
    tokens are then in distribution, and every model of a run shares the hidden coordinates in
    which a recurrent scaffold is written (C6). ``W_hh``, the biases and the readout are trained.

    ``n_out`` classes for the pattern classifier; ``tied=True`` makes the readout a map into the
    embedding space scored against the (fixed) embedding table: the next-token model.
    """

    def __init__(self, vocab: int, hidden: int = 64, embed_dim: int = 32, n_out: int = 5,
                 tied: bool = False, input_seed: int = 0, generator: torch.Generator | None = None):
        super().__init__()
        self.hidden, self.tied = hidden, tied
        self.rnn = nn.RNN(embed_dim, hidden, nonlinearity="tanh", batch_first=True)
        self.readout = nn.Linear(hidden, embed_dim if tied else n_out)
        with torch.no_grad():                                     # seeded init, torch's ranges
            b = 1 / math.sqrt(hidden)
            for p in [*self.rnn.parameters(), *self.readout.parameters()]:
                p.copy_(torch.empty_like(p).uniform_(-b, b, generator=generator))
            # the fixed input pathway e(x), W_ih: the same for every model with this input_seed
            g_in = torch.Generator().manual_seed(input_seed)
            self.register_buffer("table", torch.randn(vocab, embed_dim, generator=g_in))
            self.rnn.weight_ih_l0.copy_(torch.randn(hidden, embed_dim, generator=g_in)
                                        / math.sqrt(embed_dim))   # unit-variance input drive
        self.rnn.weight_ih_l0.requires_grad_(False)

    @property
    def w_hh(self) -> torch.Tensor:
        return self.rnn.weight_hh_l0

    def states(self, tokens: torch.Tensor) -> torch.Tensor:
        """All hidden states ``h_1..h_L`` (batch, L, hidden)."""
        return self.rnn(self.table[tokens])[0]

    def forward(self, tokens: torch.Tensor, candidates: torch.Tensor | None = None):
        """Classifier: pattern logits from ``h_L``. Tied: next-token logits at every step over
        ``candidates`` (token ids), ``<W_out h_t + b, e(c)>``."""
        h = self.states(tokens)
        if not self.tied:
            return self.readout(h[:, -1])
        return self.readout(h) @ self.table[candidates].T


def states_with(model: PatternRNN, tokens: torch.Tensor, w_hh: torch.Tensor | None = None):
    """Hidden states with the recurrent matrix replaced by ``w_hh`` (e.g. an ablated one).

    The recursion ``h_t = tanh(W_ih e(x_t) + b_ih + W_hh h_{t-1} + b_hh)``, h_0 = 0, written out
    so that any ``W_hh`` can be plugged in; equal to ``model.states`` when ``w_hh`` is None.
    """
    r = model.rnn
    w = r.weight_hh_l0 if w_hh is None else w_hh
    tokens = tokens.to(model.table.device)
    drive = model.table[tokens] @ r.weight_ih_l0.T + r.bias_ih_l0 + r.bias_hh_l0
    h = torch.zeros(tokens.shape[0], model.hidden, dtype=drive.dtype, device=drive.device)
    out = []
    for t in range(tokens.shape[1]):
        h = torch.tanh(drive[:, t] + h @ w.T)                     # eq. of the RNN, one step
        out.append(h)
    return torch.stack(out, 1)


# -- training ----------------------------------------------------------------------------------
def train_classifier(model: PatternRNN, task: PatternTask, steps: int, batch: int = 128,
                     lr: float = 3e-3, n_seqs: int = 0, shuffle_labels: bool = False,
                     weight_decay: float = 0.0, generator: torch.Generator | None = None, progress=None) -> list[float]:
    """Cross-entropy on the pattern label of train-token sequences (no transition labels).

    ``n_seqs > 0`` trains on a fixed set of that many sequences (needed for ``shuffle_labels``,
    the generic-statistics control: same inputs, labels permuted once, so only memorisation is
    possible); ``n_seqs = 0`` draws fresh sequences every step. Returns the loss per step.
    """
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            weight_decay=weight_decay)
    fixed = task.sample(n_seqs, "train", generator) if n_seqs else None
    if fixed is not None and shuffle_labels:
        fixed["label"] = fixed["label"][torch.randperm(n_seqs, generator=generator)]
    dev = model.table.device
    losses = []
    it = range(steps) if progress is None else progress(range(steps), desc="classifier")
    for _ in it:
        if fixed is None:
            b = task.sample(batch, "train", generator)
            x, y = b["tokens"], b["label"]
        else:
            idx = torch.randint(0, n_seqs, (batch,), generator=generator)
            x, y = fixed["tokens"][idx], fixed["label"][idx]
        loss = F.cross_entropy(model(x.to(dev)), y.to(dev))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def accuracy(model: PatternRNN, batch: dict) -> float:
    """Pattern classification accuracy on a batch from ``task.sample``."""
    pred = model(batch["tokens"].to(model.table.device)).argmax(1).cpu()
    return float((pred == batch["label"]).float().mean())


def next_token_loss(model: PatternRNN, tokens: torch.Tensor, alphabet: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``x_{t+1}`` from ``h_t``, t = 1..L-1, over ``alphabet``.

    Restricting the softmax to the split's alphabet makes the optimal predictor identity-free:
    after ``AB`` it puts 1/3 on A, 1/3 on B and 1/3 spread over the unused tokens.
    """
    dev = model.table.device
    tokens, alphabet = tokens.to(dev), alphabet.to(dev)
    logits = model(tokens[:, :-1], candidates=alphabet)          # (n, L-1, |alphabet|)
    lookup = torch.full((int(alphabet.max()) + 1,), -1, dtype=torch.long, device=dev)
    lookup[alphabet] = torch.arange(len(alphabet), device=dev)
    target = lookup[tokens[:, 1:]]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def train_next_token(model: PatternRNN, task: PatternTask, steps: int, batch: int = 128,
                     lr: float = 3e-3, weight_decay: float = 0.0, eval_every: int = 25,
                     eval_batch: dict | None = None,
                     generator: torch.Generator | None = None) -> dict:
    """Next-token training on train-token sequences; every ``eval_every`` steps the loss on a
    fixed batch of train-token and of novel-token sequences (the learning curves of C6)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            weight_decay=weight_decay)
    ev = eval_batch or {"train": task.sample(512, "train", generator)["tokens"],
                        "novel": task.sample(512, "novel", generator)["tokens"]}
    curve = {"step": [], "train": [], "novel": []}
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            with torch.no_grad():
                curve["step"].append(step)
                for split in ("train", "novel"):
                    curve[split].append(float(next_token_loss(model, ev[split],
                                                              task.tokens(split))))
        if step == steps:
            break
        x = task.sample(batch, "train", generator)["tokens"]
        loss = next_token_loss(model, x, task.train_tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: np.asarray(v) for k, v in curve.items()}


def optimal_next_token_loss(task: PatternTask, split: str = "novel") -> float:
    """The entropy floor of :func:`next_token_loss`: the loss of the Bayes predictor that knows the
    pattern family (uniform patterns) but not which pattern is being played."""
    n_tok = len(task.tokens(split))
    total = 0.0
    for t in range(1, task.length):                               # predict position t from 0..t-1
        for prefix in task.prefixes[t - 1]:
            cont = [p for p in task.patterns if p.startswith(prefix)]
            w = len(cont) / task.n_classes
            counts: dict[str, int] = {}
            for p in cont:
                counts[p[t]] = counts.get(p[t], 0) + 1
            used = len(set(prefix))
            for letter, c in counts.items():
                q = c / len(cont)
                # a new letter is any of the n_tok - used unused tokens, uniformly
                q_tok = q / (n_tok - used) if letter not in prefix else q
                total += w * q * -math.log(q_tok)
    return total / (task.length - 1)


# -- probes and geometry -----------------------------------------------------------------------
def probe_accuracy(x, y, seed: int = 0, test_frac: float = 0.5, C: float = 1.0) -> float:
    """Held-out balanced accuracy of a logistic-regression probe ``y ~ x`` (x standardised).

    Chance is 1 / (number of classes) whatever the base rates; a constant ``y`` gives 1.0.
    """
    x = np.asarray(x.detach() if torch.is_tensor(x) else x, float)
    y = np.asarray(y.detach() if torch.is_tensor(y) else y)
    if len(np.unique(y)) < 2:
        return 1.0
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_frac, random_state=seed, stratify=y)
    clf = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=2000))
    clf.fit(xtr, ytr)
    return float(balanced_accuracy_score(yte, clf.predict(xte)))


def fixed_probe(x_fit, y, conditions: dict, seed: int = 0, test_frac: float = 0.5) -> dict:
    """A decoder fit on the intact network's states, applied to every condition (C4).

    The logistic probe is fit on a random ``1 - test_frac`` of ``x_fit`` (intact states); each
    ``conditions[name]`` holds the states of the same sequences under an ablation, scored by
    balanced accuracy on the held-out sequences. This asks whether the network still carries the
    variable in the code it uses, which is what an ablation of its own weights can erase.
    """
    y = np.asarray(y)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(test_frac * len(y)))
    te, tr = order[:n_test], order[n_test:]
    clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    clf.fit(np.asarray(x_fit, float)[tr], y[tr])
    return {name: float(balanced_accuracy_score(y[te], clf.predict(np.asarray(x, float)[te])))
            for name, x in conditions.items()}


def prefix_purity(states, prefix, seed: int = 0) -> float:
    """Cluster-vs-prefix purity: k-means with k = number of distinct prefixes, then the fraction
    of states whose cluster's majority prefix is their own (1 = clusters are the tree's nodes)."""
    x = np.asarray(states, float)
    y = np.asarray(prefix)
    k = len(np.unique(y))
    if k < 2:
        return 1.0
    lab = KMeans(k, n_init=4, random_state=seed).fit_predict(x)
    return float(sum(np.bincount(y[lab == c]).max() for c in np.unique(lab)) / len(y))


def identity_residual(states, tokens, vocab: int, alpha: float = 1.0, seed: int = 0):
    """The states with what token *identity* explains additively taken out (C2): the residual
    of a ridge regression of ``states`` (n, hidden) on the one-hot tokens ``tokens`` (n, t) seen
    so far, cross-fitted over two random halves (each half's residual comes from the other
    half's fit, so no sequence's own fit absorbs its own structure). An additive model of the
    tokens cannot express "this token equals that one", the interaction the pattern tree is made
    of, so the tree's structure stays and the letters go."""
    x = np.asarray(states, float)
    tok = np.asarray(tokens).reshape(len(x), -1)
    design = np.zeros((len(x), tok.shape[1] * vocab))
    design[np.arange(len(x))[:, None], np.arange(tok.shape[1]) * vocab + tok] = 1.0
    half = np.random.default_rng(seed).permutation(len(x)) < len(x) // 2
    out = np.empty_like(x)
    for fit, res in ((half, ~half), (~half, half)):
        model = Ridge(alpha=alpha).fit(design[fit], x[fit])
        out[res] = x[res] - model.predict(design[res])
    return out


def best_k(states, k_max: int = 8, seed: int = 0) -> int:
    """Number of clusters (2..k_max) with the highest silhouette score under k-means."""
    x = np.asarray(states, float)
    scores = [silhouette_score(x, KMeans(k, n_init=4, random_state=seed).fit_predict(x))
              for k in range(2, k_max + 1)]
    return int(np.argmax(scores)) + 2


def participation_ratio(states) -> float:
    """Linear dimensionality (sum lambda)^2 / sum lambda^2 of the state covariance eigenvalues."""
    x = np.asarray(states, float)
    lam = np.clip(np.linalg.eigvalsh(np.cov(x.T)), 0, None)
    return float(lam.sum() ** 2 / (lam ** 2).sum())


def leading_projection(states: torch.Tensor, w_hh: torch.Tensor, k: int = 0) -> torch.Tensor:
    """``v_k^T h``: what the k-th singular component of ``W_hh`` reads from a state (C3).

    ``W_hh h = sum_i s_i u_i (v_i^T h)``: component i carries ``v_i^T h`` into the next step along
    ``u_i``. The sign of a singular pair is arbitrary, so correlations are reported in absolute value.
    """
    _, _, vh = torch.linalg.svd(w_hh.detach(), full_matrices=False)
    return states.detach() @ vh[k]


def corr(a, b) -> float:
    """Pearson correlation of two 1-D arrays (0 when either is constant)."""
    a, b = np.asarray(a, float).ravel(), np.asarray(b, float).ravel()
    if a.std() == 0 or b.std() == 0:
        return 0.0
    return float(np.corrcoef(a, b)[0, 1])


# -- scaffolds ---------------------------------------------------------------------------------
def bulk_edge(w: torch.Tensor) -> float:
    """Largest singular value expected of an i.i.d. random square matrix with ``w``'s median
    singular value: the quarter-circle law puts the edge at 2 sigma sqrt(n) and the median at
    about 0.808 sigma sqrt(n), so edge ~ 2.475 x median. Components above it stand out of the bulk."""
    return float(2.475 * torch.linalg.svdvals(w.detach().double()).median())


def n_outliers(w: torch.Tensor, margin: float = 1.1) -> int:
    """Number of singular values above ``margin`` x :func:`bulk_edge` (the effective low rank)."""
    s = torch.linalg.svdvals(w.detach().double())
    return int((s > margin * bulk_edge(w)).sum())


def stable_rank(w: torch.Tensor) -> float:
    """``||W||_F^2 / s_1^2 = sum_i s_i^2 / s_1^2``: how many components of the size of the leading one
    the matrix's energy would fill (1 for rank one, n for an orthogonal matrix). Continuous and
    scale-free, so two matrices trained at different weight decays compare on it (C3's control)."""
    s = torch.linalg.svdvals(w.detach().double())
    return float((s ** 2).sum() / s[0] ** 2) if s[0] > 0 else 0.0


def scaffold(w: torch.Tensor, rank: int, norm: float | None = None) -> torch.Tensor:
    """The leading rank-``rank`` part ``sum_{i<rank} s_i u_i v_i^T`` of ``w``; rescaled to Frobenius
    norm ``norm`` when given (the equal-norm control scaffold)."""
    if not 1 <= rank <= min(w.shape):
        raise ValueError(f"a scaffold's rank must be in 1..{min(w.shape)} (the hidden size), "
                         f"got {rank}")
    u, s, vh = torch.linalg.svd(w.detach(), full_matrices=False)
    part = (u[:, :rank] * s[:rank]) @ vh[:rank]
    if norm is not None:
        part = part * (norm / part.norm())
    return part


def add_scaffold(model: PatternRNN, part: torch.Tensor) -> PatternRNN:
    """Initialise ``W_hh <- W_hh + part`` (the fresh random init plus the transferred scaffold)."""
    with torch.no_grad():
        model.rnn.weight_hh_l0.add_(part.to(model.rnn.weight_hh_l0.device))
    return model
