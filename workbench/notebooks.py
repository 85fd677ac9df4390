"""The notebooks on disk: discovery, their title and claims, their parameters and SIZES table,
and hygiene.

No torch here: the CLI imports this module and must start fast. A ground-floor module: it
reads notebook files and imports only ``env``, so the run, the runner and ``workbench plan``,
all higher up, read the parameters cell through it.
"""
from __future__ import annotations

import ast
import io
import json
import math
import re
import tokenize
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


class NotebookError(ValueError):
    """A notebook file that cannot be read (truncated, not JSON, not a notebook)."""


def notebooks_dir() -> Path:
    return project_root() / "notebooks"


def read_notebook(path: Path) -> dict:
    """The notebook's JSON; :class:`NotebookError` naming the file when it is not a notebook."""
    path = Path(path)
    try:
        nb = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise NotebookError(f"{path}: not a readable notebook ({e.msg} at line {e.lineno}; "
                            "truncated or hand-edited?)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise NotebookError(f"{path}: cannot be read ({e})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise NotebookError(f"{path}: not a notebook (no list of cells)")
    return nb


def info_of(path: Path, nb: dict | None = None) -> NotebookInfo:
    """A notebook's number, slug, title (its first ``# heading``) and claim ids."""
    path = Path(path)
    nb = read_notebook(path) if nb is None else nb
    m = NAME_RE.match(path.name)
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
    return NotebookInfo(m.group(1) if m else "", path.stem, path, title, claims)


def discover(directory: Path | None = None,
             broken: list[tuple[Path, str]] | None = None) -> list[NotebookInfo]:
    """Every ``NN-slug.ipynb`` in ``notebooks/``, sorted by number. A file that cannot be read
    is skipped (one broken notebook must not hide the others) and appended to ``broken`` as
    ``(path, reason)`` when that list is given."""
    out = []
    for path in sorted((directory or notebooks_dir()).glob("*.ipynb")):
        if not NAME_RE.match(path.name):
            continue
        try:
            nb = read_notebook(path)
        except NotebookError as e:
            if broken is not None:
                broken.append((path, str(e)))
            continue
        out.append(info_of(path, nb))
    return out


def resolve(name: str, directory: Path | None = None) -> NotebookInfo:
    """Find a notebook by slug ("12-nfi"), number ("12") or path; a clear error otherwise."""
    p = Path(name)
    if p.suffix == ".ipynb" and p.exists():
        return info_of(p.resolve())     # a broken file is named now, not by a JSON error later
    broken: list[tuple[Path, str]] = []
    known = discover(directory, broken)
    for info in known:
        if name in (info.slug, info.number, info.slug.split("-", 1)[1]):
            return info
    for path, reason in broken:
        m = NAME_RE.match(path.name)
        if name in (path.stem, m.group(1), m.group(2)):
            raise NotebookError(reason)
    choices = ", ".join(i.slug for i in known) or "(none found)"
    raise LookupError(f"no notebook named {name!r}; known notebooks: {choices}")


@dataclass(frozen=True)
class Limit:
    """A parameter's declared limit: an interval (``[1..]``, ``(0..1]``) or choices
    (``{smoke|full}``), written at the end of its help comment in the parameters cell."""
    text: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] | None = None

    def allows(self, value) -> bool:
        if self.choices is not None:
            # a device choice "cuda" admits one GPU by number ("cuda:1"), as pick_device does
            text = str(value)
            return text in self.choices or (
                "cuda" in self.choices and re.fullmatch(r"cuda:\d+", text) is not None)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (isinstance(value, float) and math.isnan(value)):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        if self.high is not None and (value > self.high or
                                      (self.high_open and value == self.high)):
            return False
        return True

    def describe(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {_num(self.low)}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {_num(self.high)}")
        return " and ".join(parts) or "any number"


_INTERVAL_RE = re.compile(r"([\[(])\s*([^\[\]()]*?)\s*\.\.\s*([^\[\]()]*?)\s*([\])])\s*$")
_CHOICES_RE = re.compile(r"\{([^{}]*\|[^{}]*|[^{}|]+)\}\s*$")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def parse_limit(help_text: str) -> Limit | None:
    """The limit at the very end of a help comment, or None: ``[a..b]`` inclusive, ``(a..b)``
    exclusive (mixed as ``(0..1]``), an end left out is unbounded; ``{a|b|c}`` for choices."""
    text = (help_text or "").rstrip()
    m = _INTERVAL_RE.search(text)
    if m:
        opener, low, high, closer = m.groups()
        try:
            lo = float(low) if low else None
            hi = float(high) if high else None
        except ValueError:
            return None             # "(see 1..n)": prose, not a limit
        return Limit(m.group(0).strip(), lo, hi, opener == "(", closer == ")")
    m = _CHOICES_RE.search(text)
    if m:
        choices = tuple(c.strip() for c in m.group(1).split("|") if c.strip())
        if choices:
            return Limit(m.group(0).strip(), choices=choices)
    return None


#: The parameters every notebook's cell declares: they configure the run (``workbench.start``),
#: they are not the method's knobs. Each maps to the ``workbench run`` option that sets it;
#: ``device`` has none and is set like a knob (``-p device cuda``).
RESERVED = {"scale": "--scale", "seed": "--seeds", "device": None, "out_dir": "--out"}


class ParameterError(ValueError):
    """A parameter name or value the notebook's parameters cell does not accept (a ``-p`` value
    before any job starts, or a value a kernel was given)."""


def check_limit(slug: str, name: str, value, spec: dict, subject: str | None = None) -> None:
    """:class:`ParameterError` when ``value`` breaks the limit declared at the end of the
    parameter's help comment (``spec``: its entry of :func:`parameters`; None passes where the
    default is None). ``subject``: how the message names the value (default ``parameter 'NAME'
    = VALUE``). The one check of the runner's ``-p`` values and of the kernel's parameters."""
    limit = spec.get("limit")
    if limit is None or (value is None and spec.get("default") == "None"):
        return
    if value is None or not limit.allows(value):
        subject = subject or f"parameter '{name}' = {value!r}"
        about = spec.get("help", "").rstrip()
        about = about[: -len(limit.text)].rstrip() if about.endswith(limit.text) else about
        raise ParameterError(
            f"{slug}: {subject} is outside its limit {limit.text} ({limit.describe()})"
            + (f"; {name}: {about}" if about else ""))


def parameters_cell(nb: dict) -> str | None:
    """The source of the cell tagged ``parameters`` (None when there is none)."""
    for cell in nb.get("cells", []):
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            return "".join(cell.get("source", ""))
    return None


def parameters(path: Path) -> dict[str, dict]:
    """The parameters cell: name -> {type, default, help, limit}.

    ``type`` and ``default`` are source text as papermill's inspection gives them (``"int"``,
    ``'"smoke"'``; ``"None"`` for an unannotated name); ``limit`` is the :class:`Limit` at the end
    of the help comment, or None. Read with :mod:`ast` (no papermill import: 1.4 s), so the
    runner checks every job before any starts. :class:`NotebookError` names a file that does not
    read or whose parameters cell does not parse."""
    path = Path(path)
    src = parameters_cell(read_notebook(path))
    if src is None:
        return {}
    try:
        tree = ast.parse(src)
    except SyntaxError as e:
        raise NotebookError(f"{path}: its parameters cell does not parse (line {e.lineno}: "
                            f"{e.msg})") from None
    comments: dict[int, str] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string.lstrip("#").strip()
    except (tokenize.TokenError, SyntaxError):
        pass
    out = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name, kind = node.target.id, ast.unparse(node.annotation)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name):
            name, kind = node.targets[0].id, "None"
        else:
            continue
        default = ast.get_source_segment(src, node.value) if node.value is not None else "None"
        help_text = comments.get(node.end_lineno) or comments.get(node.lineno) or ""
        out[name] = {"type": kind, "default": default, "help": help_text,
                     "limit": parse_limit(help_text)}
    return out


