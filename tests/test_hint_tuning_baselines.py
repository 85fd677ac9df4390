"""06's published baselines: Arora & Zanette's length-penalized reward equals its formula and
keeps correctness first; the distillation set keeps the shortest correct sample."""
import math

import numpy as np

from workbench.methods import hint_tuning_baselines as hb


def sig(z):
    return 1 / (1 + math.exp(-z))


def test_reward_equals_the_formula_on_hand_made_values():
    # group "a": correct answers of 10 and 20 tokens (mean 15, std 5) and a wrong one of 5
    r = hb.length_penalized_reward([1, 1, 0], [10, 20, 5], ["a", "a", "a"], alpha=0.4)
    assert np.allclose(r, [1 - 0.4 * sig(-1), 1 - 0.4 * sig(1), 0.0], atol=1e-6)


def test_correctness_comes_first_and_shorter_correct_answers_earn_more():
    rng = np.random.default_rng(0)
    correct = rng.integers(0, 2, 40)
    lengths = rng.integers(3, 50, 40)
    groups = np.repeat(np.arange(10), 4)
    r = hb.length_penalized_reward(correct, lengths, groups, alpha=0.3)
    assert (r[correct == 0] == 0).all() and (r[correct == 1] >= 0.7).all()
    for g in range(10):
        ok = (groups == g) & (correct == 1)
        order = np.argsort(lengths[ok], kind="stable")
        assert (np.diff(r[ok][order]) <= 1e-12).all()          # longer never earns more


def test_groups_are_standardized_apart_and_alpha_zero_is_correctness():
    one = hb.length_penalized_reward([1, 1], [4, 8], [0, 0], 0.5)
    both = hb.length_penalized_reward([1, 1, 1, 1], [4, 8, 40, 90], [0, 0, 1, 1], 0.5)
    assert np.allclose(both[:2], one)
    assert np.allclose(hb.length_penalized_reward([1, 0, 1], [3, 9, 30], [0, 0, 1], 0.0),
                       [1, 0, 1])
    lone = hb.length_penalized_reward([1, 0], [7, 3], [0, 0], 0.5)   # one correct: at the mean
    assert np.allclose(lone, [0.75, 0.0])


def test_shortest_correct_sample():
    assert hb.shortest_correct([0, 1, 1, 1], [2, 9, 5, 5]) == 2
    assert hb.shortest_correct([0, 0], [2, 9]) is None
    assert hb.shortest_correct([True], [12]) == 0
