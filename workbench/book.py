"""The book: a batch run's executed notebooks as one static, searchable, offline site.

``workbench book RUN_DIR`` (``make book``) writes Sphinx sources into ``OUT/src`` and builds
``OUT/html`` with myst-nb (docs/book.md says why this tool): one chapter per notebook of the run,
read from the executed notebook as the run left it (never re-executed), with its story, its
method code as ``workbench.show`` printed it, its figures, and, after the title, the verdict
table over seeds from the record (``notebooks/results/<slug>.json``: held on n of 3 seeds, with
the intervals the claims' evidence carries) and links to the method's and the harness's code and
tests; a front page with the claims matrix (every recorded notebook x its claims, coloured by the
seeds held, each cell a link to the claim's row in its chapter); a page per shared part (the zoo
and its cards, the quantizers, the batch runner); the ``docs/`` pages. Verdicts come from the
records, never recomputed here.

Offline: MathJax 3 (SVG output, no font files, so it renders from ``file://`` too) is copied from
the ``sphinx-mathjax-offline`` package into ``_static``; plotly figures (a notebook output of
plotly's MIME type) are drawn by the ``plotly.min.js`` that the plotly package ships; ipywidgets
outputs (progress bars with no saved state) are dropped and myst-nb's widget loader (a CDN
script) is switched off. :func:`remote_urls` finds any script, style or font the built pages
would fetch from the network; the tests require none. No torch here: the CLI imports it.
"""
from __future__ import annotations

import ast
import html
import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from . import report, results
from .env import project_root
from .plots import PLOTLY_MIME, rounded

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
DOCS = ["findings", "decisions", "zoo", "zoo-lessons", "gguf", "batches", "benchmarks",
        "book"]  # docs/ pages, in this order
SHARED = {   # page -> (title, modules shown on it)
    "zoo": ("The zoo: shared backbones and their cards",
            ["workbench/models/recipes.py", "workbench/models/zoo.py",
             "workbench/models/adapters.py", "workbench/models/clip.py"]),
    "quantizers": ("The quantizers", None),            # every module of workbench/quant
    "batch": ("The batch runner and the report",
              ["workbench/batch.py", "workbench/cluster.py", "workbench/report.py",
               "workbench/results.py"]),
}
NO_CHAPTERS = ("{run_dir} holds no executed notebook (SLUG/<scale>/seed-N/SLUG.ipynb); give the "
               "--out folder of a `workbench run`")
EXTRA_HINT = "the book needs Sphinx and myst-nb: pip install -e '.[book]' (in dev)"


@dataclass
class Chapter:
    """One notebook of the run: the executed notebook the book shows and where it came from."""
    slug: str
    notebook: Path          # the executed .ipynb
    rel: str                # its run folder, relative to the run dir
    seed: int | None
    claims: list            # that run's own verdicts (its metrics.json's claims)
    scale: str | None = "smoke"


# -- reading the run --------------------------------------------------------------------------

def chapters(run_dir: Path) -> list[Chapter]:
    """The run's notebooks, one chapter each: of the jobs :func:`workbench.report.collect` finds
    (the runner's folders, as the report reads them), per notebook the run with no grid point,
    smoke before full, lowest seed first, that finished ok and left its executed notebook."""
    run_dir, best = Path(run_dir), {}
    for r in report.collect(run_dir):
        nb = Path(r["dir"]) / f"{r['notebook']}.ipynb"
        if r["status"] not in ("ok", "cached") or r["params"] or not nb.is_file():
            continue
        rank = (r["scale"] not in (None, "smoke"), r["seed"] if r["seed"] is not None else 99)
        if r["notebook"] not in best or rank < best[r["notebook"]][0]:
            best[r["notebook"]] = (rank, Chapter(r["notebook"], nb, r["rel"], r["seed"],
                                                 r["claims"], r["scale"]))
    return [best[slug][1] for slug in sorted(best)]


