"""The harness of notebook 18: the trace pool (problems, teachers, true difficulty), signatures
back in pool order, and the difficulty correlations."""
import numpy as np
import pandas as pd
import pytest

from workbench.data import packing, tasks
from workbench.experiments import loss_signature as ex
from workbench.methods import loss_signature as ls
from workbench.models import zoo


def test_problems_come_from_disjoint_sides_n_per_level():
    rng = np.random.default_rng(0)
    train = ex.draw_problems(["add", "count"], 3, "train", rng)
    test = ex.draw_problems(["add", "count"], 2, "test", rng)
    levels = sum(len(tasks.get(f).difficulties) for f in ("add", "count"))
    assert len(train) == 3 * levels and len(test) == 2 * levels
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    again = ex.draw_problems(["add", "count"], 3, "train", np.random.default_rng(0))
    assert [e.prompt for e in again] == [e.prompt for e in train]


def test_solver_noise_controls_the_share_of_wrong_traces():
    exs = [e for f in ("add", "sub", "chain", "count") for e in tasks.generate(f, 200, seed=1)]
    clean = ex.solver_traces(exs, 0.0, seed=0)
    assert all(t.correct for t in clean)
    assert [t.completion for t in clean] == [e.completion(True) for e in exs]
    noisy = ex.solver_traces(exs, 0.3, seed=0)
    wrong = 1 - np.mean([t.correct for t in noisy])
    assert 0.25 < wrong < 0.35
    # a corrupted trace keeps its shape: as many steps, only digits changed
    for t, e in zip(noisy, exs):
        assert t.completion.count(";") == e.completion(True).count(";")


def test_pool_level_spans_each_family_from_0_to_1():
    exs = ex.draw_problems(["add", "count"], 1, "train", np.random.default_rng(0))
    pool = ex.pool_frame(ex.solver_traces(exs, 0.0, 0, "solver"))
    for f, g in pool.groupby("family"):
        assert g.level.min() == 0.0 and g.level.max() == 1.0
        # the level orders as the difficulty does
        assert (np.diff(g.sort_values("difficulty").level.to_numpy()) > 0).all()


def test_signatures_come_back_in_pool_order():
    """Batches are sorted by length; the rows must return to the traces' order: with every
    labelled token read, sigma = 0 is each trace's own unperturbed loss."""
    model, tok = zoo.load("lm-micro")
    exs = tasks.generate("add", 4, seed=0, difficulty=1) + tasks.generate("chain", 4, seed=0,
                                                                          difficulty=3)
    traces = ex.solver_traces(exs[::-1], 0.0, 0, "solver")      # long ones first
    sigs, tokens = ex.pool_signatures(model, tok, traces, [1.0], n_dirs=2, dir_rank=2, scales=[0.0, 0.3],
                                      seed=0, device="cpu", batch=3)
    assert sigs[1.0].shape == (8, 2, 2)
    for i, t in enumerate(traces):
        b = packing.pad(packing.encode(tok, [t.prompt], [t.completion]), tok.pad_token_id)
        alone = ls.masked_losses(model, b, b["labels"] != -100)[0]
        assert sigs[1.0][i, :, 0] == pytest.approx([alone, alone], rel=1e-4)
    read, labelled = tokens[1.0]
    assert read == labelled > 0


def test_difficulty_correlations_see_a_planted_proxy():
    rng = np.random.default_rng(0)
    level = np.repeat(np.linspace(0, 1, 5), 20)
    pool = pd.DataFrame({"level": level, "pred": level + 0.1 * rng.normal(size=100),
                         "teacher": np.tile(["a", "b"], 50), "family": np.repeat(["x", "y"], 50)})
    sig = rng.normal(size=(100, 2, 3)) + 1                       # sigma = 0: noise only
    few = np.stack([np.outer(level, [1, 2, 4])] * 2, 1)           # convex in sigma everywhere
    r = ex.difficulty_correlations(pool, sig, few, [0.0, 0.1, 0.2], 200, seed=0)
    assert r["main"]["rho"] > 0.9 and r["main"]["low"] > 0.8
    assert abs(r["unperturbed"]["rho"]) < 0.3
    assert r["few"]["rho"] > 0.99                               # the steepest rise scales with level
    assert set(r["within"]) == {"a", "b", "x", "y"}


def test_sigma_correlations_find_the_scale_that_reads_difficulty():
    g = np.random.default_rng(0)
    level = np.repeat(np.linspace(0, 1, 5), 8)
    scales = [0.0, 0.1, 0.2, 0.3, 0.4]
    sig = g.normal(1.0, 0.01, (len(level), 2, len(scales)))
    sig[:, :, 3] += 2 * level[:, None]                        # only sigma = 0.3 knows the level
    t = ex.sigma_correlations(sig, level, scales)
    assert list(t.sigma) == scales and t.loc[t["spearman at sigma"].idxmax(), "sigma"] == 0.3
    assert t["spearman at sigma"].iloc[3] > 0.9 and abs(t["spearman at sigma"].iloc[0]) < 0.5
    assert abs(t["share of inflection points"].sum() - 1) < 1e-12
    stars = [ls.inflection(scales, c)[0] for c in sig.mean(1)]        # each in its interval
    assert t["share of inflection points"].iloc[1] == np.mean([0.1 <= v < 0.2 for v in stars])
    assert t["spearman, inflection loss"].nunique() == 1


