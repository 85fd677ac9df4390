"""The house rules for every notebook: short cells, no harness defined in a
notebook, the paper's equations displayed, and a "What we saw" rendered from recorded runs
(notebooks/results/<slug>.json, current with the notebook's code and the zoo), never typed."""
import ast
import json
import re

import pytest

from workbench import results
from workbench.notebooks import discover

NOTEBOOKS = discover()
MAX_CELL, MAX_DEF = 30, 10


def cells(info):
    return json.loads(info.path.read_text())["cells"]


def source(c) -> str:
    return "".join(c["source"])


def long_cells(nb_cells) -> list[str]:
    out = []
    for i, c in enumerate(nb_cells):
        if c["cell_type"] != "code":
            continue
        src = source(c)
        n = sum(1 for line in src.splitlines() if line.strip())
        if n > MAX_CELL:
            out.append(f"cell {i}: {n} lines (at most {MAX_CELL}: move the harness to experiments/)")
        code = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ln = node.end_lineno - node.lineno + 1
                if ln > MAX_DEF:
                    out.append(f"cell {i}: {node.name} is {ln} lines (a notebook defines only "
                               f"short helpers it shows on purpose, at most {MAX_DEF})")
    return out


def what_we_saw(nb_cells) -> tuple[list[str], list[dict]]:
    """The markdown of the "What we saw" section and its code cells (up to the next heading)."""
    md, code, inside = [], [], False
    for c in nb_cells:
        src = source(c)
        if c["cell_type"] == "markdown" and re.match(r"#+ ", src.lstrip()):
            head = src.lstrip().splitlines()[0]
            if inside and not head.lower().lstrip("# ").startswith("what we saw"):
                break
            inside = inside or "what we saw" in head.lower()
        if inside:
            (md.append(src) if c["cell_type"] == "markdown" else code.append(c))
    return md, code


RECORDING = re.compile(r"\brun\.(record|claim|savefig|finish|log)\b")


def misplaced_explorers(nb_cells) -> list[str]:
    """Explorer cells (tagged ``explore``, left out of the record's key) must come after the
    cell that calls ``run.finish()`` and record nothing, so they cannot move a recorded number."""
    finish = max((i for i, c in enumerate(nb_cells) if c["cell_type"] == "code"
                  and "run.finish()" in source(c)), default=None)
    out = []
    for i, c in enumerate(nb_cells):
        if "explore" not in c.get("metadata", {}).get("tags", []):
            continue
        if finish is None or i < finish:
            out.append(f"cell {i}: an explorer before run.finish() (move it after the verdicts)")
        if RECORDING.search(source(c)):
            out.append(f"cell {i}: an explorer that records ({RECORDING.search(source(c))[0]})")
    return out


TYPED = re.compile(r"(?<![\w.$\\{])[-+]?\d+\.\d+(?![\w}])|\d+\s?%")


MAX_POSITIONAL = 6       # more than this and a call passes a sizes/settings object or keywords


