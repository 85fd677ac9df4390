"""Paper 03 (HDCA): the radial compression, the Poincare distance classifier and the adapters.
geoopt's Poincare ball is the reference geometry."""
import math
import warnings

import pytest

torch = pytest.importorskip("torch")

with warnings.catch_warnings():       # geoopt 0.5.1 calls the deprecated torch.jit.script
    warnings.simplefilter("ignore", DeprecationWarning)
    import geoopt  # noqa: E402  (the test extra's reference, not optional)

from workbench.methods import hdca  # noqa: E402


def _rand(n, d, seed=0, scale=1.0):
    return scale * torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _unit(n, d, seed=0):
    return torch.nn.functional.normalize(_rand(n, d, seed), dim=-1)


# -- compression (eq. 1) ------------------------------------------------------------------------

@pytest.mark.parametrize("c", [0.5, 1.0, 16.0])
def test_compression_keeps_direction_and_matches_geoopt_expmap0(c):
    u = _rand(50, 12, 1) * torch.logspace(-4, 1, 50, dtype=torch.float64)[:, None]
    k = hdca.compress(u, c)
    cos = torch.nn.functional.cosine_similarity(k, u, dim=-1)
    assert torch.allclose(cos, torch.ones_like(cos), atol=1e-12)
    ball = geoopt.PoincareBall(c=c)
    assert torch.allclose(k, ball.expmap0(u, project=False), atol=1e-10)
    r = u.norm(dim=-1)
    assert torch.allclose(k.norm(dim=-1), torch.tanh(math.sqrt(c) * r) / math.sqrt(c), atol=1e-12)


@pytest.mark.parametrize("c", [1.0, 16.0])
def test_compression_is_monotone_bounded_and_identity_near_zero(c):
    r = torch.logspace(-6, 3, 400, dtype=torch.float64)
    u = r[:, None] * torch.tensor([[0.6, -0.8]], dtype=torch.float64)
    rho = hdca.compress(u, c).norm(dim=-1)
    assert (rho.diff() >= -1e-12).all() and (rho.diff()[:200] > 0).all()   # monotone (strict until
    # float64 saturates tanh at the top of the range; 1e-12: norm round-off)
    assert (rho < 1 / math.sqrt(c) + 1e-12).all() and (rho <= r + 1e-15).all()   # bounded, shrinks
    ratio = hdca.compression_ratio(r, c)
    assert ratio[0] == pytest.approx(1.0, abs=1e-9)               # ratio -> 1 as the norm -> 0
    assert (ratio.diff() <= 1e-15).all()                          # decreasing: sublinear growth
    assert ratio[-1] < 1e-2 and float(hdca.compression_ratio(0.0, c)) == 1.0


def test_compression_off_is_the_identity():
    u = _rand(4, 3)
    assert hdca.compress(u, 0.0) is u


# -- Poincare ball (eq. 3) ----------------------------------------------------------------------

@pytest.mark.parametrize("c", [1.0, 4.0])
def test_mobius_add_and_distance_match_geoopt(c):
    ball = geoopt.PoincareBall(c=c)
    x = ball.expmap0(_rand(30, 8, 2, 0.5 / math.sqrt(c)))
    y = ball.expmap0(_rand(30, 8, 3, 0.8 / math.sqrt(c)))
    assert torch.allclose(hdca.mobius_add(x, y, c), ball.mobius_add(x, y), atol=1e-10)
    d = hdca.poincare_distance(x, y, c)
    assert torch.allclose(d, ball.dist(x, y), atol=1e-8)
    assert torch.allclose(d, hdca.poincare_distance(y, x, c), atol=1e-10)      # symmetric
    # closed form: arcosh(1 + 2c|x-y|^2 / ((1 - c|x|^2)(1 - c|y|^2))) / sqrt(c)
    num = 2 * c * ((x - y) ** 2).sum(-1)
    den = (1 - c * (x ** 2).sum(-1)) * (1 - c * (y ** 2).sum(-1))
    assert torch.allclose(d, torch.acosh(1 + num / den) / math.sqrt(c), atol=1e-8)
    assert hdca.poincare_distance(x, x, c).abs().max() < 1e-6


def test_poincare_tau_matches_the_cosine_logit_range():
    z = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=torch.float64)
    w = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    lp = hdca.poincare_logits(z, w, scale=30.0, alpha=1.0, c=1.0)
    assert float(lp[0, 0] - lp[1, 0]) == pytest.approx(60.0, rel=1e-9)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_poincare_classifier_keeps_the_cosine_ranking(seed):
    z, w = _unit(200, 16, seed), _unit(12, 16, seed + 10)
    lc = hdca.cosine_logits(z, w, 30.0)
    lp = hdca.poincare_logits(z, w, 30.0, alpha=1.0, c=1.0)
    assert torch.equal(lc.argmax(-1), lp.argmax(-1))
    assert torch.equal(lc.argsort(-1), lp.argsort(-1))
    assert not torch.allclose(lc - lc.mean(-1, keepdim=True), lp - lp.mean(-1, keepdim=True),
                              atol=1e-2)        # the same order, different logits


def test_poincare_gradient_is_reshaped_where_similarity_is_high():
    cos = torch.tensor([-0.5, 0.0, 0.5, 0.9, 0.99])
    gc = hdca.logit_slope(cos, "cosine", 30.0)
    gp = hdca.logit_slope(cos, "poincare", 30.0)
    assert torch.allclose(gc, torch.full_like(gc, 30.0))            # cosine: a constant slope
    assert (gp > 0).all() and (gp.diff() > 0).all()                 # grows with similarity
    assert gp[-1] / gp[1] > 3


