"""Unit tests of the Hadamard representation layer, the torsos and the matched-width formula."""
import math

import pytest
import torch
from torch import nn

from workbench.methods import hadamard as hr


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("act", ["tanh", "relu", "gelu"])
def test_hr_layer_is_the_product_of_two_branches(act):
    torch.manual_seed(0)
    layer = hr.HadamardLinear(5, 7, act)
    x = torch.randn(11, 5)
    f = hr.ACTIVATIONS[act]()
    expected = f(layer.branch1(x)) * f(layer.branch2(x))
    out = layer(x)
    assert out.shape == (11, 7)
    torch.testing.assert_close(out, expected)
    # the branches are independent parameters, not tied copies
    assert not torch.allclose(layer.branch1.weight, layer.branch2.weight)


def test_hr_layer_parameter_count_is_twice_the_standard():
    assert n_params(hr.HadamardLinear(10, 32)) == 2 * (10 + 1) * 32
    assert n_params(hr.StandardLinear(10, 32)) == (10 + 1) * 32
    assert n_params(hr.HadamardLinear(10, 32, norm=True)) == 2 * (10 + 1) * 32 + 4 * 32


def test_tanh_hr_output_is_bounded_and_saturates_only_when_both_branches_do():
    layer = hr.HadamardLinear(1, 2)
    with torch.no_grad():
        layer.branch1.weight[:] = torch.tensor([[50.0], [50.0]])   # both units' branch 1 saturates
        layer.branch2.weight[:] = torch.tensor([[50.0], [0.01]])   # only unit 0's branch 2 does
        layer.branch1.bias.zero_(), layer.branch2.bias.zero_()
    h = layer(torch.linspace(0.5, 1.0, 20)[:, None])
    assert h.abs().max() <= 1.0
    assert h[:, 0].min() > 0.99                 # both branches saturated: a constant
    assert h[:, 1].abs().max() < 0.02           # one branch unsaturated: not a constant +-1


@pytest.mark.parametrize("m,width,head", [(64, 64, 3), (1600, 128, 4), (4, 8, 1)])
@pytest.mark.parametrize("norm", [False, True])
def test_matched_width_equalizes_parameters_with_heads(m, width, head, norm):
    hw = hr.matched_width(m, width, head, norm)
    hr_count = n_params(hr.HadamardLinear(m, width, norm=norm)) + (width + 1) * head
    wide_count = n_params(hr.StandardLinear(m, hw, norm=norm)) + (hw + 1) * head
    per_unit = m + 1 + head + (2 if norm else 0)            # parameters one more wide unit adds
    assert abs(wide_count - hr_count) <= per_unit / 2       # the closest integer width
    assert width < hw < 2 * width + 1


def test_matched_width_closed_form():
    # 2 (m+1) H + (H+1) A = (m+1) H' + (H'+1) A  ->  H' = H (2(m+1) + A) / (m+1+A)
    assert hr.matched_width(64, 64, 3) == round(64 * (2 * 65 + 3) / (65 + 3)) == 125
    assert hr.matched_width(9, 10, 0) == 20                  # no head: exactly twice as wide


@pytest.mark.parametrize("family,shape", [("classic", (4,)), ("minatar", (4, 10, 10)),
                                          ("ale", (4, 84, 84))])
def test_torsos_shapes_and_matched_parameter_counts(family, shape):
    head = 5
    torsos = {k: hr.Torso(k, family, shape, head, width=32) for k in hr.TORSOS}
    x = torch.rand((3,) + shape) * (255 if family == "ale" else 1)
    for kind, t in torsos.items():
        assert t(x).shape == (3, t.out_dim)
    assert torsos["standard"].out_dim == torsos["hadamard"].out_dim == 32
    counts = {k: hr.rep_param_count(t, head) for k, t in torsos.items()}
    assert counts["hadamard"] > counts["standard"]
    assert abs(counts["wide"] - counts["hadamard"]) / counts["hadamard"] < 0.01
    # the encoders are the same architecture: only the representation layer differs
    enc = {k: n_params(t.encoder) for k, t in torsos.items()}
    assert len(set(enc.values())) == 1


def test_unknown_torso_or_activation_is_a_clear_error():
    with pytest.raises(ValueError, match="standard"):
        hr.Torso("deep", "classic", (4,), 2)
    with pytest.raises(ValueError, match="tanh"):
        hr.Torso("hadamard", "classic", (4,), 2, act="swish")


def test_representation_stats_on_a_torso():
    torch.manual_seed(0)
    t = hr.Torso("hadamard", "classic", (4,), 3, width=16)
    st = hr.representation_stats(t, torch.randn(200, 4))
    assert set(st) == {"inactive", "dormant", "saturated", "srank", "erank", "sv"}
    assert all(0 <= st[k] <= 1 for k in ("inactive", "dormant", "saturated"))
    assert 1 <= st["srank"] <= 16 and 1 <= st["erank"] <= 16
    assert st["sv"].shape == (16,)
    assert math.isclose(st["erank"], float(torch.exp(torch.distributions.Categorical(
        probs=torch.as_tensor(st["sv"] / st["sv"].sum())).entropy())), rel_tol=1e-4)
