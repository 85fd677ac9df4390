"""Notebook hygiene (docs/design.md): no outputs, one literal parameters cell, python3 kernel spec.
Executing them is nbval's job (`pytest notebooks --nbval-lax`, see the README)."""
import ast
import json

import pytest

from workbench.notebooks import discover, hygiene_problems, parameters

NOTEBOOKS = discover()
REQUIRED = ("scale", "seed", "device", "out_dir")


def test_there_are_notebooks():
    assert any(i.slug == "12-nfi" for i in NOTEBOOKS)


@pytest.mark.parametrize("info", NOTEBOOKS, ids=lambda i: i.slug)
def test_hygiene(info):
    assert hygiene_problems(info.path) == []


@pytest.mark.parametrize("info", NOTEBOOKS, ids=lambda i: i.slug)
def test_parameters_cell_is_literal_and_complete(info):
    nb = json.loads(info.path.read_text())
    (cell,) = [c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", [])]
    names = []
    for stmt in ast.parse("".join(cell["source"])).body:
        assert isinstance(stmt, (ast.AnnAssign, ast.Assign)), ast.dump(stmt)
        ast.literal_eval(stmt.value)          # literals only: nothing derived here
        names.append(stmt.target.id if isinstance(stmt, ast.AnnAssign) else stmt.targets[0].id)
    spec = parameters(info.path)
    # papermill's parser silently drops a line it cannot read (an `=` in a help comment,
    # an `int | None` annotation): every assignment must survive its inspection
    assert sorted(spec) == sorted(names)
    assert all(name in spec for name in REQUIRED)
    assert spec["scale"]["default"] == '"smoke"' and spec["seed"]["type"] == "int"


@pytest.mark.parametrize("info", NOTEBOOKS, ids=lambda i: i.slug)
def test_title_and_claims_listed(info):
    assert info.title != info.slug and info.claims and info.claims[0] == "C1"
    nb = json.loads(info.path.read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "run.finish()" in code and "workbench.show(" in code
    for cid in info.claims:
        assert f'"{cid}"' in code or f"'{cid}'" in code, f"{cid} is listed but never claimed"


@pytest.mark.parametrize("info", NOTEBOOKS, ids=lambda i: i.slug)
def test_opening_follows_the_template(info):
    """The opening is short: start() reads the parameters cell, run.sizes() checks the knobs."""
    nb = json.loads(info.path.read_text())
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    (opening,) = [c for c in cells if "workbench.start(" in c]
    assert f'workbench.start("{info.slug}", globals())' in opening
    assert "run.sizes(SIZES" in opening and len(opening.strip().splitlines()) <= 20
    assert "raise " not in opening           # checks live in start() / run.sizes(limits=...)
