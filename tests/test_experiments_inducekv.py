"""Unit tests of workbench.experiments.inducekv: notebook 01's harness (the stream spec, the C1
checks on a tiny random Llama, the cached runs' keys, the C3 summary and the C2 footprint)."""
import hashlib
import json

import numpy as np
import pytest
import torch

from workbench.data import tasks
from workbench.evaluate import MIDDLE
from workbench.experiments import inducekv as lab
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
