"""The shared sweep: every method on one grid, each judged at the value its validation picks."""
import math

import pytest

from workbench import cache
from workbench.sweep import sweep


def _toy(method, lr):
    """val peaks at lr 0.1 for 'a' and 0.01 for 'b'; 'b' diverges at 1.0."""
    peak = {"a": 0.1, "b": 0.01}[method]
    if method == "b" and lr == 1.0:
        return {"val": math.nan, "test": 0.0}
    val = 1 - abs(math.log10(lr) - math.log10(peak)) / 3
    return {"val": val, "test": val - 0.05}


def test_each_method_is_judged_at_its_own_best_value():
    s = sweep(_toy, ["a", "b"], [0.001, 0.01, 0.1, 1.0], select="val")
    assert len(s.table) == 8
    best = s.best().set_index("method")
    assert best.loc["a", "lr"] == 0.1 and best.loc["b", "lr"] == 0.01
    assert best.loc["a", "test"] == pytest.approx(0.95) and best["selected"].all()
    # lower is better: the lowest val (a tie goes to the first value), the NaN never chosen
    worst = sweep(_toy, ["a", "b"], [0.001, 0.01, 0.1, 1.0], select="val", mode="min")
    assert worst.at_best("b")["lr"] == 0.001 and worst.at_best("a")["lr"] == 0.001


def test_ties_go_to_the_first_value_and_all_diverged_is_not_selected():
    s = sweep(lambda m, v: {"val": 1.0 if m == "flat" else math.inf}, ["flat", "dead"],
              [0.3, 0.1, 0.2], select="val")
    assert s.at_best("flat")["lr"] == 0.3 and s.at_best("flat")["selected"]
    assert not s.at_best("dead")["selected"]
    with pytest.raises(KeyError, match="no runs of 'c'"):
        s.at_best("c")


def test_a_cached_sweep_runs_only_what_is_new(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    calls = []

    def run(m, v):
        calls.append((m, v))
        return _toy(m, v)

    where = cache.folder("sweeps") / cache.key("toy")
    first = sweep(run, ["a"], [0.01, 0.1], select="val", cache_dir=where)
    wider = sweep(run, ["a"], [0.01, 0.1, 1.0], select="val", cache_dir=where)
    assert calls == [("a", 0.01), ("a", 0.1), ("a", 1.0)]
    assert first.table["val"].tolist() == wider.table["val"].tolist()[:2]


def test_bad_input_is_refused_with_what_to_do():
    with pytest.raises(KeyError, match="returned no 'val'"):
        sweep(lambda m, v: {"acc": 1.0}, ["a"], [0.1], select="val")
    with pytest.raises(ValueError, match="mode"):
        sweep(_toy, ["a"], [0.1], select="val", mode="best")
    with pytest.raises(ValueError, match="at least one"):
        sweep(_toy, [], [0.1], select="val")


def test_the_plot_draws_a_line_per_method():
    s = sweep(_toy, ["a", "b"], [0.001, 0.01, 0.1], select="val")
    ax = s.plot("test")
    assert len(ax.get_legend().get_texts()) == 2 and ax.get_xscale() == "log"
    names = [f"m{i}" for i in range(9)]
    many = sweep(lambda m, v: {"val": 1.0}, names, [0.01, 0.1], select="val")
    styles = {ln.get_label(): ln.get_linestyle() for ln in many.plot().get_lines()
              if not ln.get_label().startswith("_")}
    assert styles["m0"] == "-" and styles["m8"] == "--"     # past the palette: dashed
