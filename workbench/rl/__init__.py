"""Readable single-file-style RL agents (after CleanRL) and seeded vectorized environments.

- :mod:`workbench.rl.envs`: ``make_vec_env(env_id, num_envs, seed)`` for CartPole, MinAtar and
  ALE Atari (``ale-py`` imported only for ``ALE/...`` ids); ``ENV_IDS`` lists the choices.
- :mod:`workbench.rl.dqn`: ``DQNSettings``, ``train_dqn(settings, torso_fn, seed, device)``.
- :mod:`workbench.rl.ppo`: ``PPOSettings``, ``train_ppo(settings, torso_fn, seed, device)``.

The agents take the network torso as a factory ``torso_fn(obs_shape, head_dim)`` returning a
module with an ``out_dim`` attribute, so a method module (e.g. ``workbench.methods.hadamard``)
supplies the architecture and the agents stay architecture-agnostic.
"""
from .envs import ENV_IDS, check_env_id, env_family, make_vec_env

__all__ = ["ENV_IDS", "check_env_id", "env_family", "make_vec_env"]