# -- adapters (eq. 2) ---------------------------------------------------------------------------

def test_adapter_starts_as_the_identity_and_freezes_old_sessions():
    f = _unit(10, 8).float()
    ad = hdca.HDCAAdapter(8, rank=2, per_session=True, c_task=4.0, c_cum=4.0)
    ad.new_session()
    assert torch.allclose(ad(f), f, atol=1e-6)
    assert len(ad.trainable()) == 2
    ad.new_session()
    assert len(ad.adapters) == 2 and len(ad.trainable()) == 2
    assert all(not p.requires_grad for p in ad.adapters[0].parameters())
    seq = hdca.HDCAAdapter(8, rank=2, per_session=False)
    seq.new_session()
    seq.new_session()
    assert len(seq.adapters) == 1 and len(seq.trainable()) == 2


def test_displacement_is_bounded_per_task_and_cumulatively():
    f = _unit(20, 8, 4).float()
    ad = hdca.HDCAAdapter(8, rank=3, per_session=True, c_task=4.0, c_cum=16.0)
    for _ in range(4):
        ad.new_session()
        with torch.no_grad():
            ad.adapters[-1].B.normal_(0, 50.0)                     # huge raw updates
    raw = sum(ad.residuals(f)).norm(dim=-1)
    per_task = torch.stack([hdca.compress(u, 4.0).norm(dim=-1) for u in ad.residuals(f)])
    assert (per_task <= 0.5 + 1e-6).all()
    disp = ad.displacement(f).norm(dim=-1)
    assert (disp <= 0.25 + 1e-6).all() and (raw > 10).all()
    plain = hdca.HDCAAdapter(8, rank=3, per_session=True)
    plain.adapters = ad.adapters                                  # the same factors, no kappa
    assert torch.allclose(plain.displacement(f).norm(dim=-1), raw)


# -- the in-encoder adapter (eq. 2') -------------------------------------------------------------

def _tiny_clip():
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection
    torch.manual_seed(0)
    cfg = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                           num_attention_heads=4, image_size=8, patch_size=4, projection_dim=12)
    return CLIPVisionModelWithProjection(cfg).eval()


def _hidden(vm, x, n_blocks):
    """The hidden states entering the first of the last ``n_blocks`` blocks."""
    h = vm.pre_layrnorm(vm.embeddings(pixel_values=x))
    for layer in vm.encoder.layers[: len(vm.encoder.layers) - n_blocks]:
        h = layer(h, None)
        h = h[0] if isinstance(h, tuple) else h
    return h


@pytest.mark.parametrize("n_blocks", [1, 2, 3])
def test_encoder_adapter_without_sessions_is_clips_own_image_embedding(n_blocks):
    m = _tiny_clip()
    vm, layers = m.vision_model, m.vision_model.encoder.layers
    x = torch.rand(5, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = torch.nn.functional.normalize(m(pixel_values=x).image_embeds, dim=-1)
        ad = hdca.EncoderHDCA(layers[-n_blocks:], vm.post_layernorm, m.visual_projection, 2)
        hm = hdca.block_inputs(layers[-n_blocks], _hidden(vm, x, n_blocks))
        assert torch.allclose(ad(hm), ref, atol=1e-5)
        ad.new_session()                                           # B = 0: still the identity
        assert torch.allclose(ad(hm), ref, atol=1e-5)


def test_encoder_adapter_is_a_compressed_branch_beside_the_last_mlp():
    # one block: h'' = h' + MLP(LN2(h')) + R(LN2(h')) on the class token, then pooled and projected
    m = _tiny_clip()
    vm, layer = m.vision_model, m.vision_model.encoder.layers[-1]
    x = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    ad = hdca.EncoderHDCA([layer], vm.post_layernorm, m.visual_projection, 2, True, 0.5, 0.25)
    ad.new_session()
    with torch.no_grad():
        ad.sites[0].adapters[0].B.normal_(0, 3.0)
        h = _hidden(vm, x, 1)
        hm = hdca.block_inputs(layer, h)
        out, mid = hm[:, 0, 0], hm[:, 0, 1]
        r = hdca.compress(hdca.compress(ad.sites[0].adapters[0](mid), 0.5), 0.25)
        want = torch.nn.functional.normalize(m.visual_projection(vm.post_layernorm(out + r)), dim=-1)
        assert torch.allclose(ad(hm), want, atol=1e-5)
        assert torch.allclose(ad.displacement(hm)[:, 0], r, atol=1e-6)
        assert (ad.displacement(hm).norm(dim=-1) <= 2.0 + 1e-5).all()   # 1 / sqrt(0.25)


def test_encoder_adapter_state_is_the_factors_of_each_site_and_session():
    m = _tiny_clip()
    vm, layers = m.vision_model, m.vision_model.encoder.layers
    ad = hdca.EncoderHDCA(layers[-2:], vm.post_layernorm, m.visual_projection, 3, True, 1.0, 1.0)
    ad.new_session()
    ad.new_session()
    keys = set(ad.state_dict())
    assert keys == {f"sites.{i}.adapters.{s}.{p}" for i in (0, 1) for s in (0, 1) for p in "AB"}
    assert len(ad.trainable()) == 4                                # the newest session's A, B x 2
    hm = hdca.block_inputs(layers[-2], _hidden(vm, torch.rand(3, 3, 8, 8), 2)).detach()
    assert [u.shape for u in ad.residuals(hm)] == [(3, 2, 16)] * 2
