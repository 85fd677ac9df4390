"""The explorers' live behaviour in a real browser: JupyterLab in headless Chromium.

A notebook with two explorers (``explore`` over a matplotlib drawing, chosen by a dropdown, and
``explore_table`` over a table, a plotly figure moved by a slider) is opened in JupyterLab and
run; the test then moves each control as a reader would (selects an option, presses an arrow key
on the slider) and checks that the picture below it changed: the PNG's bytes for the first, the
plotly title for the second. Under papermill and nbval the same calls draw one static picture
(tests/test_explore.py); this is the only place the live path runs.

It needs Playwright and a Chromium: ``make chromium`` installs both (the Chromium build the npm
registry carries, unpacked into ``.venv/chromium``); ``$WORKBENCH_CHROMIUM`` names another
executable. Without them the test is skipped and says why.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from urllib.request import urlopen

import pytest

from workbench.env import project_root

pytestmark = pytest.mark.slow

TOKEN = "workbench-browser-test"
# run every cell once the notebook's kernel is connected (before that, the command is a no-op)
RUN_ALL = """async () => {
  const app = window.jupyterapp, pause = () => new Promise(r => setTimeout(r, 200));
  let w = app.shell.currentWidget;
  while (!w || !w.sessionContext) { await pause(); w = app.shell.currentWidget; }
  await w.context.ready; await w.sessionContext.ready;
  while (!w.sessionContext.session || !w.sessionContext.session.kernel) { await pause(); }
  await app.commands.execute('notebook:run-all-cells');
}"""

CELLS = [
    "import matplotlib.pyplot as plt\nimport pandas as pd\n"
    "from workbench.explore import explore, explore_table",
    # a drawing whose pixels depend on the knob: a bar whose height is the chosen value
    "def draw(height):\n    fig, ax = plt.subplots(figsize=(3, 2))\n"
    "    ax.bar([0], [{'low': 1, 'high': 5}[height]])\n    ax.set_ylim(0, 6)\n    return fig\n"
    "explore(draw, height=['low', 'high'])",
    "table = pd.DataFrame({'bits': [2, 2, 3, 3, 4, 4], 'step': [0, 1] * 3,\n"
    "                      'loss': [3.0, 2.5, 2.0, 1.8, 1.5, 1.4]})\n"
    "explore_table(table, x='step', y='loss', knobs=['bits'], title='loss by bits')",
]



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on a fresh folder holding the test notebook; yields its page URL."""
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}",
                     "metadata": {}, "outputs": [], "source": src}
                    for i, src in enumerate(CELLS)],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                      "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "explore.ipynb").write_text(json.dumps(nb))
    port = _free_port()
    env = dict(os.environ, WORKBENCH_HOME=str(project_root()),
               PYTHONPATH=os.pathsep.join([str(project_root()), os.environ.get("PYTHONPATH", "")]))
    for k in ("CI", "WORKBENCH_BATCH", "WORKBENCH_STRICT"):
        env.pop(k, None)                       # a live session, not a batch or strict run
    # the server serves its working folder: the folder's name (under pytest's tmp_path) stays off
    # its command line, where env.interactive() would read "pytest" and draw statically
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
         f"--IdentityProvider.token={TOKEN}",
         "--LabApp.expose_app_in_browser=True", "--ServerApp.open_browser=False",
         "--allow-root"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urlopen(f"{base}/api/status?token={TOKEN}", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("JupyterLab did not start within 60 s")
        yield f"{base}/lab/tree/explore.ipynb?token={TOKEN}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_explorers_respond_in_jupyterlab(lab, chromium):
    playwright, exe, args = chromium
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=args, timeout=120_000)
        page = browser.new_page(viewport={"width": 1200, "height": 1600})
        page.set_default_timeout(120_000)
        page.goto(lab)
        page.wait_for_function("window.jupyterapp && document.querySelector('.jp-Notebook')")
        page.evaluate(RUN_ALL)

        # explorer 1: the dropdown redraws the matplotlib PNG
        select = page.locator(".widget-dropdown select").first
        select.wait_for()
        image = page.locator(".jp-RenderedImage img").first
        image.wait_for()
        before = image.get_attribute("src")
        select.select_option("high")
        page.wait_for_function("(b) => { const i = document.querySelector('.jp-RenderedImage img');"
                               " return i && i.src !== b; }", arg=before)

        # explorer 2: the slider (bits 2 -> 3) redraws the plotly figure's title
        title = page.locator(".jp-RenderedPlotly .gtitle").first
        title.wait_for()
        assert "bits=2" in title.text_content()
        handle = page.locator(".noUi-handle").last
        handle.focus()
        handle.press("ArrowRight")
        page.wait_for_function("() => [...document.querySelectorAll('.jp-RenderedPlotly .gtitle')]"
                               ".some(t => t.textContent.includes('bits=3'))")
        browser.close()
