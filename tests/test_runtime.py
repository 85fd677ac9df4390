"""The Run object: sizes, seeding, claims, strict mode and the files finish() writes."""
import json

import numpy as np
import pytest
import torch

import workbench
from workbench import cache
from workbench.device import pick_device
from workbench.runtime import ClaimFailed

SIZES = {"smoke": {"steps": 10, "lr": 0.1, "name": "a"}, "full": {"steps": 1000, "lr": 0.01,
                                                                  "name": "a"}}


def test_sizes_by_scale_with_overrides(tmp_path):
    run = workbench.start("00-test", scale="full", out_dir=tmp_path)
    assert run.sizes(SIZES) == SIZES["full"]
    assert run.sizes(SIZES, steps=5, lr=None) == {"steps": 5, "lr": 0.01, "name": "a"}
    with pytest.raises(KeyError, match="steps"):
        run.sizes(SIZES, step=5)


def test_bad_scale_and_device(tmp_path):
    with pytest.raises(ValueError, match="smoke"):
        workbench.start("00-test", scale="huge", out_dir=tmp_path)
    with pytest.raises(ValueError, match="device"):
        pick_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            pick_device("cuda")
    assert pick_device("auto").type in ("cpu", "cuda")


def test_seeding_makes_runs_repeatable(tmp_path):
    workbench.start("00-test", seed=3, out_dir=tmp_path)
    a = (torch.rand(3), np.random.rand(3))
    workbench.start("00-test", seed=3, out_dir=tmp_path)
    b = (torch.rand(3), np.random.rand(3))
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_finish_writes_the_contract(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    run = workbench.start("00-test", seed=1, out_dir=tmp_path, lr=0.5)
    cache.build(cache.folder("00-test") / "sweep-x", lambda tmp: {"acc": 0.5})
    run.record("loss", np.float32(0.25))
    run.record(acc=torch.tensor(0.5), curve=np.arange(3), bad=float("nan"))
    run.claim("C1", "loss is small", holds=np.bool_(True), evidence={"loss": 0.25}, robust=True)
    run.claim("C2", "accuracy is high", holds=False)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    run.savefig(fig, "line")
    summary = run.finish()
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m == json.loads(json.dumps(summary))
    assert m["notebook"] == "00-test" and m["seed"] == 1 and m["scale"] == "smoke"
    assert m["metrics"] == {"loss": 0.25, "acc": 0.5, "curve": [0, 1, 2], "bad": None}
    assert [(c["id"], c["holds"], c["robust"]) for c in m["claims"]] == [
        ("C1", True, True), ("C2", False, False)]
    assert m["params"]["lr"] == 0.5 and m["figures"] == ["line.png"]
    assert (tmp_path / "figures" / "line.png").stat().st_size > 0
    # every cache entry the run asked for, and how it got it (what `workbench zoo ship --smoke`
    # ships, and how a fresh clone's run shows what it still trained)
    assert {"entry": "00-test/sweep-x", "ready": "done.json", "how": "built"} in m["cache"]
    env = json.loads((tmp_path / "env.json").read_text())
    assert {"git", "packages", "device", "determinism"} <= set(env)
    assert json.loads((tmp_path / "params.json").read_text())["seed"] == 1


def test_strict_mode_raises_on_a_failed_robust_claim(tmp_path, monkeypatch):
    run = workbench.start("00-test", out_dir=tmp_path)
    run.claim("C1", "robust but false", holds=False, robust=True)
    monkeypatch.setenv("WORKBENCH_STRICT", "1")
    with pytest.raises(ClaimFailed, match="C1"):
        run.finish()
    assert (tmp_path / "metrics.json").exists()        # the results are still written
    monkeypatch.setenv("WORKBENCH_STRICT", "0")
    run.finish()


def test_claim_needs_a_computed_bool(tmp_path):
    run = workbench.start("00-test", out_dir=tmp_path)
    with pytest.raises(TypeError):
        run.claim("C1", "typed in", holds="yes")
    run.claim("C1", "first", holds=True)
    run.claim("C1", "re-run cell", holds=False)
    assert [c.text for c in run.claims] == ["re-run cell"]


def test_default_run_dir_is_interactive_and_one_per_run(tmp_path, monkeypatch):
    # a JupyterLab run and a plain papermill run of one notebook must not write into the same
    # runs/interactive/<slug> and overwrite each other: each run gets its own folder
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path))
    run = workbench.start("00-test")
    assert run.out_dir.parent == tmp_path / "runs" / "interactive" / "00-test"
    code = ("import workbench; print(workbench.start('00-test', device='cpu').out_dir)")
    import subprocess, sys
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**__import__("os").environ, "WORKBENCH_HOME": str(tmp_path)},
                           check=True).stdout.strip().splitlines()[-1]
    assert other != str(run.out_dir) and run.out_dir.is_dir()


def test_show_prints_source(capsys):
    workbench.show(pick_device)
    assert "def pick_device" in capsys.readouterr().out