def convention_breaks(nb_cells) -> list[str]:
    """Where a notebook leaves the house convention: its harness imported as anything but
    ``lab`` and its paper's method module as anything but ``method`` (another method module,
    such as a paper's baselines, under a name of its own), and calls with more than
    ``MAX_POSITIONAL`` positional arguments."""
    out = []
    for i, c in enumerate(nb_cells):
        if c["cell_type"] != "code":
            continue
        code = "\n".join(line for line in source(c).splitlines()
                         if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and node.module in ("workbench.experiments",
                                                                      "workbench.methods"):
                harness = node.module == "workbench.experiments"
                for a in node.names:
                    if harness and a.asname != "lab":
                        out.append(f"cell {i}: import {a.name} as lab, not {a.asname}")
                    elif not harness and a.asname in ("lab", None):
                        out.append(f"cell {i}: method module {a.name} under {a.asname!r}")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                mod = getattr(node, "module", None) or node.names[0].name
                if mod.startswith(("workbench.experiments.", "workbench.methods.")):
                    out.append(f"cell {i}: import {mod} as `from workbench.<floor> import <name> "
                               f"as lab|method`")
            elif isinstance(node, ast.Call) and len(node.args) > MAX_POSITIONAL:
                out.append(f"cell {i}: {ast.unparse(node.func)} takes {len(node.args)} "
                           f"positional arguments (pass a settings object or keywords)")
    return out


def test_the_checks_catch_what_they_look_for():
    bad = [{"cell_type": "code", "source": ["x = 1\n"] * 31},
           {"cell_type": "code", "source": ["def f():\n"] + ["    y = 1\n"] * 10}]
    assert len(long_cells(bad)) == 2
    saw = [{"cell_type": "markdown", "source": ["## What we saw\n", "C1 holds at 0.53.\n"]},
           {"cell_type": "code", "source": ["results.show('x')\n"], "metadata": {}},
           {"cell_type": "markdown", "source": ["## Exercises\n", "Try lr 0.5.\n"]}]
    md, code = what_we_saw(saw)
    assert len(md) == 1 and len(code) == 1 and TYPED.findall(md[0]) == ["0.53"]
    tagged = {"cell_type": "code", "metadata": {"tags": ["explore"]}}
    early = [{**tagged, "source": ["explore.explore(draw, bits=[2, 3])\n"]},
             {"cell_type": "code", "metadata": {}, "source": ["run.finish()\n"]},
             {**tagged, "source": ["run.record(x=1)\n"]}]
    assert len(misplaced_explorers(early)) == 2 and misplaced_explorers(early[1:2]) == []
    imports = [{"cell_type": "code", "source": [
        "from workbench.experiments import nfi as X\n", "from workbench.methods import nfi\n",
        "import workbench.methods.nfi as m\n", "f(1, 2, 3, 4, 5, 6, 7)\n"]}]
    assert len(convention_breaks(imports)) == 4
    good = [{"cell_type": "code", "source": [
        "from workbench.experiments import nfi as lab\n", "from workbench.methods import nfi as method\n",
        "from workbench.methods import mf_router as router\n", "f(1, 2, 3, 4, 5, 6, k=7)\n"]}]
    assert convention_breaks(good) == []


@pytest.mark.parametrize("info", NOTEBOOKS, ids=lambda i: i.slug)
def test_cells_are_short_and_define_no_harness(info):
    assert long_cells(cells(info)) == []


@pytest.mark.parametrize("info", NOTEBOOKS, ids=lambda i: i.slug)
def test_one_import_convention_and_no_long_positional_calls(info):
    assert convention_breaks(cells(info)) == []


@pytest.mark.parametrize("info", NOTEBOOKS, ids=lambda i: i.slug)
def test_the_method_section_displays_an_equation(info):
    assert any("$$" in source(c) for c in cells(info) if c["cell_type"] == "markdown"), \
        "no display equation ($$...$$): write the paper's key equations in the method section"


@pytest.mark.parametrize("info", NOTEBOOKS, ids=lambda i: i.slug)
def test_what_we_saw_is_rendered_from_recorded_runs(info):
    md, code = what_we_saw(cells(info))
    assert md, "no 'What we saw' section"
    shown = [c for c in code if "results" in c.get("metadata", {}).get("tags", [])
             and f'results.show("{info.slug}")' in source(c)]
    assert shown, f'a code cell tagged "results" must call results.show("{info.slug}")'
    typed = [n for m in md for n in TYPED.findall(m)]
    assert typed == [], f"numbers typed into What we saw (render them with results.say): {typed}"


@pytest.mark.parametrize("info", NOTEBOOKS, ids=lambda i: i.slug)
def test_explorers_come_after_the_verdicts_and_record_nothing(info):
    assert misplaced_explorers(cells(info)) == []


@pytest.mark.parametrize("scale", results.SCALES)
@pytest.mark.parametrize("info", NOTEBOOKS, ids=lambda i: i.slug)
def test_recorded_results_are_current(info, scale):
    if scale != "smoke" and results.load(info.slug, scale) is None:
        pytest.skip(f"{info.slug} has no {scale} record yet")
    why = results.stale(info.slug, scale)
    knob = "" if scale == "smoke" else f" --scale {scale}"
    assert why == [], (f"{info.slug} ({scale}): {'; '.join(why)}. Record again: workbench run "
                       f"{info.slug}{knob} --seeds 0,1,2 --jobs 1 --out runs/rec && "
                       f"workbench record runs/rec")


@pytest.mark.parametrize("info", NOTEBOOKS, ids=lambda i: i.slug)
def test_a_robust_claim_holds_at_mid_too(info):
    """CI runs smoke with strict robust claims; mid is recorded, not run in CI, so its record
    is where a robust claim must be seen to hold on every seed."""
    d = results.load(info.slug, "mid")
    if d is None:
        pytest.skip(f"{info.slug} has no mid record yet")
    failing = [f"{cid} (seeds {[s for s, h in zip(d['seeds'], c['holds']) if not h]})"
               for cid, c in d["claims"].items() if c["robust"] and not all(c["holds"])]
    assert failing == [], f"{info.slug}: robust claims that do not hold at mid: {failing}"


# -- every page the code and the docs cite is in the repository ------------------------------

from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"(?<![\w./-])((?:\.\./)*(?:docs|papers)/[\w./-]*\.md)")   # docs/x.md, papers/x.md
LINK = re.compile(r"\]\(([^)\s#:]+\.md)(?:#[^)]*)?\)")                        # [text](x.md#anchor)
OUTSIDE = re.compile(r"\b(?:DESIGN|STYLE|ZOO|REFERENCES)\.md\b|\.\./shared[/\\]")


