"""Unit tests of workbench.experiments.inducekv: notebook 01's harness (the stream spec, the C1
checks on a tiny random Llama, the cached runs' keys, the C3 summary, the C2 footprint, and the
explorer's replay of the stream from cached answer scores)."""
import hashlib
import json

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from workbench.data import tasks
from workbench.evaluate import MIDDLE, heldout_examples
from workbench.experiments import inducekv as lab
from workbench.methods import inducekv as K
from tiny_models import CharTok, tiny_llama


Tok = CharTok


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(n_layers=2)


def test_stream_spec():
    assert lab.parse_stream("sub sort@4") == [("sub", "sub", MIDDLE["sub"]), ("sort@4", "sort", 4)]
    assert list(lab.scenarios("sub sort")) == ["task-incremental"]
    assert list(lab.scenarios("sub", "sort@3 sort@4")) == ["task-incremental", "domain-incremental"]
    with pytest.raises(Exception):
        lab.parse_stream("no_such_family")


def test_c1_checks_find_the_entry_equal_to_its_prefix_and_the_rotary_mistake(tiny):
    model, tok = tiny
    data = {n: {"pool": tasks.generate(n, 3, seed=1, difficulty=2),
                "test": tasks.generate(n, 2, seed=2, difficulty=2)} for n in ("sort", "sub")}
    c1 = lab.equivalence_table(model, tok, data, ["sort", "sub"], False)
    assert len(c1) == 4 and (c1.max_logit_diff < 1e-4).all()
    assert (c1.max_hidden_diff_any_layer < 1e-4).all()
    assert (c1.wrong_positions_diff > 100 * c1.max_logit_diff.max()).all()
    assert lab.two_entries_diff(model, tok, data, ["sort", "sub"], False) < 1e-4
    assert lab.generate_matches(model, tok, data, ["sort", "sub"], False,
                                max_new_tokens=4) == [True] * 4


