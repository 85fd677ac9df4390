"""Soft Actor-Critic (Haarnoja et al. 2018) with a SimbaV2-style torso (Lee et al. 2025,
"Hyperspherical Normalization for Scalable Deep RL", arXiv 2502.15280), in the single-file
manner of CleanRL ``sac_continuous_action.py``.

SAC as CleanRL writes it: a squashed-Gaussian actor (``LOG_STD_MIN``..``LOG_STD_MAX`` through a
tanh), twin Q critics with target copies updated by Polyak averaging (``tau``), the policy and
the entropy temperature alpha (autotuned to the target entropy -|A|) updated every
``policy_frequency`` critic steps, a replay buffer, ``learning_starts`` uniformly random steps.
The squashed log-probability follows the change of variables a = tanh(u) * scale + bias:

    log pi(a | s) = log N(u; mu, sigma) - sum_i log(scale_i (1 - tanh(u_i)^2) + 1e-6)

The SimbaV2-style torso (:class:`SimbaTorso`) keeps the paper's hyperspherical residual design
at small size: the input, shifted by a constant and l2-normalized, is embedded and put back on
the unit sphere, e = l2n(W_e [x, c]); one residual block whose MLP is the torso under study
(``torso_fn``: an encoder layer and the representation layer, e.g. standard, HR or wide) and a
linear projection P back to the embedding, mixed by a learned per-dimension step alpha and
normalized again (the paper's LERP on the hypersphere):

    h = torso(e),    z = s * l2n(e + alpha * (l2n(P h) - e))

with a learned per-dimension scaler s (SimbaV2's scalers; initialised to sqrt(d), so the heads
read features of unit root-mean-square rather than a unit vector).

SimbaV2's reward scaling (:class:`ReturnNormalizer`) is an option, off by default (see
``normalize_reward``). What it leaves out of SimbaV2, for size: weight
projection onto the sphere after each step, the scalers inside the block and the distributional
critic.
The diagnostics read h.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Callable

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SACSettings", "SimbaTorso", "Actor", "SoftQNetwork", "squashed_log_prob",
           "soft_update", "ReturnNormalizer", "make_continuous_env", "train_sac", "CONTINUOUS_IDS"]

CONTINUOUS_IDS = ("Pendulum-v1", "MountainCarContinuous-v0")
LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


@dataclass
class SACSettings:
    env_id: str = "Pendulum-v1"
    """a Gymnasium continuous-control id (``CONTINUOUS_IDS``)"""
    total_timesteps: int = 20_000
    """environment steps"""
    buffer_size: int = 100_000
    """replay memory size"""
    gamma: float = 0.99
    """discount factor"""
    tau: float = 0.005
    """target smoothing coefficient (Polyak)"""
    batch_size: int = 256
    """minibatch size sampled from replay"""
    learning_starts: int = 1_000
    """uniformly random steps before learning"""
    policy_lr: float = 3e-4
    """actor (and alpha) Adam learning rate"""
    q_lr: float = 1e-3
    """critic Adam learning rate"""
    policy_frequency: int = 2
    """critic steps per actor step (the actor step is repeated to compensate, as in CleanRL)"""
    alpha: float = 0.2
    """initial entropy temperature"""
    autotune: bool = True
    """tune alpha to the target entropy -|A|"""
    embed_dim: int = 64
    """SimbaV2 embedding (sphere) dimension"""
    normalize_reward: bool = False
    """SimbaV2's reward scaling, r / sqrt(running variance of the discounted return + 1e-8); off:
    without SimbaV2's smaller temperature it lets the entropy bonus swamp the scaled rewards (on
    Pendulum-v1 no learning in 6k steps with it, the swing-up by about 5k without)"""
    diag_every: int = 1_000
    """env steps between ``on_eval`` calls"""
    diag_batch: int = 512
    """transitions sampled from replay for ``on_eval``"""


def l2n(x: torch.Tensor) -> torch.Tensor:
    """Projection onto the unit hypersphere, x / ||x||."""
    return F.normalize(x, dim=-1, eps=1e-8)


class SimbaTorso(nn.Module):
    """SimbaV2-style hyperspherical residual torso around ``torso_fn`` (see the module docstring).

    ``inner`` is ``torso_fn((embed_dim,), embed_dim)``: its representation is read by the
    projection P of ``embed_dim`` outputs, so a parameter-matched torso matches with P counted.
    """

    def __init__(self, torso_fn: Callable, in_dim: int, embed_dim: int = 64, shift: float = 3.0):
        super().__init__()
        self.shift = shift
        self.embed = nn.Linear(in_dim + 1, embed_dim)
        self.inner = torso_fn((embed_dim,), embed_dim)
        self.proj = nn.Linear(self.inner.out_dim, embed_dim)
        self.alpha = nn.Parameter(torch.full((embed_dim,), 0.5))   # 1 / (blocks + 1), one block
        self.scaler = nn.Parameter(torch.full((embed_dim,), math.sqrt(embed_dim)))   # unit RMS out
        self.out_dim = embed_dim

    def embed_input(self, x: torch.Tensor) -> torch.Tensor:
        """e = l2n(W_e l2n([x, shift])): what the inner torso reads."""
        x = x.float()
        x = l2n(torch.cat([x, torch.full_like(x[..., :1], self.shift)], -1))
        return l2n(self.embed(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.embed_input(x)
        return self.scaler * l2n(e + self.alpha * (l2n(self.proj(self.inner(e))) - e))


class SoftQNetwork(nn.Module):
    """Q(s, a): a SimbaTorso on [s, a] and a linear head."""

    def __init__(self, torso_fn: Callable, obs_dim: int, act_dim: int, embed_dim: int = 64):
        super().__init__()
        self.torso = SimbaTorso(torso_fn, obs_dim + act_dim, embed_dim)
        self.head = nn.Linear(embed_dim, 1)

    def forward(self, obs, act):
        return self.head(self.torso(torch.cat([obs.float(), act.float()], -1))).squeeze(-1)


def squashed_log_prob(u: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor,
                      scale: torch.Tensor) -> torch.Tensor:
    """log pi(a) of a = tanh(u) * scale + bias, u ~ N(mean, exp(log_std)), summed over action
    dimensions: the Gaussian log-density minus log |da/du| (the 1e-6 as in CleanRL)."""
    normal = torch.distributions.Normal(mean, log_std.exp())
    return (normal.log_prob(u) - torch.log(scale * (1 - torch.tanh(u).pow(2)) + 1e-6)).sum(-1)


class Actor(nn.Module):
    """The squashed-Gaussian policy: a SimbaTorso on s, mean and log-std heads."""

    def __init__(self, torso_fn: Callable, obs_dim: int, space: gym.spaces.Box, embed_dim: int = 64):
        super().__init__()
        self.torso = SimbaTorso(torso_fn, obs_dim, embed_dim)
        act_dim = int(np.prod(space.shape))
        self.mean, self.log_std = nn.Linear(embed_dim, act_dim), nn.Linear(embed_dim, act_dim)
        self.register_buffer("scale", torch.tensor((space.high - space.low) / 2.0, dtype=torch.float32))
        self.register_buffer("bias", torch.tensor((space.high + space.low) / 2.0, dtype=torch.float32))

    def forward(self, obs):
        h = self.torso(obs)
        log_std = torch.tanh(self.log_std(h))
        return self.mean(h), LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)

    def get_action(self, obs):
        """(sampled action, its log-prob, the deterministic action tanh(mean))."""
        mean, log_std = self(obs)
        u = torch.distributions.Normal(mean, log_std.exp()).rsample()
        action = torch.tanh(u) * self.scale + self.bias
        return action, squashed_log_prob(u, mean, log_std, self.scale), \
            torch.tanh(mean) * self.scale + self.bias


@torch.no_grad()
def soft_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """theta_target <- tau theta_source + (1 - tau) theta_target (Polyak averaging)."""
    for tp, sp in zip(target.parameters(), source.parameters()):
        tp.data.mul_(1.0 - tau).add_(sp.data, alpha=tau)


class ReturnNormalizer:
    """Running variance of the discounted return G_t = gamma G_{t-1} + r_t (reset at episode
    ends), Welford's algorithm; SimbaV2 divides rewards by its standard deviation, so the value
    targets stay of order one."""

    def __init__(self, gamma: float):
        self.gamma, self.g, self.n, self.mean, self.m2 = gamma, 0.0, 0, 0.0, 0.0

    def update(self, reward: float, done: bool) -> None:
        self.g = self.gamma * self.g + float(reward)
        self.n += 1
        d = self.g - self.mean
        self.mean += d / self.n
        self.m2 += d * (self.g - self.mean)
        self.g = 0.0 if done else self.g

    @property
    def std(self) -> float:
        return float(np.sqrt(self.m2 / max(1, self.n - 1) + 1e-8)) if self.n > 1 else 1.0


def make_continuous_env(env_id: str, seed: int) -> gym.Env:
    """One seeded continuous-control environment with episode statistics."""
    if env_id not in CONTINUOUS_IDS:
        raise ValueError(f"unknown continuous env_id {env_id!r}; choose one of {CONTINUOUS_IDS}")
    env = gym.wrappers.RecordEpisodeStatistics(gym.make(env_id))
    env.action_space.seed(seed)
    return env


def train_sac(s: SACSettings, torso_fn: Callable, seed: int = 0, device="cpu",
              on_eval: Callable | None = None) -> dict:
    """Train SAC on one environment; returns ``episodes`` ((step, return) pairs), the ``actor``,
    ``qf1``, ``sps`` and ``logs`` (per actor step: ``qf_loss``, ``actor_loss``, ``alpha``).
    ``on_eval(step, agent, obs, actions)`` gets a replay sample every ``diag_every`` steps, with
    ``agent`` a dict of the ``actor`` and ``qf1``."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    env = make_continuous_env(s.env_id, seed)
    obs_dim, act_dim = int(np.prod(env.observation_space.shape)), int(np.prod(env.action_space.shape))
    actor = Actor(torso_fn, obs_dim, env.action_space, s.embed_dim).to(device)
    qf1, qf2 = (SoftQNetwork(torso_fn, obs_dim, act_dim, s.embed_dim).to(device) for _ in range(2))
    qf1_t, qf2_t = copy.deepcopy(qf1), copy.deepcopy(qf2)
    q_opt = torch.optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=s.q_lr)
    a_opt = torch.optim.Adam(actor.parameters(), lr=s.policy_lr)
    log_alpha = torch.tensor(np.log(s.alpha), dtype=torch.float32, device=device, requires_grad=True)
    alpha_opt = torch.optim.Adam([log_alpha], lr=s.policy_lr)
    target_entropy = -float(act_dim)
    n = min(s.buffer_size, s.total_timesteps)
    buf = {k: torch.zeros((n, d), device=device) for k, d in
           (("obs", obs_dim), ("next", obs_dim), ("act", act_dim), ("rew", 1), ("term", 1))}

    episodes, logs, t0 = [], [], time.time()
    ret_norm = ReturnNormalizer(s.gamma)
    obs, _ = env.reset(seed=seed)
    for step in range(s.total_timesteps):
        if step < s.learning_starts:
            action = env.action_space.sample()
        else:
            with torch.no_grad():
                action = actor.get_action(torch.as_tensor(obs, device=device)[None])[0][0].cpu().numpy()
        next_obs, reward, term, trunc, info = env.step(action)
        j = step % n
        for k, v in (("obs", obs), ("next", next_obs), ("act", action), ("rew", [reward]),
                     ("term", [float(term)])):
            buf[k][j] = torch.as_tensor(np.asarray(v, np.float32), device=device)
        obs = next_obs
        ret_norm.update(reward, term or trunc)
        if term or trunc:
            episodes.append((step + 1, float(info["episode"]["r"])))
            obs, _ = env.reset()
        size = min(step + 1, n)
        if step >= s.learning_starts:
            idx = torch.randint(0, size, (s.batch_size,), generator=gen).to(device)
            b = {k: v[idx] for k, v in buf.items()}
            if s.normalize_reward:
                b["rew"] = b["rew"] / ret_norm.std
            alpha = log_alpha.exp().detach()
            with torch.no_grad():
                na, nlogp, _ = actor.get_action(b["next"])
                q_next = torch.min(qf1_t(b["next"], na), qf2_t(b["next"], na)) - alpha * nlogp
                target = b["rew"][:, 0] + s.gamma * (1 - b["term"][:, 0]) * q_next
            qf_loss = F.mse_loss(qf1(b["obs"], b["act"]), target) + \
                F.mse_loss(qf2(b["obs"], b["act"]), target)
            q_opt.zero_grad()
            qf_loss.backward()
            q_opt.step()
            if step % s.policy_frequency == 0:
                for _ in range(s.policy_frequency):
                    pi, logp, _ = actor.get_action(b["obs"])
                    actor_loss = (alpha * logp - torch.min(qf1(b["obs"], pi), qf2(b["obs"], pi))).mean()
                    a_opt.zero_grad()
                    actor_loss.backward()
                    a_opt.step()
                    if s.autotune:
                        with torch.no_grad():
                            _, logp, _ = actor.get_action(b["obs"])
                        alpha_loss = (-log_alpha.exp() * (logp + target_entropy)).mean()
                        alpha_opt.zero_grad()
                        alpha_loss.backward()
                        alpha_opt.step()
                        alpha = log_alpha.exp().detach()
                logs.append({"qf_loss": qf_loss.item(), "actor_loss": actor_loss.item(),
                             "alpha": float(alpha)})
            soft_update(qf1_t, qf1, s.tau)
            soft_update(qf2_t, qf2, s.tau)
        if on_eval is not None and step >= s.learning_starts and \
                ((step + 1) % s.diag_every == 0 or step == s.total_timesteps - 1):
            idx = torch.randint(0, size, (s.diag_batch,), generator=gen).to(device)
            on_eval(step + 1, {"actor": actor, "qf1": qf1}, buf["obs"][idx], buf["act"][idx])
    env.close()
    return {"episodes": episodes, "actor": actor, "qf1": qf1, "logs": logs,
            "sps": s.total_timesteps / (time.time() - t0)}
