"""The experiments of notebook 09: Hadamard Representation against dormant neurons and rank
collapse in deep RL (the method itself is :mod:`workbench.methods.hadamard`).

The harness trains one agent (PPO or DQN from :mod:`workbench.rl`) per torso (standard, HR,
parameter-matched wide) and inner seed, measures the representation every few updates
(:func:`workbench.methods.hadamard.representation_stats`), and reduces the runs to what the
claims read: inactivity and dormancy over training, rank and saturation late in training, the
final return, PPO's own update diagnostics, the ReLU comparison, the saturation of each HR
branch, and the singular spectrum of the representation. The explorer scales the trained
torsos' pre-activations by a gain and counts saturated units again (:func:`gain_table`,
:func:`gain_figure`): the p against p squared of one branch against a product of two.

With ``task_steps`` in PPO's settings the runs train on a stream of permuted-input tasks
(:class:`workbench.rl.envs.TaskStream`); :func:`task_table` then reads the diagnostics per task and
:func:`stream_degradation` checks that the standard torso loses capacity along the stream.
"""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as widgets
import numpy as np
import pandas as pd
import torch
from IPython.display import display

from workbench import diagnostics as dx
from workbench import plots
from workbench.device import seed_everything
from workbench.env import interactive
from workbench.methods import hadamard as hr
from workbench.rl import env_family, make_vec_env
from workbench.rl.dqn import DQNSettings, train_dqn
from workbench.rl.envs import TaskStream
from workbench.rl.ppo import PPOSettings, train_ppo

__all__ = ["AGENTS", "LABEL", "PPO_LOGS", "Setup", "make_setup", "torso_sizes", "train_one",
           "train_torsos", "checkpoints", "smoothed_return", "series", "returns", "summarize",
           "policy_actions", "eval_returns", "final_returns", "claim_intervals",
           "curves_by_torso", "ppo_logs", "ppo_log_means", "relu_summary", "branch_saturation",
           "spectrum_figure", "spectrum_slider", "spectrum_start_end", "preactivations",
           "saturation_at", "gain_table", "gain_figure", "OTHER_AGENTS",
           "train_other_agents", "other_agents_summary", "other_agents_intervals", "task_of",
           "per_task", "task_table", "stream_degradation"]

AGENTS = ("ppo", "dqn")
LABEL = {"standard": "standard", "hadamard": "HR", "wide": "wide (param-matched)"}
PPO_LOGS = {"approx KL (k3)": "approx_kl", "clip fraction": "clipfrac",
            "explained variance": "explained_variance"}


@dataclass
class Setup:
    """Everything one training run needs besides its torso, seed and activation."""
    agent: str                 # "ppo" or "dqn"
    env_id: str                # environment id (workbench.rl.ENV_IDS)
    family: str                # observation family of env_id: classic, minatar or ale
    width: int                 # units of the standard / HR representation layer
    total_timesteps: int       # environment steps per run
    agent_cfg: dict            # the agent's settings (learning rate, envs, ...)
    activation: str            # tanh, relu or gelu
    inner_seeds: list          # one training run per torso and inner seed
    tau: float = 0.1           # tau-dormant threshold (Sokar et al. 2023)
    activity_tau: float = 0.1  # inactive threshold of the activity score (C1)
    device: object = "cpu"


def make_setup(S: dict, agent: str, activation: str, seed: int, *, tau: float,
               activity_tau: float, device) -> Setup:
    """The :class:`Setup` the sizes ``S`` imply: the agent's settings (with the learning-rate
    knob applied), the observation family and the inner seeds ``seed * 100 + i``."""
    if agent not in AGENTS:
        raise ValueError(f"agent must be 'ppo' or 'dqn', got {agent!r}")
    cfg = dict(S[agent], **({"learning_rate": S["learning_rate"]} if S["learning_rate"] else {}))
    return Setup(agent, S["env_id"], env_family(S["env_id"]), S["width"], S["total_timesteps"],
                 cfg, activation, [seed * 100 + i for i in range(S["n_inner_seeds"])], tau,
                 activity_tau, device)


