"""Model merging as Frechet averaging; LoRA merging on the quotient manifold.

Paper 13 (NeurIPS 2026, "Generalizing the geometry of model merging through Frechet averages";
spec in ``docs/papers/13-frechet-merging.md``). A merge is the Frechet mean

    theta* = argmin_theta  sum_i w_i d(theta, theta_i)^2                               (1)

on a manifold whose points are *functions*, not parameter vectors: where the parameters have a
symmetry group, the manifold is the quotient by it, so that (1) is invariant by construction.

LoRA. ``Delta W = B A`` is unchanged by ``(B, A) -> (B G, G^-1 A)`` for every invertible r x r G,
so an adapter is a point of the quotient (R*^{m x r} x R*^{r x n}) / GL(r), the manifold of rank-r
matrices (docs/papers/13-frechet-merging.md, "Our geometry"). Averaging the factors B and A separately
(peft's ``linear``) is a function of the representatives, not of the points: it moves with G.

The geometry used here (our choice; the paper leaves metric and distance approximation open):
fix the GL(r) freedom down to O(r) with the *balanced* representative ``B = U S^1/2,
A = S^1/2 V^T`` of ``Delta W = U S V^T`` (``B^T B = A A^T``), stack ``Z = [B; A^T]`` and take the
flat metric of the stacked factors. O(r) acts on Z by isometries (Z -> Z Q), so the quotient
distance has a closed form (orthogonal Procrustes):

    d([Z1], [Z2]) = min_{Q in O(r)} ||Z1 - Z2 Q||_F,                                    (2)

the Bures-Wasserstein distance between the PSD lifts Z Z^T = [[(XX^T)^1/2, X], [X^T, (X^TX)^1/2]].
So rank-r matrices sit, through their lifts, in the quotient R^{(m+n) x r} / O(r) (rank-r PSD
matrices); the mean is taken there and read back as the product of its blocks, B A (it need not be
balanced itself). Its exponential map is a straight line of representatives, its log map the aligned difference,
and parallel transport between representatives of one point is the group action (the functions
``quotient_log``, ``quotient_exp``, ``transport``). (1) is then solved by the Karcher iteration
Z <- exp_Z(sum_i w_i log_Z(Z_i)) (generalized Procrustes analysis, :func:`frechet_quotient`).

Alternatives measured beside it: the embedded (Frobenius) distance ||X - X_i||, whose Frechet mean
on the rank-r manifold is the truncated SVD of the mean product (Eckart-Young); and balanced
factors averaged without alignment (invariant to G, yet an arbitrary choice of signs).

Fisher merging (C3). In a flat space with the distance approximated by each model's own diagonal
Fisher metric, d(theta, theta_i)^2 ~ (theta - theta_i)^T F_i (theta - theta_i), (1) is the Fisher
merge theta* = (sum w_i F_i)^-1 sum w_i F_i theta_i (Matena & Raffel 2022): :func:`fisher_merge`
in closed form, :func:`frechet_flat` by minimizing (1) numerically.

Permutations (C5). Hidden units of an MLP can be permuted; weight matching (Ainsworth et al. 2023,
"Git Re-Basin") aligns model 2 to model 1 by a linear assignment per layer, then averages:
:func:`weight_matching`, :func:`permute_mlp`.
"""
from __future__ import annotations

import numpy as np
import torch
from peft.tuners.lora import LoraLayer
from scipy.optimize import linear_sum_assignment, minimize
from threadpoolctl import threadpool_limits

__all__ = ["lora_layers", "get_factors", "set_factors", "random_invertible", "reparameterize",
           "balanced", "unstack", "procrustes", "quotient_log", "quotient_exp", "transport",
           "quotient_distance", "frechet_quotient", "merge_quotient", "merge_balanced_unaligned",
           "merge_naive", "merge_svd", "merge_modules", "fisher_merge", "frechet_flat",
           "mlp_diag_fisher", "permute_mlp", "weight_matching", "interpolate"]

# -- LoRA factors of a peft model ---------------------------------------------------------------


def lora_layers(model, adapter: str) -> dict:
    """``{module name: LoraLayer}`` of the peft ``model`` that carry ``adapter``."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, LoraLayer) and adapter in m.lora_A}


def get_factors(model, adapter: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (B, A)}`` in float64 on the host (where the merges run) with the LoRA scaling
    folded in (sqrt on each side), so that ``B @ A`` is exactly the module's ``Delta W`` (peft:
    scaling * B A)."""
    out = {}
    for n, m in lora_layers(model, adapter).items():
        s = float(m.scaling[adapter]) ** 0.5
        out[n] = (s * m.lora_B[adapter].weight.detach().double().cpu(),
                  s * m.lora_A[adapter].weight.detach().double().cpu())
    return out


