"""Paper 13: the quotient geometry of LoRA, its Frechet mean, the Fisher special case, and weight
matching. Each test states a property the paper relies on and would fail if the code were wrong."""
import pytest
import torch

from workbench.experiments.frechet import mlp_forward
from workbench.methods import frechet as fr


def _pair(m, n, r, gen, scale=1.0):
    return (scale * torch.randn(m, r, generator=gen, dtype=torch.float64),
            scale * torch.randn(r, n, generator=gen, dtype=torch.float64))


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def test_reparameterization_keeps_the_product_but_moves_the_naive_merge(gen):
    pairs = [_pair(12, 9, 3, gen) for _ in range(3)]
    fs = [{"m": p} for p in pairs]
    re = [fr.reparameterize(f, gen) for f in fs]
    for f, g in zip(fs, re):
        assert torch.allclose(f["m"][0] @ f["m"][1], g["m"][0] @ g["m"][1], atol=1e-10)
    nb, na = fr.merge_naive(pairs)
    rb, ra = fr.merge_naive([g["m"] for g in re])
    assert (nb @ na - rb @ ra).norm() > 0.1 * (nb @ na).norm()


def test_quotient_merge_is_invariant_and_identity_on_equal_inputs(gen):
    pairs = [_pair(12, 9, 3, gen) for _ in range(3)]
    (b, a), hist = fr.merge_quotient(pairs)
    re = [fr.reparameterize({"m": p}, gen)["m"] for p in pairs]
    (b2, a2), _ = fr.merge_quotient(re)
    assert torch.allclose(b @ a, b2 @ a2, atol=1e-9)
    # the Karcher objective never increases
    assert all(h1 >= h2 - 1e-12 for h1, h2 in zip(hist, hist[1:]))
    # equal inputs (in different gauges) merge to themselves
    x = pairs[0][0] @ pairs[0][1]
    same = [fr.reparameterize({"m": pairs[0]}, gen)["m"] for _ in range(3)]
    (b3, a3), _ = fr.merge_quotient(same)
    assert torch.allclose(b3 @ a3, x, atol=1e-9)
    # the merge is a rank-r matrix on the manifold
    assert torch.linalg.matrix_rank(b @ a).item() == 3
    assert b.shape == (12, 3) and a.shape == (3, 9)


