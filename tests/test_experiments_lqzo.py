"""The harness of notebook 02 (LQZO): the task data, the gradient spectrum, the per-layer
estimator quality against its theory, the memory count, ZO fine-tuning and the ViT run."""
import numpy as np
import pytest
import torch

from workbench import evaluate
from workbench.experiments import lqzo as ex
from workbench.methods import lqzo as M
from workbench.models import zoo
from tiny_models import TwoLayerNet


_Net = TwoLayerNet


def test_task_data_draws_the_pool_from_the_train_side_only():
    _, tok = zoo.load("lm-micro")
    d = ex.task_data(tok, "sub", 1, seed=3, device="cpu", n_pool=64)
    train, held = {e.prompt for e in d["train_ex"]}, {e.prompt for e in d["held_ex"]}
    assert not train & held and {e.prompt for e in d["pool"]} <= train
    assert len(d["pool"]) == len(d["train"]["input_ids"]) == 64
    assert len(d["held"]["input_ids"]) == len(d["held_ex"])
    again = ex.task_data(tok, "sub", 1, seed=3, device="cpu", n_pool=64)
    assert [e.prompt for e in again["pool"]] == [e.prompt for e in d["pool"]]


def test_gradient_spectrum_sees_a_rank_one_gradient():
    g = torch.outer(torch.arange(1.0, 9.0), torch.tensor([1.0, -2.0, 0.5, 3.0]))
    (s,) = ex.gradient_spectrum(["model.layers.0.self_attn.q_proj"], [g], rank=1, seed=0)
    assert s["layer"] == "0.q_proj" and s["shape"] == (8, 4)
    assert s["energy_top_r"] == pytest.approx(1.0) and s["energy_top1"] == pytest.approx(1.0)
    assert 0.25 < s["energy_top_r_null"] < s["energy_top_r_null_q"] < 0.9   # random 8 x 4
    assert s["beats_null"]


def test_gradient_spectrum_null_is_a_test_at_its_level():
    """Unstructured gradients beat the same-shape null's 95th percentile about 5% of the time;
    layers of one shape share one null."""
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(16, 4, generator=gen) for _ in range(60)] + [torch.randn(16, 8)]
    spec = ex.gradient_spectrum([f"model.layers.{i}.mlp.up_proj" for i in range(61)], grads,
                                rank=2, seed=0)
    assert sum(s["beats_null"] for s in spec[:60]) / 60 < 0.2
    assert len({s["energy_top_r_null_q"] for s in spec[:60]}) == 1
    assert spec[60]["energy_top_r_null"] < spec[0]["energy_top_r_null"]   # 2 of 8 < 2 of 4


def test_layer_quality_meets_the_unbiased_law_theory():
    """Any law with E[zz^T] = I gives D E[cos^2] ~ 1; a full Gaussian's squared error over D is
    1 + 1/D (E[d^2 ||z||^2] = (D + 2) ||g||^2) and its sqrt(D) E|cos| is ~ sqrt(2/pi)."""
    g = [torch.randn(16, 4, generator=torch.Generator().manual_seed(1))]
    laws = {"full": M.Perturbation("gaussian"), "lqzo": M.Perturbation("bag", 2, True)}
    q = ex.layer_quality(laws, g, n=4000, seed=0)
    for name in laws:
        assert q[name]["cos2"][0] == pytest.approx(1.0, rel=0.1)
    assert q["full"]["sq_err"][0] == pytest.approx(1.0 + 1 / 64, rel=0.1)
    assert q["full"]["cos"][0] == pytest.approx(np.sqrt(2 / np.pi), rel=0.05)


def test_memory_profile_a_zo_step_holds_inference_memory():
    torch.manual_seed(0)
    q, scales = M.quantize(_Net(), 3, 8)
    params = list(scales.values())
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    loss_fn = lambda: ((q(x) - y) ** 2).mean()                      # noqa: E731
    mem = ex.memory_profile(q, params, loss_fn,
                            lambda: M.zo_step(loss_fn, params, M.Perturbation("bag", 2), 1, 1e-3, 1e-3))
    assert mem["zo_step"]["saved"] == mem["inference"]["saved"] == 0
    assert mem["zo_step"]["total"] == mem["inference"]["total"] < mem["backprop"]["total"]
    assert mem["backprop"]["grads"] == ex.tensor_bytes(params)
    assert all(p.grad is None for p in params)


