"""Smoke tests of the RL agents and environments (tiny budgets, seconds in all)."""
import numpy as np
import pytest
import torch

from workbench.methods.hadamard import torso_factory
from workbench.rl import ENV_IDS, check_env_id, env_family, make_vec_env
from workbench.rl.dqn import DQNSettings, train_dqn
from workbench.rl.envs import finished_episodes
from workbench.rl.ppo import PPOSettings, train_ppo


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


@pytest.mark.parametrize("kind", ["standard", "hadamard", "wide"])
def test_ppo_smoke_step_runs_and_learns_something(kind):
    calls = []
    s = PPOSettings(total_timesteps=512, num_envs=4, num_steps=64, diag_every=1)
    out = train_ppo(s, torso_fn=torso_factory(kind, "classic", width=16), seed=0,
                    on_update=lambda u, step, agent, obs: calls.append((u, step, tuple(obs.shape))))
    assert calls == [(1, 256, (256, 4)), (2, 512, (256, 4))]
    assert len(out["episodes"]) > 0
    before = torso_factory(kind, "classic", width=16)((4,), 3)
    torch.manual_seed(0)
    assert any(not torch.equal(p, q) for p, q in zip(out["agent"].torso.state_dict().values(),
                                                     before.state_dict().values()))


@pytest.mark.parametrize("kind", ["standard", "hadamard"])
def test_dqn_smoke_step_runs_and_updates(kind):
    calls = []
    s = DQNSettings(total_timesteps=400, num_envs=2, learning_starts=100, batch_size=16,
                    train_frequency=4, target_network_frequency=50, diag_every=200, diag_batch=32)
    torch.manual_seed(0)
    out = train_dqn(s, torso_fn=torso_factory(kind, "classic", width=16), seed=0,
                    on_eval=lambda step, q, obs: calls.append((step, tuple(obs.shape))))
    assert [c[0] for c in calls] == [200, 400] and calls[0][1] == (32, 4)
    q = out["q_network"](torch.zeros(3, 4))
    assert q.shape == (3, 2) and torch.isfinite(q).all()


def test_ppo_runs_on_minatar():
    s = PPOSettings(env_id="MinAtar/Breakout-v1", total_timesteps=64, num_envs=2, num_steps=32)
    out = train_ppo(s, torso_fn=torso_factory("hadamard", "minatar", width=16), seed=0)
    assert out["agent"].torso.out_dim == 16


def test_env_ids_cover_the_three_families():
    fams = {env_family(e) for e in ENV_IDS}
    assert fams == {"classic", "minatar", "ale"}
