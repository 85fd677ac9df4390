"""The HR harness (notebook 09): the setup the sizes imply, the matched torsos, the smoothed
return, the summaries over checkpoints, and the branch-saturation diagnostic."""
import numpy as np
import pytest
import torch

from workbench.experiments import hadamard as X
from workbench.methods import hadamard as hr

S = {"env_id": "CartPole-v1", "width": 16, "total_timesteps": 1024, "n_inner_seeds": 2,
     "learning_rate": None, "relu_timesteps": 0, "threads": 1,
     "ppo": dict(learning_rate=2.5e-3, num_envs=4, num_steps=32, diag_every=2),
     "dqn": dict(learning_rate=2.5e-4, num_envs=4)}


def test_setup_applies_the_learning_rate_knob_and_the_inner_seeds():
    s = X.make_setup(S, "ppo", "tanh", 3, tau=0.1, activity_tau=0.1, device="cpu")
    assert s.inner_seeds == [300, 301] and s.family == "classic"
    assert s.agent_cfg["learning_rate"] == 2.5e-3
    s = X.make_setup(dict(S, learning_rate=1e-3), "ppo", "tanh", 0, tau=0.1, activity_tau=0.1, device="cpu")
    assert s.agent_cfg["learning_rate"] == 1e-3 and S["ppo"]["learning_rate"] == 2.5e-3
    with pytest.raises(ValueError):
        X.make_setup(S, "sac", "tanh", 0, tau=0.1, activity_tau=0.1, device="cpu")


def test_the_wide_torso_matches_hr_parameters():
    sizes = X.torso_sizes(X.make_setup(S, "ppo", "tanh", 0, tau=0.1, activity_tau=0.1, device="cpu"), 0)
    (u_std, n_std), (u_hr, n_hr), (u_wide, n_wide) = (sizes[k] for k in hr.TORSOS)
    assert u_std == u_hr == 16 and u_wide > u_hr
    assert n_hr > n_std and abs(n_wide - n_hr) <= 64 + 3      # within one unit of the wide layer


def test_smoothed_return_averages_the_last_finished_episodes():
    episodes = np.array([[10, 1.0], [20, 3.0], [30, 5.0], [40, 7.0]])
    out = X.smoothed_return(episodes, [5, 20, 40], window=2)
    assert np.isnan(out[0]) and out[1] == 2.0 and out[2] == 6.0


class _Tracker(dict):
    steps = [0, 10, 20, 30]


def _result(inactive, episodes):
    tr = _Tracker(inactive=np.array(inactive), dormant=np.zeros(4), saturated=np.array(inactive),
                  srank=np.arange(4.0), erank=np.arange(4.0) + 1)
    return {"tracker": tr, "episodes": np.array(episodes, float)}


def test_summaries_average_late_checkpoints_and_final_episodes():
    res = {k: [_result([0.0, 0.0, 0.2, 0.4], [[5, 1.0], [25, 10.0]]),
               _result([0.0, 0.0, 0.0, 0.2], [[29, 20.0]])] for k in hr.TORSOS}
    steps = X.checkpoints(res)
    s = X.summarize(res, steps)["hadamard"]
    assert s["inactive_mean"] == pytest.approx(0.1)            # all checkpoints, both seeds
    assert s["inactive_late"] == pytest.approx(0.2)            # steps >= 15: the last two
    assert s["erank_late"] == pytest.approx(3.5) and s["srank_late"] == pytest.approx(2.5)
    assert s["return_final"] == pytest.approx(15.0)            # episodes from step 24 on
    assert X.relu_summary(res)["wide"]["inactive_mean"] == pytest.approx(0.1)


def test_a_product_unit_saturates_only_where_both_branches_do():
    torch.manual_seed(0)
    t = hr.Torso("hadamard", "classic", (4,), 3, width=32, act="tanh")
    with torch.no_grad():                  # drive the first half of branch 1's units to +-1
        t.rep.branch1.bias[:16] = 50.0
        t.rep.branch2.bias[:8] = 50.0      # and a quarter of branch 2's, overlapping
    out = X.branch_saturation({"torso": t, "states": torch.randn(256, 4)})
    assert out["branch1"] >= 0.5 and out["branch2"] >= 0.25
    assert out["product"] <= min(out["branch1"], out["branch2"])
    assert out["product"] >= 0.25 and out["branch1_x_branch2"] == out["branch1"] * out["branch2"]


