"""GPTVQ: vector GPTQ with small learned codebooks (van Baalen et al. 2024, "GPTVQ: The Blessing
of Dimensionality for LLM Quantization", arXiv:2402.15319; reference code
``Qualcomm-AI-research/gptvq``, ``gptq.py`` ``GPTQ.fasterquant(use_vq=True)`` and
``vq_quant.py``).

GPTQ's column sweep, but ``dim`` consecutive input columns of a row form one vector, and a vector
is replaced by the nearest entry of a codebook of ``2**(bits * dim)`` entries (``bits`` index bits
per weight). A codebook serves a block of ``rows_per_group`` consecutive rows by
``cols_per_group`` consecutive columns; it is initialised when the sweep reaches the block's first
column, on the weights as they stand then (after the error feedback of earlier columns), by
Mahalanobis-rank seeding (``mahalanobis_init``: ``k`` points evenly spaced in the ranking of their
Mahalanobis distance to the mean) and ``kmeans_iters`` EM iterations weighted per column by the
GPTQ loss weight ``1 / [U]_jj^2`` (``U`` the upper Cholesky factor of ``H^-1``, so ``[U]_jj^2``
is the inverse Hessian's diagonal entry of the remaining columns; our reading of the paper's
Hessian-weighted distance, ``--hessian-weighted-lookups`` in its scripts); every lookup uses the
same weights. Each vector's error, divided by ``[U]_jj`` per column, is spread over
the later columns exactly as GPTQ does (all ``dim`` columns of a vector at once, then lazy batch
updates per ``blocksize``). After the sweep the codebooks are updated with assignments fixed (the
paper's codebook update, ``lut_m_step``): Adam, ``m_steps`` steps at ``m_lr`` on
``tr((W - Q) H (W - Q)^T)``, restarted at a tenth of the rate whenever the loss rises above its
start.

Departures, named: codebooks stay in fp16 (the paper optionally quantizes them to 8 bits and
compresses them by SVD; we spend those bits on larger codebook blocks instead), no blockwise
normalization of the weights (``vq_scaling_blocksize = -1``, the paper's default), the k-means
seeding is deterministic (the Mahalanobis rank needs no draw), and the weights are GPTQ's loss
weights in both places (the reference code's lookups weight by ``1 / [U]_jj`` and its k-means by
``[U]_jj``). K-means stops once no assignment changes, a fixed point where
the remaining iterations would change nothing.

Storage: ``bits`` index bits per weight plus ``2**(bits * dim) * dim * codebook_bits`` bits per
``rows_per_group * cols_per_group`` weights (:func:`vq_bits_per_weight`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .gptq import inverse_cholesky

__all__ = ["VQQuantized", "vq_bits_per_weight", "rows_for_budget", "mahalanobis_init",
           "weighted_kmeans", "assign", "gptvq"]


@dataclass
class VQQuantized:
    """Codebook indices and codebooks of one (out, in) weight.

    ``codebooks[gr, gc]`` (k, dim) serves rows ``gr * rows_per_group ...`` and columns
    ``gc * cols_per_group ...``; ``index`` (out, in // dim) names each vector's entry."""
    index: torch.Tensor        # (out, in // dim) long
    codebooks: torch.Tensor    # (out // rows_per_group, in // cols_per_group, k, dim)
    dim: int
    rows_per_group: int
    cols_per_group: int
    codebook_bits: int = 16

    def dequantize(self) -> torch.Tensor:
        out, nv = self.index.shape
        r, c, d = self.rows_per_group, self.cols_per_group, self.dim
        gr = torch.arange(out, device=self.index.device) // r
        gc = torch.arange(nv, device=self.index.device) * d // c
        cb = self.codebooks[gr[:, None], gc[None, :], self.index]        # (out, nv, d)
        return cb.reshape(out, nv * d)

    @property
    def bits_per_weight(self) -> float:
        k = self.codebooks.shape[2]
        return vq_bits_per_weight(int(round(torch.log2(torch.tensor(float(k))).item() / self.dim)),
                                  self.dim, self.rows_per_group * self.cols_per_group,
                                  self.codebook_bits)


def vq_bits_per_weight(bits: int, dim: int, weights_per_codebook: int,
                       codebook_bits: int = 16) -> float:
    """Index bits plus the codebook's share: ``bits + 2**(bits dim) dim codebook_bits / n``."""
    return bits + 2 ** (bits * dim) * dim * codebook_bits / weights_per_codebook


def rows_for_budget(bits: int, dim: int, rows: int, cols_per_group: int, budget: float,
                    codebook_bits: int = 16) -> int:
    """The fewest rows per codebook block (a divisor of ``rows``) whose bits per weight, codebook
    included, stay within ``budget``; ``ValueError`` when even all rows do not."""
    for r in range(1, rows + 1):
        if rows % r == 0 and vq_bits_per_weight(bits, dim, r * cols_per_group,
                                                codebook_bits) <= budget + 1e-12:
            return r
    raise ValueError(f"no codebook block of {rows} rows fits {budget} bits per weight")


def mahalanobis_init(x: torch.Tensor, k: int) -> torch.Tensor:
    """(G, N, d) points -> (G, k, d) seeds: the points at ``k`` evenly spaced ranks of their
    Mahalanobis distance to the group mean (GPTVQ's ``mahalanobis_init``)."""
    xc = x - x.mean(1, keepdim=True)
    sigma = xc.transpose(1, 2) @ xc
    lam = torch.linalg.pinv(sigma)
    dist = ((xc @ lam) * xc).sum(-1)                                     # (G, N)
    order = torch.argsort(dist, dim=1)
    pick = torch.round(torch.linspace(0, x.shape[1] - 1, k, device=x.device)).long()
    idx = order[:, pick].unsqueeze(-1).expand(-1, -1, x.shape[2])
    return torch.gather(x, 1, idx).clone()


def assign(x: torch.Tensor, cb: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Nearest entry: (G, N, d) points, (G, k, d) codebooks, optional per-coordinate (N, d) or
    (d,) weights of the squared distance ``sum_j w_j (x_j - c_j)^2`` -> (G, N) indices."""
    w = torch.ones_like(x[0]) if weight is None else weight.expand_as(x[0])      # (N, d)
    dist = 0
    for j in range(x.shape[-1]):                 # d is small: one (G, N, k) pass per coordinate
        dist = dist + w[:, j, None] * (x[..., j, None] - cb[:, None, :, j]).pow(2)
    return dist.argmin(-1)


def weighted_kmeans(x: torch.Tensor, cb: torch.Tensor, weight: torch.Tensor | None,
                    iters: int) -> torch.Tensor:
    """EM on (G, N, d) points from (G, k, d) seeds, distances and means weighted per coordinate
    by ``weight`` (N, d) (GPTVQ's ``kmeans_vq`` / ``kmeans_m_step_3``); an empty cluster keeps
    its entry. Returns the codebooks."""
    cb = cb.clone()
    w = torch.ones_like(x[0]) if weight is None else weight.expand_as(x[0])      # (N, d)
    k, d, prev = cb.shape[1], cb.shape[2], None
    for _ in range(iters):
        a = assign(x, cb, w)
        if prev is not None and torch.equal(a, prev):                    # converged
            break
        idx = (a + k * torch.arange(x.shape[0], device=x.device)[:, None]).reshape(-1)
        num = torch.zeros(cb.numel() // d, d, dtype=x.dtype, device=x.device).index_add_(
            0, idx, (x * w).reshape(-1, d)).reshape(cb.shape)
        den = torch.zeros_like(num).reshape(-1, d).index_add_(
            0, idx, w.repeat(x.shape[0], 1)).reshape(cb.shape)
        cb = torch.where(den > 1e-12, num / den.clamp(min=1e-12), cb)
        prev = a
    return cb


def _m_step(w, H, vq: VQQuantized, steps: int, lr: float, betas=(0.9, 0.999),
            eps: float = 1e-8) -> VQQuantized:
    """The codebook update with assignments fixed (``lut_m_step``): Adam (Kingma and Ba 2015,
    written out) on ``tr((W - Q) H (W - Q)^T)``, restarting at lr / 10 when the loss rises above
    its start (at most 6 tries; else the k-means codebooks stay)."""
    def loss_of(cb):
        d = w - VQQuantized(vq.index, cb, vq.dim, vq.rows_per_group, vq.cols_per_group).dequantize()
        return ((d @ H) * d).sum()

    with torch.no_grad():
        start = loss_of(vq.codebooks)
    for _ in range(6):
        cb = vq.codebooks.clone().requires_grad_(True)
        m, v, ok = torch.zeros_like(cb), torch.zeros_like(cb), True
        for t in range(1, steps + 1):
            loss = loss_of(cb)
            if not torch.isfinite(loss) or loss > start:
                ok = False
                break
            g, = torch.autograd.grad(loss, cb)
            with torch.no_grad():
                m.mul_(betas[0]).add_((1 - betas[0]) * g)
                v.mul_(betas[1]).add_((1 - betas[1]) * g * g)
                cb -= lr * (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps)
        with torch.no_grad():
            if ok and loss_of(cb) <= start:
                return VQQuantized(vq.index, cb.detach(), vq.dim, vq.rows_per_group,
                                   vq.cols_per_group, vq.codebook_bits)
        lr /= 10
    return vq


def gptvq(w: torch.Tensor, H: torch.Tensor, bits: int, dim: int = 2, rows_per_group: int = 32,
          cols_per_group: int = 128, blocksize: int = 128, percdamp: float = 0.01,
          kmeans_iters: int = 100, m_steps: int = 25, m_lr: float = 1e-3,
          codebook_bits: int = 16) -> VQQuantized:
    """GPTVQ (van Baalen et al. 2024, Algorithm 1) of one (out, in) weight given
    ``H = 2/N X X^T``: ``bits`` index bits per weight, vectors of ``dim`` consecutive inputs,
    one codebook of ``2**(bits dim)`` entries per ``rows_per_group x cols_per_group`` block
    (see the module docstring for each step and its reference)."""
    W = w.detach().clone().float()
    rows, cols = W.shape
    if cols % cols_per_group or rows % rows_per_group or cols_per_group % dim \
            or blocksize % dim or cols_per_group % blocksize and blocksize % cols_per_group:
        raise ValueError("rows, columns, codebook blocks, blocksize and dim do not nest")
    k = 2 ** (bits * dim)
    G0 = H.detach().float()
    Hd = H.detach().clone().double()
    dead = torch.diag(Hd) == 0
    Hd[dead, dead] = 1
    W[:, dead] = 0
    U = inverse_cholesky(Hd, percdamp).float()
    ud = torch.diag(U)
    G = rows // rows_per_group
    index = torch.zeros(rows, cols // dim, dtype=torch.long, device=W.device)
    books = torch.zeros(G, cols // cols_per_group, k, dim, device=W.device)
    Q = torch.zeros_like(W)
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1, Err1, U1 = W[:, i1:i2].clone(), torch.zeros(rows, i2 - i1, device=W.device), U[i1:i2, i1:i2]
        for i in range(0, i2 - i1, dim):
            col = i1 + i
            if col % cols_per_group == 0:                    # a new codebook block: fit on W now
                c2 = col + cols_per_group
                pts = W[:, col:c2].reshape(G, -1, dim)
                wt = (1 / ud[col:c2] ** 2).reshape(-1, dim).repeat(rows_per_group, 1)
                books[:, col // cols_per_group] = weighted_kmeans(
                    pts, mahalanobis_init(pts, k), wt, kmeans_iters)
            cb = books[:, col // cols_per_group]
            x = W1[:, i:i + dim].reshape(G, -1, dim)
            a = assign(x, cb, 1 / ud[col:col + dim] ** 2)                # (G, rows_per_group)
            q = torch.gather(cb, 1, a.unsqueeze(-1).expand(-1, -1, dim)).reshape(rows, dim)
            index[:, col // dim] = a.reshape(rows)
            Q[:, col:col + dim] = q
            err = (W1[:, i:i + dim] - q) / ud[col:col + dim]
            W1[:, i + dim:] -= err @ U1[i:i + dim, i + dim:]
            Err1[:, i:i + dim] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]                   # lazy batch update
    vq = VQQuantized(index, books, dim, rows_per_group, cols_per_group, codebook_bits)
    if m_steps > 0:
        vq = _m_step(w.detach().float(), G0, vq, m_steps, m_lr)
    if codebook_bits == 16:                                  # stored as fp16
        vq = VQQuantized(vq.index, vq.codebooks.half().float(), dim, rows_per_group,
                         cols_per_group, codebook_bits)
    return vq
