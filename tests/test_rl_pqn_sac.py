"""PQN and SAC (notebook 09's other agents): their defining properties, at tiny budgets."""
import math

import gymnasium as gym
import numpy as np
import pytest
import torch

from workbench.methods.hadamard import TORSOS, rep_param_count, torso_factory
from workbench.rl import pqn as pqn_mod
from workbench.rl.pqn import PQNSettings, lambda_returns, train_pqn
from workbench.rl.sac import (Actor, SACSettings, SimbaTorso, soft_update, squashed_log_prob,
                              train_sac)


def test_lambda_returns_one_step_monte_carlo_and_episode_cuts():
    T, g = 4, 0.9
    r = torch.arange(1.0, T + 1)[:, None]
    nq = torch.full((T, 1), 10.0)
    zero = torch.zeros(T, 1)
    one_step = lambda_returns(r, zero, zero, nq, g, 0.0)
    torch.testing.assert_close(one_step, r + g * nq)              # lambda = 0: r + gamma max Q'
    mc = lambda_returns(r, zero, zero, nq, g, 1.0)                # lambda = 1: n-step to the end
    expect = sum(g ** k * r[k, 0] for k in range(T)) + g ** T * 10.0
    assert mc[0, 0].item() == pytest.approx(expect.item())
    done = zero.clone()
    done[1] = 1.0                                                 # a truncation at t = 1
    cut = lambda_returns(r, zero, done, nq, g, 1.0)
    assert cut[1, 0].item() == pytest.approx(2 + g * 10.0)        # bootstraps, chain cut
    assert cut[0, 0].item() == pytest.approx(1 + g * cut[1, 0].item())
    term = done.clone()
    assert lambda_returns(r, term, done, nq, g, 0.5)[1, 0].item() == pytest.approx(2.0)


def test_pqn_has_one_network_no_buffer_layernorm_and_bootstraps_from_it(monkeypatch):
    built, boot_nets = [], []
    real_init, real_max_q = pqn_mod.QNetwork.__init__, pqn_mod._max_q

    def counting_init(self, *a, **k):
        built.append(self)
        real_init(self, *a, **k)

    def spy_max_q(net, obs, device):
        boot_nets.append(net)
        return real_max_q(net, obs, device)
    monkeypatch.setattr(pqn_mod.QNetwork, "__init__", counting_init)
    monkeypatch.setattr(pqn_mod, "_max_q", spy_max_q)
    seen = []
    s = PQNSettings(env_id="MinAtar/Breakout-v1", total_timesteps=256, num_envs=4, num_steps=16,
                    diag_every=2)
    out = train_pqn(s, torso_factory("hadamard", "minatar", 16, "relu", norm=True), seed=0,
                    on_update=lambda u, step, net, obs: seen.append((step, obs.shape)))
    assert len(built) == 1                                        # no target network
    assert boot_nets and all(n is out["q_network"] for n in boot_nets)   # online bootstrap
    assert any(isinstance(m, torch.nn.LayerNorm) for m in out["q_network"].modules())
    assert out["n_updates"] == 4 * s.update_epochs * s.num_minibatches
    assert seen[-1] == (256, (64, 4, 10, 10))                     # the rollout, not a buffer
    with pytest.raises(ValueError, match="LayerNorm"):
        train_pqn(s, torso_factory("standard", "minatar", 16, "relu"), seed=0)


def test_squashed_log_prob_is_the_change_of_variables():
    torch.manual_seed(0)
    mean, log_std = torch.randn(5, 2) * 0.5, torch.randn(5, 2) * 0.3 - 0.5
    scale, bias = torch.tensor([2.0, 0.5]), torch.tensor([0.0, 1.0])
    u = mean + log_std.exp() * torch.randn(5, 2)
    dist = torch.distributions.TransformedDistribution(
        torch.distributions.Normal(mean, log_std.exp()),
        [torch.distributions.TanhTransform(), torch.distributions.AffineTransform(bias, scale)])
    a = torch.tanh(u) * scale + bias
    torch.testing.assert_close(squashed_log_prob(u, mean, log_std, scale),
                               dist.log_prob(a).sum(-1), atol=1e-3, rtol=1e-4)


def test_soft_update_is_polyak_averaging():
    src, tgt = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    w_s, w_t = src.weight.detach().clone(), tgt.weight.detach().clone()
    soft_update(tgt, src, 0.1)
    torch.testing.assert_close(tgt.weight, 0.1 * w_s + 0.9 * w_t)
    soft_update(tgt, src, 1.0)
    torch.testing.assert_close(tgt.weight, w_s)


def test_simba_torso_is_on_the_sphere_and_wide_matches_hr_parameters():
    sizes = {}
    for kind in TORSOS:
        t = SimbaTorso(torso_factory(kind, "classic", 32), 4, embed_dim=32)
        z = t(torch.randn(7, 4) * 5)
        torch.testing.assert_close(z.norm(dim=-1) / t.scaler[0], torch.ones(7))
        sizes[kind] = rep_param_count(t.inner, 32)
    assert sizes["hadamard"] > sizes["standard"]
    assert abs(sizes["wide"] - sizes["hadamard"]) / sizes["hadamard"] < 0.03


def test_sac_runs_on_pendulum_and_reports_the_representation():
    seen = []
    s = SACSettings(total_timesteps=450, learning_starts=200, batch_size=32, embed_dim=16,
                    diag_every=100, diag_batch=64)
    out = train_sac(s, torso_factory("hadamard", "classic", 16), seed=0,
                    on_eval=lambda step, agent, obs, act: seen.append((step, obs.shape, act.shape)))
    assert [x[0] for x in seen] == [300, 400, 450] and seen[0][1:] == ((64, 3), (64, 1))
    assert len(out["episodes"]) == 2 and out["logs"]
    space = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)
    a, logp, det = Actor(torso_factory("standard", "classic", 8), 3, space, 8).get_action(
        torch.randn(10, 3))
    assert a.abs().max() <= 2.0 and logp.shape == (10,) and torch.isfinite(logp).all()
