"""Fixture notebooks for the batch tests (strict mode is set by the root conftest.py)."""
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


@pytest.fixture
def fixture_notebooks(tmp_path):
    """Four notebooks for the batch tests: one that works, one that raises, one that outlives
    its timeout, one whose kernel dies."""
    d = tmp_path / "notebooks"
    d.mkdir()
    make_notebook(d / "01-ok.ipynb", OK_BODY, "x: int = 1  # a number\n")
    make_notebook(d / "02-raises.ipynb", 'raise RuntimeError("boom from the notebook")')
    make_notebook(d / "03-slow.ipynb", "import time\ntime.sleep(sleep_s)",
                  "sleep_s: float = 60.0  # how long to sleep\n")
    make_notebook(d / "04-dies.ipynb", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    return d
