"""GSQ: hard assignments lie exactly on the grid, the relaxation beats its start, scale solve."""
import torch

from workbench import quant as Q
from workbench.methods import gsq as M


def _problem(out=16, cols=64, n=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, cols, generator=g) @ (torch.randn(cols, cols, generator=g) / 8 +
                                             torch.eye(cols))
    W = torch.randn(out, cols, generator=g)
    return W, 2 / n * X.T @ X


def _run(W, H, bits, steps=100, init="gptq", seed=0):
    q0 = Q.gptq(W, H, bits, 32) if init == "gptq" else Q.rtn(W, bits, 32)
    batch = Q.Quantized(q0.codes[None], q0.scale[None], q0.zero[None], bits, 32)
    cfg = M.GSQConfig(steps=steps)
    idx, scale, hist = M.gsq(W[None], H[None], batch, cfg, torch.Generator().manual_seed(seed))
    return q0, idx[0], scale[0], hist


def test_hard_assignment_is_exactly_on_the_grid():
    W, H = _problem()
    for bits in (2, 3):
        q0, idx, scale, _ = _run(W, H, bits, steps=60)
        grid = Q.levels(bits).float()
        lv = grid[idx]
        assert idx.min() >= 0 and idx.max() < 2 ** bits
        w_hat = Q.expand_groups(scale, 32, 64) * lv
        # re-quantize with RTN's rounding, using the learned scales: the same codes and tensor
        codes = Q.quantize_codes(w_hat, scale, q0.zero, bits, 32)
        assert torch.equal(codes.long() - q0.zero[:, :1].long(), lv.long())
        assert torch.equal(Q.dequantize(codes, scale, q0.zero, 32), w_hat)


def test_gsq_improves_on_its_start_at_low_bits():
    W, H = _problem(seed=1)
    for bits, init, factor in ((2, "rtn", 0.9), (2, "gptq", 0.9), (3, "gptq", 0.97)):
        q0, idx, scale, hist = _run(W, H, bits, init=init)
        w_hat = Q.expand_groups(scale, 32, 64) * Q.levels(bits).float()[idx]
        e0 = Q.output_error(W, q0.dequantize(), H)
        e1 = Q.output_error(W, w_hat, H)
        assert e1 < factor * e0, (bits, init, e0, e1)
        assert len(hist["loss"]) == 100 and sum(hist["flips"]) > 0


