"""The notebook template: what ``workbench new NN-slug`` writes, the anatomy of DESIGN.md.

Every cell that the author must rewrite carries ``TODO(template)``; a test checks that no notebook
in ``notebooks/`` still does. As written, the template runs end to end (a toy measurement and a
computed claim), so a new notebook executes from its first minute.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell
from nbformat.v4 import new_notebook as blank

from .notebooks import KERNELSPEC, NAME_RE, TEMPLATE_MARK as MARK, clean, notebooks_dir

__all__ = ["new_notebook"]

TITLE = """# {number} · {title}

**The problem.** {mark}: the problem the paper addresses, in two or three sentences of your own.
**The method.** {mark}: what the paper proposes, with its central equation written out.

**What this notebook tests**
- **C1** (robust) {mark}: the first claim, as the spec `papers/{slug}.md` states it, and how we
  measure it.

**Scaled down.** {mark}: at `smoke` scale (CPU, at most 90 s) ... ; `full` runs ... on one GPU.
"""

PARAMETERS = """scale: str = "smoke"  # smoke (CPU, at most 90 s) or full (one GPU) {{smoke|full}}
seed: int = 0  # seeds torch, numpy and the data [0..]
device: str = "auto"  # auto, cpu, cuda or mps {{auto|cpu|cuda|mps}}
out_dir: str = None  # run directory (None: runs/interactive/{slug})
steps: int = None  # training steps (None: the scale's size) [1..]
"""

SIZES = """SIZES = {{
    # smoke: {mark} why these sizes show the claims within 90 s on 2 CPU cores
    "smoke": {{"steps": 200, "threads": 1}},
    # full: the sizes that show every claim clearly, for one GPU
    "full": {{"steps": 20_000, "threads": 0}},
}}
"""

OPENING = """import numpy as np

import workbench
from workbench import plots, results

run = workbench.start("{slug}", globals())   # the parameters cell's names, checked and recorded
S = run.sizes(SIZES)                          # knobs named like a size override it
S
"""

METHOD_MD = """## The method

{mark}: the method's equations, and the function that implements each, e.g.

$$\\theta_{{t+1}} = \\theta_t - \\eta \\, \\nabla_\\theta \\mathcal{{L}}(\\theta_t).$$

The method lives in `workbench/methods/{module}.py` and is shown in place; the data preparation,
baselines and training harness the notebook calls live in `workbench/experiments/{module}.py`.
"""

METHOD = """workbench.show(workbench.start)   # {mark}: workbench.show(<your method's function>)
"""

EXPERIMENT_MD = """## 1 · {mark}: the first experiment (C1)

One or two sentences: why this experiment tests the claim.
"""

EXPERIMENT = """rng = np.random.default_rng(run.seed)   # {mark}: the experiment
x = rng.normal(size=S["steps"])
fig, ax = plots.subplots()
ax.hist(x, bins=30)
ax.set(title="a histogram", xlabel="value", ylabel="count")
run.savefig(fig, "histogram")
"""

VERDICTS_MD = """## Verdicts
"""

VERDICTS = """run.claim("C1", "{mark}: what is claimed", holds=bool(abs(x.mean()) < 0.5),
          evidence={{"mean": x.mean()}}, robust=True)
run.record(mean=x.mean())
run.finish()
"""

EXPLORE_MD = """## Explore

{mark}: the knob that carries the paper's idea, and why it teaches the paper best. Each move
redraws from what the notebook computed (under a second); papermill and CI show the default.
"""

EXPLORE = """from workbench.explore import explore, range_

def draw(bins):                                 # {mark}: one state of the picture
    fig, ax = plots.subplots()
    ax.hist(x, bins=bins)
    ax.set(title=f"{{bins}} bins", xlabel="value", ylabel="count")
    return fig

explore(draw, bins=range_(5, 60, 5, 30))
"""

CLOSING_MD = """## What we saw

The verdicts of seeds 0, 1 and 2 at smoke scale, from `notebooks/results/{slug}.json`
(`workbench run {slug} --seeds 0,1,2 --jobs 1 --out runs/rec && workbench report runs/rec`).
"""

CLOSING = """results.show("{slug}")
results.say("{slug}", \"\"\"{mark}: your reading of each claim, every number a field:
C1 holds on {{claims[C1]}} seeds (the mean is {{metrics[mean]:.2f}}).\"\"\")
"""

EXERCISES_MD = """## Exercises

1. {mark}: what to change, and what to expect.
"""


def new_notebook(name: str, title: str | None = None, directory: Path | None = None,
                 force: bool = False) -> Path:
    """Write ``directory/NN-slug.ipynb`` from the template; refuse to overwrite one that exists."""
    slug = name[:-6] if name.endswith(".ipynb") else name
    if not NAME_RE.match(slug + ".ipynb"):
        raise ValueError(f"{name!r} is not a notebook name: use NN-slug, two digits, then "
                         "lowercase letters, digits and dashes (e.g. 08-htfm)")
    path = (directory or notebooks_dir()) / f"{slug}.ipynb"
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; pass --force to overwrite it")
    number = slug[:2]
    module = re.sub(r"[^a-z0-9]+", "_", slug[3:])
    fill = dict(number=number, slug=slug, module=module, mark=MARK,
                title=title or slug[3:].replace("-", " ").title())
    cells = [new_markdown_cell(TITLE.format(**fill)),
             new_code_cell(PARAMETERS.format(**fill), metadata={"tags": ["parameters"]}),
             new_code_cell(SIZES.format(**fill)),
             new_code_cell(OPENING.format(**fill)),
             new_markdown_cell(METHOD_MD.format(**fill)),
             new_code_cell(METHOD.format(**fill)),
             new_markdown_cell(EXPERIMENT_MD.format(**fill)),
             new_code_cell(EXPERIMENT.format(**fill)),
             new_markdown_cell(VERDICTS_MD.format(**fill)),
             new_code_cell(VERDICTS.format(**fill)),
             new_markdown_cell(EXPLORE_MD.format(**fill)),
             new_code_cell(EXPLORE.format(**fill), metadata={"tags": ["explore"]}),
             new_markdown_cell(CLOSING_MD.format(**fill)),
             new_code_cell(CLOSING.format(**fill), metadata={"tags": ["results"]}),
             new_markdown_cell(EXERCISES_MD.format(**fill))]
    nb = blank(cells=cells)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    clean(path)
    return path
