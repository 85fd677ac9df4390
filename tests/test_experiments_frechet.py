"""The harness of notebook 13 (workbench.experiments.frechet): the reparameterization draws on
a tiny peft model (C1, C2), the identity check, and the MLP side (C3, C5) on a small synthetic
task."""
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from workbench.experiments import frechet as xp  # noqa: E402
from workbench.methods import frechet as fr  # noqa: E402

FAMS = ["t1", "t2"]


class TinyBench(xp.Bench):
    """A Bench whose examples are already token rows (no tokenizer needed)."""

    def _batch(self, examples):
        ids = torch.stack(list(examples))
        return {"input_ids": ids, "labels": ids}


def _bench(cls=None):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=32)
    lora = dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(**lora),
                                adapter_name="t1")
    model.add_adapter("t2", peft.LoraConfig(**lora))
    model.eval()
    g = torch.Generator().manual_seed(1)
    rows = {f: list(torch.randint(0, 32, (3, 8), generator=g)) for f in FAMS}
    return (cls or TinyBench)(model, None, FAMS, evals={}, loss_sets=rows, with_steps=False)


def test_reparameterizations_keep_each_adapter_and_move_only_the_naive_merge():
    bench = _bench()
    factors = {f: fr.get_factors(bench.model, f) for f in FAMS}
    sets = [factors[f] for f in FAMS]
    gen = torch.Generator().manual_seed(0)
    draws = xp.reparam_draws(bench, sets, gen, n=3, cond=10.0, iters=30)
    assert list(draws.draw) == [0, 1, 2]
    assert draws.own_loss_change.max() < 1e-4                 # every adapter's function is kept
    spread = {m: draws[m].max() - draws[m].min() for m in ("naive", "quotient", "svd_of_mean")}
    assert spread["naive"] > 100 * spread["quotient"]         # C1 and C2 in miniature
    assert spread["quotient"] < 1e-4 and spread["svd_of_mean"] < 1e-4
    ident = xp.identity_errors(factors, FAMS, gen, 10.0, 30)
    assert set(ident) == set(FAMS) and max(ident.values()) < 1e-6


