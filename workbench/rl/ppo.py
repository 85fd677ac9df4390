"""Proximal Policy Optimization (Schulman et al. 2017), in the single-file manner of CleanRL.

Follows vwxyzjn/cleanrl ``cleanrl/ppo.py`` / ``ppo_atari.py``: vectorized environments, rollouts
of ``num_steps`` per env, GAE (lambda = 0.95), advantage normalization per minibatch, clipped
surrogate objective and clipped value loss, entropy bonus, global gradient clipping at 0.5,
learning rate annealed linearly to 0, orthogonal init (policy head gain 0.01, value head 1).
Actor and critic share one torso (as in ``ppo_atari.py``), so the representation the
diagnostics measure is read by both heads. The torso is passed in: ``torso_fn(obs_shape,
head_dim) -> module with .out_dim``.

``task_steps`` > 0 trains on a stream of tasks (:class:`workbench.rl.envs.TaskStream`, drawn
from the seed): every ``task_steps`` environment steps the observation features are shown under a
new signed permutation, on the same network and optimizer.

``on_update(update, step, agent, obs)`` is called after every ``diag_every`` updates (and the
last) with the rollout's observations, so a notebook can measure the representation on the
states the agent visits.

Every update logs what CleanRL's ``ppo.py`` writes to TensorBoard, in ``result["logs"]`` (one
dict per update): ``learning_rate``, ``value_loss``, ``policy_loss``, ``entropy``,
``old_approx_kl`` (-logratio mean), ``approx_kl`` (the k3 estimator (ratio - 1) - logratio,
Schulman 2020, "Approximating KL divergence"), both of the last minibatch as in CleanRL,
``clipfrac`` (fraction of samples with |ratio - 1| > clip_coef, over all minibatches of the
update) and ``explained_variance`` (1 - Var[returns - values] / Var[returns] of the rollout).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical

LOG_KEYS = ("learning_rate", "value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl",
            "clipfrac", "explained_variance")

from .envs import TaskStream, finished_episodes, make_vec_env

__all__ = ["LOG_KEYS", "PPOSettings", "kl_estimates", "clip_fraction", "explained_variance",
           "ActorCritic", "train_ppo"]


@dataclass
class PPOSettings:
    env_id: str = "CartPole-v1"
    """the environment id (``workbench.rl.envs.ENV_IDS``)"""
    total_timesteps: int = 500_000
    """total environment steps, summed over the vectorized envs"""
    learning_rate: float = 2.5e-4
    """Adam learning rate (annealed linearly to 0 when ``anneal_lr``)"""
    num_envs: int = 4
    """number of parallel environments"""
    num_steps: int = 128
    """steps per env in each rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """lambda of generalized advantage estimation"""
    num_minibatches: int = 4
    """minibatches per epoch"""
    update_epochs: int = 4
    """epochs over each rollout"""
    norm_adv: bool = True
    """normalize advantages within each minibatch"""
    clip_coef: float = 0.2
    """surrogate clipping coefficient"""
    clip_vloss: bool = True
    """clip the value loss as in the PPO paper's code"""
    ent_coef: float = 0.01
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    max_grad_norm: float = 0.5
    """global gradient-norm clip"""
    target_kl: float | None = None
    """stop an update's epochs early beyond this approximate KL (None: never)"""
    diag_every: int = 10
    """call ``on_update`` every this many updates"""
    task_steps: int = 0
    """environment steps (summed over the envs) per task of a stream of permuted-input tasks
    (0: one stationary task); a multiple of ``num_envs``"""

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.num_minibatches

    @property
    def num_updates(self) -> int:
        return max(1, self.total_timesteps // self.batch_size)

    def stream(self, seed: int) -> TaskStream | None:
        """The task stream of a run with this seed (None for one stationary task)."""
        if not self.task_steps:
            return None
        if self.task_steps % self.num_envs:
            raise ValueError(f"task_steps {self.task_steps} is not a multiple of "
                             f"num_envs {self.num_envs}")
        return TaskStream(self.task_steps // self.num_envs, seed)


def kl_estimates(logratio: torch.Tensor) -> tuple[float, float]:
    """(old_approx_kl, approx_kl) of KL(pi_old || pi_new) from samples of pi_old, with
    ``logratio = log pi_new(a|s) - log pi_old(a|s)``: the k1 estimator -logratio (unbiased, can be
    negative) and the k3 estimator (r - 1) - log r with r = exp(logratio) (unbiased and >= 0;
    Schulman 2020), the one CleanRL logs as ``approx_kl``."""
    ratio = logratio.exp()
    return float((-logratio).mean()), float(((ratio - 1) - logratio).mean())


def clip_fraction(ratio: torch.Tensor, clip_coef: float) -> float:
    """Fraction of samples whose probability ratio is outside [1 - clip_coef, 1 + clip_coef]."""
    return float(((ratio - 1.0).abs() > clip_coef).float().mean())


def explained_variance(y_pred, y_true) -> float:
    """1 - Var[y_true - y_pred] / Var[y_true]: 1 for a perfect value function, 0 for one that
    predicts the mean, negative for worse; NaN when the returns do not vary (as in CleanRL)."""
    y_pred, y_true = np.asarray(y_pred, dtype=np.float64), np.asarray(y_true, dtype=np.float64)
    var_y = np.var(y_true)
    return float("nan") if var_y == 0 else float(1 - np.var(y_true - y_pred) / var_y)


class ActorCritic(nn.Module):
    """A shared torso with a policy head (logits) and a value head."""

    def __init__(self, torso_fn: Callable, obs_shape: tuple, n_actions: int):
        super().__init__()
        self.torso = torso_fn(obs_shape, n_actions + 1)      # heads: n_actions logits + 1 value
        self.actor = nn.Linear(self.torso.out_dim, n_actions)
        self.critic = nn.Linear(self.torso.out_dim, 1)
        nn.init.orthogonal_(self.actor.weight, 0.01)
        nn.init.orthogonal_(self.critic.weight, 1.0)
        nn.init.zeros_(self.actor.bias)
        nn.init.zeros_(self.critic.bias)

    def get_value(self, x):
        return self.critic(self.torso(x)).squeeze(-1)

    def get_action_and_value(self, x, action=None):
        h = self.torso(x)
        dist = Categorical(logits=self.actor(h))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(h).squeeze(-1)


def train_ppo(s: PPOSettings, torso_fn: Callable, seed: int = 0, device="cpu",
              on_update: Callable | None = None, progress: Callable | None = None) -> dict:
    """Train PPO; returns ``episodes`` ((step, return) pairs), the ``agent``, ``sps``, ``logs``
    (one dict per update: ``update``, ``step`` and :data:`LOG_KEYS`) and ``task``: the task in
    force at the end (0 without a stream)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)        # minibatch shuffling
    device = torch.device(device)
    stream = s.stream(seed)
    envs = make_vec_env(s.env_id, s.num_envs, seed, stream)
    obs_shape = envs.single_observation_space.shape
    agent = ActorCritic(torso_fn, obs_shape, envs.single_action_space.n).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=s.learning_rate, eps=1e-5)

    obs = torch.zeros((s.num_steps, s.num_envs) + obs_shape, device=device)
    actions = torch.zeros((s.num_steps, s.num_envs), dtype=torch.long, device=device)
    logprobs = torch.zeros((s.num_steps, s.num_envs), device=device)
    rewards = torch.zeros((s.num_steps, s.num_envs), device=device)
    dones = torch.zeros((s.num_steps, s.num_envs), device=device)
    values = torch.zeros((s.num_steps, s.num_envs), device=device)

    episodes, logs, global_step, t0 = [], [], 0, time.time()
    next_obs, _ = envs.reset(seed=seed)
    next_obs = torch.as_tensor(next_obs, device=device)
    next_done = torch.zeros(s.num_envs, device=device)
    updates = range(1, s.num_updates + 1)
    for update in (progress(updates, desc=f"ppo seed {seed}") if progress else updates):
        if s.anneal_lr:
            optimizer.param_groups[0]["lr"] = (1.0 - (update - 1.0) / s.num_updates) * s.learning_rate

        # -- rollout -----------------------------------------------------------------------
        for step in range(s.num_steps):
            global_step += s.num_envs
            obs[step], dones[step] = next_obs, next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
            values[step], actions[step], logprobs[step] = value, action, logprob
            next_obs, reward, term, trunc, infos = envs.step(action.cpu().numpy())
            rewards[step] = torch.as_tensor(reward, device=device, dtype=torch.float32)
            next_obs = torch.as_tensor(next_obs, device=device)
            next_done = torch.as_tensor(np.logical_or(term, trunc), device=device, dtype=torch.float32)
            episodes += [(global_step, r) for r, _ in finished_episodes(infos)]

        # -- GAE (truncation treated as termination, as CleanRL does) ------------------------
        with torch.no_grad():
            next_value = agent.get_value(next_obs)
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(s.num_steps)):
                nextnonterminal = 1.0 - (next_done if t == s.num_steps - 1 else dones[t + 1])
                nextvalues = next_value if t == s.num_steps - 1 else values[t + 1]
                delta = rewards[t] + s.gamma * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + s.gamma * s.gae_lambda * nextnonterminal * lastgaelam
            returns = advantages + values

        b_obs = obs.reshape((-1,) + obs_shape)
        b_logprobs, b_actions = logprobs.reshape(-1), actions.reshape(-1)
        b_advantages, b_returns, b_values = advantages.reshape(-1), returns.reshape(-1), values.reshape(-1)

        # -- optimize the policy and value network --------------------------------------------
        b_inds, clipfracs = np.arange(s.batch_size), []
        for _ in range(s.update_epochs):
            rng.shuffle(b_inds)
            for start in range(0, s.batch_size, s.minibatch_size):
                mb = b_inds[start:start + s.minibatch_size]
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb], b_actions[mb])
                logratio = newlogprob - b_logprobs[mb]
                ratio = logratio.exp()
                with torch.no_grad():
                    old_approx_kl, approx_kl = kl_estimates(logratio)
                    clipfracs.append(clip_fraction(ratio, s.clip_coef))
                mb_adv = b_advantages[mb]
                if s.norm_adv:
                    mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss = torch.max(-mb_adv * ratio,
                                    -mb_adv * torch.clamp(ratio, 1 - s.clip_coef, 1 + s.clip_coef)).mean()
                if s.clip_vloss:
                    v_clipped = b_values[mb] + torch.clamp(newvalue - b_values[mb], -s.clip_coef, s.clip_coef)
                    v_loss = 0.5 * torch.max((newvalue - b_returns[mb]) ** 2,
                                             (v_clipped - b_returns[mb]) ** 2).mean()
                else:
                    v_loss = 0.5 * ((newvalue - b_returns[mb]) ** 2).mean()
                loss = pg_loss - s.ent_coef * entropy.mean() + s.vf_coef * v_loss
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), s.max_grad_norm)
                optimizer.step()
            if s.target_kl is not None and approx_kl > s.target_kl:
                break
        logs.append({"update": update, "step": global_step,
                     "learning_rate": optimizer.param_groups[0]["lr"], "value_loss": v_loss.item(),
                     "policy_loss": pg_loss.item(), "entropy": entropy.mean().item(),
                     "old_approx_kl": old_approx_kl, "approx_kl": approx_kl,
                     "clipfrac": float(np.mean(clipfracs)),
                     "explained_variance": explained_variance(b_values.cpu().numpy(),
                                                              b_returns.cpu().numpy())})

        if on_update is not None and (update == 1 or update % s.diag_every == 0
                                      or update == s.num_updates):
            on_update(update, global_step, agent, b_obs)
    envs.close()
    # the task of the last decision (the final step may already show the next task's observation)
    task = stream.first_task + (global_step // s.num_envs - 1) // stream.task_steps if stream else 0
    return {"episodes": episodes, "agent": agent, "sps": global_step / (time.time() - t0),
            "logs": logs, "task": task}
