"""GSQ: Gumbel-Softmax scalar quantization (paper 14, ``papers/14-gsq.md``).

Post-training scalar quantization that *learns* which grid level each weight takes. A weight
row is stored on a symmetric, group-wise scalar grid, ``w_hat_i = s_{g(i)} * l_{c_i}`` with levels
``l in {-2^(b-1), ..., 2^(b-1) - 1}`` (4 levels at 2 bits, 8 at 3 bits; 3 for ternary) and one
scale ``s_g`` per group of ``g`` inputs. RTN picks ``c_i`` by rounding, GPTQ by rounding with
error feedback; GSQ relaxes the discrete choice with a Gumbel-Softmax over the ``K`` levels,

    p_{ik} = softmax_k((z_{ik} + lambda_t G_{ik}) / tau_t),    G ~ Gumbel(0, 1)        (1)
    w_tilde_i = s_{g(i)} * sum_k p_{ik} l_k                                           (2)

and minimizes the layer-wise reconstruction error on calibration activations,

    L(z, s) = tr((W_tilde - W) H (W_tilde - W)^T) / tr(W H W^T),   H = 2/N X X^T      (3)

jointly over the logits ``z`` (one per weight and level: the relaxation's cardinality equals the
number of grid levels) and the per-group scales ``s``, while the temperature ``tau_t`` and the
noise ``lambda_t`` anneal to zero. Then each weight takes its argmax level (exactly on the grid)
and the scales are re-solved in closed form for those assignments (a ``G x G`` least squares per
row, eq. 4 in :func:`optimal_scales`). The result is a plain ``Quantized`` (integer codes, scales,
zero point) that any scalar kernel, or a GGUF Q4_0 file, can hold.

Layer problems of equal shape (e.g. the query/key/value of every block) are solved as one
batch. Inputs come from the full-precision model (layer-wise, not sequential).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from ..quant import Quantized, block_linears, expand_groups, gptq, levels, rtn

__all__ = ["GSQConfig", "temperature", "relaxed_step", "optimal_scales", "gsq", "by_shape",
           "quantize_model"]


@dataclass
class GSQConfig:
    """Optimization settings of GSQ (same algorithm at every scale)."""
    steps: int = 200            # relaxed optimization steps per layer (batch)
    lr: float = 0.05            # Adam learning rate on the logits z (decays linearly to 0)
    scale_lr: float = 0.01      # Adam learning rate on the log-scales
    tau_start: float = 1.0      # Gumbel-Softmax temperature at the first step
    tau_end: float = 0.02       # ... at the last step (geometric schedule)
    noise: float = 0.5          # Gumbel noise multiplier lambda at the first step (-> 0 linearly)
    init_margin: float = 3.0    # logit bonus of the initial (GPTQ/RTN) level
    percdamp: float = 0.01      # H + percdamp * mean(diag H) I, as GPTQ (calibration noise)
    solve_scales: bool = True   # closed-form scales for the final hard assignment (eq. 4)


def temperature(step: int, cfg: GSQConfig) -> float:
    """Geometric annealing ``tau_t = tau_start (tau_end / tau_start)^(t / (T - 1))``."""
    frac = step / max(cfg.steps - 1, 1)
    return cfg.tau_start * (cfg.tau_end / cfg.tau_start) ** frac


def relaxed_step(z, rho, s0, w, H, grid, tau: float, norm, gumbel=None):
    """Eq. (3) at the relaxed weights of eqs. (1)-(2), and its gradients in closed form.

    ``z`` (K, B, out, in) logits (K first: a softmax over a leading dim is fast), ``rho``
    (B, out, G) log-scale offsets (``s = s0 exp(rho)``), ``gumbel`` an optional Gumbel(0, 1) draw
    already multiplied by lambda. Returns ``(loss (B,), dL/dz, dL/drho)``. Written out rather than
    autograd: on a CPU it is several times faster over the (K, B, out, in) logits, and a test
    checks it against autograd.
    """
    B, O, I = w.shape
    g = I // rho.shape[-1]
    zz = (z if gumbel is None else z + gumbel) / tau
    p = torch.softmax(zz, dim=0)                                       # eq. (1)
    del zz
    E = torch.tensordot(grid, p, dims=1)                               # expected level
    s_full = expand_groups(s0 * rho.exp(), g, I)
    d = s_full * E - w                                                 # eq. (2) minus W
    dH = torch.bmm(d, H)
    loss = (dH * d).sum((1, 2)) / norm.view(B)                         # eq. (3), per layer
    gws = 2 * dH / norm * s_full                                       # dL/dW_tilde * s
    grho = (gws * E).view(B, O, I // g, g).sum(-1)                     # dL / d rho
    gz = p.mul_(grid.view(-1, 1, 1, 1) - E).mul_(gws / tau)            # softmax Jacobian
    return loss, gz, grho


def optimal_scales(w, H, lv, group_size: int, ridge: float = 1e-8):
    """Per-group scales minimizing eq. (3) for fixed levels ``lv`` (batched over leading dims).

    Row ``o``'s weight is ``A_o s_o`` with ``A_o`` (in x G) holding the levels of group ``g`` in
    column ``g``; the error ``(A s - w)^T H (A s - w)`` is minimized by

        (A^T H A) s = A^T H w.                                                         (4)
    """
    B, O, I = lv.shape
    G = I // group_size
    Hg = H.view(B, I, G, group_size)
    L = lv.view(B, O, G, group_size)
    Q = torch.einsum("bihj,bohj->boih", Hg, L)                    # H A per row: (B, O, I, G)
    M = torch.einsum("bogi,bogih->bogh", L, Q.view(B, O, G, group_size, G))   # A^T H A
    rhs = torch.einsum("bogi,bogi->bog", L, (w @ H).view(B, O, G, group_size))  # A^T H w
    M = M + ridge * torch.diagonal(M, dim1=-2, dim2=-1).mean(-1, keepdim=True)[..., None] * \
        torch.eye(G, device=M.device)
    return torch.linalg.solve(M.double(), rhs.double().unsqueeze(-1)).squeeze(-1).float()


def gsq(w: torch.Tensor, H: torch.Tensor, init: Quantized, cfg: GSQConfig | None = None,
        generator: torch.Generator | None = None, grid: torch.Tensor | None = None):
    """GSQ of a batch of same-shape weights ``w`` (B, out, in) with Hessians ``H`` (B, in, in).

    ``init`` holds the starting codes and scales (from RTN, GPTQ or a GGUF file), batched the
    same way (codes (B, out, in), scale/zero (B, out, G)); the grid is ``codes - zero`` of a
    symmetric grid unless ``grid`` (the K level values) is given. Returns ``(levels_index,
    scale, history)``: the chosen level index in ``0..K-1`` per weight, the final scales, and
    per-step loss, temperature and assignment flips.

    The gradients of eq. (3) come from :func:`relaxed_step`; ``torch.optim.Adam`` steps the
    logits and the log-scales, with learning rates decaying linearly to 0.
    """
    cfg = cfg or GSQConfig()
    B, O, I = w.shape
    g = init.group_size
    grid = (levels(init.bits).float() if grid is None else grid).to(w.device)
    K = len(grid)
    if cfg.percdamp > 0:                     # the damping GPTQ applies to the same H
        diag = torch.diagonal(H, dim1=-2, dim2=-1)
        H = H + cfg.percdamp * diag.mean(-1).view(B, 1, 1) * torch.eye(I, device=H.device)
    lv0 = init.codes.long() - expand_groups(init.zero, g, I).long()    # signed levels
    idx0 = lv0 - int(grid[0])                                          # index into grid
    s0 = init.scale.float().clone()
    # initial logits: a bonus for the starting level plus a distance prior -(w/s - l_k)^2
    z = -(w / expand_groups(s0, g, I) - grid.view(K, 1, 1, 1)) ** 2
    z.scatter_add_(0, idx0.unsqueeze(0),
                   torch.full((1, B, O, I), cfg.init_margin, device=w.device))
    rho = torch.zeros_like(s0)                                         # s = s0 * exp(rho)
    opt = torch.optim.Adam([{"params": [z], "lr": cfg.lr},
                            {"params": [rho], "lr": cfg.scale_lr}], betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 - t / cfg.steps)
    norm = torch.einsum("boi,bij,boj->b", w, H, w).clamp(min=1e-12).view(B, 1, 1)
    hist = {"loss": [], "tau": [], "flips": []}
    prev = idx0.clone()
    half = max(cfg.steps // 2, 1)
    for t in range(cfg.steps):
        tau = temperature(t, cfg)
        lam = cfg.noise * max(0.0, 1 - t / half)                      # noise off mid-way
        gumbel = None
        if lam > 0:                       # eq. (1): + lambda Gumbel, Gumbel = -log Exp(1)
            gumbel = torch.empty_like(z).exponential_(generator=generator).clamp_(min=1e-20)
            gumbel = gumbel.log_().mul_(-lam)
        loss, z.grad, rho.grad = relaxed_step(z, rho, s0, w, H, grid, tau, norm, gumbel)
        opt.step()
        sched.step()
        cur = z.argmax(0)
        hist["flips"].append(int((cur != prev).sum()))
        prev = cur
        hist["loss"].append(float(loss.mean()))
        hist["tau"].append(tau)
    idx = z.argmax(0)
    scale = s0 * rho.exp()
    if cfg.solve_scales:
        solved = optimal_scales(w, H, grid[idx], g)
        ok = torch.isfinite(solved) & (solved * s0 > 0)        # keep the sign, never zero
        scale = torch.where(ok, solved, scale)
    return idx, scale, hist


# -- whole-model drivers ----------------------------------------------------------------------

def by_shape(layers: dict[str, nn.Linear]) -> dict[tuple, list[str]]:
    """Layer names grouped by weight shape, so equal shapes are solved as one batch."""
    out: dict[tuple, list[str]] = {}
    for n, m in layers.items():
        out.setdefault(tuple(m.weight.shape), []).append(n)
    return out


def quantize_model(model, hessians: dict, method: str, bits: int, group_size: int,
                   cfg: GSQConfig | None = None, seed: int = 0, init: dict | None = None,
                   grid: torch.Tensor | None = None):
    """Quantize every block linear of ``model`` with ``method`` in {rtn, gptq, gsq}.

    Returns ``(weights, info)``: name -> dequantized weight, and per-layer details (the
    ``Quantized`` result, reconstruction error before/after, GSQ history and seconds). GSQ
    starts from GPTQ unless ``init`` (name -> Quantized, e.g. a GGUF file's) is given.
    """
    layers = block_linears(model)
    weights, info = {}, {}
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    gvals = (levels(bits).float() if grid is None else grid).to(dev)   # the K level values
    for shape, names in by_shape(layers).items():
        W = torch.stack([layers[n].weight.detach().float() for n in names])
        Hs = torch.stack([hessians[n] for n in names])
        t0 = time.time()
        if method in ("rtn", "gptq") or (method == "gsq" and init is None):
            starts = {n: (rtn(layers[n].weight.detach(), bits, group_size) if method == "rtn"
                          else gptq(layers[n].weight.detach(), hessians[n], bits, group_size))
                      for n in names}
        else:
            starts = {n: init[n] for n in names}
        t_init = time.time() - t0
        if method != "gsq":
            for n in names:
                q = starts[n]
                weights[n] = q.dequantize()
                info[n] = {"q": q, "seconds": t_init / len(names)}
            continue
        batch = Quantized(torch.stack([starts[n].codes for n in names]),
                          torch.stack([starts[n].scale for n in names]),
                          torch.stack([starts[n].zero for n in names]), bits, group_size)
        t1 = time.time()
        idx, scale, hist = gsq(W, Hs, batch, cfg, gen, gvals)
        secs = time.time() - t1
        for j, n in enumerate(names):
            lv = gvals[idx[j]].round().long()
            zero = starts[n].zero
            codes = (lv + expand_groups(zero, group_size, lv.shape[1]).long()).to(torch.int16)
            q = Quantized(codes, scale[j], zero, bits, group_size)
            weights[n] = q.dequantize()
            info[n] = {"q": q, "levels": lv, "seconds": secs / len(names), "hist": hist,
                       "batch": len(names), "init": starts[n]}
    return weights, info
