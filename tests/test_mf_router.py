"""RouteLLM's matrix-factorization router (notebook 11's published baseline): the score is the
reference's bilinear form, the win rate is Bradley-Terry, and training fits the battles."""
import torch

from workbench.methods import mf_router as M


def test_score_is_the_bilinear_form_on_hand_made_values():
    r = M.MFRouter(n_models=2, text_dim=3, dim=2)
    with torch.no_grad():
        r.P.weight.copy_(torch.tensor([[3.0, 4.0], [0.0, -2.0]]))     # unit: (.6, .8), (0, -1)
        r.text_proj.weight.copy_(torch.tensor([[1.0, 0.0, 1.0], [0.0, 2.0, 0.0]]))
        r.classifier.weight.copy_(torch.tensor([[1.0, -1.0]]))
    e = torch.tensor([[1.0, 1.0, 1.0]])                               # W e = (2, 2)
    s = r.score(e)
    assert torch.allclose(s, torch.tensor([[0.6 * 2 - 0.8 * 2, 0.0 * 2 + 1.0 * 2]]))
    assert torch.allclose(r.score(e, torch.tensor([1])), s[:, 1])
    assert not any(m.bias is not None for m in (r.text_proj, r.classifier))


def test_score_is_linear_in_the_prompt_and_blind_to_the_model_embeddings_norm():
    torch.manual_seed(0)
    r = M.MFRouter(3, 5, 4)
    a, b = torch.randn(2, 5), torch.randn(2, 5)
    assert torch.allclose(r.score(2 * a - b), 2 * r.score(a) - r.score(b), atol=1e-5)
    before = r.score(a)
    with torch.no_grad():
        r.P.weight.mul_(7.0)
    assert torch.allclose(r.score(a), before, atol=1e-6)


def test_win_probability_is_bradley_terry():
    torch.manual_seed(1)
    r = M.MFRouter(3, 5, 4)
    e = torch.randn(6, 5)
    p = r.win_prob(e, 0, 2)
    assert torch.allclose(p + r.win_prob(e, 2, 0), torch.ones(6))
    assert torch.allclose(p, torch.sigmoid(r.score(e)[:, 0] - r.score(e)[:, 2]))
    assert torch.allclose(r.win_prob(e, 1, 1), torch.full((6,), 0.5))


def test_battles_pit_the_label_against_every_other_candidate():
    win, lose, q = M.battles(torch.tensor([2, 0]), 3)
    assert sorted(zip(win.tolist(), lose.tolist(), q.tolist())) == \
        [(0, 1, 1), (0, 2, 1), (2, 0, 0), (2, 1, 0)]


def test_training_learns_a_separable_routing():
    torch.manual_seed(0)
    e = torch.randn(200, 6)
    labels = (e[:, 0] > 0).long()                                     # model 1 wins where e_0 > 0
    r = M.train_mf(e, labels, 2, M.MFSettings(dim=8, lr=1e-2, epochs=30, noise=0.1))
    with torch.no_grad():
        assert (r.route(e).argmax(1) == labels).float().mean() > 0.95
