"""Loss signatures (paper 18): inflection points, deterministic signatures, token sub-sampling
and selection."""
import numpy as np
import pytest

from workbench.data import tasks
from workbench.methods import loss_signature as ls


@pytest.mark.parametrize("centre,width", [(0.3, 0.05), (0.5, 0.1), (0.8, 0.07)])
def test_inflection_of_a_logistic_curve(centre, width):
    x = np.linspace(0, 1.2, 41)
    lo, hi = 0.4, 5.0
    y = lo + (hi - lo) / (1 + np.exp(-(x - centre) / width))
    xi, yi = ls.inflection(x, y)
    assert xi == pytest.approx(centre, abs=0.02)
    assert yi == pytest.approx((lo + hi) / 2, rel=0.05)        # half way up a logistic


def test_inflection_on_a_coarse_uneven_grid_and_without_a_sign_change():
    x = np.array([0.0, 0.1, 0.2, 0.35, 0.5, 0.7, 1.0])
    y = 1 + 3 / (1 + np.exp(-(x - 0.35) / 0.08))
    xi, _ = ls.inflection(x, y)
    assert 0.2 <= xi <= 0.5
    # convex everywhere (no bend): the steepest rise, at the last interval's midpoint
    xc, yc = ls.inflection(x, np.exp(3 * x))
    assert xc == pytest.approx(0.85) and yc == pytest.approx(np.interp(0.85, x, np.exp(3 * x)))
    with pytest.raises(ValueError):
        ls.inflection([0, 1], [0, 1])


def test_subsample_picks_the_requested_fraction_of_labelled_tokens():
    torch = pytest.importorskip("torch")
    labels = torch.full((3, 400), -100)
    labels[0, 10:210] = 1          # 200 labelled tokens
    labels[1, 0:400] = 1           # 400
    labels[2, 50:53] = 1           # 3: fewer than one token at 1%
    for frac, want in ((0.01, [2, 4, 1]), (0.005, [1, 2, 1]), (0.1, [20, 40, 1]), (1.0, [200, 400, 3])):
        m = ls.subsample_mask(labels, frac, seed=0)
        assert m.sum(1).tolist() == want
        assert not (m & (labels == -100)).any()        # only labelled positions are read
    assert torch.equal(ls.subsample_mask(labels, 0.1, 5), ls.subsample_mask(labels, 0.1, 5))
    assert not torch.equal(ls.subsample_mask(labels, 0.1, 5), ls.subsample_mask(labels, 0.1, 6))
    with pytest.raises(ValueError):
        ls.subsample_mask(labels, 0.0, 0)


def _micro_pool():
    from workbench.data import packing
    from workbench.models import zoo
    model, tok = zoo.load("lm-micro")
    exs = tasks.generate("add", 6, seed=0, difficulty=2)
    b = packing.pad(packing.encode(tok, [e.prompt for e in exs], [e.completion(True) for e in exs]),
                    tok.pad_token_id)
    return model, b


def test_signatures_are_deterministic_for_a_seed_and_restore_the_weights():
    torch = pytest.importorskip("torch")
    model, b = _micro_pool()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mask = ls.subsample_mask(b["labels"], 0.5, seed=1)
    scales = [0.0, 0.2, 0.5]
    s1 = ls.signatures(model, [b], [mask], ls.low_rank_directions(model, 3, 2, seed=7), scales)
    s2 = ls.signatures(model, [b], [mask], ls.low_rank_directions(model, 3, 2, seed=7), scales)
    s3 = ls.signatures(model, [b], [mask], ls.low_rank_directions(model, 3, 2, seed=8), scales)
    assert s1.shape == (6, 3, 3) and np.array_equal(s1, s2) and not np.allclose(s1, s3)
    # sigma = 0 is the unperturbed loss, the same for every direction
    assert np.allclose(s1[:, :, 0], ls.masked_losses(model, b, mask)[:, None])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_directions_are_low_rank_and_scaled_to_the_weight():
    torch = pytest.importorskip("torch")
    model, _ = _micro_pool()
    (d,) = ls.low_rank_directions(model, 1, 2, seed=0)
    layers = ls.perturbed_layers(model)
    assert set(d) == set(layers) and len(d) >= 4
    for n, delta in d.items():
        assert torch.linalg.matrix_rank(delta.double(), rtol=1e-5) == 2
        assert float(delta.norm()) == pytest.approx(float(layers[n].weight.norm()), rel=1e-5)


def test_select_subset_round_robin_hardest_first():
    scores = np.array([0.1, 0.9, 0.5, 0.8, 0.2, 0.7, 0.3])
    clusters = np.array([0, 0, 0, 1, 1, 2, 2])
    assert ls.select_subset(scores, clusters, 5) == [1, 3, 5, 2, 4]
    assert sorted(ls.select_subset(scores, clusters, 99)) == list(range(7))


def test_cluster_nmi_sees_planted_clusters_and_chance_is_low():
    rng = np.random.default_rng(0)
    cats = np.repeat([0, 1, 2], 50)
    feats = rng.normal(size=(150, 4)) + 4 * np.eye(3, 4)[cats]
    r = ls.cluster_nmi(feats, cats, 3, seed=0, n_perm=50)
    assert r["nmi"] > 0.9 and r["chance_p99"] < 0.1
    r0 = ls.cluster_nmi(rng.normal(size=(150, 4)), cats, 3, seed=0, n_perm=50)
    assert r0["nmi"] < 0.15


def test_teacher_scores_pick_the_lowest():
    s = ls.teacher_scores([1.0, 2.0, 0.5, 0.7, 3.0], ["a", "b", "a", "c", "b"])
    assert s == {"a": 0.75, "b": 2.5, "c": 0.7}