def _relaxed_inputs(K=4, B=2, O=3, I=8, g=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(K, B, O, I, generator=gen, dtype=torch.float64)
    rho = 0.1 * torch.randn(B, O, I // g, generator=gen, dtype=torch.float64)
    s0 = 0.5 + torch.rand(B, O, I // g, generator=gen, dtype=torch.float64)
    w = torch.randn(B, O, I, generator=gen, dtype=torch.float64)
    X = torch.randn(B, 32, I, generator=gen, dtype=torch.float64)
    H = 2 / 32 * X.transpose(1, 2) @ X
    norm = torch.einsum("boi,bij,boj->b", w, H, w).view(B, 1, 1)
    grid = Q.levels(2).double()
    gumbel = 0.3 * -torch.log(torch.empty_like(z).exponential_(generator=gen))
    return z, rho, s0, w, H, grid, norm, gumbel


def test_gsq_closed_form_gradients_match_autograd():
    """The gradients gsq() steps with (relaxed_step) are those of eq. (3) at eqs. (1)-(2)."""
    z, rho, s0, w, H, grid, norm, gumbel = _relaxed_inputs()
    for tau, noise in ((1.0, None), (0.3, gumbel), (0.05, gumbel)):
        loss, gz, grho = M.relaxed_step(z.clone(), rho, s0, w, H, grid, tau, norm, noise)
        za, ra = z.clone().requires_grad_(), rho.clone().requires_grad_()
        p = torch.softmax((za if noise is None else za + noise) / tau, dim=0)   # eq. (1)
        w_tilde = Q.expand_groups(s0 * ra.exp(), 4, 8) * torch.tensordot(grid, p, dims=1)
        d = w_tilde - w
        ref = torch.einsum("boi,bij,boj->b", d, H, d) / norm.view(-1)           # eq. (3)
        ref.sum().backward()
        assert torch.allclose(loss, ref.detach(), rtol=1e-12)
        assert torch.allclose(gz, za.grad, rtol=1e-9, atol=1e-12)
        assert torch.allclose(grho, ra.grad, rtol=1e-9, atol=1e-12)


def test_relaxation_anneals_to_the_argmax():
    """As tau -> 0 the relaxed weight is the hard one: the loss at the argmax levels."""
    z, rho, s0, w, H, grid, norm, _ = _relaxed_inputs(seed=1)
    loss, _, _ = M.relaxed_step(z.clone(), rho, s0, w, H, grid, 1e-6, norm)
    d = Q.expand_groups(s0 * rho.exp(), 4, 8) * grid[z.argmax(0)] - w
    hard = torch.einsum("boi,bij,boj->b", d, H, d) / norm.view(-1)
    assert torch.allclose(loss, hard, rtol=1e-10)
    cfg = M.GSQConfig(steps=11, tau_start=1.0, tau_end=0.01)
    assert M.temperature(0, cfg) == 1.0 and abs(M.temperature(10, cfg) - 0.01) < 1e-12


def _hardening(bits, tau_end, steps=40, seed=2):
    """(relaxed loss at the first and last step, hard loss of the start and of the argmax)."""
    W, H = _problem(seed=seed)
    q0 = Q.gptq(W, H, bits, 32)
    batch = Q.Quantized(q0.codes[None], q0.scale[None], q0.zero[None], bits, 32)
    cfg = M.GSQConfig(steps=steps, tau_end=tau_end, solve_scales=False)
    idx, scale, hist = M.gsq(W[None], H[None], batch, cfg, torch.Generator().manual_seed(0))
    Hd = H + cfg.percdamp * H.diag().mean() * torch.eye(H.shape[0])     # gsq's damped H
    norm = Q.output_error(W, torch.zeros_like(W), Hd)
    hard = Q.output_error(W, Q.expand_groups(scale[0], 32, 64) * Q.levels(bits).float()[idx[0]],
                          Hd) / norm
    start = Q.output_error(W, q0.dequantize(), Hd) / norm
    return hist, start, hard


def test_annealing_hardens_the_relaxation_onto_the_grid():
    """14's C3 (weights end on the grid) by construction, tested as a property of the annealing:
    at tau_start the relaxed weights sit off the grid (their loss is not the hard start's); at
    tau_end the relaxed loss is the loss of the argmax levels, so taking the argmax (on the grid
    by construction) changes nothing. With no annealing (tau_end = tau_start) it would not be."""
    for bits in (2, 3):
        hist, start, hard = _hardening(bits, M.GSQConfig().tau_end)
        assert hist["tau"][-1] == M.GSQConfig().tau_end and sum(hist["flips"][-5:]) <= 3
        assert abs(hist["loss"][0] - start) > 0.05 * start              # soft at the start
        assert abs(hist["loss"][-1] - hard) < 0.03 * hard               # hard at the end
        hist1, _, hard1 = _hardening(bits, 1.0)                         # never annealed
        assert abs(hist1["loss"][-1] - hard1) > 0.05 * hard1


def test_optimal_scales_match_least_squares():
    W, H = _problem(out=3, cols=64)
    lv = torch.randint(-2, 2, (1, 3, 64)).float()
    s = M.optimal_scales(W[None], H[None], lv, 16)[0]
    L = torch.linalg.cholesky(H.double())                     # H = L L^T
    for o in range(3):
        A = torch.zeros(64, 4, dtype=torch.float64)
        for gi in range(4):
            A[gi * 16:(gi + 1) * 16, gi] = lv[0, o, gi * 16:(gi + 1) * 16]
        ref = torch.linalg.lstsq(L.T @ A, L.T @ W[o].double()).solution
        assert torch.allclose(s[o].double(), ref, rtol=1e-3, atol=1e-5)

