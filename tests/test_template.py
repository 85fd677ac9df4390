"""`workbench new`: a new paper in one command. Its notebook has the house anatomy, its files pass
the house and layering checks, its own tests pass and its notebook runs end to end, all in a
copy of the checkout; a bad name, a taken number or a file that exists is refused with nothing
written."""
import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import papermill as pm
import pytest

import test_house
import test_layering
import test_notebooks
from workbench import plan
from workbench.cli import main
from workbench.notebooks import TEMPLATE_MARK, hygiene_problems, info_of, parameters
from workbench.template import module_name, new_paper, notebook, plan_entry

ROOT = Path(__file__).resolve().parents[1]
SLUG, MODULE = "20-demo-paper", "demo_paper"


def bare_checkout(root: Path) -> Path:
    """The least a checkout needs for `workbench new`: plan.py, the papers' index, notebooks/
    (and docs/findings.md, which a paper's page links)."""
    (root / "workbench").mkdir(parents=True)
    shutil.copy(ROOT / "workbench" / "plan.py", root / "workbench" / "plan.py")
    (root / "docs" / "papers").mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "papers" / "README.md", root / "docs" / "papers" / "README.md")
    (root / "docs" / "findings.md").write_text("# Findings\n")
    (root / "notebooks").mkdir()
    return root


def snapshot(root: Path) -> dict:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_new_paper_writes_each_part_and_registers_it(tmp_path, monkeypatch):
    root = bare_checkout(tmp_path)
    paths = new_paper(SLUG, root=root)
    assert [str(p.relative_to(root)) for p in paths] == [
        f"notebooks/{SLUG}.ipynb", f"workbench/methods/{MODULE}.py",
        f"workbench/experiments/{MODULE}.py", f"tests/test_{MODULE}.py",
        f"tests/test_experiments_{MODULE}.py", f"docs/papers/{SLUG}.md", "workbench/plan.py",
        "docs/papers/README.md"]
    monkeypatch.setattr(test_house, "ROOT", root)
    method = (root / "workbench/methods" / f"{MODULE}.py").read_text()
    assert f"``docs/papers/{SLUG}.md``" in method and "eq. (1)" in method
    for p in paths[:6]:                                        # the new files
        if p.suffix == ".py":
            ast.parse(p.read_text())
        assert test_house.dangling(p, p.read_text()) == []     # every page it cites exists
    # the page has a paper page's sections; the index lists it after 19, in order
    page = (root / "docs/papers" / f"{SLUG}.md").read_text()
    for head in ("## The paper", "## Claims and how the notebook measures them", "## Baselines",
                 "## Scales", "## Where this departs from the official code"):
        assert head in page
    rows = [line for line in (root / "docs/papers/README.md").read_text().splitlines()
            if line.startswith("| ") and line[2:4].isdigit()]
    assert rows[-1] == f"| 20 | [{SLUG}]({SLUG}.md) | Demo Paper | `methods/{MODULE}.py` |"
    # the cost model: registered in MODELS, and `workbench plan` reads it like any other
    # loaded as a module of its own (its dataclasses look their module up in sys.modules)
    spec = importlib.util.spec_from_file_location("plan_copy", root / "workbench/plan.py")
    copy = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "plan_copy", copy)
    spec.loader.exec_module(copy)
    ns = vars(copy)
    assert ns["MODELS"]["20"] is ns["c20"] and ns["MODELS"]["19"] is ns["c19"]
    monkeypatch.setitem(plan.MODELS, "20", ns["c20"])
    nb_path = paths[0]
    full, smoke = (plan.estimate(SLUG, nb_path, s) for s in ("full", "smoke"))
    assert 0 < full.seconds <= plan.BUDGET_S and full.flops > smoke.flops


