"""Unit tests for paper 17: pattern labelling, probes, the RNN and its helpers."""
import math

import numpy as np
import pytest
import torch

from workbench.data.patterns import (PatternTask, all_patterns, canonical, distinct_indices,
                                     make_task, transitions)
from workbench.methods import rnn_abstraction as ra


# -- pattern labelling on hand-made sequences --------------------------------------------------
@pytest.mark.parametrize("seq, pattern", [
    ([5, 5, 2], "AAB"), ([3, 9, 3], "ABA"), ([1, 4, 4], "ABB"), ([7, 7, 7], "AAA"),
    ([1, 2, 3], "ABC"), ("ccd", "AAB"), ("eef", "AAB"), ([9, 1, 9, 1], "ABAB"),
    ([2, 2, 8, 2], "AABA"), ([4, 6, 6, 0], "ABBC")])
def test_canonical_pattern(seq, pattern):
    assert canonical(seq) == pattern


def test_transitions_hand_made():
    assert transitions([5, 5, 2]) == [1, 0]
    assert transitions([3, 9, 3]) == [0, 0]
    assert transitions([1, 4, 4]) == [0, 1]
    assert transitions([7, 7, 7, 2]) == [1, 1, 0]


def test_pattern_families():
    assert all_patterns(3) == ("AAA", "AAB", "ABA", "ABB", "ABC")
    assert len(all_patterns(4)) == 15 and len(all_patterns(5)) == 52      # Bell numbers
    assert all(canonical(p) == p for p in all_patterns(4))


def test_task_labels_hand_made_and_rejects_bad_family():
    task = PatternTask(all_patterns(3), torch.arange(10), torch.arange(10, 15))
    assert task.label([5, 5, 2]) == task.patterns.index("AAB")
    assert task.label([11, 12, 11]) == task.patterns.index("ABA")
    assert task.prefixes == [("A",), ("AA", "AB"), all_patterns(3)]
    sub = PatternTask(("AAB", "ABA"), torch.arange(10), torch.arange(10, 15))
    with pytest.raises(ValueError):
        sub.label([1, 2, 3])                       # ABC is not in this family
    with pytest.raises(ValueError):
        PatternTask(("BAB",), torch.arange(10), torch.arange(10, 15))   # not canonical
    with pytest.raises(ValueError):
        PatternTask(("AAB",), torch.arange(10), torch.arange(5, 15))    # overlapping splits


@pytest.mark.parametrize("length", [3, 4])
def test_sampled_sequences_carry_consistent_labels(length):
    g = torch.Generator().manual_seed(0)
    task = make_task(30, 10, length, generator=g)
    for split in ("train", "novel"):
        b = task.sample(300, split, g)
        allowed = set(task.tokens(split).tolist())
        for tok, lab, tr, pre in zip(b["tokens"], b["label"], b["transitions"], b["prefix"]):
            assert set(tok.tolist()) <= allowed
            assert canonical(tok) == task.patterns[lab]
            assert tr.tolist() == transitions(tok)
            for t in range(length):
                assert task.prefixes[t][pre[t]] == canonical(tok[:t + 1])


def test_distinct_indices_are_distinct_and_uniform():
    x = distinct_indices(30000, 4, 2, torch.Generator().manual_seed(1))
    assert (x[:, 0] != x[:, 1]).all() and x.min() >= 0 and x.max() < 4
    counts = np.unique(x.numpy(), axis=0, return_counts=True)[1]
    assert len(counts) == 12 and counts.min() > 0.8 * 30000 / 12


def test_scaffold_rank_and_norm():
    w = torch.randn(16, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    part = ra.scaffold(w, 3)
    s = torch.linalg.svdvals(w)
    assert torch.linalg.matrix_rank(part) == 3
    assert torch.allclose(torch.linalg.svdvals(part)[:3], s[:3])
    assert math.isclose(float(ra.scaffold(w, 3, norm=2.5).norm()), 2.5, rel_tol=1e-9)


def test_outliers_of_a_spiked_random_matrix():
    g = torch.Generator().manual_seed(6)
    n = 64
    noise = torch.randn(n, n, generator=g, dtype=torch.float64) / math.sqrt(n)
    assert ra.n_outliers(noise) == 0                             # pure bulk: no outliers
    u = torch.randn(n, 2, generator=g, dtype=torch.float64)
    spiked = noise + 3 * (u[:, :1] @ u[:, 1:].T) / (u[:, 0].norm() * u[:, 1].norm())
    assert ra.n_outliers(spiked) == 1


def test_stable_rank_counts_leading_size_components_and_ignores_scale():
    g = torch.Generator().manual_seed(7)
    u, v = torch.randn(16, 1, generator=g), torch.randn(1, 16, generator=g)
    assert math.isclose(ra.stable_rank(u @ v), 1.0, rel_tol=1e-6)        # rank one
    q = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=torch.float64))[0]
    assert math.isclose(ra.stable_rank(q), 16.0, rel_tol=1e-9)           # flat spectrum: n
    d = torch.diag(torch.tensor([3.0, 1.0, 1.0, 0.0]))
    assert math.isclose(ra.stable_rank(d), (9 + 1 + 1) / 9, rel_tol=1e-9)
    assert math.isclose(ra.stable_rank(0.01 * d), ra.stable_rank(d), rel_tol=1e-9)
    assert ra.stable_rank(torch.zeros(3, 3)) == 0.0


