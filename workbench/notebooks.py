"""The notebooks on disk: discovery, their title and claims, their parameters, and hygiene.

No torch here: the CLI imports this module and must start fast.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .env import project_root

NAME_RE = re.compile(r"^(\d\d)-([a-z0-9-]+)\.ipynb$")
CLAIM_RE = re.compile(r"\*\*(C\d+)\*\*|^\s*[-*]\s*(C\d+)\b", re.M)
TEMPLATE_MARK = "TODO(template)"   # what `workbench new` leaves for the author to rewrite
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


@dataclass
class NotebookInfo:
    number: str
    slug: str          # "12-nfi": the notebook's name without .ipynb
    path: Path
    title: str
    claims: list[str] = field(default_factory=list)


def notebooks_dir() -> Path:
    return project_root() / "notebooks"


def discover(directory: Path | None = None) -> list[NotebookInfo]:
    """Every ``NN-slug.ipynb`` in ``notebooks/``, sorted by number."""
    out = []
    for path in sorted((directory or notebooks_dir()).glob("*.ipynb")):
        m = NAME_RE.match(path.name)
        if not m:
            continue
        nb = json.loads(path.read_text())
        title, claims = path.stem, []
        for cell in nb.get("cells", []):
            if cell.get("cell_type") != "markdown":
                continue
            src = "".join(cell.get("source", ""))
            if title == path.stem:
                head = re.search(r"^#\s+(.+)$", src, re.M)
                if head:
                    title = re.sub(r"^\d+\s*[·.:-]\s*", "", head.group(1).strip())  # "12 · X"
            for a, b in CLAIM_RE.findall(src):
                cid = a or b
                if cid not in claims:
                    claims.append(cid)
            if claims:
                break          # claims are listed in the summary cell; later cells restate them
        out.append(NotebookInfo(m.group(1), path.stem, path, title, claims))
    return out


def resolve(name: str, directory: Path | None = None) -> NotebookInfo:
    """Find a notebook by slug ("12-nfi"), number ("12") or path; a clear error otherwise."""
    p = Path(name)
    if p.suffix == ".ipynb" and p.exists():
        m = NAME_RE.match(p.name)
        return NotebookInfo(m.group(1) if m else "", p.stem, p.resolve(), p.stem)
    known = discover(directory)
    for info in known:
        if name in (info.slug, info.number, info.slug.split("-", 1)[1]):
            return info
    choices = ", ".join(i.slug for i in known) or "(none found)"
    raise LookupError(f"no notebook named {name!r}; known notebooks: {choices}")


def parameters(path: Path) -> dict[str, dict]:
    """The parameters cell as papermill's inspection reads it: name -> {type, default, help}."""
    import papermill as pm
    params = pm.inspect_notebook(str(path))
    return {name: {"type": p["inferred_type_name"], "default": p["default"], "help": p["help"]}
            for name, p in params.items()}


def clean(path: Path) -> bool:
    """Strip outputs, execution counts and volatile metadata; keep cell ids and tags; normalise
    the kernel spec. Returns True when the file changed."""
    raw = path.read_text()
    nb = json.loads(raw)
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        meta = cell.get("metadata", {})
        cell["metadata"] = {k: v for k, v in meta.items() if k in ("tags", "jupyter", "editable")}
    nb["metadata"] = {"kernelspec": dict(KERNELSPEC),
                      "language_info": {"name": "python"}}
    new = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    if new != raw:
        path.write_text(new)
        return True
    return False


def hygiene_problems(path: Path) -> list[str]:
    """What breaks the notebook conventions of STYLE.md (empty list when none)."""
    problems = []
    nb = json.loads(path.read_text())
    cells = nb.get("cells", [])
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        problems.append(f"{len(tagged)} cells tagged 'parameters' (want exactly 1)")
    for i, c in enumerate(cells):
        if c.get("cell_type") == "code" and (c.get("outputs") or c.get("execution_count")):
            problems.append(f"cell {i} has stored outputs or an execution count")
        if "id" not in c:
            problems.append(f"cell {i} has no id")
    ids = [c["id"] for c in cells if "id" in c]
    if len(set(ids)) != len(ids):
        # nbformat "corrects" a repeated id with a fresh random one on every read, so a
        # notebook with one changes each time it is opened and saved
        problems.append("cell ids repeat: give each cell its own id")
    ks = nb.get("metadata", {}).get("kernelspec", {})
    if ks.get("name") != "python3" or ks.get("display_name") != KERNELSPEC["display_name"]:
        problems.append(f"kernel spec is {ks!r}, want name 'python3' / 'Python 3 (ipykernel)'")
    if not NAME_RE.match(path.name):
        problems.append("name is not NN-slug.ipynb (lowercase, no spaces)")
    for i, c in enumerate(cells):
        if TEMPLATE_MARK in "".join(c.get("source", "")):
            problems.append(f"cell {i} still has a {TEMPLATE_MARK} to rewrite")
    finish = [c for c in cells if c.get("cell_type") == "code"
              and "run.finish()" in "".join(c.get("source", ""))]
    if finish and "".join(finish[-1]["source"]).rstrip().splitlines()[-1] != "run.finish()":
        problems.append("run.finish() is not the last line of its cell: end the cell with it "
                        "so the verdict table is shown (never assign or print its result)")
    return problems