def test_the_notebook_has_the_house_anatomy(tmp_path):
    root = bare_checkout(tmp_path)
    nb_path = new_paper(SLUG, title="A demo", root=root)[0]
    info = info_of(nb_path)
    nb = json.loads(nb_path.read_text())
    assert nb["cells"][0]["source"][0].startswith("# 20 · A demo") and info.claims == ["C1"]
    # the only hygiene problems are the marks the author must rewrite
    problems = hygiene_problems(nb_path)
    assert problems and all(TEMPLATE_MARK in p for p in problems)
    assert {"scale", "seed", "device", "out_dir", "steps", "lr"} <= set(parameters(nb_path))
    opening = "".join(nb["cells"][3]["source"])
    assert f"from workbench.experiments import {MODULE} as lab\n" in opening
    assert f"from workbench.methods import {MODULE} as method\n" in opening
    assert len(opening.splitlines()) <= 10
    # what tests/test_notebooks.py and tests/test_house.py ask of every notebook
    test_notebooks.test_parameters_cell_is_literal_and_complete(info)
    test_notebooks.test_title_and_claims_listed(info)
    test_notebooks.test_opening_follows_the_template(info)
    cells = nb["cells"]
    assert test_house.long_cells(cells) == [] and test_house.misplaced_explorers(cells) == []
    assert any("$$" in "".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    md, code = test_house.what_we_saw(cells)
    assert md and [n for m in md for n in test_house.TYPED.findall(m)] == []
    assert any(f'results.show("{SLUG}")' in "".join(c["source"]) for c in code)
    assert test_layering.private_reaches([nb_path]) == []


def test_the_modules_keep_the_layering(tmp_path, monkeypatch):
    root = bare_checkout(tmp_path)
    new_paper(SLUG, root=root)
    monkeypatch.setattr(test_layering, "PKG", root / "workbench")
    edges = test_layering.import_graph()
    assert edges[f"workbench.experiments.{MODULE}"] == {f"workbench.methods.{MODULE}"}
    assert test_layering.cycles(edges) == [] and test_layering.floor_violations(edges) == []
    test_layering.test_shared_parts_never_import_a_method()
    test_layering.test_nothing_but_an_experiment_imports_an_experiment()


def test_a_dry_run_lists_what_a_run_writes_and_writes_nothing(tmp_path):
    root = bare_checkout(tmp_path)
    before = snapshot(root)
    listed = new_paper(SLUG, root=root, dry_run=True)
    assert snapshot(root) == before
    assert new_paper(SLUG, root=root) == listed


@pytest.mark.parametrize("name, module, match", [
    ("Demo Paper", None, "NN-slug"), ("2-x", None, "NN-slug"), ("20_demo", None, "NN-slug"),
    ("20-3d-paper", None, "pass --module NAME"), ("20-demo", "Demo", "not a module name"),
    ("20-demo", "class", "not a module name"),
    ("07-other", None, r"07 is taken by notebooks/07-x.ipynb.*e\.g\. 08-other"),
    ("21-other", None, "21 is taken: docs/papers/README.md"),
    ("22-other", None, "22 is taken: workbench/plan.py's MODELS"),
    ("23-clash", None, "tests/test_clash.py exists; nothing was written"),
])
def test_refused_with_a_way_out_and_nothing_written(tmp_path, name, module, match):
    root = bare_checkout(tmp_path)
    (root / "notebooks" / "07-x.ipynb").write_text("{}")
    index = root / "docs/papers/README.md"
    index.write_text(index.read_text().replace("| 19 |", "| 21 | x |\n| 19 |"))
    plan_py = root / "workbench/plan.py"
    plan_py.write_text(plan_py.read_text().replace('"19": c19}', '"19": c19, "22": c19}'))
    (root / "tests").mkdir()
    (root / "tests" / "test_clash.py").write_text("")
    before = snapshot(root)
    with pytest.raises((ValueError, FileExistsError), match=match):
        new_paper(name, module=module, root=root)
    assert snapshot(root) == before


def test_the_module_name_comes_from_the_slug():
    assert module_name("20-demo-paper") == "demo_paper"
    assert module_name("09-hadamard-representation", "hadamard") == "hadamard"


def test_plan_entry_appends_to_models_and_keeps_lines_short():
    src = ('def c01(p, S):\n    return []\n\n\n# the cost models\nMODELS = {"01": c01, '
           '"02": c01}\nZOO = 1\n')
    out = plan_entry(src, "03", "03-x")
    assert out.index("def c03(p, S):") < out.index("# the cost models") < out.index("MODELS")
    assert '"02": c01, "03": c03}\nZOO = 1\n' in out
    ns = {"_mlp": lambda *a: list(a)}
    exec(out, ns)
    assert ns["MODELS"]["03"]({}, {"dim": 4, "steps": 10}) == [[4, 10, 10,
                                                               "gradient descent (placeholder)"]]
    full = "MODELS = {" + ", ".join(f'"{i:02d}": c01' for i in range(1, 9)) + "}\n"   # 97 wide
    wrapped = plan_entry("def c01(p, S):\n    return []\n\n\n" + full, "09", "09-x")
    assert max(len(line) for line in wrapped.splitlines()) <= 100
    assert wrapped.endswith('"08": c01,\n          "09": c09}\n')
    assert plan_entry("MODELS = {}\n", "01", "01-x").endswith('MODELS = {"01": c01}\n')


def test_cli_new_dry_run_then_writes_then_refuses(monkeypatch, tmp_path, capsys):
    root = bare_checkout(tmp_path)
    monkeypatch.setenv("WORKBENCH_HOME", str(root))
    before = snapshot(root)
    assert main(["new", SLUG, "--module", "demo", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would write" in out and "workbench/methods/demo.py" in out and snapshot(root) == before
    assert main(["new", SLUG, "--module", "demo"]) == 0
    out = capsys.readouterr().out
    assert (root / "workbench/experiments/demo.py").exists() and "TODO(template)" in out
    assert "tests/test_demo.py tests/test_experiments_demo.py" in out
    assert main(["new", SLUG, "--module", "demo"]) == 2
    assert "exist" in capsys.readouterr().err


def test_hygiene_sees_repeated_cell_ids(tmp_path):
    path = tmp_path / "97-ids.ipynb"
    nbformat.write(notebook("97-ids", "ids", "Ids"), str(path))
    assert not any("ids repeat" in p for p in hygiene_problems(path))
    nb = json.loads(path.read_text())
    nb["cells"][1]["id"] = nb["cells"][0]["id"]
    path.write_text(json.dumps(nb))
    assert any("ids repeat" in p for p in hygiene_problems(path))


def checkout_copy(root: Path) -> Path:
    """A copy of the checkout that `workbench new` and the house tests can work in: the package,
    the notebooks, the papers' pages, the root conftest and pyproject, and the house tests."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "workbench", root / "workbench", ignore=ignore)
    (root / "notebooks").mkdir(parents=True)
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        shutil.copy(nb, root / "notebooks" / nb.name)
    shutil.copytree(ROOT / "docs" / "papers", root / "docs" / "papers")
    for name in ("conftest.py", "pyproject.toml"):
        shutil.copy(ROOT / name, root / name)
    (root / "tests").mkdir()
    for name in ("conftest.py", "test_layering.py", "test_house.py", "test_plan.py",
                 "test_notebooks.py"):
        shutil.copy(ROOT / "tests" / name, root / "tests" / name)
    return root


@pytest.mark.slow
def test_a_new_paper_passes_its_tests_and_runs_end_to_end(tmp_path, monkeypatch):
    root = checkout_copy(tmp_path / "checkout")
    monkeypatch.setenv("WORKBENCH_HOME", str(root))
    assert main(["new", SLUG]) == 0
    # the copy's package, not the checkout's, is what the subprocess and the kernel import
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    where = subprocess.run([sys.executable, "-c", "import workbench; print(workbench.__file__)"],
                           cwd=root, capture_output=True, text=True, check=True).stdout
    assert Path(where.strip()).is_relative_to(root)
    # its own tests, and what the house and layering tests ask of it, in the copy
    select = ("demo_paper or layering or every_notebook_has or "
              f"({SLUG} and not recorded_results and not hygiene)")
    tests = [f"tests/test_{MODULE}.py", f"tests/test_experiments_{MODULE}.py",
             "tests/test_layering.py", "tests/test_house.py", "tests/test_plan.py",
             "tests/test_notebooks.py"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                          "-k", select, *tests], cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
    # the notebook, at smoke, to its verdicts, its explorer and its "What we saw"
    out = tmp_path / "run"
    executed = tmp_path / "out.ipynb"
    pm.execute_notebook(str(root / "notebooks" / f"{SLUG}.ipynb"), str(executed),
                        kernel_name="python3", parameters={"out_dir": str(out)},
                        cwd=str(root / "notebooks"), progress_bar=False)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["sizes"]["steps"] == 200
    (claim,) = metrics["claims"]
    assert claim["id"] == "C1" and claim["holds"] is True
    cells = json.loads(executed.read_text())["cells"]
    (finish,) = [c for c in cells if "run.finish()" in "".join(c["source"])]
    assert "text/html" in finish["outputs"][-1]["data"]             # the verdict table
    (explorer,) = [c for c in cells if "explore" in c["metadata"].get("tags", [])]
    assert "Explorer, drawn at its default (lr=0.1)" in "".join(explorer["outputs"][0]["text"])
    assert any("image/png" in o.get("data", {}) for o in explorer["outputs"])
    (shown,) = [c for c in cells if "results" in c["metadata"].get("tags", [])]
    assert f"No recorded runs of {SLUG}" in "".join(shown["outputs"][0]["data"]["text/markdown"])
