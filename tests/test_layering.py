"""The house: dependencies inside ``workbench/`` point one way (docs/design.md)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import workbench

PKG = Path(workbench.__file__).parent


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (module-level and function-level alike)."""
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = ("workbench",) + p.relative_to(PKG).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    edges = {m: set() for m in mods}
    for m, p in mods.items():
        anchor = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            edges[m] |= {t for t in targets if t in mods and t != m and not m.startswith(t + ".")}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other, directly or around a loop."""
    reach = {m: set() for m in edges}
    for m in edges:
        todo = list(edges[m])
        while todo:
            t = todo.pop()
            if t not in reach[m]:
                reach[m].add(t)
                todo.extend(edges[t])
    found = {frozenset([m] + [t for t in reach[m] if m in reach[t]]) for m in edges if m in reach[m]}
    return sorted(sorted(c) for c in found)


def test_the_graph_finds_a_cycle_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    edges = import_graph()
    assert "workbench.env" in edges["workbench.runtime"]       # the graph sees real edges
    assert cycles(edges) == []


def test_shared_parts_never_import_a_method():
    for m, targets in import_graph().items():
        if not m.startswith(("workbench.methods", "workbench.experiments", "workbench.template")):
            assert not any(t.startswith("workbench.methods") for t in targets), m


def test_nothing_but_an_experiment_imports_an_experiment():
    for m, targets in import_graph().items():
        if not m.startswith("workbench.experiments"):
            assert not any(t.startswith("workbench.experiments") for t in targets), m


# The floors of the house, ground first. A module imports from its own floor or a lower one,
# never from a floor above. A module is on the floor of its package or of its own name ("data"
# holds every workbench.data module; "__init__" is the package itself); every module must be on
# one, so a new module is placed on purpose.
FLOORS = [
    # what every floor may use: where it runs, seeds and devices, the device audit, the cache,
    # progress, plots, costs, diagnostics, statistics over seeds, the notebook files, the sweep
    # and explorer harnesses
    ("ground", ("env", "device", "placement", "cache", "progress", "plots", "costs",
                "diagnostics", "stats", "notebooks", "sweep", "explore")),
    ("data", ("data",)),                    # task generators, corpus, shipped data sets
    ("quant", ("quant",)),                  # quantization primitives and GGUF files
    ("evaluate", ("evaluate",)),            # LM evaluation shared by the zoo and the papers
    ("models", ("models",)),                # backbones, zoo recipes and training, adapters
    ("methods", ("methods", "rl")),         # one method per paper; the RL agents
    ("experiments", ("experiments",)),      # one harness per paper
    # what drives the notebooks: the run, the runner, reports, the book, the CLI
    ("top", ("runtime", "plan", "results", "batch", "cluster", "report", "report_html", "book",
             "template", "cards", "compare", "cli", "__init__")),
]


def floor_of(module: str, floors=FLOORS) -> int:
    """The floor (0 = ground) of ``workbench.x.y``: the floor that names ``x.y`` or ``x``."""
    name = module.removeprefix("workbench").lstrip(".") or "__init__"
    for level, (_, parts) in enumerate(floors):
        if any(name == p or name.startswith(p + ".") for p in parts):
            return level
    raise LookupError(f"{module} is on no floor: add it to FLOORS in tests/test_layering.py")


def floor_violations(edges: dict[str, set[str]], floors=FLOORS) -> list[str]:
    """Every import that reaches up: ``"a (floor) imports b (higher floor)"``."""
    names = [name for name, _ in floors]
    found = []
    for m, targets in sorted(edges.items()):
        for t in sorted(targets):
            if floor_of(t, floors) > floor_of(m, floors):
                found.append(f"{m} ({names[floor_of(m, floors)]}) imports "
                             f"{t} ({names[floor_of(t, floors)]})")
    return found


def test_the_floor_check_finds_an_import_that_reaches_up():
    floors = [("ground", ("env",)), ("models", ("models",)), ("top", ("runtime", "__init__"))]
    edges = {"workbench.models.zoo": {"workbench.runtime", "workbench.env"},
             "workbench.runtime": {"workbench.models.zoo", "workbench.env"},
             "workbench": {"workbench.runtime"}, "workbench.env": set()}
    assert floor_violations(edges, floors) == [
        "workbench.models.zoo (models) imports workbench.runtime (top)"]
    assert floor_violations({"workbench.env": {"workbench.models"}}, floors) == [
        "workbench.env (ground) imports workbench.models (models)"]
    with pytest.raises(LookupError, match="workbench.nowhere"):
        floor_of("workbench.nowhere", floors)


def test_every_module_is_on_a_floor():
    for m in import_graph():
        floor_of(m)


def test_no_module_imports_from_a_floor_above_its_own():
    edges = import_graph()
    assert "workbench.device" in edges["workbench.models.training"]   # fast math is below models
    assert floor_violations(edges) == []


def test_the_cli_starts_without_torch():
    code = "import sys, workbench.cli, workbench.batch, workbench.report; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def private_reaches(paths) -> list[str]:
    """``module._name`` uses of a workbench module's private name from outside that module."""
    import re
    names = {p.stem for p in PKG.rglob("*.py") if p.stem != "__init__"}
    pat = re.compile(r"\b(" + "|".join(sorted(names)) + r")\._[a-z]\w*")
    found = []
    for p in paths:
        for m in pat.finditer(Path(p).read_text()):
            if Path(p).stem != m.group(1):
                found.append(f"{p}: {m.group(0)}")
    return found


def test_private_reach_finder_finds_one(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("zoo._recipe('lm-base')\nzoo.recipe('lm-base')\n")
    assert private_reaches([f]) == [f"{f}: zoo._recipe"]


def test_nothing_reaches_another_modules_private_names():
    root = PKG.parent
    files = list(PKG.rglob("*.py")) + list((root / "notebooks").glob("*.ipynb"))
    assert private_reaches(files) == []
