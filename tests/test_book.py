"""The book: a run's executed notebooks as a static site, built from a small synthetic
run folder (two notebooks with real records, no execution), then opened in headless Chromium.

The pure parts (which run a chapter shows, the intervals of a claim's evidence, the claims
matrix, what a chapter keeps of a notebook) are fast; building the site (Sphinx, a few seconds)
and the browser are marked slow. The browser test opens every page from ``file://`` with every
network request refused, and fails on a console error, a page error, a request that would leave
the machine, maths that MathJax did not render, or a plotly figure that did not draw. Without
Sphinx (the ``book`` extra) or Chromium (``make chromium``) those tests are skipped and say why.
"""
from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

from workbench import book
from workbench.cli import main
from workbench.env import project_root

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning",
                                        "ignore::PendingDeprecationWarning")

# a 1x1 PNG: a figure as a notebook output carries it
PNG = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360f80f000001010000a5f6451d0000000049454e44ae426082")).decode()
PLOTLY = {"data": [{"x": [1, 2, 3], "y": [3, 1, 2], "type": "scatter"}],
          "layout": {"title": {"text": "a plotly figure in the book"}}}


def _cell(kind, source, tags=(), outputs=()):
    c = {"cell_type": kind, "id": f"c{abs(hash(source)) % 10**8}", "metadata": {"tags": list(tags)},
         "source": source}
    if kind == "code":
        c.update(execution_count=1, outputs=list(outputs))
    return c