def test_a_short_training_run_measures_every_torso():
    setup = X.make_setup(dict(S, n_inner_seeds=1, total_timesteps=256), "ppo", "tanh", 0,
                         tau=0.1, activity_tau=0.1, device="cpu")
    res = X.train_torsos(setup, verbose=False)
    steps = X.checkpoints(res)
    assert len(steps) >= 1 and all(len(res[k]) == 1 for k in hr.TORSOS)
    assert X.series(res, "wide", "erank").shape == (1, len(steps))
    assert len(res["hadamard"][0]["spectra"]) == len(steps)


def _runs(width=16):
    torch.manual_seed(0)
    states = torch.randn(64, 4)
    return {k: [{"torso": hr.Torso(k, "classic", (4,), 3, width), "states": states}]
            for k in hr.TORSOS}


def test_a_gain_on_the_preactivations_recounts_saturation():
    runs = _runs()
    with torch.no_grad():                                   # push branch 1 into saturation
        runs["hadamard"][0]["torso"].rep.branch1.bias += 4.0
    pre, act = X.preactivations(runs["hadamard"][0])
    assert set(pre) == {"branch 1", "branch 2"}
    at1 = X.saturation_at(pre, act, 1.0)
    ref = X.branch_saturation(runs["hadamard"][0])                          # gain 1: as trained
    assert list(at1.values()) == pytest.approx([ref[k] for k in ("branch1", "branch2", "product",
                                                                 "branch1_x_branch2")])
    assert at1["branch 1"] > 0.5 and at1["product"] <= at1["branch 2"] + 1e-9
    assert all(v == 0 for v in X.saturation_at(pre, act, 0.0).values())     # tanh(0) = 0
    t = X.gain_table(runs, [0.0, 1.0, 5.0], 0)
    assert set(t.series) == {"standard", "wide (param-matched)", "HR branch 1", "HR branch 2",
                             "HR product", "HR branch 1 x branch 2"}
    assert len(t) == 3 * 6 and t.saturated.between(0, 1).all()
    X.gain_figure(t, runs["hadamard"][0], 1.0, 0)


def test_evaluation_returns_are_per_seeded_episode_and_repeatable():
    setup = X.make_setup(dict(S, n_inner_seeds=1, total_timesteps=256), "ppo", "tanh", 0,
                         tau=0.1, activity_tau=0.1, device="cpu")
    res = X.train_torsos(setup, verbose=False)
    net = res["hadamard"][0]["policy"]
    for greedy in (False, True):
        a = X.eval_returns("CartPole-v1", net, 5, seed=1000, greedy=greedy)
        assert a.shape == (5,) and (a >= 1).all() and (a <= 500).all()
        assert np.array_equal(a, X.eval_returns("CartPole-v1", net, 5, 1000, greedy))  # same items
    g = X.eval_returns("CartPole-v1", net, 5, seed=1000, greedy=True)
    assert np.array_equal(g[:3], X.eval_returns("CartPole-v1", net, 3, 1000, greedy=True))
    final = X.final_returns(setup, res, 4, seed=7)
    assert set(final) == set(hr.TORSOS) and final["wide"].shape == (1, 4)
    q = torch.nn.Linear(4, 2)                             # a DQN-like network: argmax of its output
    assert X.policy_actions(q, torch.zeros(3, 4)).tolist() == [int(q.bias.argmax())] * 3
    obs = torch.zeros(2000, 4)
    sampled = X.policy_actions(net, obs, torch.Generator().manual_seed(0))
    p = torch.softmax(net.actor(net.torso(obs[:1])), -1)[0, 1].item()
    assert abs(sampled.float().mean().item() - p) < 0.05      # samples follow the policy
    assert X.policy_actions(net, obs[:1]).item() == int(p > 0.5)


def test_claim_intervals_are_positive_when_hr_wins():
    res = {"standard": [_result([0.2, 0.2, 0.4, 0.4], []), _result([0.2, 0.3, 0.5, 0.4], [])],
           "hadamard": [_result([0.1, 0.1, 0.1, 0.1], []), _result([0.1, 0.0, 0.1, 0.2], [])],
           "wide": [_result([0.0] * 4, []), _result([0.0] * 4, [])]}
    steps = X.checkpoints(res)
    final = {"standard": np.full((2, 6), 100.0), "hadamard": np.full((2, 6), 95.0),
             "wide": np.full((2, 6), 120.0)}
    ci = X.claim_intervals(res, steps, final)
    assert list(ci.index) == ["c1", "c3_standard", "c3_wide", "c4"]
    assert ci.loc["c1", "diff"] == pytest.approx(0.225) and ci.loc["c1", "low"] > 0
    assert ci.loc["c4", "diff"] == pytest.approx(0.3) and ci.loc["c4", "n_items"] == 2   # late
    assert ci.loc["c3_standard", "diff"] == pytest.approx(5.0)          # 95 - 0.9 x 100: matches
    assert ci.loc["c3_wide", "high"] == pytest.approx(-25.0)            # loses to wide
    assert (ci.n_seeds == 2).all() and ci.loc["c3_wide", "n_items"] == 6


