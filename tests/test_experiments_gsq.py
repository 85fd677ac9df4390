"""The GSQ harness (notebook 14): the layer swap, per-layer errors, the baselines, the ablations'
solved scales, the row names, the gap and slope helpers, and the readers' agreement check."""
import math

import pytest
import torch
from torch import nn

from workbench import quant as Q
from workbench.experiments import gsq as X
from workbench.methods import gsq as M


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 4, bias=False), nn.Linear(4, 3, bias=False)


def _hessian(cols, n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cols, generator=g)
    return 2 / n * x.T @ x


def test_swapped_puts_weights_in_and_restores_them():
    m = _Two()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    new = torch.full((4, 8), 0.5)
    with X.swapped(m, {"a": new}) as inside:
        assert torch.equal(inside.a.weight, new) and torch.equal(inside.b.weight, before["b.weight"])
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())


def _one_block_model(lin):
    """``(model, name)``: a model whose one block's ``mlp.down_proj`` is ``lin``, and its name as
    ``block_linears`` lists it."""
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Module()])
    model.model.layers[0].mlp = nn.Module()
    model.model.layers[0].mlp.down_proj = lin
    return model, next(iter(Q.block_linears(model)))


def test_layer_errors_are_relative_to_the_weight():
    lin = nn.Linear(64, 16, bias=False)
    torch.manual_seed(1)
    model, name = _one_block_model(lin)
    H = {name: _hessian(64)}
    w = lin.weight.detach()
    err = X.layer_errors(model, H, {name: w.clone()})
    assert err[name] == 0.0                                            # exact weights: no error
    assert math.isclose(X.layer_errors(model, H, {name: torch.zeros_like(w)})[name], 1.0,
                        rel_tol=1e-6)                                  # zero weights: the whole norm
    rtn = Q.rtn(w, 2, 32).dequantize()
    assert 0 < X.layer_errors(model, H, {name: rtn})[name] < 1


def test_solved_scales_never_do_worse_than_the_assignment_s_own_scales():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g)
    H = _hessian(64)
    q = Q.gptq(w, H, 2, 32)
    lin = nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    bed = X.Bed(model=None, tok=None, card={}, calib=None, held=None, layers={"l": lin},
                H={"l": H}, ppl_fp=0.0, load_s=0.0, t_start=0.0)
    solved = X.solved_scales(bed, {"l": {"q": q}}, 32)["l"]
    assert solved.shape == w.shape
    assert Q.output_error(w, solved, H) <= Q.output_error(w, q.dequantize(), H) * (1 + 1e-5)


def test_baseline_quantizes_every_layer_on_its_grid():
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(8, 64, generator=g))
    bed = X.Bed(model=None, tok=None, card={}, calib=None, held=None, layers={"l": lin},
                H={"l": _hessian(64)}, ppl_fp=0.0, load_s=0.0, t_start=0.0)
    for method, ref in (("rtn", Q.rtn(lin.weight.detach(), 3, 32)),
                        ("gptq", Q.gptq(lin.weight.detach(), bed.H["l"], 3, 32))):
        w, info = X.baseline(bed, method, 3, 32)
        assert torch.equal(w["l"], ref.dequantize()) and torch.equal(info["l"]["q"].codes, ref.codes)


def test_rows_name_the_variant():
    """The verdict table says which rows are the published method and which are our ablations."""
    assert X.NAMES["gsq"] == "GSQ (as published)"
    assert all("ablation, ours" in X.NAMES[a] for a in X.ABLATIONS)


def test_gap_closed_and_loglog_slope():
    assert X.gap_closed(10.0, 20.0, 12.0) == 0.8
    assert math.isnan(X.gap_closed(10.0, 9.0, 9.5))                    # no gap to close
    assert abs(X.loglog_slope([1, 2, 4, 8], [3, 6, 12, 24]) - 1.0) < 1e-6
    assert abs(X.loglog_slope([1, 10, 100], [1, 100, 10_000]) - 2.0) < 1e-6


def test_readers_agree_needs_exact_codes_and_matching_perplexities():
    ok = {"exact": True, "ppl_memory": 10.0, "ppl_transformers": 10.0, "ppl_llama_cpp": 10.05}
    assert X.readers_agree({"a": ok, "b": dict(ok, ppl_llama_cpp=None)})
    assert not X.readers_agree({"a": dict(ok, exact=False)})
    assert not X.readers_agree({"a": dict(ok, ppl_transformers=10.01)})
    assert not X.readers_agree({"a": dict(ok, ppl_llama_cpp=10.2)})    # beyond 1 %


def test_timing_sweep_times_one_layer_per_width():
    sizes, secs = X.timing_sweep([32, 64], steps=2, seed=0, tokens=16)
    assert sizes == [32 * 32, 64 * 64] and len(secs) == 2 and all(s > 0 for s in secs)


def _bed_of(lin, H):
    return X.Bed(model=None, tok=None, card={}, calib=None, held=None, layers={"l": lin},
                 H={"l": H}, ppl_fp=0.0, load_s=0.0, t_start=0.0)


def test_group_sizes_divide_every_layer():
    layers = {"a": nn.Linear(128, 4, bias=False), "b": nn.Linear(384, 4, bias=False)}
    assert X.group_sizes(layers) == [32, 64, 128]


