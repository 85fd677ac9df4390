"""A new paper in one command: what ``workbench new NN-slug`` writes.

A paper is a notebook with the anatomy of docs/design.md, its method
(``workbench/methods/<name>.py``), its harness (``workbench/experiments/<name>.py``), their tests,
its cost model in ``workbench/plan.py`` and its page ``docs/papers/NN-slug.md`` (listed in
``docs/papers/README.md``). As written they hold a placeholder
(gradient descent on a random quadratic, a computed claim) that runs end to end and passes its
tests, so a new paper executes from its first minute; everything the author must rewrite carries
``TODO(template)`` (a test checks that no notebook in ``notebooks/`` still does).
"""
from __future__ import annotations

import ast
import keyword
import re
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell
from nbformat.v4 import new_notebook as blank

from .env import project_root
from .notebooks import KERNELSPEC, NAME_RE, TEMPLATE_MARK as MARK, clean

__all__ = ["new_paper", "notebook", "module_name", "plan_entry"]

TITLE = """# {number} · {title}

**The problem.** {mark}: the problem the paper addresses, in two or three sentences of your own.
**The method.** {mark}: what the paper proposes, with its central equation written out.

**What this notebook tests**
- **C1** (robust) {mark}: the first claim, as the paper's page `docs/papers/{slug}.md` states
  it, and how we measure it.

**Scaled down.** {mark}: at `smoke` scale (CPU, at most 90 s) ... ; `mid` (CPU, at most 15
minutes a seed) gives the effect room: ... ; `full` runs ... on one GPU.
"""

PARAMETERS = """scale: str = "smoke"  # smoke (2 CPU cores, at most 90 s), mid (2 CPU cores, at most 15 minutes a seed) or full (one GPU) {{smoke|mid|full}}
seed: int = 0  # seeds torch, numpy and the data [0..]
device: str = "auto"  # auto, cpu, cuda or mps {{auto|cpu|cuda|mps}}
out_dir: str = None  # run directory (None: runs/interactive/{slug})
steps: int = None  # gradient steps (None: the scale's size) [1..]
lr: float = None  # step size (None: the scale's size) (0..]
"""

SIZES = """SIZES = {{
    # smoke: {mark} why these sizes show the claims within 90 s on 2 CPU cores
    "smoke": {{"steps": 200, "lr": 0.1, "dim": 16, "threads": 1}},
    # mid: {mark} the paper's setting scaled to 15 minutes a seed on 2 CPU cores, each size's rule
    # written here before any mid result ("mid": "smoke" where smoke already meets the claims'
    # preconditions)
    "mid": {{"like": "smoke", "steps": 2000}},
    # full: the sizes that show every claim clearly, for one GPU
    "full": {{"steps": 20_000, "lr": 0.1, "dim": 1024, "threads": 0}},
}}
"""

OPENING = """import workbench
from workbench import plots, results
from workbench.experiments import {module} as lab
from workbench.methods import {module} as method

run = workbench.start("{slug}", globals())   # the parameters cell's names, checked and recorded
S = run.sizes(SIZES)                          # knobs named like a size override it
S
"""

METHOD_MD = """## The method

{mark}: the method's equations, and the function that implements each. The placeholder is one
gradient step,

$$\\theta_{{t+1}} = \\theta_t - \\eta \\, \\nabla_\\theta \\mathcal{{L}}(\\theta_t).$$

The method lives in `workbench/methods/{module}.py` and is shown in place; the data preparation,
baselines and training harness the notebook calls live in `workbench/experiments/{module}.py`.
"""

METHOD = """workbench.show(method.gradient_step)   # {mark}: show each function of your method
"""

EXPERIMENT_MD = """## 1 · {mark}: the first experiment (C1)

One or two sentences: why this experiment tests the claim. The placeholder descends a random
quadratic $\\mathcal{{L}}(\\theta) = \\tfrac12 \\sum_i a_i \\theta_i^2$ with the sizes'
`steps`, `lr` and `dim`.
"""

