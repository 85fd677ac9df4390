"""The experiments of notebook 17 (low-rank recurrent scaffolds for temporal abstraction in RNNs,
:mod:`workbench.methods.rnn_abstraction`).

What the notebook measures around the method: the PCA of the classifier's states, how well a
direction of the state tracks the same/different transitions (multiple correlation R, against
random directions), the singular-vector ablation with fixed and refit decoders (C4), the
shuffled-label control RNN and the scaffold-transfer runs of fresh next-token RNNs (C6), their
summary, and the pattern decoding of the next-token RNN against the classifier (C5). C3's
control: the same classifier and the shuffled-label RNN trained at a second weight decay, and
the rank profile of each recurrent matrix, so that "low rank emerges from the task" is judged
against a network trained at equal decay on targets without the pattern structure. The
explorer's table: C4's ablation over the number of leading components cut, against the memory of
each transition and the network's own pattern accuracy.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from sklearn.decomposition import PCA
from sklearn.linear_model import LinearRegression

from .. import diagnostics as D
from ..methods import rnn_abstraction as ra

__all__ = ["tree_clauses", "state_pca", "transition_R", "random_direction_R", "ablated_final_states",
           "ablation_decoding", "pattern_classifier", "shuffled_label_rnn", "rank_profile",
           "transfer_runs", "transfer_summary", "decoding_vs_classifier", "ablation_sweep"]


def tree_clauses(purity, best_k, dim: float, nodes, n_patterns: int) -> bool:
    """C2's three clauses on one set of states: at every step whose tree level branches (more
    than one node), prefix purity >= 0.9 and the silhouette's preferred k equal to the nodes;
    and a participation ratio ``dim`` of at most the number of patterns."""
    deep = [t for t, n in enumerate(nodes) if n > 1]
    return bool(all(purity[t] >= 0.9 for t in deep) and all(best_k[t] == nodes[t] for t in deep)
                and dim <= n_patterns)


def state_pca(H: np.ndarray) -> PCA:
    """A 2-component PCA fit on every state of ``H`` (n, L, hidden), for the trajectory panels."""
    return PCA(2).fit(H.reshape(-1, H.shape[-1]))


def transition_R(proj: np.ndarray, trans: np.ndarray) -> list[float]:
    """Per step t >= 2: the multiple correlation R of ``proj[:, t]`` with the transitions
    ``1..t`` so far (the square root of a linear fit's R²)."""
    rs = []
    for t in range(1, proj.shape[1]):
        x, y = trans[:, :t], proj[:, t]
        rs.append(float(np.sqrt(max(LinearRegression().fit(x, y).score(x, y), 0))))
    return rs


def random_direction_R(H: np.ndarray, trans: np.ndarray, seed: int, n: int = 20) -> list[float]:
    """:func:`transition_R`'s minimum over steps for ``n`` random unit directions of the state
    (torch generator seeded ``seed``): what a direction with no special role scores."""
    rg = torch.Generator().manual_seed(seed)
    return [min(transition_R(H @ (d / np.linalg.norm(d)), trans))
            for d in torch.randn(n, H.shape[-1], generator=rg).numpy()]


def ablated_final_states(model, tokens, W: torch.Tensor, seed: int, n_rand: int = 5) -> dict:
    """The final states of ``tokens`` with ``W_hh`` intact, with its leading singular component
    removed, and with ``n_rand`` random rank-one matrices of the same norm removed (generators
    seeded ``1000 seed + r``)."""
    variants = {"intact": W, "leading": D.ablate_singular(W, 0)}
    for r in range(n_rand):
        variants[f"random{r}"] = D.ablate_random(W, 0, torch.Generator().manual_seed(1000 * seed + r))
    with torch.no_grad():
        return {k: ra.states_with(model, tokens, w)[:, -1].cpu().numpy()
                for k, w in variants.items()}


def ablation_decoding(finals: dict, trans: np.ndarray, length: int, seed: int):
    """Decoding of transition 1 (``first``) and of the last transition (``last``) from the final
    states under every ablation: a decoder fit on the intact states (``fixed``, per condition)
    and a decoder refit on each condition's states (``refit``). Returns ``(summary, refit)``:
    the summary holds intact, leading and the mean and std over the random ablations."""
    dec, refit = {}, {}
    for j, tname in ((0, "first"), (length - 2, "last")):
        y = trans[:, j]
        dec[tname] = ra.fixed_probe(finals["intact"], y, finals, seed=seed)
        refit[tname] = {k: ra.probe_accuracy(x, y, seed=seed) for k, x in finals.items()}
    rand = [k for k in finals if k.startswith("random")]
    summary = {t: {"intact": dec[t]["intact"], "leading": dec[t]["leading"],
                   "random_mean": float(np.mean([dec[t][k] for k in rand])),
                   "random_std": float(np.std([dec[t][k] for k in rand]))} for t in dec}
    refit = {t: {"intact": refit[t]["intact"], "leading": refit[t]["leading"],
                 "random_mean": float(np.mean([refit[t][k] for k in rand]))} for t in refit}
    return summary, refit


def pattern_classifier(task, S: dict, *, lr: float, weight_decay: float, input_seed: int,
                       generator: torch.Generator, device) -> ra.PatternRNN:
    """A classifier RNN trained exactly as the notebook's main one (fresh train-token sequences
    every step, ``S["steps"]`` steps of ``S["batch"]``) at ``weight_decay``: C3's no-decay run.
    Draws its init and its data from ``generator``; returned on the CPU."""
    m = ra.PatternRNN(task.vocab_size, S["hidden"], S["embed_dim"], task.n_classes,
                      input_seed=input_seed, generator=generator).to(device)
    ra.train_classifier(m, task, S["steps"], S["batch"], lr, weight_decay=weight_decay,
                        generator=generator)
    return m.cpu()


def shuffled_label_rnn(task, S: dict, *, lr: float, weight_decay: float, input_seed: int,
                       generator: torch.Generator, device) -> ra.PatternRNN:
    """The control: a classifier RNN with the same budget and input pathway, trained on a fixed
    set of ``S["shuffled_seqs"]`` sequences whose pattern labels are permuted once (generic
    statistics of the same inputs, no abstraction). Draws from ``generator``."""
    shuf = ra.PatternRNN(task.vocab_size, S["hidden"], S["embed_dim"], task.n_classes,
                         input_seed=input_seed, generator=generator).to(device)
    ra.train_classifier(shuf, task, S["steps"], S["batch"], lr, n_seqs=S["shuffled_seqs"],
                        shuffle_labels=True, weight_decay=weight_decay, generator=generator)
    return shuf


def rank_profile(w: torch.Tensor) -> dict:
    """How low-rank a recurrent matrix is: its stable rank ``||W||_F^2 / s_1^2`` (C3's measure),
    its entropy effective rank, its outliers above the random bulk, and the share of its energy
    ``s_i^2`` in the leading component."""
    s = torch.linalg.svdvals(w.detach().double())
    return {"stable_rank": ra.stable_rank(w), "erank": D.erank(s, is_sv=True),
            "n_outliers": ra.n_outliers(w), "top1_energy": float(s[0] ** 2 / (s ** 2).sum())}


def transfer_runs(task, parts: dict, S: dict, *, lr: float, weight_decay: float, input_seed: int,
                  eval_batch: dict, seed: int, device):
    """Fresh next-token RNNs, ``S["inner_seeds"]`` per initialisation of ``W_hh`` in ``parts``
    (None: random init; else random init plus that scaffold). Inner seed i starts every
    condition from the same fresh init (generator ``100000 + 97 seed + i``). Returns
    ``(curves, models)``: the learning curves per condition, and the inner-seed-0 model of each."""
    curves, models = {name: [] for name in parts}, {}
    for i in range(S["inner_seeds"]):
        for name, p in parts.items():
            g_i = torch.Generator().manual_seed(100_000 + 97 * seed + i)
            m = ra.PatternRNN(task.vocab_size, S["hidden"], S["embed_dim"], tied=True,
                              input_seed=input_seed, generator=g_i)
            if p is not None:
                ra.add_scaffold(m, p)
            c = ra.train_next_token(m.to(device), task, S["nt_steps"], S["nt_batch"], lr,
                                    weight_decay=weight_decay, eval_every=S["eval_every"],
                                    eval_batch=eval_batch, generator=g_i)
            curves[name].append(c)
            if i == 0:
                models[name] = m.cpu()
    return curves, models


def transfer_summary(curves: dict) -> tuple[dict, dict]:
    """Per condition and inner seed: the mean train-token loss over training (the area under the
    curve: lower is faster) and the final novel-token loss (the mean of the last 3 evaluations)."""
    auc = {n: [float(np.mean(c["train"])) for c in cs] for n, cs in curves.items()}
    final_novel = {n: [float(np.mean(c["novel"][-3:])) for c in cs] for n, cs in curves.items()}
    return auc, final_novel


def decoding_vs_classifier(H_clf: np.ndarray, H_other: np.ndarray, y: np.ndarray,
                           seed: int) -> dict:
    """Held-out balanced accuracy of decoding ``y`` from the final state of the classifier and
    of another network, on the same sequences."""
    return {"classifier": ra.probe_accuracy(H_clf[:, -1], y, seed=seed),
            "next-token": ra.probe_accuracy(H_other[:, -1], y, seed=seed)}


def _ablations(W: torch.Tensor, k_max: int, seed: int, n_rand: int) -> dict:
    """``W_hh`` with its top k singular components cut (``("top", k)``) and with k random rank-one
    matrices of the same norms cut (``("random", k, r)``, r < ``n_rand``), k = 0..``k_max``."""
    out = {("top", 0): W, **{("random", 0, r): W for r in range(n_rand)}}
    for k in range(1, k_max + 1):
        out[("top", k)] = D.ablate_singular(W, list(range(k)))
        for r in range(n_rand):
            g = torch.Generator().manual_seed(1000 * seed + 100 * k + r)
            out[("random", k, r)] = D.ablate_random(W, list(range(k)), g)
    return out


def ablation_sweep(model, tokens, W: torch.Tensor, trans: np.ndarray, labels, seed: int,
                   k_max: int = 8, n_rand: int = 3) -> pd.DataFrame:
    """C4 over the number of components cut: for k = 0..``k_max``, the final states with the top
    k singular components of ``W_hh`` removed, or k random rank-one matrices of the same norms
    (mean over ``n_rand`` draws), read by decoders of each transition fit on the intact states
    (:func:`ra.fixed_probe`, balanced accuracy, chance 0.5) and by the network's own readout
    (pattern accuracy, chance 1 / patterns). One row per (ablation, k, what is read)."""
    variants = _ablations(W, k_max, seed, n_rand)
    with torch.no_grad():
        finals = {key: ra.states_with(model, tokens, w)[:, -1] for key, w in variants.items()}
        own = {key: float((model.readout(h).argmax(1)
                           == torch.as_tensor(labels, device=h.device)).float().mean())
               for key, h in finals.items()}
    finals = {key: h.cpu().numpy() for key, h in finals.items()}
    reads = {"pattern (own readout)": own}
    for j in range(trans.shape[1]):
        reads[f"transition {j + 1}"] = ra.fixed_probe(finals[("top", 0)], trans[:, j], finals,
                                                     seed=seed)
    rows = []
    for what, acc in reads.items():
        for k in range(k_max + 1):
            rand = [acc[("random", k, r)] for r in range(n_rand)]
            rows += [{"ablation": "top k singular components", "components cut": k,
                      "read out": what, "accuracy": acc[("top", k)]},
                     {"ablation": "k random rank-one (same norms)", "components cut": k,
                      "read out": what, "accuracy": float(np.mean(rand))}]
    return pd.DataFrame(rows)