def resolve_sizes(table: dict) -> dict:
    """``SIZES`` with every row written as another scale's name (``"mid": "smoke"``: mid runs
    exactly the smoke sizes) replaced by that row, and every row written as another plus changes
    (``"mid": {"like": "smoke", "steps": 1000}``) by that row with the changes. A row naming a
    scale the table lacks, or another such row, is an error."""
    def base(scale, name):
        target = table.get(name)
        if not isinstance(target, dict) or "like" in target:
            rows = sorted(k for k, v in table.items() if isinstance(v, dict) and "like" not in v)
            raise KeyError(f"SIZES row {scale!r} names {name!r}, which is not a row of sizes; "
                           f"rows: {rows}")
        return target
    out = {}
    for scale, row in table.items():
        if isinstance(row, str):
            row = base(scale, row)
        elif isinstance(row, dict) and "like" in row:
            row = {**base(scale, row["like"]), **{k: v for k, v in row.items() if k != "like"}}
        out[scale] = row
    return out


def sizes_table(path: Path) -> dict:
    """The notebook's ``SIZES`` literal (the cell that assigns it; literals and ``dict()`` only),
    with rows that name another scale resolved (:func:`resolve_sizes`)."""
    nb = json.loads(Path(path).read_text())
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and "SIZES = " in src:
            tree = ast.parse(src)
            for stmt in tree.body:
                if isinstance(stmt, ast.Assign) and getattr(stmt.targets[0], "id", "") == "SIZES":
                    code = compile(ast.Expression(stmt.value), str(path), "eval")
                    return resolve_sizes(eval(code, {"__builtins__": {"dict": dict}}))  # literals
    raise LookupError(f"{path.name}: no SIZES cell")


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
    """What breaks the notebook conventions of docs/design.md (empty list when none)."""
    problems = []
    try:
        nb = read_notebook(path)
    except NotebookError as e:
        return [str(e)]
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
