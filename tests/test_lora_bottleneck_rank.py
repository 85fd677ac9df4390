"""Paper 05: the bottleneck-rank identities, the trace-norm solvers, the attention invariances and
the LoRA stationary points, on tiny random matrices and on real features of the zoo LM."""
import math

import pytest
import torch

from workbench.methods import lora_bottleneck_rank as br


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def problem(n=24, d_in=10, d_out=7, k=3, lam=0.05, eps=0.0, seed=0):
    g = gen(seed)
    x = br.low_rank_features(n, d_in, k, g)
    r = x @ torch.randn(d_out, d_in, generator=g, dtype=torch.float64).T \
        + 0.1 * torch.randn(n, d_out, generator=g, dtype=torch.float64)
    p = br.psd_perturbation(d_in, seed) if eps else None
    return br.LeastSquares(x, r, lam=lam, eps=eps, p=p)


# -- C1: the loss sees D only through D X^T -------------------------------------------------------

def test_bottleneck_rank_of_constructed_features():
    g = gen()
    for k in (1, 3, 5):
        x = br.low_rank_features(40, 12, k, g)
        assert br.bottleneck_rank(x) == k
    assert br.bottleneck_rank(torch.zeros(5, 4)) == 0
    # duplicated rows add nothing
    x = torch.randn(6, 9, generator=g, dtype=torch.float64)
    assert br.bottleneck_rank(torch.cat([x, x, 2 * x])) == 6


def test_projection_keeps_outputs_and_cannot_raise_trace_norm():
    g = gen(1)
    x = br.low_rank_features(30, 12, 4, g)
    d = torch.randn(8, 12, generator=g, dtype=torch.float64)
    dp = br.project_rows(d, br.row_basis(x))
    assert torch.allclose(x @ dp.T, x @ d.T, atol=1e-10)
    assert br.trace_norm(dp) <= br.trace_norm(d) + 1e-12
    assert br.numeric_rank(dp) <= 4 < br.numeric_rank(d)
    null = br.null_update(x, 8, g)
    assert float((x @ null.T).abs().max()) < 1e-10 and null.norm() > 1


def test_svt_is_the_prox_of_the_trace_norm():
    """prox optimality: M - SVT(M) is lam times a subgradient of ||.||_* at SVT(M), and SVT(M)
    beats random nearby points on 1/2 ||Z - M||^2 + lam ||Z||_*."""
    g = gen(2)
    m = torch.randn(6, 5, generator=g, dtype=torch.float64)
    lam = 0.7
    z = br.svt(m, lam)
    s_m = torch.linalg.svdvals(m)
    assert torch.allclose(torch.linalg.svdvals(z), (s_m - lam).clamp_min(0), atol=1e-12)
    sub = (m - z) / lam
    u, s, vh = torch.linalg.svd(z, full_matrices=False)
    k = int((s > 1e-10).sum())
    assert torch.allclose(u[:, :k].T @ sub @ vh[:k].T, torch.eye(k, dtype=sub.dtype), atol=1e-10)
    assert float(torch.linalg.matrix_norm(sub, 2)) <= 1 + 1e-10

    def obj(w):
        return 0.5 * float(((w - m) ** 2).sum()) + lam * br.trace_norm(w)
    for _ in range(20):
        assert obj(z) <= obj(z + 0.05 * torch.randn(6, 5, generator=g, dtype=torch.float64))


def test_prox_grad_matches_the_closed_form():
    """X^T X / n = I: the minimizer of (2) is SVT(R^T X / n, lam), / (1 + eps) with P = I."""
    g = gen(3)
    n, d = 40, 6
    q = torch.linalg.qr(torch.randn(n, d, generator=g, dtype=torch.float64))[0] * math.sqrt(n)
    r = torch.randn(n, 4, generator=g, dtype=torch.float64)
    for eps in (0.0, 0.3):
        pb = br.LeastSquares(q, r, lam=0.4, eps=eps, p=torch.eye(d, dtype=torch.float64))
        d_hat, info = br.prox_grad(pb, steps=3000)
        exact = br.svt(r.T @ q / n, 0.4) / (1 + eps)
        assert torch.allclose(d_hat, exact, atol=1e-8)
        assert info["kkt"] < 1e-7
        assert br.kkt_residual(pb, exact) < 1e-9
        assert br.kkt_residual(pb, torch.zeros_like(exact)) > 0.1    # 0 is not optimal here


def test_minimizer_rank_is_bounded_by_the_bottleneck_not_by_n():
    for n in (8, 40, 200):
        pb = problem(n=n, d_in=12, d_out=10, k=3, lam=0.02, seed=n)
        d_hat, info = br.prox_grad(pb, steps=4000)
        assert info["kkt"] < 1e-6
        assert br.numeric_rank(d_hat, 1e-6) <= 3
        # the unregularized least-squares fit from a random start keeps a full-rank invisible part
        rand = torch.randn(10, 12, generator=gen(n), dtype=torch.float64)
        ls = rand - br.project_rows(rand, br.row_basis(pb.x)) + torch.linalg.lstsq(
            pb.x, pb.r).solution.T
        assert br.numeric_rank(ls) == 10


