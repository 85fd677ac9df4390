"""Vectorized, seeded Gymnasium environments for the RL agents: classic control, MinAtar, ALE.

Three families behind one function, :func:`make_vec_env`:

- Gymnasium classic control (``CartPole-v1``, ``Acrobot-v1``): smoke runs.
- MinAtar (Young & Tian 2019; the ``minatar`` package): 10x10xC boolean grids, returned here
  as float32 channel-first ``(C, 10, 10)``; minimal action set, sticky actions p = 0.1 (the
  package's default), an episode cap of ``MINATAR_MAX_STEPS`` steps.
- ALE Atari (``ale-py``, ROMs inside the package): the usual DQN preprocessing (noop reset,
  frame skip 4 with max-pooling, 84x84 grey, 4 stacked frames, rewards clipped to their sign
  for learning while the recorded episode return stays the game score). ``ale_py`` is imported
  only when an ``ALE/...`` id is asked for, so nothing else needs it installed.

A :class:`TaskStream` turns one environment into a non-stationary sequence of tasks on one
network, as in the loss-of-plasticity benchmarks with permuted inputs (Dohare et al. 2024, Lyle
et al. 2023): the first task is the environment itself, every later one shows its observation
features under a signed permutation of their own (:class:`PermutedFeatures`).

Every environment is wrapped in ``RecordEpisodeStatistics`` (per env) before reward clipping,
and the vector env uses same-step autoreset (the terminal observation is in
``info["final_obs"]``), the convention CleanRL's scripts were written for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import gymnasium as gym
import numpy as np
from minatar import Environment

__all__ = ["check_env_id", "env_family", "MinAtarEnv", "TaskStream", "signed_permutation",
           "PermutedFeatures", "make_env", "make_vec_env", "finished_episodes"]

CLASSIC_IDS = ("CartPole-v1", "Acrobot-v1")
MINATAR_GAMES = {"MinAtar/Asterix-v1": "asterix", "MinAtar/Breakout-v1": "breakout",
                 "MinAtar/Freeway-v1": "freeway", "MinAtar/Seaquest-v1": "seaquest",
                 "MinAtar/SpaceInvaders-v1": "space_invaders"}
MINATAR_IDS = tuple(MINATAR_GAMES)
ALE_IDS = ("ALE/Breakout-v5", "ALE/Pong-v5", "ALE/SpaceInvaders-v5", "ALE/Asterix-v5",
           "ALE/Seaquest-v5", "ALE/Qbert-v5", "ALE/BeamRider-v5", "ALE/MsPacman-v5",
           "ALE/Enduro-v5", "ALE/Freeway-v5")
ENV_IDS = CLASSIC_IDS + MINATAR_IDS + ALE_IDS
MINATAR_MAX_STEPS = 10_000


def check_env_id(env_id: str) -> str:
    """Return ``env_id`` if it is one this package builds, else a ValueError listing the choices."""
    if env_id not in ENV_IDS:
        raise ValueError(f"unknown env_id {env_id!r}; choose one of: classic {list(CLASSIC_IDS)}, "
                         f"MinAtar {list(MINATAR_IDS)}, ALE (needs ale-py) {list(ALE_IDS)}")
    return env_id


def env_family(env_id: str) -> str:
    """``"classic"``, ``"minatar"`` or ``"ale"``: which torso encoder the observations need."""
    check_env_id(env_id)
    return "classic" if env_id in CLASSIC_IDS else "minatar" if env_id in MINATAR_IDS else "ale"


class MinAtarEnv(gym.Env):
    """A Gymnasium view of ``minatar.Environment`` with float32 channel-first observations."""

    metadata = {"render_modes": []}

    def __init__(self, game: str, sticky_action_prob: float = 0.1):
        self.game = Environment(game, sticky_action_prob=sticky_action_prob)
        self.action_set = list(self.game.minimal_action_set())
        h, w, c = self.game.state_shape()
        self.action_space = gym.spaces.Discrete(len(self.action_set))
        self.observation_space = gym.spaces.Box(0.0, 1.0, shape=(c, h, w), dtype=np.float32)

    def _obs(self) -> np.ndarray:
        return np.ascontiguousarray(self.game.state().transpose(2, 0, 1), dtype=np.float32)

    def reset(self, *, seed: int | None = None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self.game.seed(int(seed))        # MinAtar draws from its own RandomState
        self.game.reset()
        return self._obs(), {}

    def step(self, action):
        reward, done = self.game.act(self.action_set[int(action)])
        return self._obs(), float(reward), bool(done), False, {}


@dataclass(frozen=True)
class TaskStream:
    """A sequence of tasks on one environment: task k (from 0) shows the observation's features
    under :func:`signed_permutation` ``(n, seed, k)``; the task advances every ``task_steps``
    steps of each environment copy (0: the task ``first_task`` throughout)."""
    task_steps: int
    seed: int
    first_task: int = 0


def signed_permutation(n: int, seed: int, task: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, signs) of task ``task``: the identity for task 0; otherwise a permutation of the
    ``n`` features and a sign per feature drawn from (seed, task), drawn again while it is the
    identity, so that every later task differs from the first."""
    order, signs = np.arange(n), np.ones(n, np.float32)
    rng = np.random.default_rng([seed, task])
    while task > 0 and np.array_equal(order, np.arange(n)) and (signs > 0).all():
        order, signs = rng.permutation(n), rng.choice(np.array([-1.0, 1.0], np.float32), n)
    return order, signs


