"""Fixture notebooks for the batch tests (strict mode is set by the root conftest.py)."""
import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

PARAMS = '''scale: str = "smoke"  # smoke or full
seed: int = 0  # random seed
device: str = "auto"  # auto, cpu or cuda
out_dir: str = None  # run directory
'''


def make_notebook(path, body: str, extra_params: str = "", title: str = "Fixture"):
    """A minimal notebook with the house anatomy: title, parameters cell, body."""
    nb = new_notebook(cells=[
        new_markdown_cell(f"# {title}\n\n- **C1** (robust) x is positive."),
        new_code_cell(PARAMS + extra_params, metadata={"tags": ["parameters"]}),
        new_code_cell(body),
    ])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nbformat.write(nb, str(path))
    return path


OK_BODY = '''import workbench
run = workbench.start("01-ok", scale=scale, seed=seed, device="cpu", out_dir=out_dir, x=x)
run.record(x=x, x_plus_seed=x + seed)
run.claim("C1", "x is positive", holds=x > 0, robust=True)
run.finish()
'''


FIGURE_BODY = '''import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import workbench
run = workbench.start("05-figure", scale=scale, seed=seed, device="cpu", out_dir=out_dir)
fig, ax = plt.subplots(figsize=(2, 2))
ax.plot([0, 1], [0, 1])
ax.set_title("a line")
run.savefig(fig, "line")
run.record(y=1.0 + seed)
run.finish()
'''

# Kills the Dask worker that runs it (the kernel's grandparent: kernel -> papermill -> worker)
# the first time, recording its own pid in `marker`; the retry finds the marker and finishes.
KILLS_WORKER_BODY = '''import os, pathlib, signal, time
m = pathlib.Path(marker)
if not m.exists():
    m.write_text(str(os.getpid()))
    stat = pathlib.Path(f"/proc/{os.getppid()}/stat").read_text()
    os.kill(int(stat.rsplit(")", 1)[1].split()[1]), signal.SIGKILL)
    time.sleep(120)
import workbench
run = workbench.start("06-kills-worker", scale=scale, seed=seed, device="cpu", out_dir=out_dir)
run.record(pid=os.getpid())
run.finish()
'''

# Under WB_TEST_HANG it leaves half a metrics.json in its out_dir (as a kernel killed while
# writing would) and waits to be interrupted; otherwise it finishes normally.
HALF_BODY = '''import os, pathlib, time
if os.environ.get("WB_TEST_HANG"):
    pathlib.Path(out_dir, "metrics.json").write_text('{"notebook": "07-half", "claims": [')
    pathlib.Path(os.environ["WB_TEST_HANG"]).write_text(str(os.getpid()))
    time.sleep(120)
import workbench
run = workbench.start("07-half", scale=scale, seed=seed, device="cpu", out_dir=out_dir)
run.record(done=1)
run.finish()
'''

ECHO_BODY = '''import workbench
run = workbench.start("08-echo", scale=scale, seed=seed, device="cpu", out_dir=out_dir)
run.record(text=text, text_type=type(text).__name__)
run.finish()
'''


@pytest.fixture
def fixture_notebooks(tmp_path):
    """Notebooks for the batch tests: one that works, one that raises, one that outlives its
    timeout, one whose kernel dies, one with a figure, one that kills its Dask worker once, one
    that hangs after half-writing metrics.json, one that records a string parameter."""
    d = tmp_path / "notebooks"
    d.mkdir()
    make_notebook(d / "01-ok.ipynb", OK_BODY, "x: int = 1  # a number\n")
    make_notebook(d / "02-raises.ipynb", 'raise RuntimeError("boom from the notebook")')
    make_notebook(d / "03-slow.ipynb", "import time\ntime.sleep(sleep_s)",
                  "sleep_s: float = 60.0  # how long to sleep\n")
    make_notebook(d / "04-dies.ipynb", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    make_notebook(d / "05-figure.ipynb", FIGURE_BODY)
    make_notebook(d / "06-kills-worker.ipynb", KILLS_WORKER_BODY,
                  "marker: str = \"\"  # a file that says the first attempt happened\n")
    make_notebook(d / "07-half.ipynb", HALF_BODY)
    make_notebook(d / "08-echo.ipynb", ECHO_BODY, "text: str = \"hi\"  # any text\n")
    return d


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-zygote", "--single-process",
                 "--disable-dev-shm-usage", "--use-gl=swiftshader"]


@pytest.fixture
def chromium():
    """``(playwright.sync_api, executable, launch args)`` of the headless Chromium that
    ``make chromium`` unpacks into the venv (or ``$WORKBENCH_CHROMIUM``); a skip saying why where
    there is none (the browser tests: test_browser.py, test_book.py)."""
    playwright = pytest.importorskip("playwright.sync_api", reason="make chromium installs "
                                     "Playwright and a Chromium for the browser tests")
    exe = os.environ.get("WORKBENCH_CHROMIUM") or str(Path(sys.prefix) / "chromium" / "chromium")
    if not Path(exe).is_file():
        pytest.skip("no Chromium: run `make chromium` (or set WORKBENCH_CHROMIUM)")
    return playwright, exe, CHROMIUM_ARGS
