"""`workbench new`: the notebook template has the house anatomy and runs end to end."""
import json

import papermill as pm
import pytest

from workbench.cli import main
from workbench.notebooks import TEMPLATE_MARK, hygiene_problems, parameters
from workbench.template import new_notebook


@pytest.mark.slow
def test_new_writes_a_notebook_that_runs(tmp_path):
    path = new_notebook("99-demo", title="A demo", directory=tmp_path)
    nb = json.loads(path.read_text())
    assert nb["cells"][0]["source"][0].startswith("# 99 · A demo")
    # the only hygiene problems are the marks the author must rewrite
    problems = hygiene_problems(path)
    assert problems and all(TEMPLATE_MARK in p for p in problems)
    assert {"scale", "seed", "device", "out_dir", "steps"} <= set(parameters(path))
    opening = "".join(nb["cells"][3]["source"])
    assert 'workbench.start("99-demo", globals())' in opening and len(opening.splitlines()) <= 10
    out = tmp_path / "run"
    pm.execute_notebook(str(path), str(tmp_path / "out.ipynb"), kernel_name="python3",
                        parameters={"steps": 40, "out_dir": str(out)}, progress_bar=False)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["sizes"]["steps"] == 40 and metrics["claims"][0]["id"] == "C1"
    executed = json.loads((tmp_path / "out.ipynb").read_text())
    (finish,) = [c for c in executed["cells"] if "run.finish()" in "".join(c["source"])]
    last = finish["outputs"][-1]
    assert "text/html" in last["data"] and "text/plain" in last["data"]   # the verdict table
    (explorer,) = [c for c in executed["cells"] if "explore" in c["metadata"].get("tags", [])]
    assert "Explorer, drawn at its default (bins=30)" in "".join(explorer["outputs"][0]["text"])
    assert any("image/png" in o.get("data", {}) for o in explorer["outputs"])   # static picture
    (shown,) = [c for c in executed["cells"] if "results" in c["metadata"].get("tags", [])]
    # What we saw: Markdown rendered from the (not yet recorded) results, no stray repr
    assert [o["output_type"] for o in shown["outputs"]] == ["display_data", "display_data"]
    assert "No recorded runs of 99-demo" in "".join(shown["outputs"][0]["data"]["text/markdown"])


def test_new_refuses_bad_names_and_overwrites(tmp_path, capsys):
    with pytest.raises(ValueError, match="NN-slug"):
        new_notebook("Demo Notebook", directory=tmp_path)
    new_notebook("98-x", directory=tmp_path)
    with pytest.raises(FileExistsError, match="--force"):
        new_notebook("98-x", directory=tmp_path)
    new_notebook("98-x", directory=tmp_path, force=True)


def test_cli_new_reports_errors(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path))
    (tmp_path / "notebooks").mkdir()
    assert main(["new", "97-cli-demo"]) == 0
    assert (tmp_path / "notebooks" / "97-cli-demo.ipynb").exists()
    assert main(["new", "97-cli-demo"]) == 2
    assert "exists" in capsys.readouterr().err


def test_hygiene_sees_repeated_cell_ids(tmp_path):
    path = new_notebook("97-ids", directory=tmp_path)
    assert not any("ids repeat" in p for p in hygiene_problems(path))
    nb = json.loads(path.read_text())
    nb["cells"][1]["id"] = nb["cells"][0]["id"]
    path.write_text(json.dumps(nb))
    assert any("ids repeat" in p for p in hygiene_problems(path))