def test_zo_finetune_moves_only_the_scales_and_is_reproducible():
    model, tok = zoo.load("lm-micro")
    d = ex.task_data(tok, "add", 1, seed=0, device="cpu", n_pool=32)
    d["held_ex"] = d["held_ex"][:8]
    d["held"] = ex.subset(d["held"], torch.arange(8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kw = dict(bits=4, group_size=32, data=d, tok=tok, steps=6, batch=4, eval_every=3, lr=1e-5,
              eps=1e-3, fp_lr=1e-4, fp_eps=1e-3, seed=0)
    p = M.Perturbation("bag", 2, True)
    r = ex.zo_finetune(model, "LQZO", p, **kw)
    assert [s for s, _ in r["curve"]] == [0, 3, 6] and len(r["train_loss"]) == 6
    codes = M.codes_snapshot(M.quantize(model, 4, 32)[0])
    assert all(torch.equal(c, M.codes_snapshot(r["model"])[n]) for n, c in codes.items())
    assert r["curve"] == ex.zo_finetune(model, "LQZO", p, **kw)["curve"]
    fp = ex.zo_finetune(model, "fp MeZO", M.Perturbation("gaussian"), **kw)
    assert fp["curve"][-1][1] != fp["curve"][0][1] and 0 <= fp["acc"] <= 1
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())   # copies only


def test_vit_experiment_is_seeded():
    laws = {"QZO": M.Perturbation("gaussian"), "LQZO": M.Perturbation("bag", 2, True)}
    a = ex.vit_experiment(3, 8, laws, train_steps=20, zo_steps=3, lr=1e-4, eps=1e-3, seed=1,
                          device="cpu")
    assert list(a) == ["fp", "INT3 RTN", "QZO", "LQZO"] and all(0 <= v <= 1 for v in a.values())
    assert a == ex.vit_experiment(3, 8, laws, train_steps=20, zo_steps=3, lr=1e-4, eps=1e-3,
                                  seed=1, device="cpu")


def test_item_losses_average_to_the_batch_loss_when_answers_have_one_length():
    model, tok = zoo.load("lm-micro")
    d = ex.task_data(tok, "sub", 2, seed=0, device="cpu", n_pool=8, n_held=12)
    assert len(d["held_ex"]) == 12
    again = ex.task_data(tok, "sub", 2, seed=5, device="cpu", n_pool=8, n_held=12)
    assert [e.prompt for e in again["held_ex"]] == [e.prompt for e in d["held_ex"]]  # seed-free
    per = ex.item_losses(model, d["held"])
    n_tok = (d["held"]["labels"][:, 1:] != -100).sum(1).double().numpy()
    with torch.no_grad():
        batch = float(ex.lm_loss(model, d["held"]))
    assert per.shape == (12,)
    assert np.sum(per * n_tok) / n_tok.sum() == pytest.approx(batch, rel=1e-5)  # token-weighted
    correct = evaluate.item_scores(model, tok, d["held_ex"])
    assert set(np.unique(correct)) <= {0.0, 1.0}
    out = ex.paired(np.ones(40), np.zeros(40))
    assert out["diff"] == 1.0 and out["low"] == 1.0 and out["n_items"] == 40


def test_vit_experiment_hands_back_per_image_correctness():
    laws = {"QZO": M.Perturbation("gaussian")}
    items = {}
    acc = ex.vit_experiment(3, 8, laws, train_steps=10, zo_steps=2, lr=1e-4, eps=1e-3, seed=0,
                            device="cpu", items=items)
    assert list(items) == ["QZO"] and items["QZO"].mean() == pytest.approx(acc["QZO"])


def test_width_losses_score_the_rtn_model_at_each_width():
    model, tok = zoo.load("lm-micro")
    d = ex.task_data(tok, "sub", 1, seed=0, device="cpu", n_pool=8)
    w = ex.width_losses(model, d, 32, widths=(4, 2))
    with torch.no_grad():
        at2 = float(ex.lm_loss(M.quantize(model, 2, 32)[0], d["held"]))
    assert list(w) == [4, 2] and w[2] == pytest.approx(at2)


def test_rank_view_reads_the_spectrum_and_scores_both_laws_on_the_same_draws():
    g = torch.outer(torch.arange(1.0, 9.0), torch.ones(4))          # rank one, 8 x 4
    p = M.Perturbation("bag", 2, True)
    v = ex.rank_view(g, p, n=256, seed=0)
    assert v["D"] == 32 and np.isclose(v["energy"][0], 1.0) and len(v["energy"]) == 4
    assert len(v["energy_reshaped"]) == min(M.near_square(32)) and np.isclose(v["energy"][-1], 1)
    assert v["law"] == ex.linearized_quality([g.double()], p, 256, 0)
    assert v["qzo"] == ex.linearized_quality([g.double()], M.Perturbation("gaussian"), 256, 0)
    d_cos2 = 32 * np.mean(np.square(v["qzo"]["cos"]))
    assert 0.7 < d_cos2 < 1.3                                       # E[cos^2] = 1/D
    fig = ex.rank_figure(v, p, "0.q_proj")
    assert len(fig.axes) == 2
