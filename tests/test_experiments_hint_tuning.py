"""The harness of notebook 06 (workbench.experiments.hint_tuning): the problems drawn, the
baselines' frontier, budget forcing, the hint reader's data, the C1-C4 bookkeeping."""
import math

import numpy as np
import pandas as pd
import pytest
import torch

from workbench.data import tasks
from workbench.experiments import hint_tuning as X
from workbench.methods import hint_tuning as ht


def test_problems_are_disjoint_seeded_and_per_level():
    fams = ("add", "count")
    levels = sum(len(tasks.get(f).difficulties) for f in fams)
    rng = np.random.default_rng(0)
    train, test = X.draw_problems(fams, "train", 3, rng), X.draw_problems(fams, "test", 2, rng)
    assert len(train) == 3 * levels and len(test) == 2 * levels
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    again = X.draw_problems(fams, "train", 3, np.random.default_rng(0))
    assert [e.prompt for e in again] == [e.prompt for e in train]
    lv = [X.relative_level(e) for e in train]
    assert min(lv) == 0.0 and max(lv) == 1.0


def test_states_and_c4_rows_from_probes():
    exs = tasks.generate("add", 3, seed=0, difficulty=2)
    probes = [ht.Probe([], "1", True, [], True, ht.NO_HINT, 0),
              ht.Probe(["a", "b"], "2", False, [True], True, ht.SPARSE_HINT, 1),
              ht.Probe(["a"], "3", False, [], False, ht.FULL_HINT, None)]
    states = X.state_table(exs, probes, [e.completion(True) for e in exs])
    assert states.state.tolist() == [0, 1, 2] and states.r_correct.tolist() == [1.0] * 3
    assert states.n_steps.tolist() == [0, 2, 1]
    orig = pd.DataFrame({"acc": [1.0, 1.0], "tokens": [10, 30]})
    tuned = pd.DataFrame({"acc": [1.0, 0.0], "tokens": [4, 16]})

    class _M:
        def parameters(self):
            return [torch.zeros(5), torch.zeros(2, 3)]
    row = X.model_row(_M(), orig, tuned, probes)
    assert row["parameters"] == 11 and row["token_reduction"] == pytest.approx(0.5)
    assert row["accuracy_drop"] == pytest.approx(0.5) and row["no_hint_share"] == pytest.approx(1 / 3)
    assert X.passes_c2(0.5, 0.05) and not X.passes_c2(0.5, 0.06) and not X.passes_c2(0.19, 0.0)


def test_summary_reduction_and_drop():
    ev = {"original": pd.DataFrame({"family": ["add"] * 2, "difficulty": [1, 2],
                                    "acc": [1.0, 0.5], "tokens": [10, 30]}),
          "hint-tuned": pd.DataFrame({"family": ["add"] * 2, "difficulty": [1, 2],
                                      "acc": [1.0, 0.0], "tokens": [2, 30]})}
    summary, reduction, drop, per_level = X.summarize(ev)
    assert reduction == pytest.approx(1 - 16 / 20) and drop == pytest.approx(0.25)
    assert per_level[("reduction", "tokens")].tolist() == pytest.approx([0.8, 0.0])
    assert summary.equals(X.accuracy_tokens(ev))


def test_frontier_is_the_upper_hull_of_the_baselines():
    pts = [(2, 0.2), (10, 0.6), (30, 0.7), (6, 0.1)]     # (6, 0.1) is dominated
    assert X.frontier_at(pts, 1) == -math.inf           # shorter than every baseline
    assert X.frontier_at(pts, 2) == pytest.approx(0.2)
    assert X.frontier_at(pts, 6) == pytest.approx(0.4)  # on the chord (2, .2)-(10, .6)
    assert X.frontier_at(pts, 20) == pytest.approx(0.65)
    assert X.frontier_at(pts, 100) == pytest.approx(0.7)
    # a point under the chord of its neighbours does not lift the frontier
    assert X.frontier_at(pts + [(20, 0.61)], 20) == pytest.approx(0.65)


def test_truncation_forces_an_answer_within_the_budget():
    torch = pytest.importorskip("torch")
    from workbench.models import zoo
    model, tok = zoo.load("lm-micro")
    exs = tasks.generate("kv", 6, seed=0, difficulty=2)
    prompts = [e.prompt for e in exs]
    for budget in (0, 3):
        outs = X.truncated_generate(model, tok, prompts, budget, answer_tokens=2)
        for o in outs:
            assert "=>" in o
            head = o.split("=>")[0]
            assert ht.count_tokens(tok, [head.rstrip()])[0] <= budget + 1
    assert torch is not None


def test_reader_data_reads_prefixes_and_answers_directly():
    prompts, comps = X.reader_data(("add", "chain"), 5, seed=0)
    assert len(prompts) == 5 * (4 + 5)
    for p, c in zip(prompts, comps):
        assert p.endswith(" =>") and "=>" not in c and ";" not in c