def executed(slug: str, title: str) -> dict:
    """An executed notebook as papermill leaves it: maths, the method shown, a figure, plotly,
    a widget progress bar and stderr noise, the injected parameters."""
    show = {"output_type": "display_data", "metadata": {},
            "data": {"text/markdown": "```python\ndef absorption_threshold(eps):\n    return 1\n"
                                      "```",
                     "text/plain": "<code>"}}
    widget = {"output_type": "display_data", "metadata": {}, "data": {
        book.WIDGET_MIME: {"model_id": "ab", "version_major": 2, "version_minor": 0},
        "text/plain": "Loading weights: 0%"}}
    stderr = {"output_type": "stream", "name": "stderr", "text": "progress noise\n"}
    png = {"output_type": "display_data", "metadata": {}, "data": {"image/png": PNG,
                                                                   "text/plain": "<Figure>"}}
    plotly = {"output_type": "display_data", "metadata": {}, "data": {
        book.PLOTLY_MIME: PLOTLY, "text/html": "<div>cdn fallback</div>", "text/plain": "Figure"}}
    return {"nbformat": 4, "nbformat_minor": 5,
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"},
                         "widgets": {"state": {}}},
            "cells": [
                _cell("markdown", f"# {title}\n\nThe threshold $\\ln(2/\\epsilon)$, and\n\n"
                                  "$$\\mathrm{fl}(1 + t) = 1 \\quad\\text{for } t < \\epsilon/2$$"),
                _cell("code", 'scale = "smoke"', tags=["parameters"]),
                _cell("code", 'out_dir = "/private/run/folder"', tags=["injected-parameters"]),
                _cell("code", "from workbench.methods import nfi\n"
                              "from workbench.experiments import nfi as lab\n"
                              "workbench.show(nfi.absorption_threshold)",
                      outputs=[show, widget, stderr]),
                _cell("code", "plots.curves(...)", outputs=[png, plotly]),
            ]}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run folder as `workbench run 12,16 --seeds 0,1` writes it (seed 1 of 12 failed)."""
    root = tmp_path_factory.mktemp("run")
    for slug, title, seeds in [("12-nfi", "12 · Numerical Feature Inflation", (0, 1)),
                               ("16-fura", "16 · FuRA: full-rank adaptation", (1,))]:
        for seed in seeds:
            d = root / slug / "smoke" / f"seed-{seed}"
            d.mkdir(parents=True)
            (d / f"{slug}.ipynb").write_text(json.dumps(executed(slug, title)))
            ok = not (slug == "12-nfi" and seed == 1)
            (d / "job.json").write_text(json.dumps({"status": "ok" if ok else "failed"}))
            rec = json.loads((project_root() / "notebooks" / "results" /
                              f"{slug}.json").read_text())
            claims = [{"id": k, "text": v["text"], "holds": v["holds"][0]}
                      for k, v in rec["claims"].items()]
            (d / "metrics.json").write_text(json.dumps({"notebook": slug, "seed": seed,
                                                        "claims": claims}))
    grid = root / "12-nfi" / "smoke-lr=0.1" / "seed-0"       # a grid point: not the chapter
    grid.mkdir(parents=True)
    (grid / "12-nfi.ipynb").write_text(json.dumps(executed("12-nfi", "grid")))
    (root / "plan.json").write_text("{}")
    return root


def test_a_chapter_is_the_default_run_at_the_lowest_seed(run_dir):
    chs = {c.slug: c for c in book.chapters(run_dir)}
    assert set(chs) == {"12-nfi", "16-fura"}
    assert chs["12-nfi"].rel == "12-nfi/smoke/seed-0" and chs["12-nfi"].seed == 0
    assert chs["16-fura"].rel == "16-fura/smoke/seed-1"


def test_intervals_are_found_wherever_the_evidence_holds_them():
    ev = {"paired": {"diff": 0.2, "low": 0.1, "high": 0.3, "n": 40},
          "per_shot": [{"low": -1, "high": 1}], "acc": 0.5}
    found = dict(book.intervals(ev))
    assert set(found) == {"paired", "per_shot[0]"}
    assert book.interval_text(found["paired"]) == "0.2 [0.1, 0.3]"
    assert book.held({"holds": [True, False, True]}) == (2, 3)


def test_the_matrix_has_every_recorded_notebook_and_links_only_present_chapters():
    recs = book.records()
    assert len(recs) == 19
    html = book.matrix_html(recs, {"12-nfi"}, {})
    assert html.count("<tr>") == 1 + 19                          # the head and one per paper
    assert 'href="chapters/12-nfi.html#claim-12-nfi-c1"' in html
    assert 'href="chapters/08-htfm.html' not in html             # not in the run: no link
    k, n = book.held(recs["08-htfm"]["claims"]["C3"])
    assert f"C3 {k}/{n}" in html and book.held_class(k, n) in html


def test_a_record_of_other_code_is_marked_stale():
    recs = {"12-nfi": dict(book.records()["12-nfi"])}
    assert not book.code_changed("12-nfi", recs["12-nfi"])
    assert "wb-stale" not in book.matrix_html(recs, set(), {})
    recs["12-nfi"]["key"] = {"notebook": "0000"}
    assert book.code_changed("12-nfi", recs["12-nfi"])
    assert "wb-stale" in book.matrix_html(recs, set(), {})


def test_every_chapter_title_carries_its_number():
    assert book.numbered_title("# Hestia: QAT\n\nx", "10-hestia") == "# 10 · Hestia: QAT\n\nx"
    assert book.numbered_title("# 12 · NFI", "12-nfi") == "# 12 · NFI"


def test_a_chapter_keeps_the_story_and_drops_the_noise(run_dir):
    ch = next(c for c in book.chapters(run_dir) if c.slug == "12-nfi")
    nb = book.chapter_notebook(ch, book.records()["12-nfi"])
    text = json.dumps(nb)
    assert "/private/run/folder" not in text and "progress noise" not in text
    assert book.WIDGET_MIME not in text and book.PLOTLY_MIME not in text and "widgets" not in \
        nb["metadata"]
    assert "Plotly.newPlot" in text and "cdn fallback" not in text
    assert PNG in text and book.TWIN_SUMMARY in text     # the PNG, its twin folded under it
    verdicts = nb["cells"][1]["source"]                         # right after the title
    assert 'id="claim-12-nfi-c1"' in verdicts and "holds on 3 of 3 seeds" in verdicts
    assert "workbench/methods/nfi.py" in verdicts and "tests/test_nfi.py" in verdicts
    assert "workbench/experiments/nfi.py" in verdicts


@pytest.fixture(scope="module")
def site(run_dir, tmp_path_factory) -> Path:
    pytest.importorskip("myst_nb", reason=book.EXTRA_HINT)
    out = tmp_path_factory.mktemp("book")
    # the CLI in its own process, as a reader runs it (Sphinx keeps global state)
    done = subprocess.run([sys.executable, "-m", "workbench.cli", "book", str(run_dir), "--out",
                           str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "book: " in done.stdout
    return out / "html"


def test_the_cli_says_what_is_wrong_with_a_folder_without_notebooks(tmp_path, capsys):
    assert main(["book", str(tmp_path / "absent")]) == 2
    assert main(["book", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a directory" in err and "holds no executed notebook" in err


@pytest.mark.slow
def test_the_site_has_every_page_and_loads_nothing_from_the_network(site):
    for page in ["index", "search", "chapters/12-nfi", "chapters/16-fura", "parts/zoo",
                 "parts/quantizers", "parts/batch", "docs/findings", "docs/book",
                 "code/workbench.methods.nfi", "code/tests.test_nfi"]:
        assert (site / f"{page}.html").is_file(), page
    assert book.remote_urls(site) == {}
    assert (site / "_static" / "plotly.min.js").is_file()
    assert (site / "_static" / "mathjax" / "tex-svg-full.js").is_file()
    index = (site / "index.html").read_text()
    assert 'href="chapters/12-nfi.html#claim-12-nfi-c1"' in index
    assert 'id="claim-12-nfi-c1"' in (site / "chapters" / "12-nfi.html").read_text()
    fura = (site / "chapters" / "16-fura.html").read_text()
    ivs = [iv for c in book.records()["16-fura"]["claims"].values()
           for _, iv in book.intervals(c["evidence"][0])]
    assert ivs and "intervals (" in fura and book.interval_text(ivs[0]) in fura
    zoo = (site / "parts" / "zoo.html").read_text()
    assert "lm-base" in zoo and "code/workbench.models.recipes.html" in zoo


@pytest.mark.slow
def test_remote_urls_finds_a_cdn_script(tmp_path):
    (tmp_path / "a.html").write_text('<script src="https://cdn.example/x.js"></script>'
                                     '<a href="https://example.org">a link loads nothing</a>')
    (tmp_path / "b.css").write_text("@font-face { src: url(https://fonts.example/f.woff2) }")
    assert book.remote_urls(tmp_path) == {"a.html": ["https://cdn.example/x.js"],
                                          "b.css": ["https://fonts.example/f.woff2"]}


# -- the browser --------------------------------------------------------------------------------




@pytest.mark.slow
def test_every_page_opens_offline_in_chromium_with_maths_and_plotly(site, chromium):
    playwright, exe, args = chromium
    pages = sorted(p for p in site.rglob("*.html") if "_static" not in p.relative_to(site).parts)
    problems, remote, with_maths = [], [], []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=args, timeout=120_000)
        page = browser.new_page()
        page.set_default_timeout(60_000)
        page.on("console", lambda m: m.type == "error" and problems.append(
            f"{page.url}: console: {m.text}"))
        page.on("pageerror", lambda e: problems.append(f"{page.url}: page error: {e}"))

        def refuse(route):
            remote.append(route.request.url)
            route.abort()
        page.route("http*://**", refuse)
        for path in pages:
            page.goto(path.as_uri())
            page.wait_for_load_state("load")
            if page.locator(".math").count():
                page.wait_for_function("document.querySelectorAll('mjx-container').length >= "
                                       "document.querySelectorAll('.math').length")
                assert page.locator("mjx-merror").count() == 0, path
                with_maths.append(path.name)
        page.goto((site / "chapters" / "12-nfi.html").as_uri())
        page.click("details.wb-twin summary")               # the twin folded under its PNG
        page.wait_for_selector(".wb-plotly .main-svg")
        assert "a plotly figure in the book" in page.locator(".wb-plotly .gtitle").text_content()
        page.goto((site / "search.html").as_uri() + "?q=absorption")
        page.wait_for_selector("#search-results li a")
        browser.close()
    assert {"12-nfi.html", "16-fura.html"} <= set(with_maths)
    assert remote == [], remote
    assert problems == [], "\n".join(problems)


def test_each_png_gets_its_twin_folded_under_it_when_every_figure_has_one():
    def out(key, value):
        return {"output_type": "display_data", "data": {key: value}}
    twin_a, twin_b = (out("text/html", f'<div id="wb-plotly-1-{i}"></div>') for i in "ab")
    png_a, png_b, text = out("image/png", "A"), out("image/png", "B"), out("text/plain", "t")
    folded = book._fold_twins([twin_a, twin_b, text, png_a, png_b])
    assert folded[:2] == [text, png_a] and folded[3] == png_b and len(folded) == 5
    for i, key in ((2, "wb-plotly-1-a"), (4, "wb-plotly-1-b")):
        html = folded[i]["data"]["text/html"]
        assert html.startswith('<details class="wb-twin"') and key in html
        assert book.TWIN_SUMMARY in html
    assert book._fold_twins([twin_a, png_a, png_b]) == [twin_a, png_a, png_b]   # one not redrawn
    assert book._fold_twins([png_a]) == [png_a]
