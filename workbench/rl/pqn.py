"""PQN: parallelised Q-learning (Gallici et al. 2024, "Simplifying Deep Temporal Difference
Learning", arXiv 2407.04811), in the single-file manner of CleanRL (``pqn.py``) and purejaxql.

What makes it PQN, each kept here:

- ``num_envs`` parallel (vectorized) environments collect short rollouts of ``num_steps``;
- no replay buffer: every rollout is used for ``update_epochs`` x ``num_minibatches`` updates
  and then thrown away;
- no target network: the bootstrap values are the *online* network's max_a Q(s', a),
  computed under ``no_grad`` while the rollout is collected;
- LayerNorm in the Q-network (the paper's regulariser that makes the above stable): the torso
  factory is called with ``norm=True`` by the caller (:func:`train_pqn` checks a LayerNorm is
  there);
- Q(lambda) targets over the rollout (Peng's Q(lambda), the paper's eq. for lambda-returns):

      G_t = r_t + gamma (1 - term_t) [(1 - lambda) max_a Q(s_{t+1}, a) + lambda G_{t+1}]

  with G_{T-1} (the rollout's last step) and every step that ends an episode bootstrapping from
  max_a Q(s_{t+1}, a) alone (a truncated episode from its true final observation);
- epsilon-greedy exploration annealed linearly from ``start_e`` to ``end_e``; Adam with
  gradient-norm clipping at ``max_grad_norm``, the learning rate annealed linearly to 0.

The torso is passed in: ``torso_fn(obs_shape, head_dim) -> module with .out_dim``.
``on_update(update, step, q_network, obs)`` is called every ``diag_every`` updates (and the
last) with the rollout's observations, so a notebook can measure the representation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .dqn import QNetwork, linear_schedule
from .envs import finished_episodes, make_vec_env

__all__ = ["PQNSettings", "lambda_returns", "train_pqn"]


@dataclass
class PQNSettings:
    env_id: str = "MinAtar/Breakout-v1"
    """the environment id (``workbench.rl.envs.ENV_IDS``)"""
    total_timesteps: int = 1_000_000
    """total environment steps, summed over the vectorized envs"""
    learning_rate: float = 2.5e-4
    """Adam learning rate (annealed linearly to 0)"""
    num_envs: int = 32
    """parallel environments"""
    num_steps: int = 32
    """rollout length per environment"""
    gamma: float = 0.99
    """discount factor"""
    q_lambda: float = 0.65
    """lambda of the Q(lambda) targets (purejaxql's MinAtar setting)"""
    update_epochs: int = 2
    """passes over each rollout"""
    num_minibatches: int = 4
    """minibatches per pass"""
    start_e: float = 1.0
    """initial exploration epsilon"""
    end_e: float = 0.05
    """final exploration epsilon"""
    exploration_fraction: float = 0.2
    """fraction of ``total_timesteps`` over which epsilon anneals"""
    max_grad_norm: float = 10.0
    """global gradient-norm clip"""
    diag_every: int = 5
    """updates between ``on_update`` calls"""

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        return max(1, self.total_timesteps // self.batch_size)


def lambda_returns(rewards: torch.Tensor, terms: torch.Tensor, dones: torch.Tensor,
                   next_max_q: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Q(lambda) targets of a (steps x envs) rollout, computed backwards.

    ``next_max_q[t]`` is max_a Q(s_{t+1}, a) of the online network (for a step that ends an
    episode, of the true final observation); ``terms`` zero the bootstrap, ``dones`` (terminated
    or truncated) cut the lambda chain, as does the rollout's end."""
    T = rewards.shape[0]
    out = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        mix = next_max_q[t] if t == T - 1 else (1 - lam) * next_max_q[t] + lam * out[t + 1]
        mix = torch.where(dones[t].bool(), next_max_q[t], mix)
        out[t] = rewards[t] + gamma * (1 - terms[t]) * mix
    return out


def _max_q(q_network: nn.Module, obs, device) -> torch.Tensor:
    with torch.no_grad():
        return q_network(torch.as_tensor(obs, device=device)).max(dim=1).values


def train_pqn(s: PQNSettings, torso_fn: Callable, seed: int = 0, device="cpu",
              on_update: Callable | None = None) -> dict:
    """Train PQN; returns ``episodes`` ((step, return) pairs), the ``q_network``, ``sps``,
    ``n_updates`` (gradient steps) and ``logs`` (per update: ``loss``, ``epsilon``,
    ``q_mean``)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    device = torch.device(device)
    envs = make_vec_env(s.env_id, s.num_envs, seed)
    obs_shape, n_actions = envs.single_observation_space.shape, envs.single_action_space.n
    q_network = QNetwork(torso_fn, obs_shape, n_actions).to(device)
    if not any(isinstance(m, nn.LayerNorm) for m in q_network.modules()):
        raise ValueError("PQN needs a LayerNorm in its Q-network: build the torso with norm=True")
    optimizer = torch.optim.Adam(q_network.parameters(), lr=s.learning_rate)
    T, N = s.num_steps, s.num_envs
    b_obs = torch.zeros((T, N) + obs_shape, device=device)
    b_act = torch.zeros((T, N), dtype=torch.long, device=device)
    b_rew, b_term, b_done, b_next = (torch.zeros((T, N), device=device) for _ in range(4))

    episodes, logs, n_grad, t0 = [], [], 0, time.time()
    obs, _ = envs.reset(seed=seed)
    explore = max(1, int(s.exploration_fraction * s.total_timesteps))
    for update in range(1, s.num_updates + 1):
        optimizer.param_groups[0]["lr"] = (1.0 - (update - 1) / s.num_updates) * s.learning_rate
        for t in range(T):
            step = ((update - 1) * T + t) * N
            eps = linear_schedule(s.start_e, s.end_e, explore, step)
            with torch.no_grad():
                greedy = q_network(torch.as_tensor(obs, device=device)).argmax(1).cpu().numpy()
            random = rng.integers(0, n_actions, N)
            actions = np.where(rng.random(N) < eps, random, greedy)
            next_obs, rewards, terms, truncs, infos = envs.step(actions)
            episodes += [(step + N, r) for r, _ in finished_episodes(infos)]
            real_next = np.array(next_obs, copy=True)          # bootstrap from the true last obs
            if "_final_obs" in infos:
                for i in np.flatnonzero(infos["_final_obs"]):
                    real_next[i] = infos["final_obs"][i]
            b_obs[t] = torch.as_tensor(obs, device=device)
            b_act[t] = torch.as_tensor(actions, device=device)
            b_rew[t] = torch.as_tensor(rewards, dtype=torch.float32, device=device)
            b_term[t] = torch.as_tensor(terms, dtype=torch.float32, device=device)
            b_done[t] = torch.as_tensor(terms | truncs, dtype=torch.float32, device=device)
            b_next[t] = _max_q(q_network, real_next, device)  # the online network: no target net
            obs = next_obs
        targets = lambda_returns(b_rew, b_term, b_done, b_next, s.gamma, s.q_lambda).reshape(-1)
        flat_obs, flat_act = b_obs.reshape((-1,) + obs_shape), b_act.reshape(-1)
        mb = max(1, s.batch_size // s.num_minibatches)
        for _ in range(s.update_epochs):
            perm = torch.randperm(s.batch_size, device=device)
            for start in range(0, s.batch_size, mb):
                idx = perm[start:start + mb]
                q = q_network(flat_obs[idx]).gather(1, flat_act[idx, None]).squeeze(1)
                loss = 0.5 * F.mse_loss(q, targets[idx])
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(q_network.parameters(), s.max_grad_norm)
                optimizer.step()
                n_grad += 1
        logs.append({"loss": loss.item(), "epsilon": eps, "q_mean": b_next.mean().item()})
        if on_update is not None and (update % s.diag_every == 0 or update == s.num_updates):
            on_update(update, update * s.batch_size, q_network, flat_obs)
    envs.close()
    return {"episodes": episodes, "q_network": q_network, "n_updates": n_grad, "logs": logs,
            "sps": s.num_updates * s.batch_size / (time.time() - t0)}