def test_prose_metrics_are_scalars_per_family():
    mk = lambda acc, tok: pd.DataFrame({"family": ["add", "add", "count"], "difficulty": [1, 2, 3],
                                        "acc": acc, "tokens": tok})
    ev = {"original": mk([1.0, 1.0, 1.0], [10, 30, 20]), "hint-tuned": mk([1.0, 0.0, 0.5], [5, 15, 2])}
    points = X.accuracy_tokens({**ev, "direct-only": mk([0.0] * 3, [1, 1, 1])})
    share = pd.Series([0.5, 0.25, 0.25])
    c4 = pd.DataFrame({"lm-reasoning": {"parameters": 10, "token_reduction": 0.5}}).T
    out = X.prose_metrics({"add": {"rho": 0.7}}, share, ev, points, 0.9, c4)
    assert out["c2_reduction_add"] == pytest.approx(0.5) and out["c2_acc_tuned_count"] == 0.5
    assert out["c1_share_sparse_hint"] == 0.25 and out["c4_lm_reasoning_parameters"] == 10.0
    assert out["c3_acc_direct"] == 0.0 and "c3_acc_truncate0" not in out
    assert all(isinstance(v, (int, float)) for v in out.values())


def test_hint_ladder_follows_each_probe_and_agrees_with_its_state():
    exs = tasks.generate("add", 4, seed=0, difficulty=2)
    probes = [ht.Probe([], "1", True, [], True, ht.NO_HINT, 0),
              ht.Probe(["a", "b", "c"], "2", False, [False, True], True, ht.SPARSE_HINT, 2),
              ht.Probe(["a", "b"], "3", False, [False], True, ht.FULL_HINT, None),
              ht.Probe(["a"], "4", False, [], False, ht.FULL_HINT, None)]
    lad = X.hint_ladder(exs, probes)
    assert sorted(lad.k.unique()) == [0, 1, 2, 3] and len(lad) == 4 * 4
    agree = lad.pivot(index="k", columns="n_steps", values="agree")
    assert agree[0].tolist() == [True] * 4                        # no steps: unaided at every k
    assert agree[3].tolist() == [False, False, True, True]        # sparse k = 2, full hint at 3
    assert agree[2].tolist() == [False, False, True, True]        # full hint from k = 2 on
    assert not lad[lad.n_steps == 1].agree.any()
    for p, (_, g) in zip(probes, lad.groupby("n_steps", sort=False)):
        first = g[g.reached].k.min() if g.reached.any() else None  # the probe's least guidance
        if p.state == ht.NO_HINT:
            assert first == 0
        elif p.state == ht.SPARSE_HINT:
            assert first == p.k
    assert lad[lad.n_steps == 3].reached.tolist() == [False, False, True, True]


def test_distillation_set_keeps_the_shortest_correct_sample_and_grpo_rewards_it_most():
    from workbench.models import zoo
    model, tok = zoo.load("lm-micro")
    e = tasks.generate("add", 1, seed=0, difficulty=2)[0]
    wrong = e.completion(True).replace(e.target, e.target + "1")
    long_ = e.completion(True) + "\nmore"                       # only the first line counts
    short = " " + e.target
    prompts, targets = X.shortest_traces([e, e], [[wrong, long_, short], [wrong]], tok)
    assert prompts == [e.prompt] and targets == [short]
    reward = X.length_reward([e], tok, alpha=0.2)
    r = reward([e.prompt] * 3, [wrong, long_, short], idx=[0, 0, 0])
    assert r[0] == 0.0 and r[2] > r[1] >= 0.8
    outs = X.sample(model, tok, [e.prompt, e.prompt + " "], k=3, max_new_tokens=4, seed=1)
    assert [len(o) for o in outs] == [3, 3] and all(isinstance(c, str) for o in outs for c in o)


def test_validation_problems_leave_the_training_draw_as_it_was():
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    plain = X.draw_problems(["add", "count"], "train", 4, rng_a)
    train, val = X.split_validation(X.draw_problems(["add", "count"], "train", 6, rng_b), 4)
    assert [e.prompt for e in train] == [e.prompt for e in plain]
    assert len(val) == 2 * (len(tasks.get("add").difficulties) + len(tasks.get("count").difficulties))
    assert not {e.prompt for e in val} & {e.prompt for e in train}
    # the generator moved as a draw of 4 moves it: the held-out draw after it is the same
    assert [e.prompt for e in X.draw_problems(["add"], "test", 3, rng_a)] == \
        [e.prompt for e in X.draw_problems(["add"], "test", 3, rng_b)]


def test_hint_rate_is_the_largest_cut_within_five_points_else_the_smallest_drop():
    t = pd.DataFrame({"drop": [0.02, 0.04, 0.10, 0.30], "reduction": [0.10, 0.25, 0.40, 0.60]},
                     index=[1e-3, 2e-3, 5e-3, 1e-2])
    assert X.pick_hint_rate(t) == 2e-3
    worse = t.assign(drop=[0.2, 0.08, 0.3, 0.4])
    assert X.pick_hint_rate(worse) == 2e-3
    assert X.pick_hint_rate(worse.assign(drop=[0.08, 0.08, 0.3, 0.4])) == 1e-3


def test_one_rate_or_no_validation_is_used_as_given():
    called = []
    picks, table = X.choose_rates(None, None, [], [1e-3, 2e-3], lambda m, lr: called.append(m),
                                    8)
    assert picks == {"hint": 1e-3, "direct": 1e-3, "distill": 1e-3} and table.empty
    picks, _ = X.choose_rates(None, None, ["x"], [5e-3], None, 8, methods=("hint",))
    assert picks == {"hint": 5e-3} and not called