def records(scale: str = "smoke") -> dict[str, dict]:
    """slug -> its record at ``scale`` (``notebooks/results/<slug>.json`` at smoke,
    ``notebooks/results/mid/<slug>.json`` at mid), every notebook recorded there."""
    return {p.stem: report.read_json(p)
            for p in sorted(results.folder(scale).glob("[0-9][0-9]-*.json"))}


def code_changed(slug: str, record: dict) -> bool:
    """Whether the checkout's notebook has other code cells than its record was made from (the
    record's zoo keys are not checked here: that needs torch; ``workbench.results.stale``)."""
    nb = project_root() / "notebooks" / f"{slug}.ipynb"
    return nb.is_file() and results.notebook_key(nb) != record.get("key", {}).get("notebook")


def intervals(evidence, prefix: str = "") -> list[tuple[str, dict]]:
    """Every interval in a claim's evidence: the dicts holding ``low`` and ``high`` (what
    ``diagnostics.paired_bootstrap`` returns), named by their path in the evidence."""
    out = []
    if isinstance(evidence, dict):
        if "low" in evidence and "high" in evidence:
            out.append((prefix or "interval", evidence))
        for k, v in evidence.items():
            if isinstance(v, (dict, list)):
                out += intervals(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(evidence, list):
        for i, v in enumerate(evidence):
            out += intervals(v, f"{prefix}[{i}]")
    return out


def held(claim: dict) -> tuple[int, int]:
    """(seeds on which the recorded claim held, seeds recorded)."""
    hs = claim.get("holds", [])
    return sum(1 for h in hs if h), len(hs)


def _num(v) -> str:
    return f"{v:.3g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def interval_text(iv: dict) -> str:
    point = next((iv[k] for k in ("diff", "mean", "estimate", "point") if k in iv), None)
    rng = f"[{_num(iv['low'])}, {_num(iv['high'])}]"
    return f"{_num(point)} {rng}" if point is not None else rng


# -- the pages ----------------------------------------------------------------------------------

def claim_anchor(slug: str, cid: str) -> str:
    return f"claim-{slug}-{cid}".lower()


def held_class(k: int, n: int) -> str:
    return f"wb-held-{round(3 * k / n) if n else 'none'}"


def _mark(h) -> str:
    return "holds" if h else "—" if h is None else "does not hold"


def _evidence_html(seeds: list, claim: dict) -> str:
    """The claim's intervals seed by seed, then its whole evidence per seed (both folded)."""
    ivs = [f"<li>seed {s}: {html.escape(name)} {interval_text(iv)}</li>"
           for s, ev in zip(seeds, claim.get("evidence", [])) for name, iv in intervals(ev)]
    out = (f"<details><summary>intervals ({len(ivs)})</summary><ul>{''.join(ivs)}</ul>"
           "</details>") if ivs else ""
    evs = "".join(f"<p>seed {s}</p><pre>"
                  f"{html.escape(json.dumps(rounded(ev), default=str))}</pre>"
                  for s, ev in zip(seeds, claim.get("evidence", [])) if ev)
    return out + (f"<details><summary>evidence</summary>{evs}</details>" if evs else "")


def verdict_html(slug: str, record: dict | None, chapter: Chapter | None = None,
                 scale: str = "smoke") -> str:
    """The chapter's verdict table at ``scale``: per claim the recorded seeds' verdicts, "holds
    on n of N seeds" (the cell coloured by n), its intervals and evidence seed by seed, this
    run's verdict (when ``chapter`` ran at that scale)."""
    if not record or not record.get("claims"):
        rel = results.path(slug, scale).relative_to(project_root()).as_posix()
        return f"<p>No recorded runs of {slug} at {scale} ({rel}).</p>"
    seeds = record.get("seeds", [])
    mine = {c.get("id"): c.get("holds") for c in (chapter.claims if chapter else [])}
    head = "".join(f"<th>seed {s}</th>" for s in seeds)
    this = f"<th>this run (seed {chapter.seed})</th>" if chapter else ""
    rows = []
    for cid, c in record["claims"].items():
        k, n = held(c)
        marks = "".join(f"<td>{_mark(h)}</td>" for h in c.get("holds", []))
        run = f"<td>{_mark(mine.get(cid))}</td>" if chapter else ""
        rows.append(f'<tr id="{claim_anchor(slug, cid)}"><td><b>{html.escape(cid)}</b></td>'
                    f"<td>{html.escape(c.get('text', ''))}{_evidence_html(seeds, c)}</td>"
                    f"<td>{'yes' if c.get('robust') else 'no'}</td>{marks}"
                    f'<td class="{held_class(k, n)}">holds on {k} of {n} seeds</td>{run}</tr>')
    return (f'<table class="wb-verdicts"><thead><tr><th>claim</th><th>what is claimed</th>'
            f"<th>robust</th>{head}<th>over seeds</th>{this}</tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def matrix_html(recs: dict[str, dict], have: set[str], titles: dict[str, str],
                mids: dict[str, dict] | None = None) -> str:
    """The claims matrix: a row per recorded notebook, a cell per claim coloured by the seeds
    it held on at smoke, with the mid record's count beside it where there is one (coloured by
    its own); a cell links to the claim's row in its chapter (when the run has that chapter)."""
    mids = mids or {}
    width = max((len(r.get("claims", {})) for r in recs.values()), default=0)
    head = f'<th colspan="{width}">claims (id: seeds held / seeds recorded)</th>'
    rows = []
    for slug, r in recs.items():
        name = html.escape(titles.get(slug, slug))
        label = f'<a href="chapters/{slug}.html">{slug}</a>' if slug in have else slug
        if code_changed(slug, r):
            label += (' <span class="wb-stale" title="the notebook\'s code changed since">'
                      "stale</span>")
        cells = []
        for cid, c in r.get("claims", {}).items():
            k, n = held(c)
            tip = html.escape(f"{cid}: {c.get('text', '')} (holds on {k} of {n} seeds"
                              f"{', robust' if c.get('robust') else ''})", quote=True)
            text = f"{cid} {k}/{n}"
            if slug in have:
                text = f'<a href="chapters/{slug}.html#{claim_anchor(slug, cid)}">{text}</a>'
            mc = mids.get(slug, {}).get("claims", {}).get(cid)
            if mc is not None:
                km, nm = held(mc)
                text += f' <span class="{held_class(km, nm)}" title="at mid">mid {km}/{nm}</span>'
            cells.append(f'<td class="{held_class(k, n)}" title="{tip}">{text}</td>')
        cells += ["<td></td>"] * (width - len(cells))
        rows.append(f'<tr><th title="{name}">{label}</th>{"".join(cells)}</tr>')
    legend = "".join(f'<span class="{held_class(k, 3)}">holds on {k} of 3</span> '
                     for k in (3, 2, 1, 0))
    return (f'<p class="wb-legend">{legend}</p><table class="wb-matrix"><thead><tr>'
            f"<th>notebook</th>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")


def code_page(rel: str) -> str:
    """A page showing one source file of the checkout (a method, a harness, a test)."""
    text = (project_root() / rel).read_text()
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    return f"---\norphan: true\n---\n# `{rel}`\n\n{fence}python\n{text}\n{fence}\n"


def code_href(rel: str) -> str:
    return "code/" + rel.replace("/", ".").removesuffix(".py") + ".html"


def modules_of(nb: dict) -> list[str]:
    """The method and harness modules a notebook imports, and their tests, as checkout paths."""
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    root, out = project_root(), []
    for kind, name in re.findall(r"from workbench\.(methods|experiments) import (\w+)", code):
        out.append(f"workbench/{kind}/{name}.py")
        out.append(f"tests/test_{'experiments_' if kind == 'experiments' else ''}{name}.py")
    out.sort(key=lambda p: ("experiments" in p, p.startswith("tests/")))   # the method first
    return [p for p in dict.fromkeys(out) if (root / p).is_file()]


def _plotly_html(fig: dict, key: str) -> str:
    """A plotly output as a div drawn by the bundled plotly.js (no CDN)."""
    data = json.dumps({"data": fig.get("data", []), "layout": fig.get("layout", {})})
    data = data.replace("</", "<\\/")
    div = f"wb-plotly-{key}"
    return (f'<div id="{div}" class="wb-plotly"></div><script>window.addEventListener("load",'
            f'function(){{var f={data};Plotly.newPlot("{div}",f.data,f.layout,'
            f'{{responsive:true}});}});</script>')


TWIN_SUMMARY = "Interactive version: hover, zoom, toggle series"


def _folded(twin_html: str) -> str:
    """A twin folded under its PNG; drawn while closed, so it is resized to the page on opening."""
    return ('<details class="wb-twin" ontoggle="if(this.open){this.querySelectorAll('
            "'.js-plotly-plot').forEach(function(d){Plotly.Plots.resize(d);});}\">"
            f"<summary>{TWIN_SUMMARY}</summary>{twin_html}</details>")


def _fold_twins(outs: list[dict]) -> list[dict]:
    """A cell whose every saved figure has its plotly twin (``plots.keep_twin``: one plotly output
    per PNG, in the same order) shows each PNG as the notebook laid it out with its twin folded
    under it; a cell with a figure plotly could not redraw keeps its outputs as they are."""
    def html_of(o):
        return o.get("data", {}).get("text/html", "")
    twins = [o for o in outs if "wb-plotly-" in html_of(o)]
    pngs = [o for o in outs if "image/png" in o.get("data", {})]
    if not twins or len(twins) != len(pngs):
        return outs
    pending, out = iter(twins), []
    for o in outs:
        if any(o is t for t in twins):
            continue
        out.append(o)
        if "image/png" in o.get("data", {}):
            t = next(pending)
            out.append({**t, "data": {"text/html": _folded(html_of(t))}})
    return out


def chapter_notebook(ch: Chapter, record: dict | None, mid: dict | None = None) -> dict:
    """The executed notebook as its chapter shows it: the verdict table and the code links after
    the title, papermill's injected parameters, widget outputs and stderr dropped, plotly
    outputs drawn offline."""
    nb = json.loads(ch.notebook.read_text())
    nb["metadata"].pop("widgets", None)
    cells = []
    for i, cell in enumerate(nb["cells"]):
        if "injected-parameters" in cell.get("metadata", {}).get("tags", []):
            continue
        outs = []
        for j, o in enumerate(cell.get("outputs", [])):
            data = o.get("data", {})
            if WIDGET_MIME in data or (o.get("output_type") == "stream"
                                       and o.get("name") == "stderr"):
                continue
            if PLOTLY_MIME in data:
                o = {**o, "data": {"text/html": _plotly_html(data[PLOTLY_MIME], f"{i}-{j}")}}
            outs.append(o)
        outs = _fold_twins(outs)
        if cell["cell_type"] == "code":
            cell["outputs"] = outs
        cells.append(cell)
    links = " · ".join(f'<a href="../{code_href(p)}"><code>{p}</code></a>'
                       for p in modules_of(nb))
    src = (f'<p class="wb-source">Executed notebook: run folder <code>{html.escape(ch.rel)}</code>'
           f" of the book's run (seed {ch.seed}); verdicts over seeds from the record "
           f"<code>notebooks/results/{ch.slug}.json</code>"
           + (f" of {record.get('recorded')}" if record else "") + "."
           + (" <b>Stale:</b> the notebook's code cells changed since that record."
              if record and code_changed(ch.slug, record) else "") + "</p>")
    mid_src = ""
    if mid:
        mid_src = (f'<p class="wb-source">At mid scale, from the record '
                   f"<code>notebooks/results/mid/{ch.slug}.json</code> of {mid.get('recorded')}."
                   + (" <b>Stale:</b> the notebook's code cells changed since that record."
                      if code_changed(ch.slug, mid) else "") + "</p>")
    mine = ch if ch.scale != "mid" else None
    md = ("## Verdicts over seeds\n\n### At smoke scale\n\n" + verdict_html(ch.slug, record, mine)
          + "\n\n" + src + "\n\n### At mid scale\n\n"
          + verdict_html(ch.slug, mid, ch if ch.scale == "mid" else None, "mid") + "\n\n" + mid_src
          + "\n\n" + (f'<p class="wb-code">The code: {links}</p>\n' if links else ""))
    first = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"), -1)
    if first >= 0:
        cells[first]["source"] = numbered_title("".join(cells[first]["source"]), ch.slug)
    cells.insert(first + 1, {"cell_type": "markdown", "id": "wb-verdicts", "metadata": {},
                             "source": md})
    nb["cells"] = cells
    return nb


def numbered_title(text: str, slug: str) -> str:
    """The title ``# Hestia: ...`` as ``# 10 · Hestia: ...``, as most notebooks write it, so the
    book's contents list every paper by its number."""
    num = slug[:2]
    if text.startswith("# ") and not text[2:].startswith(num):
        return f"# {num} · {text[2:]}"
    return text


def _docstring(rel: str) -> str:
    return ast.get_docstring(ast.parse((project_root() / rel).read_text())) or ""


def shared_page(name: str) -> tuple[str, list[str]]:
    """A shared part's page (its modules' docstrings, links to their code, its long docs page)
    and the source files it links."""
    title, mods = SHARED[name]
    root = project_root()
    if mods is None:
        quant = (root / "workbench" / "quant").glob("*.py")
        mods = sorted(p.relative_to(root).as_posix() for p in quant
                      if p.name != "__init__.py")
    mods = [m for m in mods if (root / m).is_file()]
    out = [f"# {title}", ""]
    lead = {"zoo": "The backbones the notebooks share ([docs/zoo.md](../docs/zoo.md)); their "
                   "cards, as `workbench zoo list` prints them, are below the modules.",
            "quantizers": "Grids, GPTQ, AWQ, vector quantization and the quantized linear layer "
                          "that notebooks 02, 10 and 14 use; the GGUF export: "
                          "[docs/gguf.md](../docs/gguf.md).",
            "batch": "How `workbench run` executes jobs and `workbench report` reads them: "
                     "[docs/batches.md](../docs/batches.md)."}[name]
    out += [lead, ""]
    for m in mods:
        out += [f"## [`{m}`](../{code_href(m)})", "", "```{eval-rst}", _docstring(m), "```", ""]
    if name == "zoo" and (root / "data" / "zoo.md").is_file():
        out += ["## The cards", "", "```{include} ../data-zoo.md", ":heading-offset: 2", "```",
                ""]
    return "\n".join(out), mods


def index_page(recs: dict, chs: list[Chapter], titles: dict, run_dir: Path,
               mids: dict | None = None) -> str:
    have = {c.slug for c in chs}
    n_claims = sum(len(r.get("claims", {})) for r in recs.values())
    toc = "\n".join(f"chapters/{c.slug}" for c in chs)
    docs = "\n".join(f"docs/{d}" for d in DOCS if (project_root() / "docs" / f"{d}.md").is_file())
    return f"""# Workbench: the book

The executed notebooks of a batch run, one chapter per paper: its story, the method's code shown
in place, the figures, and the verdicts, each claim tested and its verdict computed from what the
notebook measured. Built from the run `{html.escape(str(run_dir))}` ({len(chs)} notebooks,
{time.strftime('%Y-%m-%d')}) without re-running it.

## The claims matrix

{len(recs)} notebooks, {n_claims} claims, as recorded over seeds 0-2 at smoke scale
(`notebooks/results/`), and beside each, where the notebook has one, at mid scale
(`notebooks/results/mid/`, {len(mids or {})} notebooks). A cell's colour is the number of seeds
on which the claim held; a cell links to the claim's row, with its evidence and intervals, in
the chapter.

{matrix_html(recs, have, titles, mids)}

```{{toctree}}
:caption: Papers
:maxdepth: 1

{toc}
```

```{{toctree}}
:caption: Shared parts
:maxdepth: 1

parts/zoo
parts/quantizers
parts/batch
```

```{{toctree}}
:caption: Docs
:maxdepth: 1

{docs}
```
"""


CONF = '''# generated by workbench.book: the book's Sphinx configuration
project = "Workbench"
author = "Workbench"
extensions = ["myst_nb"]
myst_enable_extensions = ["dollarmath", "amsmath", "html_image"]
myst_heading_anchors = 3
nb_execution_mode = "off"           # the run executed the notebooks; the book only reads them
nb_output_stderr = "remove"
nb_merge_streams = True
nb_ipywidgets_js = {}               # myst-nb would load the widget manager from a CDN
html_theme = "sphinx_book_theme"
html_title = "Workbench: the book"
html_theme_options = {"show_navbar_depth": 1, "use_download_button": False,
                      "home_page_in_toc": True, "navigation_with_keys": False}
html_context = {"default_mode": "auto"}   # else the theme logs "invalid theme mode" once
html_show_search_summary = False    # summaries fetch() each page: refused from file://
html_static_path = ["_static"]
html_css_files = ["book.css"]
html_js_files = %(js)r
html_copy_source = False
html_show_sourcelink = False
mathjax_path = "mathjax/tex-svg-full.js"   # bundled: no CDN
suppress_warnings = ["myst.header", "myst.xref_missing", "misc.highlighting_failure",
                     "toc.not_included", "mystnb.unknown_mime_type"]
exclude_patterns = ["_build", "data-zoo.md"]
'''

CSS = """
.wb-held-3 { background: #c8e6c9; } .wb-held-2 { background: #fff3b0; }
.wb-held-1 { background: #ffd6a5; } .wb-held-0 { background: #ffb4a9; }
.wb-held-none { background: #eee; } .wb-stale { color: #b00020; font-size: 0.8em; }
.wb-matrix td, .wb-matrix th, .wb-verdicts td, .wb-verdicts th { padding: 2px 6px;
  border: 1px solid #ddd; font-size: 0.85em; vertical-align: top; }
.wb-matrix td a, .wb-verdicts a { color: inherit; }
.wb-legend span { padding: 1px 6px; margin-right: 4px; }
.wb-verdicts details { font-size: 0.9em; }
.wb-verdicts pre { white-space: pre-wrap; word-break: break-all; max-height: 20em; overflow: auto; }
.wb-verdicts tr { scroll-margin-top: 5rem; } .wb-verdicts tr:target { outline: 3px solid #1a73e8; }
.wb-plotly { min-height: 360px; }
"""


def _write(path: Path, text: str) -> None:
    """Write only when the content changed, so Sphinx's incremental build skips the rest."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _copy_if_changed(src: Path, dst: Path) -> None:
    if not dst.exists() or dst.stat().st_size != src.stat().st_size:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def mathjax_dir() -> Path:
    """MathJax 3's browser files, from the ``sphinx-mathjax-offline`` package (PyPI)."""
    import importlib.util
    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"no sphinx-mathjax-offline: {EXTRA_HINT}")
    return Path(list(spec.submodule_search_locations)[0]) / "static" / "mathjax"