def set_factors(model, adapter: str, factors: dict) -> None:
    """Write ``{module: (B, A)}`` (scaling folded in, as :func:`get_factors` returns them) into
    ``adapter``; its rank must match."""
    for n, m in lora_layers(model, adapter).items():
        b, a = factors[n]
        s = float(m.scaling[adapter]) ** 0.5
        with torch.no_grad():
            m.lora_B[adapter].weight.copy_((b / s).to(m.lora_B[adapter].weight))  # its dtype
            m.lora_A[adapter].weight.copy_((a / s).to(m.lora_A[adapter].weight))  # and device


# -- the symmetry ---------------------------------------------------------------------------------


def random_invertible(r: int, gen: torch.Generator, cond: float = 10.0) -> torch.Tensor:
    """A random G = Q1 diag(s) Q2 with log-uniform singular values of condition number ``cond``
    (a generic, non-orthogonal element of GL(r))."""
    q1 = torch.linalg.qr(torch.randn(r, r, generator=gen, dtype=torch.float64))[0]
    q2 = torch.linalg.qr(torch.randn(r, r, generator=gen, dtype=torch.float64))[0]
    s = torch.exp((torch.rand(r, generator=gen, dtype=torch.float64) - 0.5) * np.log(cond))
    return q1 @ torch.diag(s) @ q2


def reparameterize(factors: dict, gen: torch.Generator, cond: float = 10.0) -> dict:
    """``(B G, G^-1 A)`` per module with a fresh random G each: the same function (C1)."""
    out = {}
    for n, (b, a) in factors.items():
        g = random_invertible(b.shape[1], gen, cond)
        out[n] = (b @ g, torch.linalg.solve(g, a))
    return out


# -- the quotient geometry of rank-r matrices -----------------------------------------------------