def test_prox_grad_agrees_with_cvxpy():
    pytest.importorskip("cvxpy")
    for eps in (0.0, 0.05):
        pb = problem(n=20, d_in=8, d_out=5, k=3, lam=0.1, eps=eps, seed=4)
        d_hat, info = br.prox_grad(pb, steps=4000)
        d_cvx, obj = br.cvxpy_solve(pb)
        assert abs(info["objective"] - obj) < 1e-5 * max(1.0, abs(obj))
        assert float((d_hat - torch.as_tensor(d_cvx)).abs().max()) < 1e-3


# -- C2: attention ------------------------------------------------------------------------------

def test_softmax_row_shift_invariance_and_not_column_shift():
    g = gen(5)
    s = torch.randn(3, 7, 7, generator=g, dtype=torch.float64)
    assert br.softmax_shift_gap(s, 10 * torch.randn(3, 7, generator=g, dtype=torch.float64)) < 1e-12
    col = torch.softmax(s + torch.randn(7, generator=g, dtype=torch.float64), -1)
    assert float((col - torch.softmax(s, -1)).abs().max()) > 1e-3   # a column shift is seen


def test_centering_removes_one_rank_per_sequence():
    g = gen(6)
    x = torch.randn(12, 30, generator=g, dtype=torch.float64)        # two sequences of 6 tokens
    groups = torch.tensor([0] * 6 + [1] * 6)
    xc = br.centered(x, groups)
    assert br.numeric_rank(x) == 12 and br.numeric_rank(xc) == 10
    assert torch.allclose(xc[:6].mean(0), torch.zeros(30, dtype=torch.float64), atol=1e-12)


def test_constant_key_shift_is_invisible_to_position_free_attention():
    """q_i . (k_j + c) = q_i . k_j + q_i . c: a row constant, so softmax(QK^T) is unchanged."""
    g = gen(7)
    x = torch.randn(5, 16, generator=g, dtype=torch.float64)
    wq, wk = (torch.randn(4, 16, generator=g, dtype=torch.float64) for _ in range(2))
    feats = {"x": x[None], "wo": torch.zeros(4, 4, dtype=torch.float64)}
    labels = torch.full((1, 5), 1)
    dk = br.constant_key_update(feats, labels, generator=g)
    x = x[:4]                      # the feeding positions (the last token predicts nothing)
    k0, k1 = x @ wk.T, x @ (wk + dk).T
    assert torch.allclose(k1 - k0, (k1 - k0)[:1].expand_as(k0), atol=1e-10)   # same shift
    mask = torch.triu(torch.ones(4, 4, dtype=torch.bool), 1)
    a0 = torch.softmax((x @ wq.T @ k0.T).masked_fill(mask, -math.inf), -1)
    a1 = torch.softmax((x @ wq.T @ k1.T).masked_fill(mask, -math.inf), -1)
    assert float((a1 - a0).abs().max()) < 1e-10 and float(dk.norm()) > 0.1


def test_loss_and_feeding_positions():
    labels = torch.tensor([[-100, -100, 5, 6, -100], [-100, 7, -100, -100, -100]])
    assert br.loss_positions(labels).tolist() == [[False, True, True, False, False],
                                                  [True, False, False, False, False]]
    assert br.feeding_positions(labels).tolist() == [[True, True, True, False, False],
                                                     [True, False, False, False, False]]


# -- C3 / C4: LoRA with weight decay, the perturbed problem ---------------------------------------

def test_psd_perturbation_is_generic():
    p = br.psd_perturbation(7, 0)
    ev = torch.linalg.eigvalsh(p)
    assert float(ev.min()) > 0 and abs(float(ev.max()) - 1) < 1e-12
    assert torch.allclose(p, p.T)


def test_lora_stationary_points_match_the_trace_norm_problem():
    pytest.importorskip("peft")
    pb = problem(n=30, d_in=8, d_out=6, k=3, lam=0.05, eps=1e-3, seed=8)
    d_cvx, info = br.prox_grad(pb, steps=5000)
    r_star = br.numeric_rank(d_cvx, 1e-6)
    assert r_star <= 3
    d_lora, linfo = br.train_lora(pb, rank=2 * r_star, seed=0)
    assert linfo["grad_norm"] < 1e-6
    assert br.numeric_rank(d_lora, 1e-5) == r_star < 2 * r_star       # rank-deficient
    assert abs(linfo["objective"] - info["objective"]) < 1e-7
    # weight decay is the variational trace norm at a balanced stationary point
    assert abs(linfo["penalty"] - linfo["objective"]) < 1e-7
    d_small, _ = br.train_lora(pb, rank=1, seed=0)
    assert br.numeric_rank(d_small, 1e-5) == 1


