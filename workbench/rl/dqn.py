"""Deep Q-Network (Mnih et al. 2015), in the single-file manner of CleanRL.

Follows vwxyzjn/cleanrl ``cleanrl/dqn.py``: epsilon-greedy exploration annealed linearly from
``start_e`` to ``end_e`` over ``exploration_fraction`` of training, a replay buffer of
``buffer_size`` transitions, one TD update on a minibatch every ``train_frequency`` env steps
after ``learning_starts``, a target network refreshed every ``target_network_frequency`` steps
(Polyak ``tau``; 1.0 copies), MSE on the one-step target r + gamma (1 - done) max_a Q_target.
Truncated episodes bootstrap from the true final observation (``info["final_obs"]``); only
termination zeroes the target. Vectorized envs: each vector step adds ``num_envs``
transitions. The torso is passed in: ``torso_fn(obs_shape, head_dim) -> module with .out_dim``.

``on_eval(step, qnet, obs)`` is called every ``diag_every`` env steps with a replay sample of
observations, so a notebook can measure the representation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .envs import finished_episodes, make_vec_env

__all__ = ["DQNSettings", "QNetwork", "ReplayBuffer", "linear_schedule", "train_dqn"]


@dataclass
class DQNSettings:
    env_id: str = "CartPole-v1"
    """the environment id (``workbench.rl.envs.ENV_IDS``)"""
    total_timesteps: int = 500_000
    """total environment steps, summed over the vectorized envs"""
    learning_rate: float = 2.5e-4
    """Adam learning rate"""
    num_envs: int = 1
    """number of parallel environments"""
    buffer_size: int = 10_000
    """replay memory size (transitions)"""
    gamma: float = 0.99
    """discount factor"""
    tau: float = 1.0
    """target network update rate (1.0: hard copy)"""
    target_network_frequency: int = 500
    """env steps between target network updates"""
    batch_size: int = 128
    """minibatch size sampled from replay"""
    start_e: float = 1.0
    """initial exploration epsilon"""
    end_e: float = 0.05
    """final exploration epsilon"""
    exploration_fraction: float = 0.5
    """fraction of ``total_timesteps`` over which epsilon anneals"""
    learning_starts: int = 10_000
    """env steps before learning starts"""
    train_frequency: int = 10
    """env steps between gradient updates"""
    diag_every: int = 5_000
    """env steps between ``on_eval`` calls"""
    diag_batch: int = 512
    """observations sampled from replay for ``on_eval``"""


class QNetwork(nn.Module):
    """A torso and a linear head with one Q-value per action."""

    def __init__(self, torso_fn: Callable, obs_shape: tuple, n_actions: int):
        super().__init__()
        self.torso = torso_fn(obs_shape, n_actions)
        self.head = nn.Linear(self.torso.out_dim, n_actions)

    def forward(self, x):
        return self.head(self.torso(x))


class ReplayBuffer:
    """A ring buffer of (obs, next_obs, action, reward, terminated) on ``device``."""

    def __init__(self, size: int, obs_shape: tuple, obs_dtype, device):
        dt = torch.uint8 if np.dtype(obs_dtype) == np.uint8 else torch.float32   # Atari frames stay bytes
        self.obs = torch.zeros((size,) + obs_shape, dtype=dt, device=device)
        self.next_obs = torch.zeros_like(self.obs)
        self.actions = torch.zeros(size, dtype=torch.long, device=device)
        self.rewards = torch.zeros(size, device=device)
        self.dones = torch.zeros(size, device=device)
        self.size, self.pos, self.full, self.device = size, 0, False, device

    def add(self, obs, next_obs, actions, rewards, dones) -> None:
        for i in range(len(actions)):
            j = self.pos
            self.obs[j] = torch.as_tensor(obs[i], device=self.device)
            self.next_obs[j] = torch.as_tensor(next_obs[i], device=self.device)
            self.actions[j], self.rewards[j], self.dones[j] = int(actions[i]), float(rewards[i]), float(dones[i])
            self.pos = (j + 1) % self.size
            self.full = self.full or self.pos == 0

    def __len__(self) -> int:
        return self.size if self.full else self.pos

    def sample(self, n: int, generator: torch.Generator):
        idx = torch.randint(0, len(self), (n,), generator=generator).to(self.device)
        return self.obs[idx], self.next_obs[idx], self.actions[idx], self.rewards[idx], self.dones[idx]


def linear_schedule(start_e: float, end_e: float, duration: int, t: int) -> float:
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def train_dqn(s: DQNSettings, torso_fn: Callable, seed: int = 0, device="cpu",
              on_eval: Callable | None = None, progress: Callable | None = None) -> dict:
    """Train DQN; returns ``episodes`` ((step, return) pairs), the ``q_network``, ``sps`` and
    ``n_updates`` (gradient steps taken)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    envs = make_vec_env(s.env_id, s.num_envs, seed)
    obs_shape = envs.single_observation_space.shape
    n_actions = envs.single_action_space.n
    q_network = QNetwork(torso_fn, obs_shape, n_actions).to(device)
    target_network = QNetwork(torso_fn, obs_shape, n_actions).to(device)
    target_network.load_state_dict(q_network.state_dict())
    optimizer = torch.optim.Adam(q_network.parameters(), lr=s.learning_rate)
    rb = ReplayBuffer(s.buffer_size, obs_shape, envs.single_observation_space.dtype, device)

    episodes, n_updates, t0 = [], 0, time.time()
    obs, _ = envs.reset(seed=seed)
    n_iters = max(1, s.total_timesteps // s.num_envs)
    iters = range(n_iters)
    for it in (progress(iters, desc=f"dqn seed {seed}") if progress else iters):
        global_step = it * s.num_envs
        epsilon = linear_schedule(s.start_e, s.end_e, int(s.exploration_fraction * s.total_timesteps),
                                  global_step)
        if rng.random() < epsilon:
            actions = envs.action_space.sample()
        else:
            with torch.no_grad():
                q = q_network(torch.as_tensor(obs, device=device))
            actions = q.argmax(dim=1).cpu().numpy()
        next_obs, rewards, terms, truncs, infos = envs.step(actions)
        episodes += [(global_step + s.num_envs, r) for r, _ in finished_episodes(infos)]

        real_next_obs = np.array(next_obs, copy=True)   # bootstrap truncations from the true last obs
        if "_final_obs" in infos:
            for i in np.flatnonzero(infos["_final_obs"]):
                real_next_obs[i] = infos["final_obs"][i]
        rb.add(obs, real_next_obs, actions, rewards, terms)
        obs = next_obs

        step_before, step_after = global_step, global_step + s.num_envs
        crossed = lambda every: step_after // every > step_before // every   # noqa: E731
        if step_after > s.learning_starts:
            if crossed(s.train_frequency):
                b_obs, b_next, b_act, b_rew, b_done = rb.sample(s.batch_size, gen)
                with torch.no_grad():
                    target_max = target_network(b_next).max(dim=1).values
                    td_target = b_rew + s.gamma * target_max * (1 - b_done)
                old_val = q_network(b_obs).gather(1, b_act[:, None]).squeeze(1)
                loss = F.mse_loss(td_target, old_val)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                n_updates += 1
            if crossed(s.target_network_frequency):
                for tp, qp in zip(target_network.parameters(), q_network.parameters()):
                    tp.data.copy_(s.tau * qp.data + (1.0 - s.tau) * tp.data)
        if on_eval is not None and len(rb) and (crossed(s.diag_every) or it == n_iters - 1):
            on_eval(step_after, q_network, rb.sample(s.diag_batch, gen)[0])
    envs.close()
    return {"episodes": episodes, "q_network": q_network, "n_updates": n_updates,
            "sps": n_iters * s.num_envs / (time.time() - t0)}