EXPERIMENT = """settings = lab.Settings.from_sizes(S)   # {mark}: the experiment
out = lab.descend(settings, seed=run.seed)
fig, ax = plots.subplots()
ax.semilogy(out["loss"])
ax.set(title="gradient descent on a quadratic", xlabel="step", ylabel="loss")
run.savefig(fig, "loss")
"""

VERDICTS_MD = """## Verdicts
"""

VERDICTS = """loss = out["loss"]
run.claim("C1", "{mark}: what is claimed", holds=bool(loss[-1] < loss[0]),
          evidence={{"first": loss[0], "last": loss[-1]}}, robust=True)
run.record(final_loss=loss[-1])
run.finish()
"""

EXPLORE_MD = """## Explore

{mark}: the knob that carries the paper's idea, and why it teaches the paper best. Each move
redraws from what the notebook computed (under a second); papermill and CI show the default.
"""

EXPLORE = """from dataclasses import replace

from workbench.explore import explore, range_

def draw(lr):                                   # {mark}: one state of the picture
    fig, ax = plots.subplots()
    ax.semilogy(lab.descend(replace(settings, lr=lr), seed=run.seed)["loss"])
    ax.set(title=f"step size {{lr:.1f}}", xlabel="step", ylabel="loss")
    return fig

explore(draw, lr=range_(0.1, 2.1, 0.1, 0.1))   # past 2 / max curvature (about 2) it diverges
"""

CLOSING_MD = """## What we saw

The verdicts of seeds 0, 1 and 2 at smoke scale, from `notebooks/results/{slug}.json`
(`workbench run {slug} --seeds 0,1,2 --jobs 1 --out runs/rec && workbench record runs/rec`).
"""

CLOSING = """results.show("{slug}")
results.say("{slug}", \"\"\"{mark}: your reading of each claim, every number a field:
C1 holds on {{claims[C1]}} seeds (the final loss is {{metrics[final_loss]:.2e}}).\"\"\")
"""

EXERCISES_MD = """## Exercises

1. {mark}: what to change, and what to expect.
"""


# -- the Python files, the cost model and the page ------------------------------------------------

METHOD_PY = '''"""{title} (paper {number}, ``docs/papers/{slug}.md``).

{mark}: the method in a paragraph: what it computes, its equations by number, the official code
it follows (repository and file) and where this implementation departs from it (the page's
"Departures from the official code"). Only the method lives here; the data, baselines and
training harness that the notebook drives live in :mod:`workbench.experiments.{module}`.
"""
from __future__ import annotations

__all__ = ["gradient_step"]


def gradient_step(theta, grad, lr: float):
    """One gradient step, the placeholder's eq. (1):
    ``theta_{{t+1}} = theta_t - lr * grad L(theta_t)``, on numpy arrays and torch tensors alike.

    {mark}: replace with the paper's method, each function's docstring citing the equation it
    implements.
    """
    return theta - lr * grad
'''

