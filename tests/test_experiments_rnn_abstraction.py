"""The harness of notebook 17 (workbench.experiments.rnn_abstraction) at tiny sizes: the
transition statistic, the ablated states, the control RNNs, the rank profile (C3's control) and
the transfer runs."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

from workbench.data.patterns import make_task  # noqa: E402
from workbench.experiments import rnn_abstraction as xp  # noqa: E402
from workbench.methods import rnn_abstraction as ra  # noqa: E402

S = dict(hidden=8, embed_dim=4, steps=3, batch=16, shuffled_seqs=32, nt_steps=4, nt_batch=8,
         inner_seeds=2, eval_every=2)


def _task():
    return make_task(12, 6, 3, generator=torch.Generator().manual_seed(0))


def test_transition_R_is_one_for_a_linear_code_and_small_for_noise():
    rng = np.random.default_rng(0)
    trans = rng.integers(0, 2, (400, 2)).astype(float)
    proj = np.zeros((400, 3))
    proj[:, 1] = 2 * trans[:, 0] - 1
    proj[:, 2] = trans[:, 0] + 3 * trans[:, 1]
    assert xp.transition_R(proj, trans) == pytest.approx([1.0, 1.0])
    assert max(xp.transition_R(rng.normal(size=(400, 3)), trans)) < 0.25
    H = rng.normal(size=(400, 3, 5))
    r = xp.random_direction_R(H, trans, seed=1, n=4)
    assert len(r) == 4 and r == xp.random_direction_R(H, trans, seed=1, n=4)


def test_ablated_states_keep_the_intact_network_and_remove_the_leading_component():
    task = _task()
    m = ra.PatternRNN(task.vocab_size, 8, 4, task.n_classes, generator=torch.Generator().manual_seed(0))
    tokens = task.sample(20, "novel", torch.Generator().manual_seed(1))["tokens"]
    W = m.w_hh.detach()
    finals = xp.ablated_final_states(m, tokens, W, seed=0, n_rand=3)
    assert list(finals) == ["intact", "leading", "random0", "random1", "random2"]
    with torch.no_grad():
        assert np.allclose(finals["intact"], m.states(tokens)[:, -1].numpy(), atol=1e-6)
    assert not np.allclose(finals["leading"], finals["intact"])


def test_transfer_runs_start_every_condition_from_the_same_init():
    task = _task()
    g = torch.Generator().manual_seed(0)
    shuf = xp.shuffled_label_rnn(task, S, lr=1e-2, weight_decay=0.0, input_seed=7, generator=g, device="cpu")
    part = ra.scaffold(shuf.w_hh.detach(), 1)
    ev = {s: task.sample(16, s, torch.Generator().manual_seed(2))["tokens"] for s in ("train", "novel")}
    parts = {"random init": None, "again": None, "scaffold": part}
    curves, models = xp.transfer_runs(task, parts, S, lr=1e-2, weight_decay=0.0, input_seed=7, eval_batch=ev,
                                      seed=0, device="cpu")
    assert [len(curves[n]) for n in parts] == [2, 2, 2] and set(models) == set(parts)
    for i in range(2):                      # identical conditions: identical curves
        assert np.array_equal(curves["random init"][i]["train"], curves["again"][i]["train"])
    assert curves["scaffold"][0]["train"][0] != curves["random init"][0]["train"][0]
    assert list(curves["random init"][0]["step"]) == [0, 2, 4]
    auc, final = xp.transfer_summary(curves)
    assert auc["again"] == auc["random init"] and len(final["scaffold"]) == 2
    assert final["scaffold"][0] == pytest.approx(float(np.mean(curves["scaffold"][0]["novel"][-3:])))


def test_rank_profile_of_a_spiked_matrix():
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(32, 32, generator=g, dtype=torch.float64) / 32 ** 0.5
    u = torch.randn(32, 1, generator=g, dtype=torch.float64)
    spiked = noise + 4 * (u @ u.T) / u.norm() ** 2
    flat, low = xp.rank_profile(noise), xp.rank_profile(spiked)
    assert set(low) == {"stable_rank", "erank", "n_outliers", "top1_energy"}
    assert low["stable_rank"] < flat["stable_rank"] / 2 and low["erank"] < flat["erank"]
    assert (flat["n_outliers"], low["n_outliers"]) == (0, 1)
    s = torch.linalg.svdvals(spiked)
    assert low["top1_energy"] == pytest.approx(float(s[0] ** 2 / (s ** 2).sum()))
    assert low["stable_rank"] == pytest.approx(1 / low["top1_energy"])


def test_pattern_classifier_trains_like_the_notebook_and_decay_changes_it():
    task = _task()
    m = xp.pattern_classifier(task, S, lr=1e-2, weight_decay=0.0, input_seed=7,
                              generator=torch.Generator().manual_seed(4), device="cpu")
    g = torch.Generator().manual_seed(4)                   # the notebook's inline path
    ref = ra.PatternRNN(task.vocab_size, S["hidden"], S["embed_dim"], task.n_classes,
                        input_seed=7, generator=g)
    ra.train_classifier(ref, task, S["steps"], S["batch"], 1e-2, weight_decay=0.0, generator=g)
    assert torch.equal(m.w_hh, ref.w_hh) and torch.equal(m.table, ref.table)
    decayed = xp.pattern_classifier(task, S, lr=1e-2, weight_decay=0.5, input_seed=7,
                                    generator=torch.Generator().manual_seed(4), device="cpu")
    assert decayed.w_hh.norm() < m.w_hh.norm()


def test_ablation_sweep_starts_intact_and_cutting_every_component_leaves_no_memory():
    task = _task()
    m = ra.PatternRNN(task.vocab_size, 8, 4, task.n_classes,
                      generator=torch.Generator().manual_seed(0))
    seqs = task.sample(400, "novel", torch.Generator().manual_seed(1))
    trans = seqs["transitions"].numpy()
    t = xp.ablation_sweep(m, seqs["tokens"], m.w_hh.detach(), trans, seqs["label"], seed=0,
                          k_max=8, n_rand=2)
    assert len(t) == 2 * 9 * (1 + trans.shape[1])          # ablations x k x what is read
    at0 = t[t["components cut"] == 0].pivot(index="read out", columns="ablation", values="accuracy")
    assert np.allclose(at0.iloc[:, 0], at0.iloc[:, 1])      # k = 0: both are the intact network
    # W_hh = 0: the final state sees the last token only, so no transition is remembered
    gone = t[(t["components cut"] == 8) & (t.ablation == "top k singular components")]
    assert (gone[gone["read out"].str.startswith("transition")].accuracy < 0.7).all()
