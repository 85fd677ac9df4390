"""HiLoRA: training-free hierarchical routing over a pool of LoRAs.

Paper 07 (NeurIPS 2026; Han et al., arXiv 2510.12266; spec in ``docs/papers/07-hilora.md``).

1. *Rank-one components (ROCs).* A LoRA update is a sum of r rank-one terms,
   Delta W x = s sum_i b_i (a_i^T x), with b_i the i-th column of B and a_i^T the i-th row of A.
   Each ROC is a routing unit; with every ROC on, the LoRA is reproduced exactly (C1).
   :func:`rocs`, :class:`RocHooks`.
2. *Sequence level.* For each LoRA j, a Gaussian N(mu_j, Sigma_j) is fitted to features of its
   training inputs (the base model's hidden states, mean-pooled over the prompt; Ledoit-Wolf
   shrinkage, since there are few samples per dimension). An input's posterior over LoRAs is the
   softmax of the log-likelihoods over a temperature; the smallest set of LoRAs whose posterior
   mass reaches a threshold is selected, and a budget of K ROCs is split over them in proportion
   to their posterior (largest remainders). No router is trained. :func:`fit_gaussians`,
   :func:`log_likelihoods`, :func:`posterior`, :func:`select`, :func:`allocate`.
3. *Token level.* Inside each selected LoRA j, each token activates only the k_j ROCs whose input
   projections |a_i^T x| are largest (the most informative ROCs for that token).

Baselines share the same hooks: whole-LoRA gates (oracle, uniform, top-k, a trained router's
choice) and an Arrow-style router (Ostapenko et al. 2024): a prototype per LoRA and module, the top
right singular vector of its Delta W; per token, logits |v_j^T x|, top-k, softmax. Nothing here
trains a model; the notebook fits a logistic-regression router only as the training-based peer.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
from peft.tuners.lora import LoraLayer
from sklearn.covariance import LedoitWolf

from .. import evaluate

__all__ = ["lora_factors", "rocs", "prompt_features", "fit_gaussians", "factor_gaussians",
           "log_likelihoods",
           "posterior", "select", "allocate", "RocHooks", "whole_gates", "generate_routed"]

# -- ROCs of a peft LoRA -------------------------------------------------------------------------


def lora_factors(model, adapter: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{base module name: (B, A)}`` of a peft ``adapter``, float32, scaling folded into B, so
    ``B @ A`` is the module's Delta W. Names are those of the plain base model's modules."""
    out = {}
    for n, m in model.named_modules():
        if isinstance(m, LoraLayer) and adapter in m.lora_A:
            name = n.split("base_model.model.", 1)[-1]
            out[name] = (m.lora_B[adapter].weight.detach().float() * float(m.scaling[adapter]),
                         m.lora_A[adapter].weight.detach().float().clone())
    return out