def balanced(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The balanced representative Z = [U S^1/2; V S^1/2] of Delta W = B A = U S V^T, a function of
    the product only (so of the point on the quotient), unique up to Z -> Z Q, Q in O(r)."""
    r = b.shape[1]
    u, s, vh = torch.linalg.svd(b @ a, full_matrices=False)
    root = s[:r].sqrt()
    return torch.cat([u[:, :r] * root, vh[:r].T * root], dim=0)


def unstack(z: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, A)`` from a stacked Z = [B; A^T] whose first ``m`` rows are B."""
    return z[:m], z[m:].T


def procrustes(z: torch.Tensor, zi: torch.Tensor) -> torch.Tensor:
    """Q in O(r) minimizing ||Z_i Q - Z||_F: Q = U V^T for Z_i^T Z = U S V^T (Schonemann 1966).
    This optimal Q makes Z_i Q - Z horizontal at Z (Z^T (Z_i Q) is symmetric)."""
    u, _, vh = torch.linalg.svd(zi.T @ z)
    return u @ vh


def quotient_log(z: torch.Tensor, zi: torch.Tensor) -> torch.Tensor:
    """log_[Z]([Z_i]) as a horizontal vector at Z: the aligned difference Z_i Q* - Z (2)."""
    return zi @ procrustes(z, zi) - z


def quotient_exp(z: torch.Tensor, v: torch.Tensor, t: float = 1.0) -> torch.Tensor:
    """exp_[Z](t v) for horizontal v: horizontal geodesics of a flat total space under an
    isometric group are straight lines of representatives."""
    return z + t * v


def transport(v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A horizontal vector at Z moved to the representative Z Q of the same point: V Q."""
    return v @ q


def quotient_distance(z1: torch.Tensor, z2: torch.Tensor) -> float:
    """d([Z1], [Z2]) of (2)."""
    return float(quotient_log(z1, z2).norm())


def frechet_quotient(zs: list[torch.Tensor], weights=None, iters: int = 50, tol: float = 1e-12,
                     init: torch.Tensor | None = None) -> tuple[torch.Tensor, list[float]]:
    """The Frechet mean (1) with the distance (2), by the Karcher iteration
    Z <- exp_Z(sum_i w_i log_Z(Z_i)) from Z_1 (for a flat total space this is generalized
    Procrustes: align every input to the mean, average, repeat). Returns Z and the objective
    sum_i w_i d^2 after each iteration (it never increases)."""
    w = np.full(len(zs), 1.0 / len(zs)) if weights is None else np.asarray(weights, float)
    w = w / w.sum()
    z = (zs[0] if init is None else init).clone()
    history = []
    for _ in range(iters):
        logs = [quotient_log(z, zi) for zi in zs]
        history.append(float(sum(wi * float(v.pow(2).sum()) for wi, v in zip(w, logs))))
        step = sum(wi * v for wi, v in zip(w, logs))
        z = quotient_exp(z, step)
        if float(step.norm()) <= tol * max(1.0, float(z.norm())):
            break
    history.append(float(sum(wi * quotient_distance(z, zi) ** 2 for wi, zi in zip(w, zs))))
    return z, history


def merge_quotient(pairs: list[tuple[torch.Tensor, torch.Tensor]], weights=None,
                   iters: int = 50, tol: float = 1e-10
                   ) -> tuple[tuple[torch.Tensor, torch.Tensor], list[float]]:
    """Frechet merge of LoRAs ``[(B_i, A_i)]`` of one module on the quotient: ``((B, A), history)``."""
    m = pairs[0][0].shape[0]
    z, hist = frechet_quotient([balanced(b, a) for b, a in pairs], weights, iters, tol)
    return unstack(z, m), hist


def merge_balanced_unaligned(pairs, weights=None):
    """Ablation: average the balanced factors without the Procrustes alignment (a G-invariant
    input, but an averaging procedure that is not defined on the quotient: SVD signs decide)."""
    w = np.full(len(pairs), 1.0 / len(pairs)) if weights is None else np.asarray(weights, float)
    z = sum(wi * balanced(b, a) for wi, (b, a) in zip(w / w.sum(), pairs))
    return unstack(z, pairs[0][0].shape[0])


def merge_naive(pairs, weights=None):
    """Naive factor averaging: (sum w_i B_i, sum w_i A_i), what peft's ``linear`` computes with
    its weights w_i^2 (it scales each factor by the square root of the weight)."""
    w = np.full(len(pairs), 1.0 / len(pairs)) if weights is None else np.asarray(weights, float)
    return (sum(wi * b for wi, (b, _) in zip(w, pairs)), sum(wi * a for wi, (_, a) in zip(w, pairs)))


def merge_svd(pairs, weights=None, rank: int | None = None):
    """The embedded-metric Frechet mean on the rank-r manifold: truncated SVD of sum w_i B_i A_i
    (Eckart-Young), what peft's ``svd`` computes. Returned balanced."""
    w = np.full(len(pairs), 1.0 / len(pairs)) if weights is None else np.asarray(weights, float)
    x = sum(wi * (b @ a) for wi, (b, a) in zip(w, pairs))
    r = rank or pairs[0][0].shape[1]
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    return u[:, :r] * s[:r].sqrt(), s[:r].sqrt()[:, None] * vh[:r]


def merge_modules(factor_sets: list[dict], how, **kw) -> tuple[dict, dict]:
    """Apply a per-module merge ``how(pairs, **kw)`` to every module of several adapters'
    factors; returns ``(merged factors, {module: Karcher history})`` (histories only for the
    quotient merge)."""
    out, hist = {}, {}
    for n in factor_sets[0]:
        res = how([fs[n] for fs in factor_sets], **kw)
        if how is merge_quotient:
            res, hist[n] = res
        out[n] = res
    return out, hist


# -- Fisher merging as a flat Frechet mean (C3) --------------------------------------------------


def fisher_merge(thetas: list[torch.Tensor], fishers: list[torch.Tensor], weights=None,
                 eps: float = 1e-6) -> torch.Tensor:
    """Fisher merging: (sum_i w_i F_i)^-1 sum_i w_i F_i theta_i for diagonal F_i (Matena & Raffel
    2022, eq. 3); ``eps`` floors the Fisher (their ``fisher_floor``, 1e-6)."""
    w = np.full(len(thetas), 1.0 / len(thetas)) if weights is None else np.asarray(weights, float)
    num = sum(wi * (f + eps) * t for wi, f, t in zip(w, fishers, thetas))
    return num / sum(wi * (f + eps) for wi, f in zip(w, fishers))


def frechet_flat(thetas, fishers, weights=None, eps: float = 1e-6, max_iter: int = 5000):
    """The Frechet mean (1) on a flat space with d(theta, theta_i)^2 approximated by
    (theta - theta_i)^T diag(F_i) (theta - theta_i), minimized numerically: scipy L-BFGS on the
    objective J and its gradient -2 sum_i w_i F_i (theta_i - theta) (each point's metric applied to
    the log map theta_i - theta), from the plain average. Returns ``(theta, J)``; C3 checks that it
    is :func:`fisher_merge`. BLAS runs on one thread (its threads only wait for each other on
    vectors of this size, up to 10x slower on a shared CPU)."""
    w = np.full(len(thetas), 1.0 / len(thetas)) if weights is None else np.asarray(weights, float)
    ts = [t.double().numpy() for t in thetas]
    fs = [f.double().numpy() + eps for f in fishers]
    scale = float(sum(wi * f.sum() for wi, f in zip(w, fs)))     # a well-scaled objective

    def fun(x):
        logs = [t - x for t in ts]
        obj = sum(wi * (f * v ** 2).sum() for wi, f, v in zip(w, fs, logs)) / scale
        return obj, -2 * sum(wi * f * v for wi, f, v in zip(w, fs, logs)) / scale

    x0 = sum(ts) / len(ts)
    with threadpool_limits(1):
        res = minimize(fun, x0, jac=True, method="L-BFGS-B",
                       options={"maxiter": max_iter, "maxfun": 2 * max_iter, "gtol": 1e-15,
                                "ftol": 1e-18, "maxcor": 20})
    return torch.tensor(res.x, dtype=torch.float64), float(res.fun) * scale


def mlp_diag_fisher(layers: list, x: torch.Tensor) -> torch.Tensor:
    """Diagonal Fisher E_x sum_c p(c|x) (d log p(c|x) / d theta)^2 of a ReLU MLP ``[(W, b)]``,
    flattened like ``cat(W_0, b_0, W_1, ...)``. Per-sample gradients of a linear layer are outer
    products delta a^T, so their squares sum as (p delta^2)^T (a^2): no per-sample autograd."""
    acts, z = [x], x
    for i, (w, b) in enumerate(layers):
        z = z @ w.T + b
        if i < len(layers) - 1:
            z = torch.relu(z)
            acts.append(z)
    p = torch.softmax(z, -1)
    out = [torch.zeros_like(t) for wb in layers for t in wb]
    for c in range(p.shape[1]):
        delta = -p.clone()
        delta[:, c] += 1.0                               # d log p_c / d logits
        for l in range(len(layers) - 1, -1, -1):
            wt = p[:, c:c + 1] * delta ** 2
            out[2 * l] += wt.T @ acts[l] ** 2 / len(x)
            out[2 * l + 1] += wt.sum(0) / len(x)
            if l:
                delta = (delta @ layers[l][0]) * (acts[l] > 0)
    return torch.cat([t.reshape(-1) for t in out])


# -- permutation symmetry of MLPs (C5) ------------------------------------------------------------


def permute_mlp(layers: list[tuple[torch.Tensor, torch.Tensor]], perms: list) -> list:
    """Permute the hidden units of an MLP ``[(W_l, b_l)]`` (W_l: out x in) by ``perms[l]`` for
    each hidden layer l: W_l <- P W_l, b_l <- P b_l, W_{l+1} <- W_{l+1} P^T. Same function."""
    out = [(w.clone(), b.clone()) for w, b in layers]
    for l, p in enumerate(perms):
        p = torch.as_tensor(p)
        w, b = out[l]
        out[l] = (w[p], b[p])
        wn, bn = out[l + 1]
        out[l + 1] = (wn[:, p], bn)
    return out


def weight_matching(ref: list, other: list, iters: int = 20) -> list:
    """Permutations of ``other``'s hidden units that maximize sum_l <W_l^ref, P_l W_l P_{l-1}^T>
    (Ainsworth et al. 2023, weight matching): coordinate ascent, each step a linear assignment
    (``scipy.optimize.linear_sum_assignment``) for one layer given its neighbours. The start is a
    forward pass that matches each layer on its incoming weights only, so the result does not
    depend on how ``other``'s units happen to be labelled (the merge is a function on the quotient)."""
    n_hidden = len(ref) - 1
    perms: list = [None] * n_hidden

    def cost(l, with_next):
        w_in = other[l][0].double().numpy()
        if l > 0:                                       # columns already permuted by P_{l-1}
            w_in = w_in[:, perms[l - 1]]
        c = ref[l][0].double().numpy() @ w_in.T + np.outer(ref[l][1].double().numpy(),
                                                            other[l][1].double().numpy())
        if with_next:
            w_out = other[l + 1][0].double().numpy()
            if l + 1 < n_hidden:                        # rows of the next layer permuted too
                w_out = w_out[perms[l + 1]]
            c = c + ref[l + 1][0].double().numpy().T @ w_out
        return c

    for l in range(n_hidden):                           # the labelling-free start
        perms[l] = linear_sum_assignment(cost(l, False), maximize=True)[1]
    for _ in range(iters):
        changed = False
        for l in range(n_hidden):
            col = linear_sum_assignment(cost(l, True), maximize=True)[1]
            if not np.array_equal(col, perms[l]):
                perms[l], changed = col, True
        if not changed:
            break
    return perms


def interpolate(a: list, b: list, t: float) -> list:
    """(1 - t) a + t b, layer by layer."""
    return [((1 - t) * wa + t * wb, (1 - t) * ba + t * bb) for (wa, ba), (wb, bb) in zip(a, b)]
