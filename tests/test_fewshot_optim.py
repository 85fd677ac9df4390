"""Paper 15's diagnostics: budget matching, the second-moment estimator, power iteration."""
import math

import pytest

torch = pytest.importorskip("torch")

from workbench.diagnostics import top_hessian_eigenvalue  # noqa: E402
from workbench.methods import fewshot_optim as fo  # noqa: E402
from workbench.models import clip  # noqa: E402
from workbench.data import images  # noqa: E402

TINY = clip.ClipSize(dim=16, vision_layers=1, text_layers=1, heads=2, mlp=32, proj=8, steps=2,
                     n_per_class=2)


@pytest.fixture(scope="module")
def tiny():
    tok = clip.tokenizer()
    return clip.make_model(TINY, len(tok)).eval(), tok


def _support(n=3, k=2):
    names = list(images.SHAPES_HELDOUT[:n])
    x, y, _ = images.shapes(names, k, seed=3)
    return names, torch.as_tensor(x), torch.as_tensor(y)


def test_budget_matching_makes_first_step_norms_equal(tiny):
    model, tok = tiny
    names, x, y = _support()
    clf = fo.FewShotClassifier(model, tok, names, "full")
    sgd = fo.first_step_update(clf, x, y, "sgd", 1e-2)
    adam = fo.first_step_update(clf, x, y, "adam", 1e-3)
    assert sgd > 0 and adam > 0 and abs(adam - sgd) / sgd > 0.1     # they differ before matching
    lr = fo.budget_matched_lr(1e-3, adam, sgd)
    assert fo.first_step_update(clf, x, y, "adam", lr) == pytest.approx(sgd, rel=1e-3)


def test_first_step_update_restores_the_model(tiny):
    model, tok = tiny
    names, x, y = _support()
    clf = fo.FewShotClassifier(model, tok, names, "full")
    before = [p.detach().clone() for p in clf.trainable()]
    fo.first_step_update(clf, x, y, "adam", 1e-3)
    assert all(torch.equal(a, b) for a, b in zip(before, clf.trainable()))


def test_second_moment_estimator_on_known_gradients():
    # logits = x W with W = 0: the cross-entropy gradient of example i is x_i (1/C - e_{y_i})^T
    class Lin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.W = torch.nn.Parameter(torch.zeros(3, 2))

        def trainable(self):
            return [self.W]

        def forward(self, x):
            return x @ self.W

    x = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 1.0]])
    y = torch.tensor([0, 1])
    onehot = torch.nn.functional.one_hot(y, 2).float()
    g = [torch.outer(x[i], 0.5 - onehot[i]).reshape(-1) for i in range(2)]
    expect = (g[0] ** 2 + g[1] ** 2) / 2
    assert torch.allclose(fo.per_example_sq_grads(Lin(), x, y), expect)
    r, s = fo.second_moment_ratio(torch.tensor([0.5, 2.0, 0.25, 1.0]), torch.ones(4))
    assert torch.allclose(r, torch.tensor([0.5, 2.0, 0.25, 1.0]))
    assert s["frac_below_1"] == 0.5 and s["median"] == pytest.approx(0.5)


def test_per_example_sq_grads_matches_a_manual_loop(tiny):
    model, tok = tiny
    names, x, y = _support(2, 2)
    clf = fo.FewShotClassifier(model, tok, names, "linear")      # head only: 2 x proj coords
    v = fo.per_example_sq_grads(clf, x, y)
    manual = sum(torch.autograd.grad(torch.nn.functional.cross_entropy(clf(x[i:i + 1]), y[i:i + 1]),
                                     [clf.head])[0].reshape(-1) ** 2 for i in range(len(x))) / len(x)
    assert v.shape == (2 * TINY.proj,) and torch.allclose(v, manual)


def test_power_iteration_matches_the_exact_top_eigenvalue():
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=g))
    eig = torch.tensor([5.0, 2.0, 1.0, 0.5, -0.3, 0.1])
    A = q @ torch.diag(eig) @ q.T
    w = torch.nn.Parameter(torch.randn(6, generator=g))
    lam = top_hessian_eigenvalue(lambda: 0.5 * w @ A @ w, [w], iters=200, tol=1e-8,
                                 generator=torch.Generator().manual_seed(1))
    assert lam == pytest.approx(5.0, rel=1e-4)


def test_every_mode_trains_only_its_parameters(tiny):
    model, tok = tiny
    names, x, y = _support()
    counts = {}
    for mode in ("full", "linear", "coop", "lora", "adapter"):
        clf = fo.FewShotClassifier(model, tok, names, mode)
        counts[mode] = sum(p.numel() for p in clf.trainable())
        before = [p.detach().clone() for p in clf.trainable()]
        fo.train(clf, x, y, "adamw", 1e-2, 2)
        assert any(not torch.equal(a, b) for a, b in zip(before, clf.trainable())), mode
    assert counts["linear"] == 3 * TINY.proj and counts["coop"] == 4 * TINY.dim
    assert counts["full"] > counts["lora"] > 0 and counts["adapter"] > 0