def _task(n=120, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 64, generator=g)
    y = (x[:, :10].argmax(1))
    return SimpleNamespace(x_train=x[: n // 2], y_train=y[: n // 2], x_test=x[n // 2:],
                           y_test=y[n // 2:])


def test_mlp_path_midpoints_and_relabelling():
    task = _task()
    a = xp.train_mlp(task, hidden=8, steps=30, init_seed=1)
    b = xp.train_mlp(task, hidden=8, steps=30, init_seed=2)
    assert [tuple(w.shape) for w, _ in a] == [(8, 64), (8, 8), (10, 8)]
    assert xp.train_mlp(task, 8, 30, 1)[0][0].equal(a[0][0])          # seeded
    b_al = fr.permute_mlp(b, fr.weight_matching(a, b))
    # alignment is a relabelling: the same function
    assert abs(xp.evaluate_mlp(task, b_al)[0] - xp.evaluate_mlp(task, b)[0]) < 1e-10
    path = xp.interpolation_path(task, a, b, b_al, n_alpha=5)
    assert list(path.alpha) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert abs(path.naive_excess.iloc[0]) < 1e-12 and abs(path.naive_excess.iloc[-1]) < 1e-12
    mid = xp.midpoints(task, a, b, b_al)
    assert mid["naive"][0] == pytest.approx(path.naive.iloc[2])
    change = xp.relabel_change(task, a, b, mid, hidden=8, seed=0)
    assert change["aligned"] < 1e-10                          # weight matching undoes a relabelling


def test_flat_unflat_and_fisher_errors():
    task = _task()
    a = xp.train_mlp(task, hidden=4, steps=2, init_seed=3)
    v = xp.flat(a)
    assert v.numel() == sum(w.numel() + b.numel() for w, b in a)
    assert all(w.equal(w2) and b.equal(b2) for (w, b), (w2, b2) in zip(a, xp.unflat(v, a)))
    fishers = [torch.rand(v.numel(), dtype=torch.float64) for _ in range(2)]
    assert xp.fisher_errors(v, v.clone(), fishers) == (0.0, 0.0)
    err, maxabs = xp.fisher_errors(v, v * 1.01, fishers)
    assert err == pytest.approx(0.01, rel=1e-6) and maxabs == pytest.approx(0.01, rel=1e-6)


def test_karcher_gap():
    hist = {"m1": [10.0, 4.0, 3.0, 3.0], "m2": [2.0, 1.0]}
    assert xp.karcher_gap(hist, 1) == pytest.approx(0.1)         # m1: (4 - 3) / 10
    assert xp.karcher_gap(hist, 2) == 0.0


def test_mean_merge_kept_is_the_share_of_each_gain():
    table = pd.DataFrame({"a": [0.1, 1.0, 0.0, 0.55], "b": [0.5, 0.0, 0.5, 0.5]},
                         index=["base", "adapter a alone", "adapter b alone", "cat_mean"])
    kept = xp.mean_merge_kept(table, ["a", "b"])
    assert kept["a"] == pytest.approx(0.5) and kept["b"] is None     # b gains nothing
    assert xp.mean_merge_kept(table, ["a"], merge="base") == {"a": 0.0}


class ScoredBench(TinyBench):
    """TinyBench with an 'exact match' per family: 1 when the slot's loss on that family's rows
    is within 1e-4 of the family's own adapter (so only that adapter, or a merge equal to it,
    scores)."""

    def accuracy(self, adapter):
        return {f: float(abs(self.loss(adapter, self.own[f]) - self.loss(f, self.own[f])) < 1e-4)
                for f in self.families}


def test_weighted_merges_reach_the_adapter_at_weight_one_and_the_table_adds_the_ends():
    bench = _bench(ScoredBench)
    sets = [fr.get_factors(bench.model, f) for f in FAMS]
    got = xp.weighted_merges(bench, sets, weights=[0.5, 1.0], iters=30)
    assert len(got) == 2 * 2 * len(xp.MERGES) and set(got.method) == set(xp.MERGES)
    one = got[got["weight on family"] == 1.0]
    assert all(one[f][one.family == f].eq(1.0).all() for f in FAMS)   # every merge = the adapter
    assert one.answer_loss.round(4).nunique() == 2                       # one loss per adapter
    half = got[got["weight on family"] == 0.5]                   # with two families, 0.5 is the equal merge
    assert half.groupby("method").answer_loss.nunique().eq(1).all()       # either family weighted
    c4 = pd.DataFrame({"t1": [0.1, 0.2, 0.3, 1.0, 0.0], "t2": [0.2, 0.2, 0.4, 0.0, 1.0],
                       "answer_loss": [3.0, 3.5, 3.2, 2.0, 2.5]},
                      index=["naive", "svd_of_mean", "quotient", "adapter t1 alone", "adapter t2 alone"])
    t = xp.weight_table(got[got["weight on family"] == 0.5].assign(**{"weight on family": 0.75}), c4, FAMS)
    assert list(pd.unique(t.measure))[0] == "exact match, family"
    assert list(pd.unique(t.family)) == FAMS and list(pd.unique(t.method)) == list(xp.MERGES)
    assert sorted(pd.unique(t["weight on family"])) == [0.5, 0.75, 1.0]
    row = t[(t.family == "t2") & (t.method == "quotient Fréchet") & (t["weight on family"] == 0.5)]
    vals = dict(zip(row.measure, row.value))
    assert vals["exact match, family"] == 0.4
    assert np.isclose(vals["exact match, others"], 0.3)
    assert np.isclose(vals["exact match, all"], 0.35)
    assert vals["answer loss"] == 3.2
    at_one = t[(t["weight on family"] == 1.0) & (t.measure == "exact match, family")]
    assert at_one.value.eq(1.0).all()


class ItemBench(TinyBench):
    """TinyBench with fixed per-item scores per slot (no generation): slot "good" gets every
    item right, "bad" none, "alternate" every other item; the base model scores nothing."""
    SCORES = {"good": 1.0, "bad": 0.0}

    def item_scores(self, adapter):
        return {f: (np.arange(4) % 2).astype(float) if adapter == "alternate"
                else np.full(4, self.SCORES[adapter]) for f in self.families}

    def base_scores(self):
        return 9.0, {f: 0.0 for f in self.families}


def test_score_merges_keeps_per_item_scores_and_the_intervals_pair_them():
    bench = _bench(ItemBench)
    bench.model.add_weighted_adapter(FAMS, [0.5, 0.5], "good", combination_type="svd")
    bench.model.add_weighted_adapter(FAMS, [0.5, 0.5], "bad", combination_type="svd")
    bench.model.add_weighted_adapter(FAMS, [0.5, 0.5], "alternate", combination_type="svd")
    table, items = xp.score_merges(bench, ["good", "bad", "alternate"])
    assert set(items) == {"good", "bad", "alternate"} and all(len(v) == 8 for v in items.values())
    assert table.loc["alternate", "multi_task"] == 0.5 == items["alternate"].mean()   # the table's mean
    assert table.loc["base", "answer_loss"] == 9.0
    ci = xp.paired_intervals(items, "good", ["bad", "alternate"])
    assert list(ci.index) == ["bad", "alternate"] and set(ci.columns) >= {"diff", "low", "high"}
    assert ci.loc["bad"].tolist()[:3] == [1.0, 1.0, 1.0]          # no spread: every item +1
    assert ci.loc["alternate", "diff"] == 0.5 and 0 < ci.loc["alternate", "low"] <= 0.5 <= ci.loc["alternate", "high"]
    assert xp.paired_intervals(items, "alternate", ["good"]).loc["good", "high"] < 0   # loses