def test_cached_states_build_once_per_spec_under_the_old_key(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    calls = []

    def build():
        calls.append(1)
        return {"states": [{"w": torch.ones(2) * len(calls)}]}
    a = lab.cached_states("toy", {"x": 1}, build)
    b = lab.cached_states("toy", {"x": 1}, build)
    c = lab.cached_states("toy", {"x": 2}, build)
    assert len(calls) == 2 and torch.equal(a["states"][0]["w"], b["states"][0]["w"])
    assert not torch.equal(a["states"][0]["w"], c["states"][0]["w"])
    # the folder names the notebook's cached baselines have always had: no retraining
    key = hashlib.sha1(json.dumps({"x": 1}, sort_keys=True).encode()).hexdigest()[:10]
    assert lab.cache_path("toy", {"x": 1}).name == f"toy-{key}"
    assert lab.cache_path("toy", {"x": 1}).parent.name == "inducekv"


def test_results_table_and_c3_summary():
    eye = np.array([[1.0, np.nan], [0.5, 1.0]])
    flat = np.array([[0.2, np.nan], [0.2, 0.2]])
    results = {"s": {"InduceKV": {"acc": eye, "trace": [("a", 10), ("b", 30)], "passes": 5},
                     "LoRA": {"acc": flat, "trace": [("a", 20)], "passes": 50}}}
    table = lab.results_table(results, 100)
    assert table.average_accuracy.tolist() == pytest.approx([(1.0 + 0.75) / 2, 0.2])
    assert table.forgetting.tolist() == pytest.approx([0.5, 0.0])
    assert table.peak_bytes.tolist() == [30, 20]
    c3 = lab.c3_summary(table, ["s"])["s"]
    assert c3["higher_aa_than_all"] and not c3["lower_forgetting_than_all"]
    assert c3["best_baseline"] == "LoRA"


def test_footprint_checks_each_trace_against_the_budget_it_ran_under():
    results = {"s": {"InduceKV": {"trace": [("a", 90), ("b", 100)]}}}
    selection = {"random": {"trace": [("a", 101)]}}
    curve = [(100, 0.1, [("a", 100)]), (50, 0.1, [("a", 40), ("b", 50)])]
    traces, limits, peaks, within = lab.footprint(results, selection, curve, 100)
    assert limits["budget curve/50"] == 50 and limits["s/InduceKV"] == 100
    assert peaks["s/InduceKV"] == 100 and within["budget curve/50"]
    assert not within["selection/random"]


def test_slug_makes_metric_names():
    assert lab.slug("LoRA, compute-matched (fresh)") == "LoRA_compute_matched_fresh"
    assert lab.slug("MoE of LoRAs") == "MoE_of_LoRAs"


def _stream(model, tok, stream=("sort", "sub", "kv"), n_pool=6):
    prepared, tests = [], {}
    for f in stream:
        exs = tasks.generate(f, n_pool + 8, seed=1, difficulty=tasks.get(f).difficulties[0])
        prepared.append(K.prepare(model, tok, f, exs[:n_pool], exs[n_pool:n_pool + 3]))
        tests[f] = exs[n_pool + 3:]
    return prepared, tests


@pytest.mark.parametrize("mode", ["bilevel", "likelihood", "random"])
def test_replay_stream_is_run_stream_from_lookups(tiny, mode):
    model, tok = tiny
    prepared, tests = _stream(model, tok)
    ps = lab.pair_scores(model, tok, prepared, tests, False)
    assert ps.anchor_lp.shape == (18, 19) and ps.test_lp["kv"].shape == (5, 19)
    for budget in (3 * prepared[0].cands[0].nbytes, 9 * prepared[0].cands[0].nbytes):
        qk = {}
        ref = K.run_stream(model, tok, prepared, tests, budget, mode, 1, calib_steps=5,
                           seed=3, query_cache=qk)
        utils = [c.utility for P in prepared for c in P.cands]
        out = lab.replay_stream(ps, prepared, qk, budget, mode, seed=3, calib_steps=5)
        assert [c.utility for P in prepared for c in P.cands] == utils     # copies, not these
        np.testing.assert_array_equal(out["acc"], ref["acc"])
        np.testing.assert_array_equal(out["hit"], ref["hit"])
        assert out["trace"] == ref["trace"]
        last = out["made"][out["made"].after == 2].set_index("task")["entries"].to_dict()
        assert last == ref["entries_per_task"] and out["memory"].nbytes <= budget
        # the gain: the retrieved entry's answer log-likelihood over none, as the backbone says
        assert np.isnan(out["gain"][0, 1]) and np.isfinite(out["gain"][2]).all()
        mem = out["memory"]
        for j, P in enumerate(prepared):
            got = K.retrieve(mem.entries, qk[P.task], 1, mem.calib)
            lp = K.answer_scores(model, tok, tests[P.task], got)[0]
            base = K.answer_scores(model, tok, tests[P.task])[0]
            assert out["gain"][2, j] == pytest.approx((lp - base).mean(), abs=1e-4)


def test_pair_scores_are_cached_by_the_backbone_and_the_texts(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    model, tok = tiny
    prepared, tests = _stream(model, tok, ("sort", "sub"), n_pool=3)
    fresh = lab.pair_scores(model, tok, prepared, tests, False)
    first = lab.pair_scores(model, tok, prepared, tests, False, backbone="h1")
    other = lab.pair_scores(model, tok, prepared, tests, False, backbone="h2")
    assert len([p for p in (tmp_path / "zoo" / "inducekv").glob("pairs-*") if p.is_dir()]) == 2

    def boom(*a, **k):
        raise AssertionError("scored again instead of read from the cache")
    monkeypatch.setattr(lab.K, "answer_scores", boom)
    again = lab.pair_scores(model, tok, prepared, tests, False, backbone="h1")
    for ps in (first, again, other):
        np.testing.assert_array_equal(ps.anchor_lp, fresh.anchor_lp)
        assert set(ps.test_lp) == {"sort", "sub"} and ps.cands == fresh.cands
        np.testing.assert_array_equal(ps.test_exact["sub"], fresh.test_exact["sub"])


def test_stream_figure_stacks_the_memory_per_task(tiny):
    model, tok = tiny
    prepared, tests = _stream(model, tok, ("sort", "sub"), n_pool=4)
    ps = lab.pair_scores(model, tok, prepared, tests, False)
    qk = {P.task: K.query_keys(model, tok, tests[P.task]) for P in prepared}
    budget = 4 * prepared[0].cands[0].nbytes
    out = lab.replay_stream(ps, prepared, qk, budget, calib_steps=2)
    fig = lab.stream_figure(out, ["sort", "sub"], budget, "bilevel")
    heights = [p.get_height() for p in fig.axes[0].patches]         # task by task, then stage
    made = out["made"]
    want = [b / 1024 for t in ("sort", "sub")
            for b in made[made.task == t].sort_values("after").bytes]
    assert heights == pytest.approx(want) and sum(want) > 0
    assert len(fig.axes[1].get_lines()) == 2 + 1                   # a task each, the zero line
    plt.close(fig)


def test_replay_of_a_budget_below_one_entry_keeps_nothing_and_gains_nothing(tiny):
    model, tok = tiny
    prepared, tests = _stream(model, tok, ("sort", "sub"), n_pool=3)
    ps = lab.pair_scores(model, tok, prepared, tests, False)
    qk = {P.task: K.query_keys(model, tok, tests[P.task]) for P in prepared}
    out = lab.replay_stream(ps, prepared, qk, 100, calib_steps=2)
    assert out["memory"].entries == [] and (out["made"].bytes == 0).all()
    assert np.nanmax(np.abs(out["gain"])) == 0 and np.nanmax(out["hit"]) == 0


def test_a_task_of_an_in_context_family_holds_one_rule_in_every_split():
    """tag@2 and tag@3 are tag under two fixed, distinct tag letters; every split of a task
    follows its rule, the test prompts are distinct and none is a candidate's; ordinary
    families keep the registry's draws."""
    sizes = {"n_test": 12, "n_pool": 5, "n_probe": 3, "lora_train": 40}
    scens = lab.scenarios("tag@2 tag@3 sort")
    rules = lab.task_rules(scens, seed=10)
    assert set(rules) == {"tag@2", "tag@3"} and rules["tag@2"] != rules["tag@3"]
    assert rules == lab.task_rules(scens, seed=10) and rules != lab.task_rules(scens, seed=11)
    data = lab.task_data(Tok(), scens, sizes, seed=10, with_steps=False)
    for name in ("tag@2", "tag@3"):
        d = data[name]
        assert d["rule"] == rules[name]
        for split in ("test", "pool", "probes", "train"):
            assert all(e.metadata["rule"] == rules[name] and e.target.endswith(rules[name])
                       for e in d[split])
        tests_ = {e.prompt for e in d["test"]}
        assert len(tests_) == len(d["test"]) == 12
        assert not tests_ & {e.prompt for e in d["pool"] + d["probes"] + d["train"]}
    assert data["sort"]["rule"] is None
    assert [e.prompt for e in data["sort"]["test"]] == [
        e.prompt for e in heldout_examples("sort", MIDDLE["sort"], 12, seed=999)[0]]
    assert "rule" in lab.data_summary(scens, data)