def dangling(path: Path, text: str) -> list[str]:
    """Cited ``docs/...md`` / ``papers/...md`` paths (and, in Markdown, linked ``.md`` pages)
    that exist neither from the repository root nor beside ``path``; template placeholders
    (``NN-slug``, ``{slug}``) are patterns, not pages. Plus any citation of a file a clone does
    not have (the specs that lived outside the repository)."""
    refs = set(CITED.findall(text)) | (set(LINK.findall(text)) if path.suffix == ".md" else set())
    out = [r for r in sorted(refs) if "NN-" not in r and "{" not in r
           and not (ROOT / r).exists() and not (path.parent / r).exists()]
    return out + [m for m in OUTSIDE.findall(text)]


def test_the_reference_check_catches_what_it_looks_for(tmp_path):
    doc = tmp_path / "x.md"
    assert dangling(doc, "see docs/design.md and [notes](nowhere.md), or `papers/99-none.md`") == \
        ["nowhere.md", "papers/99-none.md"]
    assert dangling(tmp_path / "x.py", "a page `docs/papers/NN-slug.md`, see ZOO" + ".md") == ["ZOO.md"]


def test_every_cited_page_exists():
    files = [*ROOT.joinpath("workbench").rglob("*.py"), *ROOT.joinpath("tests").glob("*.py"),
             *ROOT.joinpath("benchmarks").glob("*.py"), *ROOT.joinpath("docs").rglob("*.md")]
    files = [f for f in files if f != Path(__file__).resolve()]   # its own examples are made up
    missing = {str(f.relative_to(ROOT)): d for f in files if (d := dangling(f, f.read_text()))}
    assert missing == {}, f"citations of pages the repository does not have: {missing}"


def test_every_notebook_has_its_paper_page():
    index = (ROOT / "docs/papers/README.md").read_text()
    for info in NOTEBOOKS:
        assert (ROOT / f"docs/papers/{info.slug}.md").exists(), f"no docs/papers/{info.slug}.md"
        assert f"({info.slug}.md)" in index, f"docs/papers/README.md does not link {info.slug}.md"