def write_sources(run_dir: Path, src: Path) -> list[Chapter]:
    """Every source file of the book under ``src``; returns the chapters."""
    root = project_root()
    chs = chapters(run_dir)
    if not chs:
        raise FileNotFoundError(NO_CHAPTERS.format(run_dir=run_dir))
    recs, mids = records(), records("mid")
    titles = {}
    from .notebooks import discover          # titles of the checkout's notebooks
    try:
        titles = {i.slug: i.title for i in discover()}
    except Exception:
        pass
    code = set()
    plotly = False
    for ch in chs:
        nb = chapter_notebook(ch, recs.get(ch.slug), mids.get(ch.slug))
        code.update(modules_of(nb))
        text = json.dumps(nb, indent=1, ensure_ascii=False)
        plotly = plotly or "wb-plotly-" in text
        _write(src / "chapters" / f"{ch.slug}.ipynb", text)
    for name in SHARED:
        page, mods = shared_page(name)
        code.update(mods)
        _write(src / "parts" / f"{name}.md", page)
    for rel in sorted(code):
        _write(src / (code_href(rel).removesuffix(".html") + ".md"), code_page(rel))
    for d in DOCS:
        if (root / "docs" / f"{d}.md").is_file():
            _write(src / "docs" / f"{d}.md", (root / "docs" / f"{d}.md").read_text())
    if (root / "data" / "zoo.md").is_file():
        _write(src / "data-zoo.md", (root / "data" / "zoo.md").read_text())
    _write(src / "index.md", index_page(recs, chs, titles, run_dir, mids))
    js = []
    static = src / "_static"
    if plotly:
        import plotly as plotly_pkg
        _copy_if_changed(Path(plotly_pkg.__file__).parent / "package_data" / "plotly.min.js",
                         static / "plotly.min.js")
        js = ["plotly.min.js"]
    _write(src / "conf.py", CONF % {"js": js})
    _write(static / "book.css", CSS)
    mj = mathjax_dir()
    for f in mj.rglob("*"):
        if f.is_file() and "sre" not in f.relative_to(mj).parts:
            _copy_if_changed(f, static / "mathjax" / f.relative_to(mj))
    return chs


