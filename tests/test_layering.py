"""The house: dependencies inside ``workbench/`` point one way (DESIGN.md)."""
import ast
import subprocess
import sys
from pathlib import Path

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
