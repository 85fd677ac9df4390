"""GSQ: Gumbel-Softmax scalar quantization (paper 14, ``docs/papers/14-gsq.md``), as the official code
IST-DASLab/GSQ defines it.

Post-training scalar quantization that *learns* which grid level each weight takes. A weight is
stored on a symmetric, group-wise scalar grid, ``w_hat_i = s_{g(i)} * l_i`` with integer levels
``l in {-2^(b-1), ..., 2^(b-1) - 1}`` and one scale ``s_g`` per group of ``g`` inputs. GSQ starts
from GPTQ's levels and relaxes the choice among a few *candidates* per weight,

    p_ik = softmax_k((lambda_t z_ik + G_ik) / tau_t),   G ~ Gumbel(0, 1),               (1)
    w_tilde_i = s_{g(i)} * sum_k p_ik c_ik,                                            (2)

where the candidates ``c_ik`` are the four 2-bit levels {-2, -1, 0, 1}
(``gumbel_quantizer_2bit.py``, ``GumbelQuantizer2Bit``) or, at 3 bits and more, the starting
level plus the five shifts {-2, ..., 2}, those that stay on the grid
(``gumbel_quantizer_int.py``, ``GumbelQuantizerInt``: ``shift_values``, ``valid_shift_mask``).
``lambda_t`` is the logit scale (100 -> 500) and ``tau_t`` the temperature (2 -> 0.05), both
linear over the steps (``trainer.py``, ``QuantizationTrainer.train_layer``), and the Gumbel noise
stays on throughout. Those endpoints are the ones README.md documents and every production
config uses (``configs/kimi-k2.5/*``, ``qwen3/*``, ``qwen35/*``, ``local/config.yaml``);
``configs/config_smoke.yaml`` has 2 -> 0.5 and 10 -> 50 for a two-step pipeline check
(16 samples, batch 8, one epoch), kept here as :data:`SMOKE_SCHEDULE`: under it the relaxation
never hardens (``(50 z + G) / 0.5`` still samples among the candidates). The objective is the
mean squared error of a whole sub-block's output, the attention part or the MLP part of a
decoder layer, against the full-precision sub-block on the same inputs,

    L(z, s) = mean((f(X; W_tilde) - f(X; W))^2),                                       (3)

(``models/base.py``, ``calculate_mse`` / ``forward_with_quantized``; ``models/llama.py``,
``get_mlp_input`` / ``get_mlp_output``), minimized by Lion (Chen et al. 2023, "Symbolic Discovery
of Optimization Algorithms", Alg. 2) with the config's learning rates (logits 2e-4 with weight
decay 1.0, scales 1e-4 without) under ``trainer.py``'s ``CustomLRScheduler`` (cosine to 0.1 of
the peak). Then each weight takes its argmax candidate: exactly on the grid, with the learned
scales. Blocks are done in order, each on the outputs of the blocks already quantized
(``main.py``, ``train_all_layers``: ``get_layer_activations`` after every layer).

Departures, named: logits are float32 (the reference keeps them in bfloat16); the attention
sub-block learns q, k, v and o jointly (the reference freezes q_proj and k_proj after a
per-linear GSQ inside GPTQ, ``prior/gptq.py`` ``fasterquant``, and by default leaves attention
unquantized, ``self_attn: false``); the GPTQ start is the layer-wise GPTQ of the full-precision
model (the reference runs GPTQ on the quantized prefix's activations). That start is the
reference's own GPTQ (:func:`gptq_start`): each group's scale searched for the lowest rounding
error with its sign free, damping 0.1. :func:`optimal_scales`,
a closed-form scale re-solve, is ours and not the paper's: notebook 14 uses it only as an
ablation row.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from ..quant import Quantized, expand_groups
from ..quant.gptq import inverse_cholesky

__all__ = ["GSQConfig", "SMOKE_SCHEDULE", "SHIFTS", "LEVELS_2BIT", "START_PERCDAMP",
           "search_scale", "gptq_start", "candidates", "init_logits",
           "schedule", "lr_factor", "Lion", "GumbelQuantizer", "block_mse", "train_subblock",
           "optimal_scales", "layer_inputs", "quantize_model"]

SHIFTS = (-2.0, -1.0, 0.0, 1.0, 2.0)    # gumbel_quantizer_int.py: shift_values (3 bits and more)
LEVELS_2BIT = (-2.0, -1.0, 0.0, 1.0)    # gumbel_quantizer_2bit.py: values


@dataclass
class GSQConfig:
    """GSQ's settings, the reference's where it has one (README.md's table, the production
    configs, ``configs/local/verify_llama32_1b.yaml`` for lr1/lr2, ``src/config.py``)."""
    steps: int = 100                     # Lion steps per sub-block (samples / batch x epochs)
    batch: int = 8                       # calibration sequences per step (data.batch_size)
    lr_logits: float = 2e-4              # training.lr1 (masks_lr in config_smoke.yaml)
    lr_scales: float = 1e-4              # training.lr2 (scales_lr)
    weight_decay: float = 1.0            # decoupled, on the logits only (scales: 0)
    betas: tuple = (0.9, 0.95)           # training.lion_betas
    min_lr: float = 0.1                  # training.scheduler_min_lr (cosine decay)
    temperature: tuple = (2.0, 0.05)     # quantization.temperature, linear over the steps
    logit_scale: tuple = (100.0, 500.0)  # quantization.scale, linear over the steps
    std: float = 0.01                    # quantization.std: logits' initial magnitude
    strength: float = 6.0                # quantization.strength: weight of the distance prior


# configs/config_smoke.yaml's endpoints (a pipeline check of two steps), as GSQConfig overrides
SMOKE_SCHEDULE = {"temperature": (2.0, 0.5), "logit_scale": (10.0, 50.0)}

# gptq.percdamp of every shipped config (configs/**/*.yaml); src/config.py's default 0.01 is
# overridden by all of them
START_PERCDAMP = 0.1


def search_scale(wg: torch.Tensor, bits: int, norm: float = 2.4, grid: int = 100,
                 maxshrink: float = 0.8) -> torch.Tensor:
    """The symmetric scale of each row of ``wg`` (rows, g) as the reference's GPTQ start fits a
    group (``src/prior/quant.py``, ``Quantizer.find_params`` with ``mse=True``, which
    ``src/models/base.py`` sets): starting from the absmax scale ``2 max|w| / (2^b - 1)``, try
    the shrunk scales ``p`` times it for ``p = 1, 0.99, ..., 1 - (grid maxshrink - 1) / grid``,
    each with both signs, and keep the one with the lowest ``sum |round-to-grid(w) - w|^norm``
    (the first on ties, the positive sign unless the negative is strictly lower). A negative
    scale mirrors the asymmetric grid ``-2^(b-1) .. 2^(b-1) - 1``, so a group whose largest
    weights are positive gets the extra level on their side."""
    maxq = 2 ** bits - 1
    zero = (maxq + 1) / 2
    x = wg.float()
    xmin = x.amin(1).clamp(max=0)
    xmax = x.amax(1).clamp(min=0)
    xmax = torch.maximum(xmin.abs(), xmax)
    xmin = torch.where(xmin < 0, -xmax, xmin)
    dead = (xmin == 0) & (xmax == 0)
    xmin, xmax = torch.where(dead, -1.0, xmin), torch.where(dead, 1.0, xmax)
    best = torch.full_like(xmax, float("inf"))
    scale = (xmax - xmin) / maxq
    for i in range(int(maxshrink * grid)):      # a loop: the (rows, g) tensors stay in cache
        p = 1 - i / grid
        s1 = (p * xmax - p * xmin) / maxq
        errs = []
        for s in (s1, -s1):
            c = torch.clamp(torch.round(x / s[:, None]) + zero, 0, maxq)
            errs.append((s[:, None] * (c - zero) - x).abs().pow(norm).sum(1))
        neg = errs[1] < errs[0]                     # the negative sign only if strictly better
        err, chosen = torch.where(neg, errs[1], errs[0]), torch.where(neg, -s1, s1)
        better = err < best                         # strict: the first shrink wins a tie
        best, scale = torch.where(better, err, best), torch.where(better, chosen, scale)
    return scale


def gptq_start(w: torch.Tensor, H: torch.Tensor, bits: int, group_size: int = 128,
               percdamp: float = START_PERCDAMP, blocksize: int = 128) -> Quantized:
    """GSQ's start as the reference computes it (``src/prior/gptq.py``, ``GPTQ.fasterquant``,
    called by ``src/models/base.py`` ``get_layer_initialization``): GPTQ (Frantar et al. 2023)
    with lazy blocks, symmetric groups whose scale comes from :func:`search_scale` on the
    weights as they stand at the start of the current block (``find_params`` on the outer
    ``W``), and damping ``percdamp * mean(diag H)`` (0.1 in every config). The rest is
    :func:`workbench.quant.gptq`'s sweep: dead inputs zeroed, each column's error divided by
    the Cholesky factor's diagonal and fed forward."""
    W = w.detach().clone().float()
    rows, cols = W.shape
    if cols % group_size:
        raise ValueError(f"in-features {cols} is not a multiple of group_size {group_size}")
    H = H.detach().clone().double()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    Hinv = inverse_cholesky(H, percdamp).float()
    maxq, zero = 2 ** bits - 1, 2.0 ** (bits - 1)
    codes = torch.zeros(rows, cols, dtype=torch.int16, device=W.device)
    scales = torch.zeros(rows, cols // group_size, device=W.device)
    scale = None
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1, Err1 = W[:, i1:i2].clone(), torch.zeros(rows, i2 - i1, device=W.device)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:               # fit on W (block start), not on W1
                scale = search_scale(W[:, col:col + group_size], bits)
                scales[:, col // group_size] = scale
            c = torch.clamp(torch.round(W1[:, i] / scale) + zero, 0, maxq)
            codes[:, col] = c.to(torch.int16)
            err = (W1[:, i] - scale * (c - zero)) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]        # lazy batch update of later columns
    return Quantized(codes, scales, torch.full_like(scales, zero), bits, group_size)


def candidates(level0: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate levels ``c`` (K, *level0.shape) of each weight and which lie on the grid.

    2 bits: the four levels {-2, -1, 0, 1}, all valid (``GumbelQuantizer2Bit``). 3 bits and
    more: ``level0 + {-2, ..., 2}``, valid where inside ``[-2^(b-1), 2^(b-1) - 1]``
    (``GumbelQuantizerInt``: ``cand``, ``valid_shift_mask``)."""
    lv = level0.float()
    if bits == 2:
        vals = torch.tensor(LEVELS_2BIT, device=lv.device).view(-1, *[1] * lv.dim())
        cand = vals.expand(-1, *lv.shape).clone()
        return cand, torch.ones_like(cand, dtype=torch.bool)
    shifts = torch.tensor(SHIFTS, device=lv.device).view(-1, *[1] * lv.dim())
    cand = lv.unsqueeze(0) + shifts
    return cand, (cand >= -(2 ** (bits - 1))) & (cand <= 2 ** (bits - 1) - 1)


def init_logits(level0, cand, valid, std: float, strength: float, generator=None):
    """The reference's initial logits ``std * (N(0, 1) + strength * (d - mean_valid d))`` with
    the distance prior ``d_k = -(c_k - level0)^2 / 2`` (``GumbelQuantizer2Bit.__init__``,
    ``GumbelQuantizerInt.__init__``: at 2 bits the mean is over all four levels, at 3 bits and
    more over the valid shifts)."""
    d = -0.5 * (cand - level0.float().unsqueeze(0)) ** 2
    v = valid.float()
    d = d - (d * v).sum(0, keepdim=True) / v.sum(0, keepdim=True)
    noise = torch.randn(cand.shape, generator=generator, device=cand.device)
    return std * (noise + strength * d)


def schedule(step: int, steps: int, start: float, end: float) -> float:
    """Linear from ``start`` at step 0 to ``end`` at the last step, as ``train_layer`` sets the
    temperature and the logit scale (``step / (num_training_steps - 1)``; one step: ``start``,
    where the reference would divide by zero)."""
    return start + (end - start) * step / max(steps - 1, 1)


def lr_factor(step: int, steps: int, min_lr: float) -> float:
    """``CustomLRScheduler._compute_lr`` / base lr with no warm-up and cosine decay:
    ``min + (1 - min) (1 + cos(pi t / (T - 1))) / 2``; with a single step the progress is 1, as
    the reference sets it when ``T - 1 == 0``."""
    progress = 1.0 if steps <= 1 else step / (steps - 1)
    return min_lr + 0.5 * (1 - min_lr) * (1 + math.cos(math.pi * progress))


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, Alg. 2), the update of ``lion_pytorch.Lion`` that ``trainer.py``
    imports: decoupled weight decay ``p <- p (1 - lr wd)``, then
    ``p <- p - lr sign(beta1 m + (1 - beta1) g)`` and ``m <- beta2 m + (1 - beta2) g``."""

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - lr * wd)
                p.add_(torch.lerp(p.grad, m, b1).sign_(), alpha=-lr)   # sign(b1 m + (1-b1) g)
                m.lerp_(p.grad, 1 - b2)                                 # b2 m + (1-b2) g


def _argmax0(z: torch.Tensor) -> torch.Tensor:
    """``z.argmax(0)`` (first maximum) for a few rows K: K elementwise passes, which on a CPU
    are many times faster than torch's strided reduction over a leading dim."""
    best, idx = z[0].clone(), torch.zeros(z.shape[1:], dtype=torch.long, device=z.device)
    for k in range(1, len(z)):
        better = z[k] > best
        idx.masked_fill_(better, k)
        best = torch.maximum(best, z[k])
    return idx


class _Relaxed(torch.autograd.Function):
    """Eqs. (1)-(2) with the softmax Jacobian written out, as ``GumbelSoftmaxFunction`` does
    (``gumbel_quantizer_int.py``): ``dL/dz_k = (lambda / tau) p_k (c_k - E_p c) s dL/dw`` and
    ``dL/ds_g = sum_{i in g} dL/dw_i E_p c_i``. On a CPU several times faster than autograd
    over the K x weights logits; a test checks it against autograd."""

    @staticmethod
    def forward(ctx, z, scales, cand, invalid, gumbel, group_size: int, tau: float, lam: float):
        zz = z.masked_fill(invalid, -1e9) if invalid is not None else z.clone()
        p = torch.softmax(zz.mul_(lam).add_(gumbel).div_(tau), dim=0)                # eq. (1)
        level = (p * cand).sum(0)
        s = expand_groups(scales, group_size, level.shape[-1])
        ctx.save_for_backward(p, level, s, cand)
        ctx.invalid, ctx.group_size, ctx.k = invalid, group_size, lam / tau
        return level * s                                                              # eq. (2)

    @staticmethod
    def backward(ctx, grad_w):
        p, level, s, cand = ctx.saved_tensors
        gs = grad_w * level
        grad_s = gs.view(*gs.shape[:-1], -1, ctx.group_size).sum(-1)
        gz = (cand - level).mul_(p).mul_(grad_w * s * ctx.k)
        if ctx.invalid is not None:
            gz.masked_fill_(ctx.invalid, 0.0)
        return gz, grad_s, None, None, None, None, None, None


class GumbelQuantizer(nn.Module):
    """One weight's GSQ state: candidates, logits ``z`` and per-group scales (``s``, learned),
    started from ``q`` (GPTQ's, RTN's or a GGUF file's codes and scales)."""

    def __init__(self, q: Quantized, cfg: GSQConfig, generator=None):
        super().__init__()
        self.bits, self.group_size, self.zero = q.bits, q.group_size, q.zero
        self.level0 = q.level_index
        self.cand, self.valid = candidates(self.level0, q.bits)
        self.invalid = None if self.valid.all() else ~self.valid     # None: skip the masking
        self.z = nn.Parameter(init_logits(self.level0, self.cand, self.valid, cfg.std,
                                          cfg.strength, generator))
        self.scales = nn.Parameter(q.scale.float().clone())

    def forward(self, tau: float, logit_scale: float, generator=None) -> torch.Tensor:
        """The relaxed weight of eqs. (1)-(2), one Gumbel draw per call."""
        u = torch.rand(self.z.shape, generator=generator, device=self.z.device)
        g = u.add_(1e-8).log_().neg_().add_(1e-8).log_().neg_()     # Gumbel, as the reference
        return _Relaxed.apply(self.z, self.scales, self.cand, self.invalid, g, self.group_size,
                              float(tau), float(logit_scale))

    def hard_index(self) -> torch.Tensor:
        """Argmax candidate of each weight (``get_hard_weights``)."""
        z = self.z.detach()
        return _argmax0(z if self.invalid is None else z.masked_fill(self.invalid, -1e9))

    def quantized(self) -> Quantized:
        """The hard result as integer codes with the learned scales: exactly on the grid."""
        lv = self.cand.gather(0, self.hard_index().unsqueeze(0))[0].round().long()
        codes = lv + expand_groups(self.zero, self.group_size, lv.shape[-1]).long()
        return Quantized(codes.to(torch.int16), self.scales.detach().clone(), self.zero,
                         self.bits, self.group_size)


def block_mse(out_q: torch.Tensor, out_fp: torch.Tensor) -> torch.Tensor:
    """Eq. (3): ``nn.MSELoss()`` (mean over every element) of the sub-block's outputs
    (``calculate_mse``)."""
    return ((out_q - out_fp) ** 2).mean()


def train_subblock(fn, quantizers: dict, inputs: torch.Tensor, targets: torch.Tensor,
                   cfg: GSQConfig, generator=None) -> dict:
    """Learn the quantizers of one sub-block: ``fn(x, weights)`` is the sub-block with the
    weights (name -> tensor) in place, ``targets`` its full-precision output on ``inputs``.

    Each step draws a batch of ``cfg.batch`` calibration rows (a shuffled pass over aligned
    chunks, ``get_random_batch_indices``), sets temperature, logit scale and learning rates for
    the step (``train_layer``, ``CustomLRScheduler``), takes eq. (3)'s gradient and a Lion step.
    Returns per-step ``loss``, ``tau``, ``logit_scale`` and ``flips`` (argmax changes)."""
    params = [{"params": [q.z], "lr": cfg.lr_logits, "weight_decay": cfg.weight_decay}
              for q in quantizers.values()]
    params += [{"params": [q.scales], "lr": cfg.lr_scales, "weight_decay": 0.0}
               for q in quantizers.values()]
    opt = Lion(params, betas=cfg.betas)
    base = [g["lr"] for g in opt.param_groups]
    hist = {"loss": [], "tau": [], "logit_scale": [], "flips": []}
    prev = {n: q.hard_index() for n, q in quantizers.items()}
    n_chunks = max(len(inputs) // cfg.batch, 1)
    order = torch.empty(0, dtype=torch.long)
    where = generator.device if generator is not None else None   # drawn where the generator is
    for t in range(cfg.steps):
        if len(order) == 0:
            order = torch.randperm(n_chunks, generator=generator, device=where)
        i, order = int(order[0]) * cfg.batch, order[1:]
        tau = schedule(t, cfg.steps, *cfg.temperature)
        lam = schedule(t, cfg.steps, *cfg.logit_scale)
        for g, lr in zip(opt.param_groups, base):
            g["lr"] = lr * lr_factor(t, cfg.steps, cfg.min_lr)
        opt.zero_grad(set_to_none=True)
        weights = {n: q(tau, lam, generator) for n, q in quantizers.items()}
        loss = block_mse(fn(inputs[i: i + cfg.batch], weights), targets[i: i + cfg.batch])
        loss.backward()
        opt.step()
        cur = {n: q.hard_index() for n, q in quantizers.items()}
        hist["flips"].append(int(sum((cur[n] != prev[n]).sum() for n in cur)))
        prev = cur
        hist["loss"].append(float(loss.detach()))
        hist["tau"].append(tau)
        hist["logit_scale"].append(lam)
    return hist


def optimal_scales(w, H, lv, group_size: int, ridge: float = 1e-8):
    """Ours, not the paper's (an ablation): per-group scales minimizing
    ``tr((W_hat - W) H (W_hat - W)^T)`` for fixed levels ``lv`` (batched over leading dims).

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


# -- the sub-blocks of a Llama decoder layer, and the whole-model driver ----------------------

@torch.no_grad()
def layer_inputs(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Hidden states entering the first decoder layer for token blocks ``ids``, and the
    layer's other arguments (rotary embeddings; causal attention, no mask), captured by a
    pre-hook as ``BaseModelWrapper.get_inputs`` does."""
    seen = {}

    def hook(_, args, kwargs):
        seen["x"] = args[0] if args else kwargs["hidden_states"]
        seen["kw"] = {"position_embeddings": kwargs["position_embeddings"],
                      "position_ids": kwargs.get("position_ids")}
        raise StopIteration

    handle = model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(input_ids=ids.to(next(model.parameters()).device))
    except StopIteration:
        pass
    finally:
        handle.remove()
    return seen["x"].detach(), seen["kw"]


def _attention(layer, kw):
    """``x + attn(ln1(x))`` with weights (``self_attn.*`` names) swapped in (``get_mlp_input``)."""
    def fn(x, weights):
        h = layer.input_layernorm(x)
        w = {k.split(".", 1)[1] + ".weight": v for k, v in weights.items()}
        return x + functional_call(layer.self_attn, w, (h,), dict(kw, attention_mask=None))[0]
    return fn


def _mlp(layer):
    """``h + mlp(ln2(h))`` with weights (``mlp.*`` names) swapped in (``get_mlp_output``)."""
    def fn(h, weights):
        w = {k.split(".", 1)[1] + ".weight": v for k, v in weights.items()}
        return h + functional_call(layer.mlp, w, (layer.post_attention_layernorm(h),))
    return fn


def _in_place(layer, qs: dict):
    """Copy the hard (dequantized) weights of ``qs`` (names relative to ``layer``) into it."""
    mods = dict(layer.named_modules())
    with torch.no_grad():
        for n, q in qs.items():
            mods[n].weight.copy_(q.dequantize().to(mods[n].weight.dtype))


def quantize_model(model, calib: torch.Tensor, init: dict, cfg: GSQConfig | None = None,
                   seed: int = 0) -> tuple[dict, dict]:
    """GSQ of every decoder layer of a Llama ``model``, in order, started from ``init`` (full
    linear name -> ``Quantized``). Per layer: the attention sub-block, then the MLP sub-block
    with the quantized attention in place against the full-precision layer (``calculate_mse``
    with ``temp_weights``); the next layer's inputs are this quantized layer's outputs. The
    model's weights are restored afterwards. Returns ``(weights, info)``: name -> dequantized
    weight, and name -> ``{"q", "hist", "seconds"}``."""
    cfg = cfg or GSQConfig()
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    x, kw = layer_inputs(model, calib)
    weights, info = {}, {}
    prefix = next(n for n, m in model.named_modules() if m is model.model.layers)
    for li, layer in enumerate(model.model.layers):
        saved = {n: p.detach().clone() for n, p in layer.named_parameters()}
        with torch.no_grad():
            y_fp = layer(x, **kw)                                   # the fp layer's output
            attn_fp = _attention(layer, kw)(x, {})
        for part, fn in (("self_attn", _attention(layer, kw)), ("mlp", _mlp(layer))):
            names = [n for n, m in layer.named_modules()
                     if isinstance(m, nn.Linear) and n.startswith(part + ".")]
            qz = {n: GumbelQuantizer(init[f"{prefix}.{li}.{n}"], cfg, gen) for n in names}
            t0 = time.time()
            if part == "self_attn":
                hist = train_subblock(fn, qz, x, attn_fp, cfg, gen)
            else:
                with torch.no_grad():
                    h = _attention(layer, kw)(x, {})                # quantized attention in place
                hist = train_subblock(fn, qz, h, y_fp, cfg, gen)
            secs = (time.time() - t0) / len(names)
            _in_place(layer, {n: q.quantized() for n, q in qz.items()})
            for n, q in qz.items():
                full = f"{prefix}.{li}.{n}"
                info[full] = {"q": q.quantized(), "hist": hist, "seconds": secs}
                weights[full] = info[full]["q"].dequantize()
        with torch.no_grad():
            x = layer(x, **kw)                                      # inputs of the next layer
            for n, p in layer.named_parameters():
                p.copy_(saved[n])
    return weights, info