def build(run_dir: Path, out: Path | None = None, jobs: int = 2, quiet: bool = True) -> Path:
    """Write the sources and build the site; returns ``OUT/html/index.html``. ``out`` defaults
    to ``RUN_DIR/book``; a second build on the same ``out`` redoes only the changed pages."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory; give the --out folder of a run")
    if not chapters(run_dir):
        raise FileNotFoundError(NO_CHAPTERS.format(run_dir=run_dir))
    out = Path(out) if out is not None else run_dir / "book"
    try:
        from sphinx.cmd.build import build_main
        import myst_nb  # noqa: F401
    except ImportError as e:
        raise ModuleNotFoundError(EXTRA_HINT) from e
    src = out / "src"
    write_sources(run_dir, src)
    args = ["-b", "html", "-d", str(out / ".doctrees"), "-j", str(jobs), str(src),
            str(out / "html")]
    if quiet:
        args.insert(0, "-q")
    rc = build_main(args)
    if rc != 0:
        raise RuntimeError(f"sphinx-build failed (exit {rc}); rerun with --verbose")
    return out / "html" / "index.html"


REMOTE = re.compile(r"""<(?:script|link|img|iframe|source)\b[^>]*?\b(?:src|href)\s*=\s*["']"""
                    r"""((?:https?:)?//[^"']+)""", re.I)
CSS_REMOTE = re.compile(r"""(?:@import\s+|url\(\s*)["']?((?:https?:)?//[^"')\s]+)""", re.I)


def remote_urls(site: Path) -> dict[str, list[str]]:
    """file -> the network URLs it would load (scripts, styles, fonts, images, frames): what
    would leave the machine when the site opens. Links a reader may follow (``<a href>``) load
    nothing and are not counted."""
    found = {}
    for p in Path(site).rglob("*"):
        if p.suffix not in (".html", ".css") or not p.is_file():
            continue
        text = p.read_text(errors="replace")
        urls = CSS_REMOTE.findall(text) if p.suffix == ".css" else REMOTE.findall(text)
        if p.suffix == ".html":
            urls += CSS_REMOTE.findall(" ".join(re.findall(r"<style[^>]*>(.*?)</style>", text,
                                                           re.S)))
        urls = [u for u in urls if "w3.org" not in u]   # XML namespaces, never fetched
        if urls:
            found[p.relative_to(site).as_posix()] = sorted(set(urls))
    return found