def test_nmi_interval_resamples_problems_and_brackets_the_nmi():
    rng = np.random.default_rng(0)
    cats = np.repeat(["a", "b", "c", "d"], 30)
    groups = np.repeat(np.arange(40), 3)                          # three traces per problem
    clusters = np.where(rng.random(120) < 0.7, pd.factorize(cats)[0], rng.integers(0, 4, 120))
    out = ex.nmi_interval(clusters, cats, groups, 300, seed=0)
    assert out["n_groups"] == 40
    assert out["low"] < out["nmi"] < out["high"]
    assert out == ex.nmi_interval(clusters, cats, groups, 300, seed=0)          # seeded
    perfect = ex.nmi_interval(pd.factorize(cats)[0], cats, groups, 100, seed=0)
    assert perfect["low"] == pytest.approx(1.0) and perfect["nmi"] == pytest.approx(1.0)
    # random clusters: the interval sits near zero, well below a planted structure's
    noise = ex.nmi_interval(rng.integers(0, 4, 120), cats, groups, 300, seed=0)
    assert noise["high"] < out["low"]


def test_student_accuracy_per_item_is_the_item_scores(monkeypatch):
    model = object()
    monkeypatch.setattr(ex.finetune, "cached_lora", lambda *a, **k: (model, None, {"cached": True}))
    monkeypatch.setattr(ex.evaluate, "item_scores", lambda m, tok, test, with_steps: np.array([1.0, 0, 1, 1]))
    traces = [ex.Trace("p", " c", "add", 1, "solver", True)]
    kw = dict(sft=None, tag="t", device="cpu")
    items = ex.subset_students("lm", "smoke", traces, {"a": [0], "b": [0]}, None, [], per_item=True, **kw)
    assert set(items) == {"a", "b"} and list(items["a"]) == [1.0, 0, 1, 1]
    acc = ex.subset_students("lm", "smoke", traces, {"a": [0]}, None, [], **kw)
    assert acc == {"a": 0.75}


def test_room_is_the_longest_reference_completion_plus_two():
    _, tok = zoo.load("lm-micro")
    exs = tasks.generate("longadd", 3, seed=0, difficulty=6) + tasks.generate("longadd", 3, seed=0,
                                                                              difficulty=14)
    longest = max(len(tok(e.completion(True), add_special_tokens=False)["input_ids"]) for e in exs)
    assert ex.room(tok, exs) == longest + 2 and longest > 150


def test_position_losses_split_the_labelled_tokens_at_the_edge():
    model, tok = zoo.load("lm-micro")
    traces = ex.solver_traces(tasks.generate("longadd", 3, seed=0, difficulty=8), 0.0, 0, "solver")
    b = packing.pad(packing.encode(tok, [t.prompt for t in traces], [t.completion for t in traces]),
                    tok.pad_token_id)
    nll, lab = ls.token_losses(model, b), b["labels"] != -100
    out = ex.position_losses(model, tok, traces, edge=40, batch=2)
    assert out["tokens_before"] + out["tokens_past"] == int(lab.sum())
    assert out["tokens_before"] == int(lab[:, :40].sum()) > 0
    assert out["past"] == pytest.approx(float(nll[:, 40:][lab[:, 40:]].mean()), rel=1e-5)
    assert out["before"] == pytest.approx(float(nll[:, :40][lab[:, :40]].mean()), rel=1e-5)
    whole = ex.position_losses(model, tok, traces, edge=10_000)
    assert whole["past"] is None and whole["tokens_past"] == 0


def test_long_bed_is_one_teacher_at_every_level_and_keeps_its_own_draws():
    model, tok = zoo.load("lm-micro")
    S = {"n_test": 1, "lora_rank": 2, "adapt_steps": 1, "n_dirs": 1, "dir_rank": 1,
         "scales": [0.0, 0.1, 0.3], "token_fraction": 0.1}
    bed = ex.long_bed({"family": "longadd", "n_per_level": 2}, S, model, tok, "t", "lm-micro", "smoke",
                      [0.1, 0.01], seed=3, device="cpu")
    assert len(bed.pool) == 10 and len(bed.test) == 5 and set(bed.pool.teacher) == {"t"}
    assert sorted(bed.pool.level.unique()) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert bed.pool.cluster.nunique() <= 5 and bed.pool.pred.notna().all()
    assert bed.max_new_tokens == ex.room(tok, bed.problems + bed.test)
    assert not {e.prompt for e in bed.problems} & {e.prompt for e in bed.test}
    assert bed.info["tokens_read_per_trace"][0.1] > bed.info["tokens_read_per_trace"][0.01] >= 1
    assert bed.sft_steps is None
    spec = {"family": "longadd", "n_per_level": 2, "levels": [6, 8], "sft_steps": 7}
    cut = ex.long_bed(spec, S, model, tok, "t", "lm-micro", "smoke", [0.1], seed=3, device="cpu")
    assert sorted(cut.pool.level.unique()) == [0.0, 1.0] and set(cut.pool.difficulty) == {6, 8}
    assert cut.sft_steps == 7
    assert [e.prompt for e in cut.problems] == [e.prompt for e in bed.problems if e.difficulty in (6, 8)]