EXPERIMENT_PY = '''"""The experiments of notebook {number} ({title},
:mod:`workbench.methods.{module}`).

{mark}: what the harness holds: the data preparation, the baselines, the training and evaluation
that the notebook calls, and what it caches. The placeholder is gradient descent on a random
quadratic (:func:`descend`), sized by :class:`Settings`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from ..methods import {module} as method

__all__ = ["Settings", "descend"]


@dataclass(frozen=True)
class Settings:
    """What one run needs, read from the notebook's sizes (:meth:`from_sizes`)."""
    steps: int      # gradient steps
    lr: float       # step size
    dim: int        # dimensions of the quadratic

    @classmethod
    def from_sizes(cls, S: dict) -> Settings:
        """The settings in ``S`` (``run.sizes(SIZES)``); the sizes not named here, such as
        ``threads``, are the runtime's."""
        return cls(**{{f.name: S[f.name] for f in fields(cls)}})


def descend(s: Settings, seed: int) -> dict:
    """Gradient descent (:func:`workbench.methods.{module}.gradient_step`) on
    ``L(theta) = 1/2 sum_i a_i theta_i^2``, the curvatures ``a_i ~ U(0.1, 1)`` and the start
    ``theta_0 ~ N(0, I)`` drawn from ``seed``: the loss before each step and after the last
    (``loss``, ``steps + 1`` values) and the final ``theta``."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.1, 1.0, s.dim)
    theta = rng.normal(size=s.dim)
    loss = np.empty(s.steps + 1)
    for t in range(s.steps + 1):
        loss[t] = 0.5 * np.sum(a * theta ** 2)
        if t < s.steps:
            theta = method.gradient_step(theta, a * theta, s.lr)
    return {{"loss": loss, "theta": theta}}
'''

TEST_METHOD_PY = '''"""The method of paper {number} (``workbench/methods/{module}.py``).
{mark}: a test for each of the paper's equations."""
import numpy as np
import torch

from workbench.methods import {module} as method


def test_a_step_moves_against_the_gradient():
    theta, grad = np.array([1.0, -2.0]), np.array([0.5, -1.0])
    np.testing.assert_allclose(method.gradient_step(theta, grad, 0.1), [0.95, -1.9])


def test_a_small_step_lowers_a_quadratic_on_tensors_too():
    theta, a = torch.tensor([3.0, -1.0]), torch.tensor([1.0, 0.2])
    after = method.gradient_step(theta, a * theta, lr=0.5)
    assert (a * after ** 2).sum() < (a * theta ** 2).sum()
'''

TEST_EXPERIMENT_PY = '''"""The harness of notebook {number} (``workbench/experiments/{module}.py``).
{mark}: a test for each piece the notebook relies on."""
import numpy as np
import pytest

from workbench.experiments import {module} as lab

SIZES = {{"steps": 50, "lr": 0.5, "dim": 4, "threads": 1}}


def test_settings_are_read_from_the_sizes():
    assert lab.Settings.from_sizes(SIZES) == lab.Settings(steps=50, lr=0.5, dim=4)
    with pytest.raises(KeyError):
        lab.Settings.from_sizes({{"steps": 50}})


def test_descent_lowers_the_loss_and_repeats_with_its_seed():
    s = lab.Settings.from_sizes(SIZES)
    loss = lab.descend(s, seed=0)["loss"]
    assert loss.shape == (51,) and np.all(np.diff(loss) < 0)
    np.testing.assert_array_equal(loss, lab.descend(s, seed=0)["loss"])
    assert not np.array_equal(loss, lab.descend(s, seed=1)["loss"])


def test_too_large_a_step_diverges():
    loss = lab.descend(lab.Settings(steps=20, lr=25.0, dim=4), seed=0)["loss"]
    assert loss[-1] > 1e6 * loss[0]
'''

PLAN_PY = '''def c{number}(p, S):
    # {mark}: the phases of {slug}, what its harness trains and evaluates, sized by S
    # (the placeholder: gradient descent on a quadratic of dim parameters)
    return [_mlp(S["dim"], S["steps"], S["steps"], "gradient descent (placeholder)")]


'''