def test_other_agents_skip_when_unsized_and_summarize_when_run():
    setup = X.make_setup(S, "ppo", "tanh", 0, tau=0.1, activity_tau=0.1, device="cpu")
    assert X.train_other_agents(dict(S, pqn=None, sac=None), setup) == {}
    sized = dict(S, pqn=dict(env_id="MinAtar/Breakout-v1", total_timesteps=1024, num_envs=4,
                             num_steps=32, diag_every=2, width=16, n_inner_seeds=2),
                 sac=dict(total_timesteps=300, learning_starts=150, batch_size=16, embed_dim=8,
                          diag_every=50, width=8, n_inner_seeds=1))
    other = X.train_other_agents(sized, setup)
    assert {a: len(other[a]["hadamard"]) for a in other} == {"pqn": 2, "sac": 1}
    table = X.other_agents_summary(other)
    assert len(table) == 6 and np.isfinite(table["erank_late"]).all()
    ci = X.other_agents_intervals(other)
    assert list(ci.index) == [f"{a}_{n}" for a in ("pqn", "sac")
                              for n in ("c1", "c4", "erank_std", "erank_wide")]


def test_diagnostics_are_read_per_task_of_a_stream():
    steps = np.array([256, 512, 768, 1024, 1280, 1536, 1792, 2048])   # 2 tasks of 1024 steps
    assert X.task_of(steps, 1024).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert X.task_of(steps, 0).tolist() == [0] * 8

    class Tr(dict):
        pass
    Tr.steps = steps.tolist()

    def run(inactive, erank):
        return {"tracker": Tr(inactive=np.array(inactive, float), erank=np.array(erank, float),
                              dormant=np.zeros(8), saturated=np.zeros(8), srank=np.ones(8))}
    res = {k: [run([0, 0, .1, .1, .3, .3, .2, .4], [9, 9, 5, 5, 4, 4, 2, 2]),
               run([0, 0, .2, .2, .5, .5, .4, .4], [9, 9, 6, 6, 5, 5, 3, 3])] for k in hr.TORSOS}
    per = X.per_task(res, steps, 1024, "standard", "inactive")   # the second half of each task
    np.testing.assert_allclose(per, [[0.1, 0.3], [0.2, 0.4]])
    table = X.task_table(res, steps, 1024)
    assert table.loc[("hadamard", 2), "erank"] == pytest.approx(2.5) and len(table) == 6
    bed = X.stream_degradation(res, steps, 1024)
    assert bed.loc["inactive_rise", "diff"] == pytest.approx(0.2)
    assert bed.loc["inactive_rise", "low"] > 0
    assert bed.loc["erank_drop", "diff"] == pytest.approx(3.0) and bed.loc["erank_drop", "low"] > 0


def test_a_stream_run_is_evaluated_on_its_last_task(monkeypatch):
    setup = X.make_setup(dict(S, n_inner_seeds=1, total_timesteps=512,
                              ppo=dict(S["ppo"], task_steps=256)), "ppo", "tanh", 0,
                         tau=0.1, activity_tau=0.1, device="cpu")
    r = X.train_one(setup, "standard", 0)
    assert r["eval_stream"].first_task == 1 and r["eval_stream"].task_steps == 0
    made, make = [], X.make_vec_env
    monkeypatch.setattr(X, "make_vec_env", lambda *a: made.append(a[3:]) or make(*a))
    X.final_returns(setup, {k: [r] for k in hr.TORSOS}, 4, 5, greedy=True)
    assert made == [(r["eval_stream"],)] * 3               # every torso plays the last task
    one_task = X.make_setup(dict(S, total_timesteps=256), "ppo", "tanh", 0, tau=0.1,
                            activity_tau=0.1, device="cpu")
    assert X.train_one(one_task, "standard", 0)["eval_stream"] is None