def test_perturbation_gap_is_within_its_bound_and_shrinks():
    base = problem(n=30, d_in=8, d_out=6, k=3, lam=0.05, seed=9)
    d0, i0 = br.prox_grad(base, steps=6000)
    gaps = []
    for eps in (0.1, 0.01, 0.001):
        pe = br.LeastSquares(base.x, base.r, lam=base.lam, eps=eps, p=br.psd_perturbation(8, 1))
        de, _ = br.prox_grad(pe, steps=6000)
        gap = pe.objective(de, eps=0.0) - i0["objective"]
        assert -1e-9 <= gap <= br.perturbation_gap_bound(pe, d0, eps) + 1e-9
        gaps.append(gap)
    assert gaps[0] > gaps[1] > gaps[2]


def test_spectral_complexity_hand_cases():
    x = torch.eye(4, dtype=torch.float64) * 2          # n = 4, S = I: ||S|| = 1, tr S = 4
    assert abs(br.spectral_complexity(x, d_out=9, tau=1.0) - (3 + 2) / 2) < 1e-12
    assert abs(br.spectral_complexity(x, 9, 2.0) - 2 * br.spectral_complexity(x, 9, 1.0)) < 1e-12
    # a flatter spectrum with the same trace has a smaller top eigenvalue: a smaller bound
    spiky = torch.diag(torch.tensor([2.0, 0, 0, 0], dtype=torch.float64))   # tr S = 1, ||S|| = 1
    flat = torch.eye(4, dtype=torch.float64)                                  # tr S = 1, ||S|| = 1/4
    assert abs(br.spectral_complexity(spiky, 9, 1.0) - (3 + 1) / 2) < 1e-12
    assert abs(br.spectral_complexity(flat, 9, 1.0) - (1.5 + 1) / 2) < 1e-12
    assert abs(br.spearman([1, 2, 3], [10, 20, 30]) - 1) < 1e-12
    assert abs(br.spearman([1, 2, 3], [3, 2, 1]) + 1) < 1e-12


# -- real features of the zoo LM ---------------------------------------------------------------

@pytest.fixture(scope="module")
def lm():
    from workbench.data import tasks
    from workbench.data.packing import task_batch
    from workbench.models import zoo
    model, tok = zoo.load("lm-tiny", "smoke")
    model.set_attn_implementation("eager")
    for p in model.parameters():
        p.requires_grad_(False)
    batch = task_batch(tok, tasks.generate("sub", 4, 0, 1))
    return model, batch


def test_real_features_null_update_is_invisible(lm):
    """C1 on the zoo LM: a large q/k/v/MLP update with D X^T = 0 on this batch's features of the
    last block leaves the loss unchanged; a random update of the same norm does not."""
    model, batch = lm
    feats = br.block_features(model, batch)
    f = br.feeding_positions(batch["labels"])
    xf = feats["x"][f]
    assert br.bottleneck_rank(xf) < xf.shape[1]           # few tokens: a real null space
    base = float(br.lm_loss(model, batch))
    name = f"model.layers.{len(model.model.layers) - 1}.self_attn.v_proj"
    hooks = br.DeltaHooks(model, [name])
    try:
        null = br.null_update(xf, 128, gen(0))
        null = null / null.norm() * 50
        with torch.no_grad():
            hooks.deltas[name].copy_(null.float())
        with torch.no_grad():
            assert abs(float(br.lm_loss(model, batch)) - base) < 1e-4
        rand = torch.randn(128, 128, generator=gen(1), dtype=torch.float64)
        with torch.no_grad():
            hooks.deltas[name].copy_((rand / rand.norm() * 50).float())
        with torch.no_grad():
            assert abs(float(br.lm_loss(model, batch)) - base) > 1e-2
    finally:
        hooks.remove()


def test_real_scores_row_shift_and_learned_query_in_bound(lm):
    """C2 on the zoo LM: the real attention is row-shift invariant, and a learned query update
    lies in the span of the loss positions' features (rank <= |S| < rank(X_F))."""
    model, batch = lm
    feats = br.block_features(model, batch)
    a = feats["attn"]
    logits = torch.log(a.clamp_min(1e-300))                  # scores up to a row constant
    assert br.softmax_shift_gap(logits, torch.randn(a.shape[:-1], generator=gen(2),
                                                     dtype=torch.float64)) < 1e-6
    bases = br.attention_bases(feats, batch["labels"])
    name = f"model.layers.{len(model.model.layers) - 1}.self_attn.q_proj"
    d, losses = br.learn_update(model, batch, name, lam=1e-3, steps=5, lr=2.0)
    assert losses[-1] < losses[0]
    assert br.outside_energy(d, bases["query"]) < 1e-4
    assert bases["ranks"]["query"] < bases["ranks"]["generic"]
    assert br.numeric_rank(d) <= bases["ranks"]["query"]
    assert br.outside_energy(d, bases["key"]) > 1e-2         # the query bound is not the key's