PAGE_MD = """# {number} · {title}

Notebook [`notebooks/{slug}.ipynb`](../../notebooks/{slug}.ipynb) · method
[`workbench/methods/{module}.py`](../../workbench/methods/{module}.py) · harness
[`workbench/experiments/{module}.py`](../../workbench/experiments/{module}.py) · tests
`tests/test_{module}.py`, `tests/test_experiments_{module}.py` · cost model `c{number}` in
`workbench/plan.py`

## The paper

{mark}: the paper (authors, title, venue, year, link) and the official code this implementation
follows (repository and commit); the problem and the method in a paragraph of our own.

## Claims and how the notebook measures them

| claim | robust | what is measured |
|---|---|---|
| C1 | yes | {mark}: the claim, and the criterion its verdict computes (placeholder: the loss falls) |

## Baselines

{mark}: each baseline, why it is the fair comparison, and how it is tuned (the same budget as
the method).

## Scales

- `smoke`: {mark}: the sizes, and why the robust claims show at them within about 90 s on 2 CPU
  cores.
- `mid`: {mark}: what mid changes (the paper's setting scaled to 15 minutes a seed on 2 CPU
  cores) and the rule behind each size.
- `full`: {mark}: the sizes that show every claim clearly, about 10 minutes on one H100
  (`workbench plan {number} --scale full`).

## Where this departs from the official code

{mark}: every place the implementation differs from the paper or its code (scale, data,
optimizer, an equation read one way), and why; "none" when there are none.

Measured verdicts over seeds 0-2: [findings.md](../findings.md#{slug}).
"""


def notebook(slug: str, module: str, title: str) -> nbformat.NotebookNode:
    """The template notebook of ``slug``, importing ``module``'s harness and method."""
    fill = dict(number=slug[:2], slug=slug, module=module, mark=MARK, title=title)
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
    return nb


def module_name(slug: str, module: str | None = None) -> str:
    """The module name of ``slug``'s method and harness: ``module`` when given, else the slug
    without its number, ``-`` as ``_`` (``20-demo-paper`` -> ``demo_paper``)."""
    name = module if module is not None else slug[3:].replace("-", "_")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        how = "choose another" if module is not None else "pass --module NAME"
        raise ValueError(f"{name!r} is not a module name (lowercase letters, digits and '_', "
                         f"starting with a letter, not a Python keyword): {how}")
    return name


def plan_entry(source: str, number: str, slug: str) -> str:
    """``workbench/plan.py``'s ``source`` with notebook ``number``'s placeholder cost model: a
    function ``cNN`` before :data:`workbench.plan.MODELS`, and its entry at the dict's end."""
    tree = ast.parse(source)
    found = [n for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)
             and [getattr(t, "id", None) for t in n.targets] == ["MODELS"]]
    if not found:
        raise ValueError("workbench/plan.py has no `MODELS = {...}` to register the cost model "
                         f"in; add c{number} by hand, or restore MODELS")
    node = found[0]
    if number in {getattr(k, "value", None) for k in node.value.keys}:
        raise ValueError(f"number {number} is taken: workbench/plan.py's MODELS has a cost model "
                         "for it; pick a free number")
    if any(isinstance(n, ast.FunctionDef) and n.name == f"c{number}" for n in tree.body):
        raise ValueError(f"workbench/plan.py already defines c{number}; pick a free number")
    lines = source.splitlines(keepends=True)
    last = lines[node.end_lineno - 1].encode()       # ast's columns count UTF-8 bytes
    head, tail = last[:node.end_col_offset - 1].decode(), last[node.end_col_offset - 1:].decode()
    entry = f'"{number}": c{number}'
    sep = ", " if node.value.keys else ""
    if len(head) + len(sep) + len(entry) + 1 > 100:  # a new line, aligned under the first key
        indent = len(lines[node.lineno - 1].encode()[:node.value.col_offset].decode()) + 1
        sep = ",\n" + " " * indent
    lines[node.end_lineno - 1] = head + sep + entry + tail
    at = node.lineno - 1
    while at > 0 and lines[at - 1].startswith("#"):       # comments that belong to MODELS
        at -= 1
    lines.insert(at, PLAN_PY.format(number=number, slug=slug, mark=MARK))
    return "".join(lines)