def torso_sizes(setup: Setup, seed: int) -> dict:
    """kind -> (representation units, parameters of the representation layer + heads) on the
    setup's environment (PPO's heads: the logits and the value; DQN's: the Q-values)."""
    env = make_vec_env(setup.env_id, 1, seed)
    obs_shape, n_actions = env.single_observation_space.shape, env.single_action_space.n
    env.close()
    head_dim = n_actions + 1 if setup.agent == "ppo" else n_actions
    out = {}
    for kind in hr.TORSOS:
        t = hr.Torso(kind, setup.family, obs_shape, head_dim, setup.width, setup.activation)
        out[kind] = (t.out_dim, hr.rep_param_count(t, head_dim))
    return out


def train_one(setup: Setup, kind: str, inner_seed: int, act: str | None = None,
              steps: int | None = None) -> dict:
    """Train one agent with one torso; returns its diagnostics per checkpoint (``tracker``), the
    singular values per checkpoint (``spectra``), its finished episodes ((step, return) rows),
    PPO's per-update ``logs``, ``sps``, the trained network (``policy``: PPO's actor-critic or
    DQN's Q-network), ``eval_stream`` (on a task stream, the last task trained on, where the
    network is evaluated; else None) and the last torso and states measured."""
    act = act or setup.activation
    seed_everything(inner_seed)
    torso_fn = hr.torso_factory(kind, setup.family, setup.width, act)
    tr, spectra, last = dx.Tracker(), [], {}

    def measure(step, net, states):
        last.update(torso=net.torso, states=states)          # kept for the branch diagnostic
        st = hr.representation_stats(net.torso, states, tau=setup.tau,
                                     activity_tau=setup.activity_tau)
        spectra.append(st.pop("sv"))
        tr.log(step, **st)

    common = dict(env_id=setup.env_id, total_timesteps=steps or setup.total_timesteps,
                  **setup.agent_cfg)
    if setup.agent == "ppo":
        out = train_ppo(PPOSettings(**common), torso_fn, seed=inner_seed, device=setup.device,
                        on_update=lambda u, step, net, obs: measure(step, net, obs))
    else:
        cfg = DQNSettings(diag_every=max(1, common["total_timesteps"] // 12), **common)
        out = train_dqn(cfg, torso_fn, seed=inner_seed, device=setup.device,
                        on_eval=lambda step, net, obs: measure(step, net, obs))
    return {"tracker": tr, "spectra": spectra,
            "episodes": np.array(out["episodes"], float).reshape(-1, 2),
            "logs": pd.DataFrame(out.get("logs", [])), "sps": out["sps"],
            "policy": out["agent"] if setup.agent == "ppo" else out["q_network"],
            "eval_stream": TaskStream(0, inner_seed, out["task"]) if out.get("task") else None,
            **last}


def train_torsos(setup: Setup, progress=lambda it, **kw: it, act: str | None = None,
                 steps: int | None = None, desc: str = "training", verbose: bool = True) -> dict:
    """kind -> one :func:`train_one` result per inner seed, trained torso by torso in the order
    of ``hr.TORSOS``; prints a line per run when ``verbose``."""
    results = {kind: [] for kind in hr.TORSOS}
    for kind, s in progress([(k, s) for k in hr.TORSOS for s in setup.inner_seeds], desc=desc):
        results[kind].append(train_one(setup, kind, s, act=act, steps=steps))
        r = results[kind][-1]
        if verbose:
            print(f"{LABEL[kind]:22s} seed {s:4d}: {len(r['episodes'])} episodes, "
                  f"{r['sps']:.0f} steps/s, final inactive {r['tracker']['inactive'][-1]:.3f}, "
                  f"erank {r['tracker']['erank'][-1]:.2f}")
    return results


def checkpoints(results: dict) -> np.ndarray:
    """The environment steps at which the representation was measured (the same in every run)."""
    return np.array(results["standard"][0]["tracker"].steps)


def smoothed_return(episodes: np.ndarray, steps, window: int = 20) -> np.ndarray:
    """Mean return of the last ``window`` episodes finished by each step (NaN before the first)."""
    out = []
    for s in steps:
        done = episodes[episodes[:, 0] <= s, 1]
        out.append(done[-window:].mean() if len(done) else np.nan)
    return np.array(out)


def series(results: dict, kind: str, name: str) -> np.ndarray:
    """(inner seeds x checkpoints) array of one diagnostic."""
    return np.stack([r["tracker"][name] for r in results[kind]])


def returns(results: dict, kind: str, steps) -> np.ndarray:
    """(inner seeds x checkpoints) smoothed returns."""
    return np.stack([smoothed_return(r["episodes"], steps) for r in results[kind]])


def summarize(results: dict, steps) -> dict:
    """kind -> what the verdicts read: inactivity and dormancy averaged over all checkpoints,
    saturation and rank over the second half of training, return (mean and std over inner seeds)
    over the episodes of the last 20% of training."""
    late = steps >= steps[-1] / 2          # the second half of training
    summary = {}
    for kind in hr.TORSOS:
        final_ret = [r["episodes"][r["episodes"][:, 0] >= 0.8 * steps[-1], 1].mean()
                     for r in results[kind]]
        summary[kind] = {
            "inactive_mean": series(results, kind, "inactive").mean(),
            "inactive_late": series(results, kind, "inactive")[:, late].mean(),
            "dormant_mean": series(results, kind, "dormant").mean(),
            "saturated_late": series(results, kind, "saturated")[:, late].mean(),
            "srank_late": series(results, kind, "srank")[:, late].mean(),
            "erank_late": series(results, kind, "erank")[:, late].mean(),
            "return_final": float(np.nanmean(final_ret)),
            "return_final_std": float(np.nanstd(final_ret)),
        }
    return summary


def curves_by_torso(results: dict, name: str, steps) -> dict:
    """torso label -> (inner seeds x checkpoints) of a diagnostic, or of the return (``return``)."""
    return {LABEL[k]: returns(results, k, steps) if name == "return" else series(results, k, name)
            for k in hr.TORSOS}


def ppo_logs(results: dict) -> dict:
    """panel title -> torso label -> (inner seeds x updates) of one of PPO's own diagnostics."""
    return {title: {LABEL[k]: np.stack([r["logs"][key] for r in results[k]]) for k in hr.TORSOS}
            for title, key in PPO_LOGS.items()}


def ppo_log_means(results: dict) -> dict:
    """``{m}_mean_{kind}``: each PPO diagnostic averaged over updates and inner seeds."""
    out = {}
    for k in hr.TORSOS:
        out.update({f"{m}_mean_{k}": float(np.nanmean(np.stack([r["logs"][m] for r in results[k]])))
                    for m in ("approx_kl", "clipfrac", "explained_variance")})
    return out


@torch.no_grad()
def policy_actions(net: torch.nn.Module, obs: torch.Tensor,
                   gen: torch.Generator | None = None) -> torch.Tensor:
    """The actions a trained network takes: a PPO actor-critic samples from its policy with the
    CPU generator ``gen`` (as it acts in training, and as CleanRL's ``ppo_eval`` plays) or, with
    ``gen=None``, takes the most probable action; a DQN takes its largest Q-value."""
    if not hasattr(net, "actor"):
        return net(obs).argmax(-1)
    logits = net.actor(net.torso(obs))
    if gen is None:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=gen).squeeze(-1)


def eval_returns(env_id: str, net: torch.nn.Module, n_episodes: int, seed: int,
                 greedy: bool = False, stream: TaskStream | None = None) -> np.ndarray:
    """The return of one episode of ``net`` (:func:`policy_actions`, actions sampled from a
    generator seeded with ``seed`` unless ``greedy``) per environment, the environments reset
    with seeds ``seed, seed + 1, ..., seed + n_episodes - 1``: the same episodes (items) for
    every network given the same seed, so two networks' returns pair item by item. ``stream``:
    the task to play (a run's ``eval_stream``; None: the environment itself)."""
    envs = make_vec_env(env_id, n_episodes, seed, stream)
    obs, _ = envs.reset(seed=seed)
    device, out = next(net.parameters()).device, np.full(n_episodes, np.nan)
    gen = None if greedy else torch.Generator().manual_seed(seed)
    while np.isnan(out).any():
        act = policy_actions(net, torch.as_tensor(obs, device=device), gen)
        obs, _, _, _, infos = envs.step(act.cpu().numpy())
        final = infos.get("final_info", {})
        if "episode" in final:
            first = final["_episode"] & np.isnan(out)         # each env's first episode only
            out[first] = final["episode"]["r"][first]
    envs.close()
    return out


def final_returns(setup: Setup, results: dict, n_episodes: int, seed: int,
                  greedy: bool = False) -> dict:
    """kind -> (inner seeds x episodes) returns of the trained networks, every network on the same
    ``n_episodes`` evaluation episodes (:func:`eval_returns` from ``seed``), on a task stream
    the last task each run trained on (the same for the three torsos of an inner seed)."""
    return {k: np.stack([eval_returns(setup.env_id, r["policy"], n_episodes, seed, greedy,
                                      r.get("eval_stream")) for r in results[k]])
            for k in hr.TORSOS}


def claim_intervals(results: dict, steps, final: dict) -> pd.DataFrame:
    """The paired comparisons of C1, C3 and C4 (a row each), as the difference that is positive
    when HR wins, with its 95 % paired bootstrap interval over (inner seeds x items)
    (:func:`workbench.diagnostics.paired_bootstrap`: the torsos share the inner seeds, the
    checkpoints and the evaluation episodes). ``c1``: standard minus HR inactive fraction, items
    all checkpoints; ``c4``: standard minus HR saturated fraction, items the checkpoints of the
    second half of training; ``c3_standard``: HR's return minus 0.9 x the standard's
    ("matches": within 10 %), ``c3_wide``: HR's minus the wide layer's, items the evaluation
    episodes (``final``, :func:`final_returns`)."""
    late = np.asarray(steps) >= steps[-1] / 2
    sat = {k: series(results, k, "saturated")[:, late] for k in ("standard", "hadamard")}
    inactive = {k: series(results, k, "inactive") for k in ("standard", "hadamard")}
    pairs = {"c1": (inactive["standard"], inactive["hadamard"]),
             "c3_standard": (final["hadamard"], 0.9 * final["standard"]),
             "c3_wide": (final["hadamard"], final["wide"]),
             "c4": (sat["standard"], sat["hadamard"])}
    return dx.paired_table(pairs)


def relu_summary(results: dict) -> dict:
    """kind -> inactive and tau-dormant fractions averaged over all checkpoints (C1-relu)."""
    return {k: {"inactive_mean": series(results, k, "inactive").mean(),
                "dormant_mean": series(results, k, "dormant").mean()} for k in hr.TORSOS}


@torch.no_grad()
def branch_saturation(result: dict) -> dict:
    """Saturated fraction of each branch of a trained HR torso, of their product, and what two
    independent branches would give (the product of the branch fractions), on the last states."""
    t, x = result["torso"], result["states"]
    z, rep = t.encoder(x.float() / t.scale_input), t.rep
    a1 = rep.act(rep.norm1(rep.branch1(z)))
    a2 = rep.act(rep.norm2(rep.branch2(z)))
    f1, f2 = dx.saturated_fraction(a1), dx.saturated_fraction(a2)
    return {"branch1": f1, "branch2": f2, "product": dx.saturated_fraction(a1 * a2),
            "branch1_x_branch2": f1 * f2}


def _spectrum(ax, results: dict, idx: int, with_erank: bool = False) -> None:
    for kind in hr.TORSOS:
        sv = results[kind][0]["spectra"][idx]
        label = LABEL[kind] + (f" (erank {results[kind][0]['tracker']['erank'][idx]:.1f})"
                               if with_erank else "")
        ax.semilogy(np.arange(1, len(sv) + 1), sv / sv.sum(), label=label)


def spectrum_figure(results: dict, steps, idx: int):
    """Normalized singular values of the first inner seed's representation at checkpoint ``idx``."""
    fig, ax = plots.subplots(1, 1, figsize=(6.4, 3.6))
    _spectrum(ax, results, idx, with_erank=True)
    ax.set(title=f"Normalized singular values at step {steps[idx]}", xlabel="index i",
           ylabel="sigma_i / sum sigma", ylim=(1e-6, 1))
    ax.legend()
    return fig


def spectrum_slider(results: dict, steps) -> None:
    """In a live notebook, a slider through the checkpoints of :func:`spectrum_figure`."""
    if interactive():
        widgets.interact(lambda checkpoint: display(spectrum_figure(results, steps, checkpoint)),
                         checkpoint=widgets.IntSlider(0, 0, len(steps) - 1, 1))


def spectrum_start_end(results: dict, steps):
    """The spectrum at the first and the last checkpoint, side by side (the static figure)."""
    fig, axes = plots.subplots(1, 2, sharey=True)
    for ax, idx in zip(axes, (0, len(steps) - 1)):
        _spectrum(ax, results, idx)
        ax.set(title=f"step {steps[idx]}", xlabel="index i", ylabel="sigma_i / sum sigma",
               ylim=(1e-6, 1))
        ax.legend()
    fig.suptitle("Singular spectrum of the representation (first seed): start vs end of training")
    return fig


# -- the explorer: saturation against a gain on the pre-activations -----------------------------

@torch.no_grad()
def preactivations(result: dict) -> tuple[dict, torch.nn.Module]:
    """The representation layer's pre-activations on the run's last states (``branch 1`` and
    ``branch 2`` for HR, ``unit`` for a standard or wide layer) and its activation."""
    t, x = result["torso"], result["states"]
    z, rep = t.encoder(x.float() / t.scale_input), t.rep
    if isinstance(rep, hr.HadamardLinear):
        pre = {"branch 1": rep.norm1(rep.branch1(z)), "branch 2": rep.norm2(rep.branch2(z))}
        return pre, rep.act
    return {"unit": rep[1](rep[0](z))}, rep[2]


@torch.no_grad()
def saturation_at(pre: dict, act: torch.nn.Module, gain: float) -> dict:
    """Saturated fractions (:func:`workbench.diagnostics.saturated_fraction`) with every
    pre-activation multiplied by ``gain`` (1: the trained layer): of a standard unit, or of each
    HR branch, their product, and what independent branches would give (f1 f2)."""
    a = {k: act(gain * v) for k, v in pre.items()}
    if "unit" in a:
        return {"unit": dx.saturated_fraction(a["unit"])}
    f1, f2 = dx.saturated_fraction(a["branch 1"]), dx.saturated_fraction(a["branch 2"])
    return {"branch 1": f1, "branch 2": f2,
            "product": dx.saturated_fraction(a["branch 1"] * a["branch 2"]),
            "branch 1 x branch 2": f1 * f2}


def gain_table(results: dict, gains, idx: int) -> pd.DataFrame:
    """Saturated fraction against the gain for inner seed ``idx`` of every torso: columns gain,
    series (``standard``, ``wide (param-matched)``, ``HR branch 1`` ...), saturated."""
    rows = []
    for kind in hr.TORSOS:
        pre, act = preactivations(results[kind][idx])
        for g in gains:
            for k, f in saturation_at(pre, act, g).items():
                name = LABEL[kind] if k == "unit" else f"HR {k}"
                rows.append({"gain": float(g), "series": name, "saturated": f})
    return pd.DataFrame(rows)


@torch.no_grad()
def gain_figure(table: pd.DataFrame, hr_result: dict, gain: float, seed: int):
    """Left: saturated fraction against the gain on the pre-activations (``table``,
    :func:`gain_table`), ``gain`` marked. Right: each HR unit's mean |output| of branch 1
    against branch 2 at that gain, red where the product is saturated: only where both are."""
    fig, (a, b) = plots.subplots(1, 2, figsize=(12, 4))
    for i, (name, g) in enumerate(table.groupby("series", sort=False)):
        a.plot(g.gain, g.saturated, "--" if "x" in name else "o-", ms=3,
               color=plots.PALETTE[i % len(plots.PALETTE)], label=name)
    a.axvline(gain, color="k", ls=":", lw=1)
    a.set(xlabel="gain on the pre-activations (1: as trained)", ylabel="saturated fraction",
          title=f"Saturated units against pre-activation size (seed {seed})")
    a.legend(fontsize=7)
    pre, act = preactivations(hr_result)
    a1, a2 = (act(gain * pre[k]) for k in ("branch 1", "branch 2"))
    m1, m2, sat = a1.mean(0).abs(), a2.mean(0).abs(), dx.saturated_units(a1 * a2)
    b.scatter(m1[~sat], m2[~sat], s=12, color=plots.PALETTE[0], label="product not saturated")
    b.scatter(m1[sat], m2[sat], s=16, color=plots.PALETTE[1], label="product saturated")
    for f in (b.axvline, b.axhline):
        f(0.95, color="k", ls=":", lw=1)
    b.set(xlabel="|mean| of branch 1's output", ylabel="|mean| of branch 2's output",
          xlim=(0, 1.02), ylim=(0, 1.02), title=f"HR units at gain {gain:g}")
    b.legend(fontsize=7)
    return fig


# ---- the other agents: PQN on MinAtar and a SimbaV2-style SAC ----

OTHER_AGENTS = {"pqn": "PQN", "sac": "SAC (SimbaV2-style)"}


def _other_run(agent: str, cfg: dict, kind: str, seed: int, width: int, act: str, tau: float,
               activity_tau: float, device) -> dict:
    """One PQN or SAC run with one torso; the representation measured as in :func:`train_one`
    (PQN: the Q-network's torso on the rollout; SAC: the first critic's inner torso, the block
    under study inside the hyperspherical residual, on a replay sample of (s, a))."""
    from workbench.rl.pqn import PQNSettings, train_pqn
    from workbench.rl.sac import SACSettings, train_sac
    seed_everything(seed)
    tr = dx.Tracker()
    stats = lambda torso, x: hr.representation_stats(torso, x, tau, activity_tau)   # noqa: E731
    if agent == "pqn":                     # PQN's LayerNorm: in each branch of the layer under study
        fn = hr.torso_factory(kind, env_family(cfg["env_id"]), width, act, norm=True)
        out = train_pqn(PQNSettings(**cfg), fn, seed=seed, device=device,
                        on_update=lambda u, step, net, obs: tr.log(step, **_no_sv(stats(net.torso, obs))))
    else:
        def measure(step, nets, obs, actions):
            q = nets["qf1"].torso
            tr.log(step, **_no_sv(stats(q.inner, q.embed_input(torch.cat([obs, actions], -1)))))
        out = train_sac(SACSettings(**cfg), hr.torso_factory(kind, "classic", width, act), seed=seed,
                        device=device, on_eval=measure)
    return {"tracker": tr, "episodes": np.array(out["episodes"], float).reshape(-1, 2), "sps": out["sps"]}


def _no_sv(st: dict) -> dict:
    st.pop("sv")
    return st


def train_other_agents(S: dict, setup: Setup, progress=lambda it, **kw: it) -> dict:
    """agent -> kind -> one :func:`_other_run` per inner seed (``setup.inner_seeds``, at most
    ``S['n_inner_seeds']``), for the agents whose settings ``S[agent]`` gives (none: skipped)."""
    out = {}
    for agent in OTHER_AGENTS:
        cfg = S.get(agent)
        if not cfg:
            continue
        cfg = dict(cfg)
        width, seeds = cfg.pop("width"), setup.inner_seeds[:cfg.pop("n_inner_seeds")]
        jobs = [(k, s) for k in hr.TORSOS for s in seeds]
        out[agent] = {k: [] for k in hr.TORSOS}
        for kind, s in progress(jobs, desc=agent):
            out[agent][kind].append(_other_run(agent, cfg, kind, s, width, setup.activation,
                                               setup.tau, setup.activity_tau, setup.device))
    return out


def other_agents_summary(other: dict) -> pd.DataFrame:
    """A row per (agent, torso): inactive and tau-dormant fractions over all checkpoints,
    saturated fraction, erank and srank over the second half of training, and the mean return
    of the episodes finished in the last 20 % of training (mean over inner seeds)."""
    rows = {}
    for agent, results in other.items():
        steps = checkpoints(results)
        s = summarize(results, steps)
        for kind in hr.TORSOS:
            rows[(OTHER_AGENTS[agent], LABEL[kind])] = {
                k: s[kind][k] for k in ("inactive_mean", "dormant_mean", "saturated_late",
                                        "erank_late", "srank_late", "return_final")}
    return pd.DataFrame(rows).T


def other_agents_intervals(other: dict) -> pd.DataFrame:
    """Per agent, the paired C1 / C4 / rank comparisons (positive where HR wins) over inner seeds
    x checkpoints (:func:`workbench.diagnostics.paired_table`): ``{agent}_c1`` standard minus HR
    inactive fraction, ``{agent}_c4`` standard minus HR saturated fraction (second half),
    ``{agent}_erank_std`` and ``{agent}_erank_wide`` HR minus standard / wide erank (second half)."""
    pairs = {}
    for agent, results in other.items():
        steps = checkpoints(results)
        late = steps >= steps[-1] / 2
        get = lambda k, m, cut=None: series(results, k, m)[:, cut if cut is not None else slice(None)]  # noqa: E731
        pairs[f"{agent}_c1"] = (get("standard", "inactive"), get("hadamard", "inactive"))
        pairs[f"{agent}_c4"] = (get("standard", "saturated", late), get("hadamard", "saturated", late))
        pairs[f"{agent}_erank_std"] = (get("hadamard", "erank", late), get("standard", "erank", late))
        pairs[f"{agent}_erank_wide"] = (get("hadamard", "erank", late), get("wide", "erank", late))
    return dx.paired_table(pairs)


# ---- a stream of tasks on one network: the diagnostics read per task ----

def task_of(steps, task_steps: int) -> np.ndarray:
    """The task (from 0) each checkpoint measures: the one after step ``s`` reads the rollout
    whose last decision was at step ``s``, of task ``(s - 1) // task_steps`` (0 without a stream)."""
    steps = np.asarray(steps)
    return (steps - 1) // task_steps if task_steps else np.zeros(len(steps), int)


def per_task(results: dict, steps, task_steps: int, kind: str, name: str) -> np.ndarray:
    """(inner seeds x tasks) of one diagnostic, each run's mean over the checkpoints of the second
    half of each task (after the network has had half the task to adapt)."""
    steps = np.asarray(steps)
    task = task_of(steps, task_steps)
    span = task_steps or steps[-1]
    late = steps - task * span > span / 2
    values = series(results, kind, name)
    return np.stack([values[:, late & (task == k)].mean(1) for k in range(task.max() + 1)], 1)


def task_table(results: dict, steps, task_steps: int,
               names=("inactive", "dormant", "saturated", "erank", "srank")) -> pd.DataFrame:
    """A row per (torso kind, task from 1): each diagnostic's mean over inner seeds of
    :func:`per_task`."""
    rows = {}
    for kind in hr.TORSOS:
        means = {n: per_task(results, steps, task_steps, kind, n).mean(0) for n in names}
        for k in range(len(means[names[0]])):
            rows[(kind, k + 1)] = {n: float(means[n][k]) for n in names}
    out = pd.DataFrame(rows).T
    out.index.names = ["torso", "task"]
    return out


def stream_degradation(results: dict, steps, task_steps: int,
                       kind: str = "standard") -> pd.DataFrame:
    """Does ``kind`` lose capacity along the stream? Paired over its runs (95 % bootstrap
    interval, runs resampled): ``inactive_rise`` the inactive fraction of the last task minus
    the first's, ``erank_drop`` the erank of the first task minus the last's (:func:`per_task`).
    Both intervals above zero: the standard torso degrades, the bed's precondition."""
    inactive = per_task(results, steps, task_steps, kind, "inactive")
    erank = per_task(results, steps, task_steps, kind, "erank")
    return dx.paired_table({"inactive_rise": (inactive[:, -1], inactive[:, 0]),
                            "erank_drop": (erank[:, 0], erank[:, -1])})
