"""The harness of notebook 05 (workbench.experiments.lora_bottleneck_rank) on tiny sizes: the rank
sweep stays under the bottleneck, the perturbation gaps inside their bound, the synthetic C5 grid
complete, and on a one-block zoo Llama null-space updates are invisible and learned updates lie in
their predicted subspaces."""
import pandas as pd
import pytest
import torch

from workbench.experiments import lora_bottleneck_rank as X
from workbench.methods import lora_bottleneck_rank as br

TINY = {"d": 6, "k": 2, "ns": [4, 32], "ks": [1, 2, 3], "lam": 0.05, "pg_steps": 3000,
        "eps": 1e-3, "gen_decays": [0.0, 2.0], "gen_lams": [0.03, 0.1], "gen_n": 20,
        "lm_lam": 1e-3, "lm_steps": 3, "lm_lr": 3.0}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_sizes_are_checked():
    X.check_sizes(TINY)
    with pytest.raises(ValueError, match="d - 1"):
        X.check_sizes({**TINY, "ks": [1, 6]})


def test_rank_sweep_stays_under_the_bottleneck_and_cvxpy_agrees():
    c1 = X.rank_sweep(TINY, gen())
    assert len(c1) == 3 * 2 and (c1.bottleneck == c1.k).all()
    assert (c1.rank_minimizer <= c1.k).all() and c1.kkt.max() < 1e-6
    assert (c1.rank_lstsq_random_start == TINY["d"]).all()      # the invisible part stays
    assert c1.trivial_bound.tolist() == [4, 6] * 3
    checks = X.cvxpy_checks(TINY, gen(1))
    assert [c["n"] for c in checks] == [4, 32] and max(c["rel_gap"] for c in checks) < 1e-5


def test_perturbation_gaps_are_inside_the_bound():
    x, r, p, pb = X.perturbed_problem(TINY, gen(2), seed=0)
    assert pb.eps == TINY["eps"] and x.shape == (24, 6) and br.bottleneck_rank(x) == 2
    pb0 = br.LeastSquares(x, r, lam=TINY["lam"])
    d0, info0 = br.prox_grad(pb0, steps=TINY["pg_steps"])
    c4 = X.perturbation_gaps(x, r, p, lam=TINY["lam"], eps_grid=[1e-1, 1e-2], d0=d0,
                             f0=info0["objective"], steps=TINY["pg_steps"])
    assert (c4.gap >= -1e-9).all() and (c4.gap <= c4.bound + 1e-9).all()
    assert c4.gap.iloc[1] < c4.gap.iloc[0]


def test_spectral_gaps_cover_the_grid():
    c5s = X.spectral_gaps(TINY, gen(3))
    assert len(c5s) == 2 * 2 * 2 and set(c5s.norm) == {"trace", "top"}
    assert (c5s.bound > 0).all()
    rho = X.group_spearman(c5s)
    assert set(rho) == {"trace", "top", "trace, decay 0", "trace, decay 2", "top, decay 0",
                        "top, decay 2"}


def test_lm_null_updates_are_invisible_and_learned_updates_in_their_spaces():
    lm, tok = X.frozen_lm("lm-micro", "smoke")
    last, names = X.attention_names(lm)
    assert last == 0 and names["k_proj"] == "model.layers.0.self_attn.k_proj"
    batch = X.task_examples_batch(tok, "kv", 2, seed=0)
    feats = br.block_features(lm, batch)
    xf = feats["x"][br.feeding_positions(batch["labels"])]
    assert br.bottleneck_rank(xf) < xf.shape[1]                 # a real null space
    invis = X.invisibility(lm, names, xf, batch, float(br.lm_loss(lm, batch)), gen(4))
    for v in invis.values():
        assert v["null_logit_change"] < 1e-3 < v["random_logit_change"]
    bases = br.attention_bases(feats, batch["labels"])
    learned, bases_nope = X.learn_updates(lm, batch, names, TINY, bases["ranks"]["head_dim"])
    assert list(learned) == ["query", "value (whole trace norm)", "value (per-head trace norm)",
                             "key (rotary)", "key (no rotary)"]
    lora_d, loss = X.peft_baseline(lm, batch, last, steps=2, seed=0, rank=2)
    tab = X.update_table(learned, bases, bases_nope, lora_d, loss)
    assert (tab.loc[["query", "value (whole trace norm)", "key (no rotary)"],
                    "outside_energy"] < 1e-4).all()
    assert len(tab) == 7 and tab.loc["peft LoRA r=8, query", "loss_end"] == loss


def test_spectra_stop_at_the_bottleneck_and_repeat_for_the_same_knobs():
    import matplotlib.pyplot as plt
    sp = X.spectra(d=10, k=3, n=40, lam=0.05, steps=2000, seed=0)
    assert len(sp["features"]) == len(sp["minimizer"]) == len(sp["least squares"]) == 10
    assert sp["rank_minimizer"] <= 3 < sp["rank_lstsq"]                   # n > d, yet rank <= k
    assert (sp["features"][3:] < 1e-9 * sp["features"][0]).all()          # features of rank k
    again = X.spectra(d=10, k=3, n=40, lam=0.05, steps=2000, seed=0)
    assert (again["minimizer"] == sp["minimizer"]).all()                  # a move back redraws it
    c1 = pd.DataFrame({"k": [3, 3], "n": [8, 40], "rank_minimizer": [3, 3],
                       "rank_lstsq_random_start": [10, 10]})
    fig = X.spectra_figure(sp, 3, 40, 10, c1)
    ax, bx = fig.axes
    assert f"minimizer rank {sp['rank_minimizer']}" in ax.get_title()
    assert [ln.get_label() for ln in bx.get_lines()][:2] == ["trace-norm minimizer", "least squares"]
    plt.close(fig)
