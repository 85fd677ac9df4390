"""AWQ (Lin et al. 2024), ``workbench.quant.awq``: alpha 0 is RTN, the scales are the reference's
normalized ``mean|x|^alpha``, and on inputs with salient channels the searched alpha lowers the
output error against alpha 0."""
import torch

from workbench import quant as Q


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_alpha_zero_is_rtn():
    gen = _gen()
    w = torch.randn(16, 64, generator=gen)
    act = torch.rand(64, generator=gen) * 5
    s = Q.awq_scales(act, 0.0)
    assert torch.equal(s, torch.ones(64))
    assert torch.equal(Q.awq_weight(w, s, 3, 32), Q.rtn(w, 3, 32).dequantize())
    wq, info = Q.awq(w, torch.eye(64), act, 3, 32, n_grid=1)      # the grid {0}
    assert info["alpha"] == 0 and torch.equal(wq, Q.rtn(w, 3, 32).dequantize())


def test_scales_are_normalized_powers_of_the_activation_means():
    act = torch.tensor([0.5, 1.0, 2.0, 8.0])
    s = Q.awq_scales(act, 0.5)
    raw = act.sqrt()
    assert torch.allclose(s, raw / (raw.max() * raw.min()).sqrt())
    assert torch.allclose(s.max() * s.min(), torch.tensor(1.0))


def test_searched_alpha_lowers_the_output_error_with_salient_channels():
    gen = _gen(1)
    X = torch.randn(4096, 64, generator=gen)
    X[:, :4] *= 25                                               # four salient input channels
    H = 2 / len(X) * X.T @ X
    w = torch.randn(32, 64, generator=gen) * 0.1
    wq, info = Q.awq(w, H, X.abs().mean(0), 3, 64)
    assert info["alpha"] > 0
    assert info["errors"][info["alpha"]] < 0.9 * info["errors"][0.0]
    assert Q.output_error(w, wq, H) < Q.output_error(w, Q.rtn(w, 3, 64).dequantize(), H)


def test_mean_abs_inputs_average_each_channel():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 6)
            self.lin = torch.nn.Linear(6, 3)

        def forward(self, input_ids):
            return self.lin(self.emb(input_ids))

    m = Tiny()
    ids = torch.randint(0, 10, (5, 7), generator=_gen(2))
    got = Q.mean_abs_inputs(m, {"lin": m.lin}, ids, batch_size=2)["lin"]
    want = m.emb(ids).detach().reshape(-1, 6).abs().mean(0)
    assert torch.allclose(got, want, atol=1e-6)
