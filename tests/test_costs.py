"""workbench.costs: interleaved timing flips its order every round, and the counts equal the
hand counts of small operations (a sum, a matrix product, its backward)."""
import numpy as np
import pytest
import torch

from workbench import costs


def test_interleaved_runs_abba_after_a_warmup():
    calls = []
    t = costs.interleaved({"A": lambda: calls.append("A"), "B": lambda: calls.append("B")},
                          repeats=4, warmup=1)
    assert calls == list("AB" + "AB" "BA" "AB" "BA")      # warm-up, then the order flips each round
    assert list(t.columns) == ["A", "B"] and len(t) == 4 and (t.to_numpy() >= 0).all()


def test_interleaved_needs_two_callables_and_a_round():
    with pytest.raises(ValueError):
        costs.interleaved({"A": lambda: None}, 3)
    with pytest.raises(ValueError):
        costs.interleaved({"A": lambda: None, "B": lambda: None}, 0)


def test_spread_summarises_the_ratios():
    s = costs.spread([1.0, 2.0, 3.0, 4.0, 10.0])
    assert s["median"] == 3.0 and s["min"] == 1.0 and s["max"] == 10.0 and s["n"] == 5
    assert s["q1"] == 2.0 and s["q3"] == 4.0


def test_flops_counts_a_matrix_product_and_its_backward():
    a = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(16, 4)
    assert costs.flops(lambda: a @ b) == 2 * 8 * 16 * 4
    assert costs.flops(lambda: (a @ b).sum().backward()) == 2 * (2 * 8 * 16 * 4)  # forward + grad of a
    assert costs.flops(lambda: a * 2 + 1) == 0                                    # elementwise: none


def test_bytes_moved_counts_inputs_and_outputs_and_skips_views():
    x, y = torch.ones(1000), torch.ones(1000)
    assert costs.bytes_moved(lambda: x + y) == 3 * 4000                  # two reads, one write
    assert costs.bytes_moved(lambda: x.view(10, 100)) == 0               # a view moves nothing
    assert costs.bytes_moved(lambda: x.double()) == 4000 + 8000
    w = torch.ones(1000, requires_grad=True)
    n = costs.bytes_moved(lambda: (w * x).sum().backward())
    assert n > 3 * 4000 and np.isfinite(n)                               # the backward is seen too