class PermutedFeatures(gym.ObservationWrapper):
    """The observation of a flat-vector environment with its features reordered and sign-flipped
    per task of a :class:`TaskStream`: ``obs'[i] = sign[i] * obs[order[i]]``. The dynamics,
    rewards and actions are the environment's, so every task is as hard as the first and the
    best policy is the same up to the input map; what changes is what the network must read."""

    def __init__(self, env: gym.Env, stream: TaskStream):
        super().__init__(env)
        space = env.observation_space
        if len(space.shape) != 1:
            raise ValueError(f"a task stream permutes flat observations; got shape {space.shape}")
        self.stream, self.steps = stream, 0
        bound = np.maximum(np.abs(space.low), np.abs(space.high)).astype(np.float32)
        self._n, self._bound = space.shape[0], bound
        self._set_task(stream.first_task)

    def _set_task(self, task: int) -> None:
        self.task = task
        self.order, self.signs = signed_permutation(self._n, self.stream.seed, task)
        b = self._bound[self.order]
        self.observation_space = gym.spaces.Box(-b, b, dtype=np.float32)

    def step(self, action):
        self.steps += 1
        if self.stream.task_steps:
            task = self.stream.first_task + self.steps // self.stream.task_steps
            if task != self.task:
                self._set_task(task)
        return super().step(action)

    def observation(self, obs):
        return (self.signs * np.asarray(obs, np.float32)[self.order]).astype(np.float32)


def _make_ale(env_id: str) -> gym.Env:
    # imported here on purpose: the ROM package is optional, and its absence gets a clear message
    try:
        import ale_py
    except ImportError as err:
        raise ImportError(f"{env_id} needs the Arcade Learning Environment: pip install ale-py "
                          "(its ROMs ship inside the package)") from err
    gym.register_envs(ale_py)
    env = gym.make(env_id, frameskip=1)                       # AtariPreprocessing skips frames
    env = gym.wrappers.RecordEpisodeStatistics(env)           # the game score, before clipping
    env = gym.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84,
                                          grayscale_obs=True, scale_obs=False)
    env = gym.wrappers.TransformReward(env, lambda r: float(np.sign(r)))
    return gym.wrappers.FrameStackObservation(env, 4)


def make_env(env_id: str, stream: TaskStream | None = None) -> Callable[[], gym.Env]:
    """A thunk that builds one environment of ``env_id`` (what ``SyncVectorEnv`` wants), under
    the task ``stream`` when one is given (flat observations only)."""
    family = env_family(env_id)

    def thunk() -> gym.Env:
        if family == "ale":
            return _make_ale(env_id)
        if family == "minatar":
            env = gym.wrappers.TimeLimit(MinAtarEnv(MINATAR_GAMES[env_id]), MINATAR_MAX_STEPS)
        else:
            env = gym.make(env_id)
        if stream is not None:
            env = PermutedFeatures(env, stream)
        return gym.wrappers.RecordEpisodeStatistics(env)
    return thunk


def make_vec_env(env_id: str, num_envs: int, seed: int,
                 stream: TaskStream | None = None) -> gym.vector.VectorEnv:
    """``num_envs`` copies of ``env_id`` in a ``SyncVectorEnv`` (same-step autoreset) with seeded
    action spaces (random exploration); the agent seeds the environments themselves with
    ``envs.reset(seed=seed)`` (copy i gets seed + i). Under a task ``stream`` every copy shows
    the same task and, stepping in lockstep, switches task at the same vector step.

    Only Gymnasium's public API: every copy is a registered or wrapped ``gym.Env``, and the
    vector env is Gymnasium's own. (Gymnasium's numpy ``CartPoleVectorEnv`` is faster per step
    but resets on the *next* step; the per-env overhead of ``SyncVectorEnv`` on CartPole is about
    0.1 ms per vector step of 16 copies, a second or so of a smoke run.)"""
    envs = gym.vector.SyncVectorEnv([make_env(env_id, stream) for _ in range(num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    envs.action_space.seed(seed)
    envs.single_action_space.seed(seed)
    return envs


def finished_episodes(infos: dict) -> list[tuple[float, int]]:
    """(return, length) of every episode that ended in this vector step."""
    final = infos.get("final_info", {})
    if "episode" not in final:
        return []
    mask = final["_episode"]
    return [(float(r), int(l)) for r, l, m in zip(final["episode"]["r"], final["episode"]["l"], mask)
            if m]