def rocs(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The r rank-one components b_i a_i^T of Delta W = B A, stacked (r, out, in); they sum to B A."""
    return b.T[:, :, None] * a[:, None, :]


# -- sequence-level features and Gaussians --------------------------------------------------------


def prompt_features(model, tok, prompts: list[str], layer: int = -1, batch: int = 64) -> torch.Tensor:
    """The base model's hidden state after block ``layer`` (``output_hidden_states``), mean-pooled
    over each ``<bos> prompt``'s tokens: (n, d)."""
    feats = []
    device = next(model.parameters()).device
    tok.padding_side = "left"
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            enc = tok([tok.bos_token + p for p in prompts[i: i + batch]], return_tensors="pt",
                      padding=True, add_special_tokens=False).to(device)
            h = model(**enc, output_hidden_states=True).hidden_states[layer]
            m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            feats.append(((h * m).sum(1) / m.sum(1)).float().cpu())
    return torch.cat(feats)


def fit_gaussians(groups: list[torch.Tensor], ridge: float = 1e-3) -> list[tuple[np.ndarray, np.ndarray]]:
    """One Gaussian (mean, Ledoit-Wolf shrunk covariance) per group of (n_j, d) features. With very
    few samples Ledoit-Wolf may shrink too little to stay invertible, so ``ridge`` times the mean
    variance is added to the diagonal."""
    out = []
    for x in groups:
        x = np.asarray(x, dtype=np.float64)
        lw = LedoitWolf().fit(x)
        cov = lw.covariance_
        out.append((lw.location_, cov + ridge * np.trace(cov) / len(cov) * np.eye(len(cov))))
    return out


def factor_gaussians(gaussians) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """The Gaussians factored once, as a deployment does at fit time: (mean, Cholesky factor L,
    log det Sigma) each. :func:`log_likelihoods` takes them in place of (mean, covariance) and
    then needs only a triangular solve per input."""
    out = []
    for mu, cov in gaussians:
        L = np.linalg.cholesky(cov)
        out.append((mu, L, float(2 * np.log(np.diag(L)).sum())))
    return out


def log_likelihoods(x, gaussians) -> np.ndarray:
    """log N(x; mu_j, Sigma_j) for every row of x and every Gaussian: (n, N), by Cholesky.
    ``gaussians``: (mean, covariance) pairs, factored here, or :func:`factor_gaussians`' triples."""
    from scipy.linalg import solve_triangular
    x = np.asarray(x, dtype=np.float64)
    out = np.empty((len(x), len(gaussians)))
    for j, g in enumerate(gaussians):
        if len(g) == 3:
            mu, L, logdet = g
            z = solve_triangular(L, (x - mu).T, lower=True)       # L^-1 (x - mu)
        else:
            mu, cov = g
            L = np.linalg.cholesky(cov)
            z = np.linalg.solve(L, (x - mu).T)
            logdet = 2 * np.log(np.diag(L)).sum()
        out[:, j] = -0.5 * ((z ** 2).sum(0) + logdet + x.shape[1] * np.log(2 * np.pi))
    return out


def posterior(loglik: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """softmax(loglik / temperature) over LoRAs, row-wise (equal priors)."""
    z = loglik / temperature
    z = z - z.max(1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(1, keepdims=True)


def select(post: np.ndarray, threshold: float = 0.9, k_max: int = 3) -> np.ndarray:
    """Adaptive LoRA selection: per row, the fewest LoRAs (at most ``k_max``) whose posterior mass
    reaches ``threshold``. Boolean (n, N)."""
    order = np.argsort(-post, axis=1)
    mass = np.cumsum(np.take_along_axis(post, order, 1), axis=1)
    count = np.minimum((mass < threshold).sum(1) + 1, k_max)
    mask = np.zeros_like(post, dtype=bool)
    for i, (o, c) in enumerate(zip(order, count)):
        mask[i, o[:c]] = True
    return mask


def allocate(post: np.ndarray, mask: np.ndarray, budget: int, rank: int) -> np.ndarray:
    """ROCs per selected LoRA: ``budget`` split in proportion to the renormalized posterior by
    largest remainders, at least one each, at most ``rank``. Integer (n, N)."""
    k = np.zeros(post.shape, dtype=int)
    for i in range(len(post)):
        sel = np.flatnonzero(mask[i])
        p = post[i, sel] / post[i, sel].sum()
        share = p * budget
        ki = np.maximum(np.floor(share).astype(int), 1)
        for j in np.argsort(-(share - np.floor(share))):
            if ki.sum() >= budget:
                break
            ki[j] += 1
        k[i, sel] = np.minimum(ki, rank)
    return k


# -- the routed forward: hooks on the base model's linears ----------------------------------------


class RocHooks:
    """Adds routed LoRA updates to the plain base model's linear layers (forward hooks).

    ``factors``: one ``{module: (B, A)}`` per LoRA of the pool (:func:`lora_factors`). Per module,
    the pool's ROCs are stacked: A_all (N r, in), B_all (out, N r). Set a routing with
    :meth:`set_gates` (per sequence: LoRA weights w and ROC budgets k, token-level top-k inside
    each LoRA) or :meth:`set_arrow` (per token, per module). ``remove()`` restores the model."""

    def __init__(self, model, factors: list[dict]):
        self.n, self.rank = len(factors), next(iter(factors[0].values()))[0].shape[1]
        self.mode, self.w, self.k, self.top, self.active = "off", None, None, 1, {}
        self.device = next(iter(factors[0].values()))[0].device     # the pool's LoRAs' device
        self.allowed = torch.ones(self.n, dtype=torch.bool, device=self.device)
        self.handles = []
        for name in factors[0]:
            mod = model.get_submodule(name)
            a_all = torch.cat([f[name][1] for f in factors], 0)           # (N r, in)
            b_all = torch.cat([f[name][0] for f in factors], 1)           # (out, N r)
            protos = torch.stack([_top_right_vector(f[name][0], f[name][1]) for f in factors])
            self.handles.append(mod.register_forward_hook(self._hook(name, a_all, b_all, protos)))

    def set_gates(self, w, k) -> None:
        """Per-sequence routing: ``w`` (B, N) LoRA weights, ``k`` (B, N) ROCs per LoRA (r: all,
        the whole LoRA; 0: off). Row i of the next batches gets row i's routing. Only the LoRAs
        some row uses are computed, and the token-level ranking only runs when some k is partial."""
        self.mode = "gates"
        w = torch.as_tensor(np.asarray(w), dtype=torch.float32, device=self.device)
        k = torch.as_tensor(np.asarray(k), dtype=torch.long, device=self.device)
        w = w * (k > 0)
        self.sel = torch.nonzero((w != 0).any(0)).flatten()             # the LoRAs in use
        self.w, self.k = w[:, self.sel], k[:, self.sel]
        self.partial = bool(((self.k > 0) & (self.k < self.rank)).any())
        self.cache = {}

    def set_arrow(self, top: int = 1, allowed=None) -> None:
        """Arrow-style per-token routing over the ``allowed`` LoRAs (default all): the top ``top``
        prototypes by |v_j^T x|, softmax-weighted."""
        self.mode, self.top = "arrow", top
        self.allowed = torch.ones(self.n, dtype=torch.bool, device=self.device) \
            if allowed is None else torch.as_tensor(np.asarray(allowed), dtype=torch.bool,
                                                    device=self.device)

    def off(self) -> None:
        self.mode = "off"

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _hook(self, name, a_all, b_all, protos):
        def hook(mod, inputs, out):
            if self.mode == "off":
                return out
            x = inputs[0]
            Bn, T = x.shape[:2]
            if self.mode == "gates":
                if not len(self.sel):
                    return out
                if name not in self.cache:                              # this batch's LoRAs only
                    n_in, n_out = a_all.shape[1], b_all.shape[0]
                    self.cache[name] = (
                        a_all.view(self.n, self.rank, n_in)[self.sel].reshape(-1, n_in),
                        b_all.view(n_out, self.n, self.rank)[:, self.sel].reshape(n_out, -1))
                a, b = self.cache[name]
                hs = (x @ a.T).view(Bn, T, len(self.sel), self.rank)     # a_i^T x per ROC
                gate = self.w[:Bn, None, :, None].expand(Bn, T, -1, self.rank)
                if self.partial:
                    # token level: keep the k_j ROCs with the largest |a_i^T x| inside LoRA j
                    mag = hs.abs()
                    srt = mag.sort(-1, descending=True).values
                    kk = self.k[:Bn, None, :, None].expand(Bn, T, -1, 1)
                    kth = srt.gather(-1, (kk - 1).clamp(min=0))
                    gate = gate * ((mag >= kth) & (kk > 0))
                self.active[name] = (gate != 0).detach()        # (B, T, LoRAs in use, r): ROCs on
                return out + (hs * gate).reshape(Bn, T, -1) @ b.T
            # Arrow: per-token logits |v_j^T x| over the allowed LoRAs, top-k, softmax over them
            hs = (x @ a_all.T).view(Bn, T, self.n, self.rank)
            logits = (x @ protos.T).abs().masked_fill(~self.allowed, float("-inf"))
            top = logits.topk(self.top, -1)
            wts = torch.zeros_like(logits).scatter(-1, top.indices, top.values.softmax(-1))
            self.active[name] = (wts > 0)[..., None].expand(Bn, T, self.n, self.rank).detach()
            return out + (hs * wts[..., None]).reshape(Bn, T, -1) @ b_all.T
        return hook


def _top_right_vector(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Arrow's prototype: the top right singular vector of Delta W = B A (input space)."""
    q, r_ = torch.linalg.qr(b)                                   # B A = Q (R A)
    _, _, vh = torch.linalg.svd(r_ @ a, full_matrices=False)
    return vh[0]


def whole_gates(choice: np.ndarray, n: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Gates for whole-LoRA routing: row i uses LoRA ``choice[i]`` fully (w = 1, k = r)."""
    w = np.zeros((len(choice), n))
    w[np.arange(len(choice)), choice] = 1.0
    return w, (w > 0) * rank


def generate_routed(model, tok, prompts: list[str], hooks: RocHooks | None = None, w=None, k=None,
                    max_new_tokens: int = 16, batch: int = 64, min_new_tokens: int | None = None):
    """Greedy completions (:func:`workbench.evaluate.generate`: ``transformers`` ``generate``
    with its KV cache) of ``prompts``, each row routed by its own gates ``w[i], k[i]`` (None:
    whatever mode ``hooks`` is in). Cut at ``<eos>``; ``min_new_tokens`` forbids ``<eos>`` before
    that many tokens (a fixed amount of work, for timing)."""
    with _min_new_tokens(model, min_new_tokens):
        if hooks is None or w is None:
            return evaluate.generate(model, tok, prompts, max_new_tokens, batch=batch)
        outs = []
        for i in range(0, len(prompts), batch):           # the gates of each generate batch
            hooks.set_gates(np.asarray(w)[i: i + batch], np.asarray(k)[i: i + batch])
            outs += evaluate.generate(model, tok, prompts[i: i + batch], max_new_tokens,
                                      batch=batch)
        return outs


@contextlib.contextmanager
def _min_new_tokens(model, n: int | None):
    """``model.generate``'s default ``min_new_tokens`` is ``n`` inside the block (None: as is)."""
    cfg = model.generation_config
    old = cfg.min_new_tokens
    if n is not None:
        cfg.min_new_tokens = n
    try:
        yield
    finally:
        cfg.min_new_tokens = old
