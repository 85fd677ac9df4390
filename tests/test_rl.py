"""Smoke tests of the RL agents and environments (tiny budgets, seconds in all)."""
import math

import numpy as np
import pytest
import torch

from workbench.methods.hadamard import torso_factory
from workbench.rl import ENV_IDS, check_env_id, env_family, make_vec_env
from workbench.rl.dqn import DQNSettings, QNetwork, train_dqn
from workbench.rl.envs import finished_episodes
from workbench.rl.ppo import (LOG_KEYS, ActorCritic, PPOSettings, clip_fraction,
                              explained_variance, kl_estimates, train_ppo)


def test_unknown_env_id_lists_the_choices():
    with pytest.raises(ValueError, match="CartPole-v1.*MinAtar/Breakout-v1.*ALE/Breakout-v5"):
        check_env_id("Breakout")
    assert env_family("MinAtar/Asterix-v1") == "minatar" and env_family("ALE/Pong-v5") == "ale"


def test_importing_rl_does_not_import_ale():
    import subprocess
    import sys
    code = ("import sys, workbench.rl, workbench.rl.ppo, workbench.rl.dqn; "
            "make = workbench.rl.make_vec_env('CartPole-v1', 2, 0); print('ale_py' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_vector_cartpole_is_seeded_and_autoresets_same_step():
    def rollout(seed):
        envs = make_vec_env("CartPole-v1", 4, seed)
        obs, _ = envs.reset(seed=seed)
        acts = np.random.default_rng(0).integers(0, 2, (200, 4))
        seen, eps = [obs], []
        for a in acts:
            obs, r, term, trunc, info = envs.step(a)
            eps += finished_episodes(info)
            if "_final_obs" in info:           # the terminal obs is kept, the returned one is fresh
                for i in np.flatnonzero(info["_final_obs"]):
                    assert np.abs(obs[i]).max() <= 0.05
            seen.append(obs)
        return np.stack(seen), eps
    a, eps = rollout(3)
    b, _ = rollout(3)
    c, _ = rollout(4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert len(eps) > 10 and all(r == length for r, length in eps)   # CartPole: +1 per step


def test_minatar_env_shape_and_seeding():
    envs = make_vec_env("MinAtar/Breakout-v1", 2, 0)
    obs, _ = envs.reset(seed=0)
    assert obs.shape == (2, 4, 10, 10) and obs.dtype == np.float32
    assert envs.single_action_space.n == 3


def initial_network(build):
    """The network an agent starts from: the agents call torch.manual_seed(seed) and then build
    it before any other torch draw (the environments use numpy), so building it right after the
    same seed gives the same weights."""
    torch.manual_seed(0)
    return build()


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("kind", ["standard", "hadamard", "wide"])
def test_ppo_smoke_step_runs_and_updates_the_network(kind):
    calls = []
    torso_fn = torso_factory(kind, "classic", width=16)
    s = PPOSettings(total_timesteps=512, num_envs=4, num_steps=64, diag_every=1)
    out = train_ppo(s, torso_fn=torso_fn, seed=0,
                    on_update=lambda u, step, agent, obs: calls.append((u, step, tuple(obs.shape))))
    assert calls == [(1, 256, (256, 4)), (2, 512, (256, 4))]
    assert len(out["episodes"]) > 0
    init = initial_network(lambda: ActorCritic(torso_fn, (4,), 2))
    # the reference is the agent's true initial network: with a zero learning rate it is unchanged
    frozen = train_ppo(PPOSettings(total_timesteps=512, num_envs=4, num_steps=64, learning_rate=0.0),
                       torso_fn=torso_fn, seed=0)
    assert same_weights(frozen["agent"], init)
    # and training moved every part of it: torso, policy head and value head
    for part in ("torso", "actor", "critic"):
        assert not same_weights(getattr(out["agent"], part), getattr(init, part)), part


def test_ppo_logs_the_reference_diagnostics_every_update():
    s = PPOSettings(total_timesteps=768, num_envs=4, num_steps=64, learning_rate=1e-2)
    out = train_ppo(s, torso_fn=torso_factory("hadamard", "classic", width=16), seed=1)
    logs = out["logs"]
    assert [r["update"] for r in logs] == [1, 2, 3] and [r["step"] for r in logs] == [256, 512, 768]
    for r in logs:
        assert set(LOG_KEYS) <= set(r)
        assert r["approx_kl"] >= 0 and 0 <= r["clipfrac"] <= 1 and r["explained_variance"] <= 1
        assert all(math.isfinite(r[k]) for k in LOG_KEYS)
    assert any(r["approx_kl"] > 0 for r in logs) and logs[-1]["learning_rate"] < s.learning_rate
    # a network that never changes has ratio 1 everywhere: no KL, nothing clipped
    frozen = train_ppo(PPOSettings(total_timesteps=512, num_envs=4, num_steps=64, learning_rate=0.0),
                       torso_fn=torso_factory("standard", "classic", width=16), seed=0)["logs"]
    assert all(abs(r["approx_kl"]) < 1e-6 and r["clipfrac"] == 0.0 for r in frozen)


def test_kl_estimators_clipfrac_and_explained_variance_on_known_values():
    logratio = torch.log(torch.tensor([2.0, 0.5, 1.0, 1.0]))
    k1, k3 = kl_estimates(logratio)
    assert k1 == pytest.approx(0.0, abs=1e-7)                       # -mean log r: ln 2 cancels
    assert k3 == pytest.approx(((1 - math.log(2)) + (-0.5 + math.log(2))) / 4, rel=1e-6)
    assert kl_estimates(torch.zeros(5)) == (0.0, 0.0)
    assert clip_fraction(torch.tensor([1.0, 1.1, 1.3, 0.7, 0.85]), 0.2) == pytest.approx(0.4)
    y = np.array([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(y, y) == 1.0
    assert explained_variance(np.full(4, y.mean()), y) == pytest.approx(0.0)
    assert explained_variance(y[::-1], y) == pytest.approx(-3.0)   # Var[y - rev y] = 4 Var[y]
    assert math.isnan(explained_variance(y, np.ones(4)))


@pytest.mark.parametrize("kind", ["standard", "hadamard"])
def test_dqn_smoke_step_runs_and_updates(kind):
    calls = []
    torso_fn = torso_factory(kind, "classic", width=16)
    settings = dict(total_timesteps=400, num_envs=2, learning_starts=100, batch_size=16,
                    train_frequency=4, target_network_frequency=50, diag_every=200, diag_batch=32)
    out = train_dqn(DQNSettings(**settings), torso_fn=torso_fn, seed=0,
                    on_eval=lambda step, q, obs: calls.append((step, tuple(obs.shape))))
    assert [c[0] for c in calls] == [200, 400] and calls[0][1] == (32, 4)
    # one TD update every 4 env steps once past learning_starts: steps 104, 108, ..., 400
    assert out["n_updates"] == len(range(104, 401, 4)) == 75
    init = initial_network(lambda: QNetwork(torso_fn, (4,), 2))
    frozen = train_dqn(DQNSettings(**settings, learning_rate=0.0), torso_fn=torso_fn, seed=0)
    assert same_weights(frozen["q_network"], init)            # the reference is the true start
    assert not same_weights(out["q_network"].torso, init.torso)
    assert not same_weights(out["q_network"].head, init.head)
    q = out["q_network"](torch.zeros(3, 4))
    assert q.shape == (3, 2) and torch.isfinite(q).all()


def test_ppo_runs_on_minatar():
    s = PPOSettings(env_id="MinAtar/Breakout-v1", total_timesteps=64, num_envs=2, num_steps=32)
    out = train_ppo(s, torso_fn=torso_factory("hadamard", "minatar", width=16), seed=0)
    assert out["agent"].torso.out_dim == 16


def test_env_ids_cover_the_three_families():
    fams = {env_family(e) for e in ENV_IDS}
    assert fams == {"classic", "minatar", "ale"}


def test_a_task_stream_permutes_the_features_and_switches_in_lockstep():
    from workbench.rl.envs import TaskStream, signed_permutation
    order, signs = signed_permutation(4, 7, 0)
    assert order.tolist() == [0, 1, 2, 3] and (signs == 1).all()          # the first task: the env
    for task in range(1, 30):
        o, s = signed_permutation(4, 7, task)
        assert sorted(o.tolist()) == [0, 1, 2, 3] and set(s.tolist()) <= {-1.0, 1.0}
        assert not (o.tolist() == [0, 1, 2, 3] and (s == 1).all())        # never the identity
        assert np.array_equal(o, signed_permutation(4, 7, task)[0])       # drawn from (seed, task)
    plain = make_vec_env("CartPole-v1", 2, 0)
    permuted = make_vec_env("CartPole-v1", 2, 0, TaskStream(3, 7))
    a, b = plain.reset(seed=0)[0], permuted.reset(seed=0)[0]
    np.testing.assert_array_equal(a, b)                                   # task 0 until 3 steps
    for step in range(1, 8):
        a, b = plain.step(np.zeros(2, int))[0], permuted.step(np.zeros(2, int))[0]
        order, signs = signed_permutation(4, 7, step // 3)
        np.testing.assert_allclose(b, signs * a[:, order])                # both copies, same task
    later = make_vec_env("CartPole-v1", 2, 0, TaskStream(0, 7, first_task=2))   # held at task 2
    order, signs = signed_permutation(4, 7, 2)
    np.testing.assert_allclose(later.reset(seed=0)[0], signs * plain.reset(seed=0)[0][:, order])


def test_ppo_on_a_task_stream_reports_its_last_task():
    torso_fn = torso_factory("standard", "classic", width=8)
    s = PPOSettings(total_timesteps=1024, num_envs=4, num_steps=32, task_steps=256)
    assert train_ppo(s, torso_fn, seed=0)["task"] == 3                    # 4 tasks of 256 steps
    one_task = PPOSettings(total_timesteps=256, num_envs=4, num_steps=32)
    assert train_ppo(one_task, torso_fn)["task"] == 0
    with pytest.raises(ValueError, match="multiple of num_envs"):
        PPOSettings(num_envs=4, task_steps=250).stream(0)