def test_frechet_mean_of_two_on_a_shared_subspace_has_a_closed_form(gen):
    """X_i = U diag(s_i) V^T: the quotient mean is U diag(((sqrt s1 + sqrt s2) / 2)^2) V^T, and it is
    the geodesic midpoint exp(log / 2)."""
    u = torch.linalg.qr(torch.randn(10, 3, generator=gen, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(7, 3, generator=gen, dtype=torch.float64))[0]
    s1 = torch.tensor([5.0, 2.0, 1.0], dtype=torch.float64)
    s2 = torch.tensor([1.0, 3.0, 0.5], dtype=torch.float64)
    pairs = [(u * s, v.T) for s in (s1, s2)]
    (b, a), _ = fr.merge_quotient(pairs)
    expect = u @ torch.diag(((s1.sqrt() + s2.sqrt()) / 2) ** 2) @ v.T
    assert torch.allclose(b @ a, expect, atol=1e-9)
    z1, z2 = fr.balanced(*pairs[0]), fr.balanced(*pairs[1])
    mid = fr.quotient_exp(z1, fr.quotient_log(z1, z2), 0.5)
    bm, am = fr.unstack(mid, 10)
    assert torch.allclose(bm @ am, expect, atol=1e-9)
    # the geodesic is length-minimizing: d(z1, mid) = d(mid, z2) = d(z1, z2) / 2
    d = fr.quotient_distance(z1, z2)
    assert fr.quotient_distance(z1, mid) == pytest.approx(d / 2, rel=1e-9)
    assert fr.quotient_distance(mid, z2) == pytest.approx(d / 2, rel=1e-9)


def test_log_is_horizontal_and_transport_follows_the_group(gen):
    z = fr.balanced(*_pair(8, 6, 3, gen))
    zi = fr.balanced(*_pair(8, 6, 3, gen))
    v = fr.quotient_log(z, zi)
    sym = z.T @ v
    assert torch.allclose(sym, sym.T, atol=1e-10)          # horizontal: Z^T V symmetric
    q = torch.linalg.qr(torch.randn(3, 3, generator=gen, dtype=torch.float64))[0]
    # log at another representative Z Q is the transported log, and the distance is unchanged
    assert torch.allclose(fr.quotient_log(z @ q, zi), fr.transport(v, q), atol=1e-9)
    assert fr.quotient_distance(z @ q, zi @ q.T) == pytest.approx(fr.quotient_distance(z, zi))


def test_svd_merge_is_the_best_rank_r_approximation_of_the_mean(gen):
    pairs = [_pair(9, 8, 2, gen) for _ in range(3)]
    b, a = fr.merge_svd(pairs)
    mean = sum(p[0] @ p[1] for p in pairs) / 3
    s = torch.linalg.svdvals(mean)
    assert float((mean - b @ a).norm() ** 2) == pytest.approx(float((s[2:] ** 2).sum()), rel=1e-9)


def test_fisher_merge_is_the_flat_frechet_mean():
    g = torch.Generator().manual_seed(1)
    thetas = [torch.randn(50, generator=g, dtype=torch.float64) for _ in range(3)]
    fishers = [torch.rand(50, generator=g, dtype=torch.float64) ** 2 for _ in range(3)]
    closed = fr.fisher_merge(thetas, fishers)
    numeric, _ = fr.frechet_flat(thetas, fishers)
    assert torch.allclose(closed, numeric, atol=1e-7)
    # with equal Fishers it is the plain average, and it is not the average otherwise
    assert torch.allclose(fr.fisher_merge(thetas, [torch.ones(50)] * 3), sum(thetas) / 3)
    assert (closed - sum(thetas) / 3).abs().max() > 0.1


def test_mlp_fisher_matches_per_sample_autograd():
    from torch.func import grad, vmap
    g = torch.Generator().manual_seed(3)
    layers = _mlp(g, (4, 5, 3))
    x = torch.randn(7, 4, generator=g, dtype=torch.float64)
    shapes = [t.shape for wb in layers for t in wb]
    theta = torch.cat([t.reshape(-1) for wb in layers for t in wb])

    def logp(th, xi, c):
        parts, i = [], 0
        for sh in shapes:
            parts.append(th[i: i + sh.numel()].view(sh))
            i += sh.numel()
        return torch.log_softmax(mlp_forward(list(zip(parts[::2], parts[1::2])), xi[None]), -1)[0, c]

    p = torch.softmax(mlp_forward(layers, x), -1)
    ref = sum((p[:, c:c + 1] * vmap(grad(logp), (None, 0, None))(theta, x, c) ** 2).mean(0)
              for c in range(3))
    assert torch.allclose(fr.mlp_diag_fisher(layers, x), ref, atol=1e-12)


def _mlp(gen, sizes=(5, 7, 6, 3)):
    return [(torch.randn(o, i, generator=gen, dtype=torch.float64),
             torch.randn(o, generator=gen, dtype=torch.float64)) for i, o in zip(sizes, sizes[1:])]


def test_weight_matching_recovers_a_hidden_permutation(gen):
    ref = _mlp(gen)
    perms = [torch.randperm(7, generator=gen).numpy(), torch.randperm(6, generator=gen).numpy()]
    other = fr.permute_mlp(ref, perms)
    x = torch.randn(20, 5, generator=gen, dtype=torch.float64)
    assert torch.allclose(mlp_forward(ref, x), mlp_forward(other, x))       # same function
    found = fr.weight_matching(ref, other)
    back = fr.permute_mlp(other, found)
    for (w1, b1), (w2, b2) in zip(ref, back):
        assert torch.equal(w1, w2) and torch.equal(b1, b2)


def test_peft_merges_match_the_formulas():
    """peft's ``linear`` is naive factor averaging with weights w^2, and its ``svd`` the
    truncated SVD of the weighted sum of the deltas."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=2, lora_alpha=4,
                           target_modules=["q_proj", "v_proj"], init_lora_weights=False),
                           adapter_name="t0")
    model.add_adapter("t1", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                       init_lora_weights=False))
    f0, f1 = fr.get_factors(model, "t0"), fr.get_factors(model, "t1")
    model.add_weighted_adapter(["t0", "t1"], [0.25, 0.25], "lin", combination_type="linear")
    model.add_weighted_adapter(["t0", "t1"], [0.5, 0.5], "svd", combination_type="svd")
    fl, fs = fr.get_factors(model, "lin"), fr.get_factors(model, "svd")
    for n in f0:
        b, a = fr.merge_naive([f0[n], f1[n]])
        assert torch.allclose(fl[n][0] @ fl[n][1], b @ a, atol=1e-5)
        b, a = fr.merge_svd([f0[n], f1[n]])
        assert torch.allclose(fs[n][0] @ fs[n][1], b @ a, atol=1e-5)
    # set_factors round-trips through peft's scaling
    fr.set_factors(model, "lin", f0)
    for n in f0:
        got = fr.get_factors(model, "lin")[n]
        assert torch.allclose(got[0] @ got[1], f0[n][0] @ f0[n][1], atol=1e-5)