def index_entry(source: str, number: str, slug: str, title: str, module: str) -> str:
    """``docs/papers/README.md``'s ``source`` with a row for the new paper in its table of papers,
    in the order of the numbers."""
    lines = source.splitlines(keepends=True)
    rows = [(i, m.group(1)) for i, line in enumerate(lines)
            if (m := re.match(r"\| (\d\d) \|", line))]
    if not rows:
        raise ValueError("docs/papers/README.md has no table of papers (rows `| NN | ...`) to "
                         f"list {slug} in; restore it, or add the row by hand")
    if number in {n for _, n in rows}:
        raise ValueError(f"number {number} is taken: docs/papers/README.md lists a paper "
                         "under it; pick a free number")
    at = max([i for i, n in rows if n < number], default=rows[0][0] - 1) + 1
    lines.insert(at, f"| {number} | [{slug}]({slug}.md) | {title} | `methods/{module}.py` |\n")
    return "".join(lines)


def new_paper(name: str, title: str | None = None, module: str | None = None,
              root: Path | None = None, dry_run: bool = False) -> list[Path]:
    """Write a new paper ``NN-slug`` into the checkout ``root`` (default: the project root): its
    notebook, method, harness, their tests and its page, its cost model into
    ``workbench/plan.py`` and its row into ``docs/papers/README.md``. Returns the paths written
    (with ``dry_run``: that would be, writing nothing). Every check comes before the first write:
    a malformed slug or module name, a number taken or a file that exists raises (ValueError,
    FileExistsError) with nothing written."""
    slug = name[:-6] if name.endswith(".ipynb") else name
    if not NAME_RE.match(slug + ".ipynb"):
        raise ValueError(f"{name!r} is not a notebook name: use NN-slug, two digits, then "
                         "lowercase letters, digits and dashes (e.g. 20-demo-paper)")
    number, module = slug[:2], module_name(slug, module)
    root = Path(root) if root is not None else project_root()
    plan_py, index_md = root / "workbench" / "plan.py", root / "docs" / "papers" / "README.md"
    for need in (plan_py, index_md):
        if not need.is_file():
            raise ValueError(f"{root} is not a workbench checkout (no {need.relative_to(root)}): "
                             "run from the checkout, or set WORKBENCH_HOME to it")
    title = title or slug[3:].replace("-", " ").title()
    files = {root / "notebooks" / f"{slug}.ipynb": None,
             root / "workbench" / "methods" / f"{module}.py": METHOD_PY,
             root / "workbench" / "experiments" / f"{module}.py": EXPERIMENT_PY,
             root / "tests" / f"test_{module}.py": TEST_METHOD_PY,
             root / "tests" / f"test_experiments_{module}.py": TEST_EXPERIMENT_PY,
             root / "docs" / "papers" / f"{slug}.md": PAGE_MD}
    there = [str(p.relative_to(root)) for p in files if p.exists()]
    if there:
        raise FileExistsError(f"{', '.join(there)} {'exists' if len(there) == 1 else 'exist'}; "
                              "nothing was written. Pick another slug, or name the modules with "
                              "--module NAME")
    used = {p.name[:2]: p for folder, pattern in (("docs/papers", "[0-9][0-9]-*.md"),
                                                  ("notebooks", "[0-9][0-9]-*.ipynb"))
            for p in sorted((root / folder).glob(pattern))}      # a notebook named first
    if number in used:
        free = f"{max(int(n) for n in used) + 1:02d}"
        raise ValueError(f"number {number} is taken by {used[number].relative_to(root)}; "
                         f"nothing was written. Pick a free one, e.g. {free}-{slug[3:]}")
    edits = {plan_py: plan_entry(plan_py.read_text(), number, slug),
             index_md: index_entry(index_md.read_text(), number, slug, title, module)}
    if dry_run:
        return [*files, *edits]
    fill = dict(number=number, slug=slug, module=module, mark=MARK, title=title)
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            nbformat.write(notebook(slug, module, title), str(path))
            clean(path)
        else:
            path.write_text(text.format(**fill))
    for path, text in edits.items():
        path.write_text(text)
    return [*files, *edits]
