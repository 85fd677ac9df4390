"""Paper 11's harness (workbench.experiments.haps): the benchmark's split, the baselines'
scores against their definitions, and the architecture-only router."""
import numpy as np
import torch

from workbench.experiments import haps as X


def test_benchmark_never_tests_on_a_training_prompt():
    train, test = X.benchmark(["kv", "add"], 30, 10, seed=0)
    assert len(train) == 60 and {e.family for e in test} == {"kv", "add"}
    assert not {e.prompt for e in test} & {e.prompt for e in train}
    assert all(sum(e.family == f for e in test) <= 10 for f in ("kv", "add"))
    assert [e.prompt for e in X.benchmark(["kv", "add"], 30, 10, seed=0)[1]] == \
        [e.prompt for e in test]


def test_routing_scores_follow_their_definitions():
    g = np.random.default_rng(0)
    static_test = (g.random((20, 3)) < 0.5).astype(float)
    static_train = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1.0]])
    adapted = {"HAPS": (g.random((20, 3)) < 0.5).astype(float)}
    arch, choice = g.integers(0, 3, 20), {"HAPS": g.integers(0, 3, 20)}
    s = X.routing_scores(static_test, static_train, adapted, arch, choice, ["x", "y", "z"])
    assert np.allclose(s["random routing"], static_test.mean(1))
    assert np.array_equal(s["single best (x)"], static_test[:, 0])      # best on training
    rows = np.arange(20)
    assert np.array_equal(s["architecture-only router"], static_test[rows, arch])
    assert np.array_equal(s["HAPS"], adapted["HAPS"][rows, choice["HAPS"]])
    for m, v in s.items():                                             # the oracles are ceilings
        ceiling = s["oracle (HAPS candidates)"] if "HAPS" in m else s["oracle (static)"]
        assert (v <= ceiling).all(), m


def test_static_router_learns_separable_labels():
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(3).repeat(20)
    x = torch.nn.functional.one_hot(labels, 8).float() + 0.05 * torch.randn(60, 8, generator=g)
    net = X.train_static_router(x, labels, 3, d_h=16, steps=150, lr=1e-2, seed=0)
    assert (net(x).argmax(1) == labels).float().mean() == 1.0
    again = X.train_static_router(x, labels, 3, d_h=16, steps=150, lr=1e-2, seed=0)
    assert torch.equal(net(x), again(x))                               # seeded


def test_bench_table_names_the_best_candidate_per_family():
    correct = np.array([[1, 0], [1, 0], [0, 1], [0, 1], [0, 1.0]])
    fam = np.array(["a", "a", "b", "b", "b"])
    bench = X.bench_table(correct, fam, ["a", "b"], ["p", "q"])
    assert bench.loc["a", "best"] == "p" and bench.loc["b", "best"] == "q"
    assert bench.loc["all families", "best"] == "q" and bench.loc["all families", "q"] == 0.6


def test_two_level_table_takes_the_levels_apart():
    g = np.random.default_rng(1)
    static_test = (g.random((12, 2)) < 0.5).astype(float)
    adapted = {"HAPS": (g.random((12, 2)) < 0.5).astype(float)}
    arch, choice = g.integers(0, 2, 12), {"HAPS": g.integers(0, 2, 12)}
    fam = np.array(["a", "b"] * 6)
    t = X.two_level_table(static_test, adapted, arch, choice, fam, ["a", "b"])
    s = X.routing_scores(static_test, static_test, adapted, arch, choice, ["x", "y"])

    def at(params, router, family="all"):
        r = t[(t.parameters == params) & (t.router == router) & (t.family == family)]
        return float(r["exact match"].item())
    assert at("generated LoRA", "its own router") == s["HAPS"].mean()          # HAPS itself
    assert at("static", "architecture-only router") == s["architecture-only router"].mean()
    assert at("static", "oracle") == s["oracle (static)"].mean()
    assert at("generated LoRA", "oracle") == s["oracle (HAPS candidates)"].mean()
    assert at("static", "random", "b") == static_test[fam == "b"].mean()
    assert len(t) == 2 * 4 * 3 and (t["exact match"] <= 1).all()