def test_group_table_reads_the_notebook_s_group_and_quantizes_the_others(monkeypatch):
    lin = nn.Linear(64, 8, bias=False)
    bed = _bed_of(lin, _hessian(64))
    seen = []
    monkeypatch.setattr(X.Bed, "ppl", lambda self, w=None: seen.append(w) or 5.0)
    res = {(m, b): {"ppl": {"rtn": 3.0, "gptq": 2.0, "gsq": 1.0}[m] + b}
           for m in X.METHODS for b in (2, 3)}
    t = X.group_table(bed, res, (2, 3), [32, 64], 64)
    assert len(seen) == 4                                  # RTN and GPTQ at group 32 only
    at64 = t[t["group size"] == 64].set_index(["method", "bits"])["ppl"]
    assert at64[("GSQ (as published)", 2)] == 3.0 and at64[("RTN", 3)] == 6.0
    assert set(t[t["group size"] == 32]["method"]) == {"RTN", "GPTQ"}   # GSQ only where it ran
    assert t[(t["bits"] == 2) & (t["group size"] == 32)]["bits per weight"].iloc[0] == 2.5


def test_grid_rows_lie_on_each_method_s_grid():
    g = torch.Generator().manual_seed(2)
    lin = nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(8, 64, generator=g))
    bed = _bed_of(lin, _hessian(64))
    q = Q.gptq(lin.weight.detach(), bed.H["l"], 2, 32)
    res = {("gsq", 2): {"info": {"l": {"q": q}}}}
    rows = X.grid_rows(bed, res, "l", 2, 32, 32, row=1, cols=64)
    assert torch.equal(rows["fp"], lin.weight.detach()[1])
    for m in ("rtn", "gptq", "gsq"):
        w, s = rows[m]
        lv = w / s.repeat_interleave(32)                   # levels: integers in -2..1
        assert torch.allclose(lv, lv.round(), atol=1e-4) and lv.min() >= -2 and lv.max() <= 1
    assert "gsq" not in X.grid_rows(bed, res, "l", 2, 64, 32)   # GSQ only at its own group
    t = X.group_table(bed, {k: {"ppl": 1.0} for k in [(m, 2) for m in X.METHODS]}, (2,), [32], 32)
    fig = X.explore_figure(t, rows, 2, 32, 1.0, "l")
    assert len(fig.axes) == 2


def test_frontier_gap_is_the_fraction_of_gptq_to_vq_closed():
    assert X.frontier_gap(12.0, 11.0, 10.0) == 0.5
    assert X.frontier_gap(12.0, 10.0, 10.0) == 1.0
    assert X.frontier_gap(12.0, 13.0, 10.0) == -0.5                   # GSQ worse than GPTQ
    assert math.isnan(X.frontier_gap(12.0, 11.0, 12.5))                # VQ not ahead: no gap


def test_frontier_runs_awq_and_gptvq_at_the_scalar_grid_s_bits(monkeypatch):
    g = torch.Generator().manual_seed(2)
    lin = nn.Linear(128, 128, bias=False)
    with torch.no_grad():
        lin.weight.copy_(0.05 * torch.randn(128, 128, generator=g))
    model, name = _one_block_model(lin)
    bed = X.Bed(model=model, tok=None, card={}, calib=None, held=None, layers={name: lin},
                H={name: _hessian(128, 1024)}, ppl_fp=0.0, load_s=0.0, t_start=0.0)
    monkeypatch.setattr(X.Bed, "ppl", lambda self, weights=None: 1.0)
    out = X.frontier(bed, (2, 3), 128, kmeans_iters=2, act_mean={name: torch.ones(128)})
    for b in (2, 3):
        assert out[("vq", b)]["bpw"] <= Q.bits_per_weight(b, 128) + 1e-12
        assert out[("awq", b)]["bpw"] == Q.bits_per_weight(b, 128)
        # flat activation means: every alpha gives the same scales, so AWQ is RTN
        assert torch.equal(out[("awq", b)]["weights"][name], Q.rtn(lin.weight.detach(), b,
                                                                   128).dequantize())
    res = {**out, **{(m, b): {"ppl": v} for b in (2, 3) for m, v in (("gptq", 2.0),
                                                                       ("gsq", 1.5))}}
    met = X.frontier_metrics(res, (2, 3))
    assert met["frontier_gap_closed_gsq_2bit"] == 0.5 and met["bpw_vq_3bit"] <= 3.125
    table = X.ppl_table({**res, ("rtn", 4): {"ppl": 3.0}}, (2,), 128, 0.9)
    assert table.loc["AWQ"].iloc[0] == 1.0


def test_gsq_start_is_the_reference_s_gptq_and_the_start_is_named():
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(8, 64, generator=g))
    bed = _bed_of(lin, _hessian(64))
    w, info = X.gsq_start(bed, 2, 32)
    ref = M.gptq_start(lin.weight.detach(), bed.H["l"], 2, 32)
    assert torch.equal(w["l"], ref.dequantize()) and torch.equal(info["l"]["q"].codes, ref.codes)
    assert X.STARTS == ("official", "absmax")
    with pytest.raises(ValueError):
        X.quantize_all(bed, (2,), 32, M.GSQConfig(steps=1), 0, start="rtn")