def test_set_threads_is_recorded(tmp_path):
    run = workbench.start("00-test", out_dir=tmp_path)
    before = torch.get_num_threads()
    try:
        run.set_threads(1)
        assert torch.get_num_threads() == 1 and run.determinism["torch_threads"] == 1
        run.set_threads(0)                      # 0 keeps what is set
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def _namespace(**values):
    """What a notebook's globals() holds after its parameters cell (and papermill's injection)."""
    ann = {"scale": str, "seed": int, "device": str, "out_dir": str, "steps": int, "lr": float,
           "name": str}
    ns = {"scale": "smoke", "seed": 0, "device": "cpu", "out_dir": None, "steps": None,
          "lr": None, "name": None, "unrelated": 5}
    ns.update(values)
    ns["__annotations__"] = ann
    return ns


def test_start_reads_the_parameters_cell_and_knobs_override_sizes(tmp_path):
    run = workbench.start("00-test", _namespace(out_dir=str(tmp_path), steps=7, lr=1, seed=2))
    assert run.seed == 2 and run.out_dir == tmp_path
    assert run.params["steps"] == 7 and run.params["lr"] == 1.0 and "unrelated" not in run.params
    # a knob named like a size overrides it; None keeps the scale's size
    assert run.sizes(SIZES) == {"steps": 7, "lr": 1.0, "name": "a"}
    assert run.sizes(SIZES, steps=3)["steps"] == 3          # an explicit override wins


def test_start_names_a_bad_parameter_value(tmp_path):
    with pytest.raises(TypeError, match="'steps' must be int.*'many'"):
        workbench.start("00-test", _namespace(out_dir=str(tmp_path), steps="many"))
    with pytest.raises(TypeError, match="'steps' must be int"):
        workbench.start("00-test", _namespace(out_dir=str(tmp_path), steps=True))
    with pytest.raises(ValueError, match="annotated"):
        workbench.start("00-test", {"scale": "smoke"})
    ns = _namespace(out_dir=str(tmp_path))
    del ns["__annotations__"]["device"]
    with pytest.raises(ValueError, match="device"):
        workbench.start("00-test", ns)


def test_sizes_rows_must_name_the_same_sizes(tmp_path):
    run = workbench.start("00-test", out_dir=tmp_path)
    with pytest.raises(KeyError, match="lr"):
        run.sizes({"smoke": {"steps": 1, "lr": 0.1}, "full": {"steps": 2}})


def test_a_threads_size_sets_torch_threads(tmp_path):
    run = workbench.start("00-test", out_dir=tmp_path)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        run.sizes({"smoke": {"threads": 1}, "full": {"threads": 0}})
        assert torch.get_num_threads() == 1 and run.determinism["torch_threads"] == 1
    finally:
        torch.set_num_threads(before)


def test_finish_returns_a_verdict_table(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_STRICT", "0")
    run = workbench.start("00-test", out_dir=tmp_path)
    run.claim("C1", "x < y", holds=True, evidence={"x": 0.123456, "y": 1})
    run.claim("C2", "a & b", holds=False, robust=True)
    verdicts = run.finish()
    html = verdicts._repr_html_()
    assert html.count("<tr>") == 3 and "&#10004; holds" in html and "does not hold" in html
    assert "a &amp; b" in html and "x = 0.1235" in html and "1/2 claims hold" in html
    text = repr(verdicts)
    assert "C2     yes    does not hold" in text and "1/2 claims hold" in text
    assert verdicts["claims"][1]["holds"] is False     # still the metrics.json summary


def test_seeding_sets_deterministic_algorithms(tmp_path):
    try:
        run = workbench.start("00-test", out_dir=tmp_path)
        assert torch.are_deterministic_algorithms_enabled()
        assert run.determinism["deterministic_algorithms"]
    finally:
        torch.use_deterministic_algorithms(False)


def test_sizes_limits_name_the_bad_knob(tmp_path):
    run = workbench.start("00-test", _namespace(out_dir=str(tmp_path), steps=0))
    with pytest.raises(ValueError, match=r"steps must be in 1\.\., got 0"):
        run.sizes(SIZES, limits={"steps": (1, None)})
    assert run.sizes(SIZES, limits={"steps": (0, 5), "lr": (None, 1)})["steps"] == 0


def test_limits_check_knobs_against_choices(tmp_path):
    run = workbench.start("00-test", _namespace(out_dir=str(tmp_path), name="b"))
    with pytest.raises(ValueError, match=r"name must be one of \['a', 'c'\], got 'b'"):
        run.sizes(SIZES, limits={"name": ["a", "c"]})
    assert run.sizes(SIZES, limits={"name": ["a", "b"]})["name"] == "b"
    with pytest.raises(KeyError, match="neither"):
        run.sizes(SIZES, limits={"nme": ["a"]})


def test_start_checks_the_limits_the_parameters_cell_declares(tmp_path):
    """A value outside a declared limit fails in the kernel too (Jupyter, plain papermill), not
    only in `workbench run`: 12-nfi declares steps [1..]."""
    from workbench.runtime import notebook_parameters
    ns = {"__annotations__": {"scale": str, "seed": int, "device": str, "out_dir": str,
                              "steps": int},
          "scale": "smoke", "seed": 0, "device": "cpu", "out_dir": str(tmp_path), "steps": -5}
    with pytest.raises(ValueError, match=r"'steps' = -5 is outside its limit \[1\.\.\]"):
        notebook_parameters(ns, "12-nfi")
    ns["steps"] = None                          # None: the scale's size, allowed
    assert notebook_parameters(ns, "12-nfi")["steps"] is None
    ns["steps"] = 3
    assert notebook_parameters(ns, "12-nfi")["steps"] == 3