# -- probes on a constructed linearly separable set --------------------------------------------
def test_probe_on_linearly_separable_states():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 8))
    y = (x @ rng.normal(size=8) > 0).astype(int)
    assert ra.probe_accuracy(x, y) >= 0.95
    noise_y = rng.integers(0, 2, 400)
    assert ra.probe_accuracy(x, noise_y) <= 0.65                  # labels independent of x: chance


def test_fixed_probe_transfers_and_detects_erasure():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 600)
    x = rng.normal(size=(600, 5))
    x[:, 0] += 3 * (2 * y - 1)                                   # the variable lives on axis 0
    erased = x.copy()
    erased[:, 0] = rng.normal(size=600)                          # an "ablation" removes it
    out = ra.fixed_probe(x, y, {"intact": x, "erased": erased})
    assert out["intact"] >= 0.95 and out["erased"] <= 0.6


def test_prefix_purity_and_best_k_on_clear_clusters():
    rng = np.random.default_rng(2)
    centers = rng.normal(scale=10, size=(3, 4))
    lab = rng.integers(0, 3, 300)
    x = centers[lab] + rng.normal(size=(300, 4))
    assert ra.prefix_purity(x, lab) == 1.0
    assert ra.best_k(x, 6) == 3
    assert ra.prefix_purity(rng.normal(size=(300, 4)), lab) < 0.6


# -- the RNN ------------------------------------------------------------------------------------
def test_states_with_matches_torch_rnn_and_uses_the_given_matrix():
    g = torch.Generator().manual_seed(7)
    m = ra.PatternRNN(20, hidden=16, embed_dim=8, n_out=5, generator=g)
    tok = torch.randint(0, 20, (9, 4), generator=g)
    with torch.no_grad():
        assert torch.allclose(ra.states_with(m, tok), m.states(tok), atol=1e-6)
        zero = ra.states_with(m, tok, torch.zeros(16, 16))
        r = m.rnn
        first = torch.tanh(m.table[tok] @ r.weight_ih_l0.T + r.bias_ih_l0 + r.bias_hh_l0)
        assert torch.allclose(zero, first, atol=1e-6)             # no recurrence: step-wise map


def test_input_pathway_is_fixed_and_shared():
    a = ra.PatternRNN(20, 16, 8, 5, input_seed=3, generator=torch.Generator().manual_seed(0))
    b = ra.PatternRNN(20, 16, 8, tied=True, input_seed=3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.table, b.table) and torch.equal(a.rnn.weight_ih_l0, b.rnn.weight_ih_l0)
    assert not torch.equal(a.w_hh, b.w_hh)
    assert not a.rnn.weight_ih_l0.requires_grad
    assert "table" not in dict(a.named_parameters())


def test_next_token_floor_is_the_entropy_of_the_bayes_predictor():
    task = PatternTask(("AAB", "ABA"), torch.arange(6), torch.arange(6, 12))
    # position 2: A (AAB) or one of 5 new tokens (ABA), 1/2 each; position 3: after AA a new
    # token (1 of 5), after AB the first token again
    pos2 = -0.5 * math.log(0.5) - 5 * 0.1 * math.log(0.1)
    expected = (pos2 + 0.5 * math.log(5) + 0.5 * 0) / 2
    assert math.isclose(ra.optimal_next_token_loss(task, "novel"), expected)


def test_classifier_learns_a_tiny_task():
    g = torch.Generator().manual_seed(8)
    task = make_task(20, 5, 3, generator=g)
    m = ra.PatternRNN(task.vocab_size, 24, 16, task.n_classes, generator=g)
    before = ra.accuracy(m, task.sample(500, "train", g))
    ra.train_classifier(m, task, 80, 64, 2e-2, generator=g)
    after = ra.accuracy(m, task.sample(500, "train", g))
    assert after > max(0.5, before + 0.2)


def test_identity_residual_takes_out_the_letters_and_keeps_their_equality():
    """States = a direction per letter at each position + a direction for "the two are equal":
    the residual keeps the equality (an interaction no additive model of the letters holds) and
    drops the letters."""
    rng = np.random.default_rng(0)
    n, vocab, hidden = 2000, 40, 16
    tok = rng.integers(0, vocab, (n, 2))
    tok[: n // 2, 1] = tok[: n // 2, 0]                   # half the sequences repeat the letter
    same = (tok[:, 0] == tok[:, 1]).astype(float)
    letters = rng.normal(size=(2, vocab, hidden))
    eq_dir = 0.3 * rng.normal(size=hidden)               # small against the letters
    states = letters[0][tok[:, 0]] + letters[1][tok[:, 1]] + np.outer(same, eq_dir)
    res = ra.identity_residual(states, tok, vocab, alpha=1.0, seed=0)
    # the whole state sorts the letters; the residual sorts "same" from "different"
    assert ra.prefix_purity(states, same.astype(int)) < 0.75
    assert ra.prefix_purity(res, same.astype(int)) > 0.95
    assert ra.participation_ratio(res) < 0.5 * ra.participation_ratio(states)
    # a state the letters explain additively leaves (almost) nothing
    additive = letters[0][tok[:, 0]] + letters[1][tok[:, 1]]
    left = ra.identity_residual(additive, tok, vocab, alpha=1e-3, seed=0)
    assert np.linalg.norm(left) < 0.05 * np.linalg.norm(additive - additive.mean(0))
