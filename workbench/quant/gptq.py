"""GPTQ (Frantar et al. 2023, Algorithm 1), following the reference ``IST-DASLab/gptq``
``gptq.py`` (``GPTQ.fasterquant``), and the input Hessians it needs."""
from __future__ import annotations


import torch
from torch import nn

from .grid import Quantized, rtn_params

__all__ = ["gptq", "inverse_cholesky", "HessianCollector", "collect_hessians", "run_batches", "output_error"]

# -- GPTQ -------------------------------------------------------------------------------------

def inverse_cholesky(H: torch.Tensor, percdamp: float) -> torch.Tensor:
    """The upper Cholesky factor of ``(H + percdamp * mean(diag H) * I)^-1``, which GPTQ's (and
    GPTVQ's) column sweep divides errors by and feeds them forward with."""
    damped = H + percdamp * torch.mean(torch.diag(H)) * torch.eye(H.shape[0], dtype=H.dtype,
                                                                   device=H.device)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True)


def gptq(w: torch.Tensor, H: torch.Tensor, bits: int, group_size: int = 128, sym: bool = True,
         blocksize: int = 128, percdamp: float = 0.01, actorder: bool = False,
         static_groups: bool = False) -> Quantized:
    """GPTQ (Frantar et al. 2023, Algorithm 1) of one (out, in) weight given ``H = 2/N X X^T``,
    as ``GPTQ.fasterquant`` of the reference ``IST-DASLab/gptq`` (``gptq.py``) does it.

    Columns are quantized one at a time; the error of column ``i``, divided by ``[H^-1]_ii``
    (the Cholesky factor's diagonal), is spread over the not-yet-quantized columns through row
    ``i`` of the upper Cholesky factor of ``H^-1`` (eq. 3 with the Cholesky reformulation of
    Sec. 3.3). Inside a block of ``blocksize`` columns the updates are immediate; the columns
    after the block are updated once per block (lazy batch updates). Dead inputs (zero
    ``H_ii``) are zeroed; damping adds ``percdamp * mean(diag H)``.

    Groups, as the reference fits them:

    - no groups (``group_size <= 0``): one quantizer per row, fitted on the whole weight
      before dead inputs are zeroed (the reference's ``find_params(W)`` comes first);
    - groups, by default: the quantizer (scale, zero) of a group is fitted when its first column comes up,
      on the weights *as they stand at the start of the current block*, that is after the lazy
      updates of earlier blocks but before the in-block updates (the reference calls
      ``find_params(W[:, i:i + groupsize])`` on the outer ``W``, not on the block copy ``W1``
      that the in-block updates change). A group that starts at column ``c`` of a block
      starting at ``i1`` is thus fitted on ``W[:, c:c + g]`` including the errors of blocks
      before ``i1`` but none of those of columns ``i1 .. c - 1`` (with ``g >= blocksize`` the
      group starts at a block start and the two readings coincide);
    - ``actorder``: columns are processed by decreasing ``H_ii``; groups are runs of
      ``group_size`` consecutive columns *in that order*, so a group's columns are scattered in
      the original layout: the result carries ``g_idx`` (each column's group);
    - ``static_groups``: every group's quantizer is fitted once, on the original weight (dead
      inputs zeroed) before the sweep, in the original column layout; with ``actorder`` a column
      still uses the group of its original index.

    With ``H = I`` it is exactly RTN.
    """
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    W = w.detach().clone().to(dtype)
    rows, cols = W.shape
    H = H.detach().clone().double()
    g = cols if group_size <= 0 else group_size
    if cols % g:
        raise ValueError(f"in-features {cols} is not a multiple of group_size {g}")
    static_groups = static_groups and group_size > 0    # one group per row: nothing to fix
    if group_size <= 0:                             # one quantizer per row, fitted (as the
        s_row, z_row = rtn_params(W, bits, -1, sym)   # reference does) before dead inputs
        s_row, z_row = s_row.to(dtype), z_row.to(dtype)   # are zeroed
    dead = torch.diag(H) == 0                       # inputs that never fire
    H[dead, dead] = 1
    W[:, dead] = 0
    if static_groups:                               # fitted before any column moves
        s_static, z_static = rtn_params(W, bits, g, sym)
        s_static, z_static = s_static.to(dtype), z_static.to(dtype)
    perm = torch.arange(cols, device=W.device)
    if actorder:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    Hinv = inverse_cholesky(H, percdamp).to(dtype)
    dev = W.device
    codes = torch.zeros(rows, cols, dtype=torch.int16, device=dev)   # in processing order
    scales = torch.zeros(rows, cols // g, dtype=dtype, device=dev)   # by group, processing order
    zeros = torch.zeros(rows, cols // g, dtype=dtype, device=dev)
    scale = zero = None
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1, Err1 = W[:, i1:i2].clone(), torch.zeros(rows, i2 - i1, dtype=dtype, device=dev)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if group_size <= 0:
                if col == 0:
                    scale, zero = s_row[:, 0], z_row[:, 0]
                    scales[:, 0], zeros[:, 0] = scale, zero
            elif static_groups:
                grp = int(perm[col]) // g
                scale, zero = s_static[:, grp], z_static[:, grp]
            elif col % g == 0:                      # fit on W (block start), not on W1
                s, z = rtn_params(W[:, col:col + g], bits, -1, sym)
                scale, zero = s[:, 0].to(dtype), z[:, 0].to(dtype)
                scales[:, col // g], zeros[:, col // g] = scale, zero
            w_col = W1[:, i]
            c = torch.clamp(torch.round(w_col / scale) + zero, 0, 2 ** bits - 1)
            q_col = scale * (c - zero)
            codes[:, col] = c.to(torch.int16)
            err = (w_col - q_col) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]        # lazy batch update of later columns
    invperm = torch.argsort(perm)
    codes = codes[:, invperm]
    if static_groups:
        return Quantized(codes, s_static.float(), z_static.float(), bits, group_size)
    if actorder and g < cols:
        g_idx = invperm // g                        # column j sat at position invperm[j]
        return Quantized(codes, scales.float(), zeros.float(), bits, group_size, g_idx=g_idx)
    return Quantized(codes, scales.float(), zeros.float(), bits, group_size)


class HessianCollector:
    """Accumulates ``H = 2/N sum_x x x^T`` of the inputs of chosen linear layers via hooks."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.H = {n: None for n in modules}
        self.n = {n: 0 for n in modules}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name):
        def hook(mod, inputs, output):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
            if self.H[name] is None:
                self.H[name] = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64,
                                           device=x.device)
            self.H[name] += 2 * x.T @ x
            self.n[name] += x.shape[0]
        return hook

    def hessians(self) -> dict[str, torch.Tensor]:
        return {n: (h / max(self.n[n], 1)).float() for n, h in self.H.items()}

    def remove(self):
        for h in self.handles:
            h.remove()


def run_batches(model: nn.Module, batches, batch_size: int = 16) -> None:
    """Forward ``batches`` (B, T) of token ids through ``model`` without gradients, ``batch_size``
    rows at a time, on the model's device (for hooks that collect calibration statistics)."""
    with torch.no_grad():
        dev = next(model.parameters()).device
        for i in range(0, len(batches), batch_size):
            model(input_ids=batches[i: i + batch_size].to(dev))


def collect_hessians(model: nn.Module, modules: dict[str, nn.Module], batches,
                     batch_size: int = 16) -> dict[str, torch.Tensor]:
    """Run ``batches`` (B, T) through ``model`` and return each module's input Hessian."""
    col = HessianCollector(modules)
    try:
        run_batches(model, batches, batch_size)
    finally:
        col.remove()
    return col.hessians()


def output_error(w: torch.Tensor, wq: torch.Tensor, H: torch.Tensor) -> float:
    """Layer-wise reconstruction error ``tr((Wq - W) H (Wq - W)^T)`` (= 2/N ||(Wq - W) X||^2)."""
    d = (wq - w).double()
    return float(torch.einsum("oi,ij,oj->", d, H.double(), d))
