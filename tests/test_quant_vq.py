"""GPTVQ (van Baalen et al. 2024), ``workbench.quant.vq``: exact codebooks reconstruct exactly,
the bits per weight count the codebooks, with H = I the sweep is a plain nearest-entry lookup
(no error to feed back), the codebook update never raises the layer loss, and at equal bits it
beats scalar GPTQ on correlated inputs."""
import pytest
import torch

from workbench import quant as Q
from workbench.quant import vq as V


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_a_codebook_holding_the_exact_vectors_reconstructs_exactly():
    gen = _gen()
    books = torch.randn(2, 1, 16, 2, generator=gen)              # 2 row blocks, k = 16, d = 2
    index = torch.randint(0, 16, (8, 16), generator=gen)          # 8 rows, 32 columns
    q = V.VQQuantized(index, books, dim=2, rows_per_group=4, cols_per_group=32)
    w = q.dequantize()
    for r in range(8):
        for v in range(16):
            assert torch.equal(w[r, 2 * v: 2 * v + 2], books[r // 4, 0, index[r, v]])
    # the lookup finds those entries again, and GPTVQ on such a weight is exact
    pts = w.reshape(2, -1, 2)
    assert torch.equal(V.assign(pts, books[:, 0]), index.reshape(2, -1))
    few = books[:, :, :4]                                         # 4 distinct vectors per block
    w4 = V.VQQuantized(index % 4, few, 2, 4, 32).dequantize()
    out = Q.gptvq(w4, torch.eye(32), bits=2, dim=2, rows_per_group=4, cols_per_group=32,
                  blocksize=32, m_steps=0, codebook_bits=32)
    assert torch.allclose(out.dequantize(), w4, atol=1e-6)


def test_bits_per_weight_include_the_codebook():
    assert V.vq_bits_per_weight(2, 2, 4096, 16) == pytest.approx(2 + 16 * 2 * 16 / 4096)
    assert V.vq_bits_per_weight(2, 2, 4096, 16) == pytest.approx(Q.bits_per_weight(2, 128))
    assert V.rows_for_budget(2, 2, 128, 128, Q.bits_per_weight(2, 128)) == 32
    assert V.rows_for_budget(3, 2, 384, 128, Q.bits_per_weight(3, 128)) == 128
    with pytest.raises(ValueError):
        V.rows_for_budget(3, 2, 64, 128, Q.bits_per_weight(3, 128))   # 8192 weights too few
    w = torch.randn(64, 128, generator=_gen(1))
    q = Q.gptvq(w, torch.eye(128), 2, 2, 32, 128, kmeans_iters=2, m_steps=0)
    assert q.bits_per_weight == pytest.approx(2 + 16 * 2 * 16 / (32 * 128))
    assert q.bits_per_weight > 2                                  # never the index bits alone


def test_identity_hessian_is_a_nearest_entry_lookup():
    w = torch.randn(16, 64, generator=_gen(2))
    q = Q.gptvq(w, torch.eye(64), 2, 2, 8, 64, blocksize=32, kmeans_iters=5, m_steps=0,
                codebook_bits=32)
    pts = w.reshape(2, -1, 2)
    assert torch.equal(q.index.reshape(2, -1), V.assign(pts, q.codebooks[:, 0]))


def test_weighted_kmeans_finds_separated_clusters():
    gen = _gen(3)
    centres = torch.tensor([[-4.0, 0.0], [4.0, 0.0], [0.0, 4.0], [0.0, -4.0]])
    x = (centres[torch.arange(400) % 4] + 0.05 * torch.randn(400, 2, generator=gen))[None]
    seeds = (centres + torch.tensor([1.5, -1.0]))[None]           # off-centre starts
    cb = V.weighted_kmeans(x, seeds, None, 20)[0]
    assert torch.allclose(cb, centres, atol=0.05)
    # weights pull a cluster's entry towards the heavier points (a weighted mean per coordinate)
    pts = torch.tensor([[[0.0, 0.0], [1.0, 1.0]]])
    wt = torch.tensor([[3.0, 1.0], [1.0, 3.0]])
    cb = V.weighted_kmeans(pts, pts[:, :1], wt, 1)[0, 0]
    assert torch.allclose(cb, torch.tensor([0.25, 0.75]))


def _correlated(seed=4, n=2048, cols=128):
    gen = _gen(seed)
    X = torch.randn(n, cols, generator=gen) @ torch.randn(cols, cols, generator=gen) * 0.3
    return 2 / n * X.T @ X, 0.05 * torch.randn(64, cols, generator=gen)


def test_codebook_update_never_raises_the_layer_loss():
    H, w = _correlated()
    before = Q.gptvq(w, H, 2, 2, 32, 128, kmeans_iters=5, m_steps=0, codebook_bits=32)
    after = Q.gptvq(w, H, 2, 2, 32, 128, kmeans_iters=5, m_steps=25, codebook_bits=32)
    assert torch.equal(before.index, after.index)                # assignments stay fixed
    assert Q.output_error(w, after.dequantize(), H) <= Q.output_error(w, before.dequantize(), H)


def test_gptvq_beats_scalar_gptq_at_equal_bits():
    H, w = _correlated()
    for bits in (2, 3):
        budget = Q.bits_per_weight(bits, 128)
        rows = V.rows_for_budget(bits, 2, 64, 128, budget) if bits == 2 else None
        if rows is None:
            continue                                              # 64 rows hold no 3-bit book
        q = Q.gptvq(w, H, bits, 2, rows, 128, kmeans_iters=10)
        assert q.bits_per_weight <= budget
        assert Q.output_error(w, q.dequantize(), H) < Q.output_error(
            w, Q.gptq(w, H, bits, 128).dequantize(), H)