class _OneWeight(torch.nn.Module):
    """Two-class logits (w x, 0): a one-parameter classifier whose gradients are easy by hand."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.3))

    def forward(self, x):
        return torch.stack([self.w * x, torch.zeros_like(x)], dim=-1)

    def trainable(self):
        return [self.w]


def test_numerator_aligned_adam_first_step_is_lr_g_full_over_g_support():
    """The bias-corrected first moment is the full-data gradient, so the first update
    is lr * g_full / (|g_support| + eps) (seeding the raw moment made it 1 / (1 - beta1) = 10x)."""
    lr = 1e-3
    x, y = torch.tensor([1.0, -2.0]), torch.tensor([0, 0])          # the support set
    xf, yf = torch.tensor([1.0, -2.0, 0.5, 3.0]), torch.tensor([0, 0, 1, 1])   # the full data
    clf = _OneWeight()
    g_support = torch.autograd.grad(torch.nn.functional.cross_entropy(clf(x), y), clf.w)[0]
    g_full = torch.autograd.grad(torch.nn.functional.cross_entropy(clf(xf), yf), clf.w)[0]
    assert abs(float(g_full)) > 0 and abs(float(g_full) - float(g_support)) > 1e-3
    w0 = float(clf.w)
    fo.train(clf, x, y, "adam_numerator", lr, steps=1, numerator_grad=[g_full])
    want = -lr * float(g_full) / (abs(float(g_support)) + 1e-8)
    assert float(clf.w) - w0 == pytest.approx(want, rel=1e-4)
    # plain Adam's first step is lr * sign(g_support): the seeding is what changes it
    clf2 = _OneWeight()
    fo.train(clf2, x, y, "adam", lr, steps=1)
    assert float(clf2.w) - w0 == pytest.approx(-lr * float(torch.sign(g_support)), rel=1e-4)


def test_a_frozen_tower_trains_on_features_computed_once_with_the_same_numbers(tiny):
    """Linear probe, CoOp and CLIP-Adapter compute the image features once; the weights they
    reach are those of a loop that runs the whole classifier every step."""
    model, tok = tiny
    names, x, y = _support()
    for mode in ("linear", "coop", "adapter"):
        torch.manual_seed(0)
        fast = fo.FewShotClassifier(model, tok, names, mode)
        torch.manual_seed(0)
        slow = fo.FewShotClassifier(model, tok, names, mode)
        assert fast.frozen_tower
        fo.train(fast, x, y, "adamw", 1e-2, 3)
        opt = fo.make_optimizer("adamw", slow.trainable(), 1e-2)
        for _ in range(3):
            loss = torch.nn.functional.cross_entropy(slow(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        for a, b in zip(fast.trainable(), slow.trainable()):
            assert torch.allclose(a, b, atol=1e-6), mode
    assert not fo.FewShotClassifier(model, tok, names, "lora").frozen_tower


def test_training_stops_at_the_first_non_finite_loss(tiny):
    model, tok = tiny
    names, x, y = _support()
    clf = fo.FewShotClassifier(model, tok, names, "full")
    with torch.no_grad():
        clf.head.fill_(float("nan"))
    losses = fo.train(clf, x, y, "sgd", 1e-2, 5)
    assert len(losses) == 1 and math.isnan(losses[0])


def test_correct_is_per_item_and_accuracy_is_its_mean(tiny):
    model, tok = tiny
    names, x, y = _support()
    clf = fo.FewShotClassifier(model, tok, names, "full")
    right = fo.correct(clf, x, y)
    assert right.dtype == torch.bool and right.shape == y.shape
    assert fo.accuracy(clf, x, y) == pytest.approx(float(right.float().mean()))
    assert torch.equal(right, clf(x).argmax(-1) == y)


def test_a_preconditioner_that_cannot_be_computed_ends_the_run_as_diverged(tiny, monkeypatch):
    """Shampoo's SVD of blown-up statistics fails to converge: the run stops, its last loss NaN."""
    model, tok = tiny
    names, x, y = _support()

    class Broken(torch.optim.SGD):
        def step(self, closure=None):
            raise torch.linalg.LinAlgError("linalg.svd: the algorithm failed to converge")

    monkeypatch.setattr(fo, "make_optimizer", lambda name, params, lr: Broken(list(params), lr=lr))
    clf = fo.FewShotClassifier(model, tok, names, "full")
    losses = fo.train(clf, x, y, "shampoo", 1e-1, 5)
    assert len(losses) == 2 and math.isfinite(losses[0]) and math.isnan(losses[1])
