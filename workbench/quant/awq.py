"""AWQ: activation-aware weight quantization (Lin et al. 2024, "AWQ: Activation-aware Weight
Quantization for On-Device LLM Compression and Acceleration", MLSys 2024; reference code
``mit-han-lab/llm-awq``, ``awq/quantize/auto_scale.py``).

Before round-to-nearest, every input channel ``j`` of a weight is scaled by
``s_j = mean|x_j|^alpha`` (the channel's mean absolute calibration activation, ``get_act_scale``),
normalized as the reference does, ``s / sqrt(max s * min s)``; the weight ``W diag(s)`` is
quantized with group-wise RTN and ``diag(s)^-1`` is folded into the input side, so the layer
computes ``Q(W diag(s)) diag(s)^-1 x``. ``alpha`` is searched on the grid ``0, 1/n, ...,
(n-1)/n`` (``n_grid = 20``) for the smallest output error on the calibration activations,
``tr(dW H dW^T)`` with ``H = 2/N X X^T`` (= the mean squared output error up to a constant).
Salient channels (large ``|x|``) get larger scales and so finer effective steps.

Departures, named: the search is per linear on its own output (the reference scales the linears
that share an input together, on the output of the module that holds them, and folds ``1/s`` into
the preceding norm or linear; here the dequantized weight ``Q(W s) / s`` carries it, which
computes the same); AWQ's second stage, the weight-clipping search (``auto_clip``), is left out.
With ``alpha = 0`` the scales are all 1 and AWQ is RTN.
"""
from __future__ import annotations

import torch

from .gptq import output_error, run_batches
from .grid import rtn

__all__ = ["N_GRID", "awq_scales", "awq_weight", "awq", "mean_abs_inputs"]

N_GRID = 20                     # auto_scale.py: n_grid


def awq_scales(act_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s = act_mean^alpha`` (clamped at 1e-4), divided by ``sqrt(max s * min s)``."""
    s = act_mean.float().pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def awq_weight(w: torch.Tensor, s: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """``Q(W diag(s)) diag(s)^-1``: the weight the scaled, RTN-quantized layer computes with."""
    return rtn(w.float() * s, bits, group_size).dequantize() / s


def awq(w: torch.Tensor, H: torch.Tensor, act_mean: torch.Tensor, bits: int,
        group_size: int = 128, n_grid: int = N_GRID) -> tuple[torch.Tensor, dict]:
    """AWQ's scale search on one (out, in) weight: ``(dequantized weight, {"alpha", "scales",
    "errors"})``, ``errors`` the output error at each grid alpha."""
    w, Hd = w.detach().float(), H.detach().double()
    errors, best = {}, None
    for i in range(n_grid):
        alpha = i / n_grid
        errors[alpha] = output_error(w, awq_weight(w, awq_scales(act_mean, alpha), bits,
                                                   group_size), Hd)
        if best is None or errors[alpha] < errors[best]:
            best = alpha
    s = awq_scales(act_mean, best)
    return awq_weight(w, s, bits, group_size), {"alpha": best, "scales": s, "errors": errors}


def mean_abs_inputs(model: torch.nn.Module, modules: dict, batches,
                    batch_size: int = 16) -> dict[str, torch.Tensor]:
    """Each module's mean absolute input per channel over ``batches`` (B, T) of token ids."""
    sums = {n: 0.0 for n in modules}
    counts = {n: 0 for n in modules}

    def hook(name):
        def fn(mod, inputs, output):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).abs().double()
            sums[name] = sums[name] + x.sum(0)
            counts[name] += x.shape[0]
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in modules.items()]
    try:
        run_batches(model, batches, batch_size)
    finally:
        for h in handles:
            h.remove()
    return {n: (sums[n] / max(counts[n], 1)).float() for n in modules}
