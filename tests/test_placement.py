"""The device audit (workbench/placement.py) fails on the placement mistakes a CPU run hides,
and the notebooks it was run on leave nothing on the host."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench import placement as P
from workbench.device import fast_math

DEV = P.SENTINEL


@pytest.fixture
def audit():
    a = P.start()
    a.violations.clear()
    yield a
    P.stop()


def kinds():
    return sorted({v["kind"] for v in P.report()})


def test_a_model_left_on_the_host_is_caught(audit):
    m = torch.nn.Linear(4, 3)                     # never moved, as 07's LM was
    m(torch.randn(2, 4).to(DEV))
    assert kinds() == ["host-parameter"]
    assert "test_placement.py" in P.report()[0]["where"]


def test_a_moved_model_with_moved_inputs_is_clean(audit):
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(DEV)
    x = torch.randn(5, 4).to(DEV)
    m(x).sum().backward()
    extra = torch.zeros(5, 2, device=x.device)    # a device taken from a tensor follows it
    (m(x) + extra).mean()
    assert P.report() == []


def test_a_host_input_to_a_moved_model_is_caught(audit):
    m = torch.nn.Linear(4, 3).to(DEV)
    m(torch.randn(2, 4))                          # the tokenizer's tensors, never moved
    assert kinds() == ["mixed"]


def test_an_adapter_built_after_the_move_is_caught(audit):
    base = torch.nn.Linear(4, 4).to(DEV)
    lora = torch.nn.Linear(4, 4, bias=False)      # created on the host after base.to(device)
    x = torch.randn(2, 4).to(DEV)
    base(x) + lora(x)
    assert "host-parameter" in kinds()


def test_moving_back_to_the_cpu_string_leaves_the_device(audit):
    m = torch.nn.Linear(4, 3).to(DEV).to("cpu")   # zoo.load's default device="cpu"
    m(torch.randn(2, 4).to(DEV))
    assert kinds() == ["host-parameter"]


def test_clones_of_device_weights_stay_on_the_device(audit):
    lin = torch.nn.Linear(4, 4).to(DEV)
    w = torch.nn.Parameter(lin.weight.detach().clone())     # hestia's and quant's wrappers
    torch.nn.functional.linear(torch.randn(2, 4).to(DEV), w)
    assert P.report() == []


def test_declared_host_work_is_not_audited(audit):
    m = torch.nn.Linear(4, 3)
    with P.host():
        m(torch.randn(2, 4))
    assert P.report() == []


def test_fast_math_is_nothing_on_the_cpu():
    x = torch.randn(8, 8)
    with fast_math("cpu"):
        y = x @ x
    assert y.dtype == torch.float32 and torch.equal(y, x @ x)


@pytest.mark.slow
@pytest.mark.parametrize("number", ["01", "03", "05", "07", "13", "15"])
def test_a_notebook_leaves_nothing_on_the_host(number, tmp_path):
    """Notebooks whose device placement was fixed, at smoke under the audit (about 2-3x their plain time):
    no module computes with a host parameter, no call mixes device and host tensors, no device
    tensor goes to numpy."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "WORKBENCH_DEVICE_AUDIT": "1"}
    out = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "workbench.cli", "run", number, "--jobs", "1", "--out",
                    str(out)], cwd=root, env=env, check=True, capture_output=True, timeout=900)
    (found,) = list(out.rglob("device_audit.json"))
    assert json.loads(found.read_text()) == []


def test_numpy_of_a_device_tensor_is_caught(audit):
    x = torch.randn(3).to(DEV)
    x.cpu().numpy()                               # fine
    assert P.report() == []
    x.numpy()                                     # an error on a GPU
    assert kinds() == ["numpy"]


def test_to_another_tensor_follows_that_tensor(audit):
    w = torch.nn.Linear(4, 4).to(DEV).weight
    host = torch.randn(4, 4)
    assert P.on_device(host.to(w)) and not P.on_device(w.to(host))


def test_as_tensor_with_a_device_moves_a_host_tensor(audit):
    m = torch.nn.Linear(4, 3).to(DEV)
    x = torch.randn(2, 4)                                            # already a tensor, on the host
    m(torch.as_tensor(x, device=next(m.parameters()).device))     # clip.image_features' move
    assert P.report() == []


def test_x_device_tells_where_x_is_and_leaves_meta_alone(audit):
    assert torch.randn(2).to(DEV).device == DEV and torch.randn(2).device == torch.device("cpu")
    assert torch.empty(2, device="meta").device.type == "meta"     # from_pretrained's check


def test_a_deep_copy_stays_on_the_device(audit):
    import copy
    m = copy.deepcopy(torch.nn.Linear(4, 3).to(DEV))                # FewShotClassifier's copy
    m(torch.randn(2, 4).to(DEV))
    assert P.report() == []


def test_calls_inside_vmap_are_not_audited_and_its_results_can_be_moved(audit):
    from torch.func import grad, vmap
    w = torch.nn.Parameter(torch.randn(4, 3).to(DEV))
    x, b = torch.randn(5, 4).to(DEV), torch.randn(3).to(DEV)
    # vmap's wrappers carry no marks: b (marked) next to them would read as a mix
    g = vmap(grad(lambda w_, xi: (xi @ w_ + b).sum()), in_dims=(None, 0))(w.detach(), x)
    assert P.report() == []
    (g.to(x.device) + w).sum()                  # fewshot_optim.per_example_sq_grads' move
    assert P.report() == []


def test_fura_block_explorer_computes_where_the_weights_are_and_returns_host_arrays(audit):
    """16's explorer: the pretrained weights live on the model's device, a learned update may
    come back from the host; the block trade and the spectra follow the weights, numpy reads
    the host copy."""
    from workbench.experiments import fura as lab
    torch.manual_seed(0)
    w0 = torch.randn(8, 16, dtype=torch.float64).to(DEV)
    delta = torch.randn(8, 16)                    # host, float32
    trade = lab.block_trade(w0, {"full": delta}, rank=2)
    spectra = lab.inside_spectra(w0, delta)
    assert P.report() == []
    assert len(trade) == len(lab.block_counts(16)) and spectra["dW"].shape == (8,)
