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


def test_a_sizes_row_may_name_another_scale():
    from workbench.notebooks import resolve_sizes
    table = {"smoke": {"n": 1}, "mid": "smoke", "full": {"n": 9}}
    assert resolve_sizes(table) == {"smoke": {"n": 1}, "mid": {"n": 1}, "full": {"n": 9}}
    with pytest.raises(KeyError, match="not a row of sizes"):
        resolve_sizes({"smoke": {"n": 1}, "mid": "tiny"})
    with pytest.raises(KeyError, match="not a row of sizes"):
        resolve_sizes({"smoke": "mid", "mid": "smoke"})
    like = {"smoke": {"n": 1, "m": 2}, "mid": {"like": "smoke", "m": 5}}
    assert resolve_sizes(like)["mid"] == {"n": 1, "m": 5}
    with pytest.raises(KeyError, match="not a row of sizes"):
        resolve_sizes({"smoke": {"like": "mid"}, "mid": {"like": "smoke"}})


@pytest.mark.parametrize("info", discover(), ids=lambda i: i.slug)
def test_every_notebook_has_a_mid_row_that_says_why(info):
    """`--scale mid` runs every notebook: its SIZES has a mid row (sizes, or the name of the
    row it runs), with a comment above it saying why, and the scale parameter allows it."""
    from workbench.notebooks import parameters, sizes_table
    assert "mid" in sizes_table(info.path)
    assert parameters(info.path)["scale"]["limit"].allows("mid")
    nb = json.loads(info.path.read_text())
    src = next("".join(c["source"]) for c in nb["cells"] if "SIZES = " in "".join(c["source"]))
    lines = src.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith('"mid"'))
    above = []
    while at > 0 and lines[at - 1].lstrip().startswith("#"):
        at -= 1
        above.insert(0, lines[at].strip())
    assert above and above[0].startswith("# mid"), f"{info.slug}: say why above the mid row"
