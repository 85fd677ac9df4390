"""The run of one notebook: parameters -> sizes, seed, device, run directory, results.

A notebook calls ``run = workbench.start("12-nfi", globals())`` once, after its parameters cell,
and ends with ``run.finish()``. In between it reads its sizes with ``run.sizes(SIZES)``, records
metrics with ``run.record``, states its claims with ``run.claim`` and saves figures with
``run.savefig``. ``finish`` writes ``metrics.json`` (the contract with the report, see
docs/design.md), ``params.json`` and ``env.json`` and returns the verdict table (HTML in Jupyter,
text elsewhere). ``run.clock`` records what is read off the wall clock.

Strict mode (``WORKBENCH_STRICT=1``, set by the test suite) makes ``finish`` raise when a claim
marked ``robust=True`` does not hold.

The run sits on the top floor, beside the CLI (tests/test_layering.py): it reads down to the
parameters cell (``notebooks``), the checkpoint checks (``models.checkpoint``) and ``workbench
plan``'s estimate; seeding, devices and fast math are below it, in ``device``, where models and
methods reach them. Nothing in the package but its ``__init__`` and the CLI imports this module.
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from . import cache
from .device import SCALES, run_device, seed_everything
from .env import git_info, in_ipython, interactive, project_root, runner_job, strict_mode
from .notebooks import (RESERVED, NotebookError, check_limit, notebooks_dir, parameters,
                        resolve_sizes)



def interactive_dir(slug: str) -> Path:
    """The run folder of a notebook run without ``out_dir`` (JupyterLab, plain papermill, a
    script): ``runs/interactive/<slug>/<YYYYmmdd-HHMMSS>-<pid>``, one per run, so that two runs
    of the same notebook (a JupyterLab session and a papermill run, say) never write into, or
    overwrite, each other's folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return project_root() / "runs" / "interactive" / slug / f"{stamp}-{os.getpid()}"


class ClaimFailed(AssertionError):
    """A robust claim did not hold while strict mode was on."""


def _jsonable(value: Any) -> Any:
    """Plain JSON types from numpy/torch scalars, arrays, paths; NaN and inf become None."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return _jsonable(value.tolist())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Path):
        return str(value)
    return repr(value)


def environment_info(device=None) -> dict:
    """Git commit and dirty flag, package versions, device: what ``env.json`` holds."""
    from importlib import metadata
    versions = {}
    for pkg in ("torch", "numpy", "pandas", "scikit-learn", "matplotlib", "transformers",
                "gymnasium", "papermill", "workbench"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    info = {"python": sys.version.split()[0], "platform": platform.platform(),
            "packages": versions, "git": git_info(),
            "cpu_count": os.cpu_count()}
    if device is not None:
        info["device"] = str(device)
        if getattr(device, "type", None) == "cuda":
            import torch
            info["gpu"] = torch.cuda.get_device_name(device)
    return info


@dataclass
class Claim:
    id: str
    text: str
    holds: bool
    robust: bool = False
    evidence: dict = field(default_factory=dict)
    clock: list = field(default_factory=list)    # evidence keys read off the wall clock


class Run:
    """One execution of one notebook. Create it with :func:`start`."""

    def __init__(self, slug: str, scale: str = "smoke", seed: int = 0, device: str = "auto",
                 out_dir: str | os.PathLike | None = None, params: dict | None = None):
        if scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self.slug, self.scale, self.seed = slug, scale, int(seed)
        self.t0 = time.time()
        self.determinism = seed_everything(self.seed)
        self.device = run_device(device)       # under the device audit, its sentinel cpu:0
        self.out_dir = Path(out_dir) if out_dir else interactive_dir(slug)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "figures").mkdir(exist_ok=True)
        self.params = {"scale": scale, "seed": self.seed, "device": device,
                       "out_dir": str(out_dir) if out_dir else None, **(params or {})}
        self.metrics: dict[str, Any] = {}
        self.clock_names: set[str] = set()
        self.claims: list[Claim] = []
        self.figures: list[str] = []
        self.resolved_sizes: dict | None = None
        self.finished = False

    # -- sizes -------------------------------------------------------------------------------
    def sizes(self, table: dict, limits: dict | None = None, **overrides) -> dict:
        """The row of ``table`` for this run's scale, with the knobs that override it applied.

        A knob of the parameters cell overrides the size of the same name when it is not None;
        so do explicit ``overrides`` (an override naming a size the table does not have is an
        error: a typo would otherwise be silently ignored). Every row must name the same sizes.
        ``limits`` maps a size or a knob to its allowed values, an inclusive ``(low, high)`` range
        (None: open) or a list of choices, so that a bad knob fails here, by name. A ``threads``
        size sets torch's CPU threads (:meth:`set_threads`). A row may name another scale instead
        (``"mid": "smoke"``): this scale then runs exactly that row
        (:func:`workbench.notebooks.resolve_sizes`).
        """
        table = resolve_sizes(table)
        if self.scale not in table:
            raise KeyError(f"SIZES has no row for scale {self.scale!r}; it has {sorted(table)}")
        keys = {scale: set(row) for scale, row in table.items()}
        if len({frozenset(k) for k in keys.values()}) > 1:
            union = set().union(*keys.values())
            missing = {scale: sorted(union - k) for scale, k in keys.items() if union - k}
            raise KeyError(f"the rows of SIZES name different sizes; missing: {missing}")
        row = dict(table[self.scale])
        for name, value in overrides.items():
            if name not in row:
                raise KeyError(f"override {name!r} is not a size of {self.slug}; "
                               f"sizes are {sorted(row)}")
        knobs = {k: v for k, v in self.params.items() if k in row and k not in RESERVED}
        for name, value in {**knobs, **overrides}.items():
            if value is not None:
                row[name] = type(row[name])(value) if isinstance(row[name], (int, float)) \
                    and not isinstance(row[name], bool) else value
        for name, allowed in (limits or {}).items():
            if name not in row and name not in self.params:
                raise KeyError(f"limits name {name!r}, which is neither a size nor a parameter")
            _check_value(self.slug, name, row[name] if name in row else self.params[name], allowed)
        self.resolved_sizes = row
        if "threads" in row:
            self.set_threads(row["threads"])
        return row

    def set_threads(self, n: int | None) -> None:
        """Use ``n`` torch CPU threads (None or 0 keeps torch's default); recorded in env.json.

        Small networks run faster on one thread: on a shared 2-core CPU, OpenMP threads that wait
        for each other made training steps up to 10x slower.
        """
        import torch
        if n:
            torch.set_num_threads(int(n))
        self.determinism["torch_threads"] = torch.get_num_threads()

    # -- results -----------------------------------------------------------------------------
    def record(self, name: str | None = None, value: Any = None, **metrics) -> None:
        """Record metrics: ``run.record("loss", 0.3)`` or ``run.record(loss=0.3, acc=0.9)``."""
        if name is not None:
            metrics[name] = value
        for key, val in metrics.items():
            self.metrics[key] = _jsonable(val)

    def clock(self, **metrics) -> None:
        """Record wall-clock measures (times, throughputs, their ratios) as :meth:`record` does,
        named in ``metrics.json``'s ``clock`` list: they measure the machine and its load, so
        ``workbench compare`` leaves them out, as it leaves out names that say time (``_s``)."""
        self.record(**metrics)
        self.clock_names.update(metrics)

    def claim(self, id: str, text: str, holds, evidence: dict | None = None,
              robust: bool = False, clock: Iterable[str] = ()) -> Claim:
        """State claim ``id`` with a verdict computed from measurements.

        ``holds`` must be a boolean computed in the notebook (numpy bools are accepted);
        ``evidence`` holds the numbers behind it; ``clock`` names the evidence keys read off the
        wall clock (left out by ``workbench compare``, like :meth:`clock`'s metrics).
        """
        if not isinstance(holds, (bool, np.bool_)):
            raise TypeError(f"claim {id}: holds must be a computed bool, got {type(holds).__name__}")
        if any(c.id == id for c in self.claims):
            self.claims = [c for c in self.claims if c.id != id]   # re-running a cell replaces it
        evidence = _jsonable(evidence or {})
        clock = [clock] if isinstance(clock, str) else list(clock)
        unknown = [k for k in clock if k not in evidence]
        if unknown:
            raise KeyError(f"claim {id}: clock names {unknown}, which its evidence does not hold")
        c = Claim(id, text, bool(holds), bool(robust), evidence, clock)
        self.claims.append(c)
        mark = "holds" if c.holds else "does NOT hold"
        print(f"[{id}{' robust' if robust else ''}] {mark}: {text}")
        return c

    def savefig(self, fig, name: str, twin: bool = True, **kwargs) -> None:
        """Save a matplotlib (png) or plotly (html) figure as ``figures/<name>``; in a live
        session a matplotlib figure of lines and points is also shown as its plotly twin
        (``plots.plotly_twin``: hover, zoom, toggle series; ``twin=False`` when the caller shows
        its own, as ``plots.curves`` does).

        Returns nothing, so that a cell ending in it shows the figure and no path.
        """
        stem = Path(name).stem
        figdir = self.out_dir / "figures"
        if hasattr(fig, "savefig"):
            path = figdir / f"{stem}.png"
            fig.savefig(path, dpi=kwargs.pop("dpi", 110), bbox_inches="tight", **kwargs)
        elif hasattr(fig, "write_html"):
            path = figdir / f"{stem}.html"
            fig.write_html(str(path), include_plotlyjs="cdn", **kwargs)
        else:
            raise TypeError(f"cannot save a {type(fig).__name__}; pass a matplotlib or plotly figure")
        if path.name not in self.figures:
            self.figures.append(path.name)
        if twin and hasattr(fig, "savefig") and interactive():
            from .plots import show_twin       # lazy: the CLI imports this module, not plotly
            show_twin(fig)                     # a live session also gets it as plotly
        elif twin and hasattr(fig, "savefig") and runner_job() and in_ipython():
            from .plots import keep_twin, plotly_twin
            keep_twin(plotly_twin(fig))        # the executed notebook keeps it (the book)

    def progress(self, iterable: Iterable | None = None, **kwargs):
        """A progress bar: live in Jupyter, a line every few percent elsewhere."""
        from .progress import progress
        return progress(iterable, **kwargs)

    @property
    def duration_s(self) -> float:
        return time.time() - self.t0

    def summary(self) -> dict:
        return {"notebook": self.slug, "scale": self.scale, "seed": self.seed,
                "duration_s": round(self.duration_s, 2), "params": _jsonable(self.params),
                "sizes": _jsonable(self.resolved_sizes), "metrics": self.metrics,
                "clock": sorted(self.clock_names),
                "claims": [c.__dict__ for c in self.claims], "figures": self.figures,
                "zoo": cache.used(), "cache": cache.entries()}

    def finish(self) -> "Verdicts":
        """Write ``metrics.json``, ``params.json``, ``env.json``; return the verdict table.

        The table renders as HTML in Jupyter and as text in papermill logs and scripts: end the
        notebook's cell with ``run.finish()``. In strict mode, raise :class:`ClaimFailed` when a
        robust claim does not hold (after writing the files and printing the table).
        """
        summary = self.summary()
        (self.out_dir / "metrics.json").write_text(json.dumps(summary, indent=2))
        (self.out_dir / "params.json").write_text(json.dumps(summary["params"], indent=2))
        env = environment_info(self.device)
        env["determinism"] = self.determinism
        from . import placement                # torch is loaded: the run picked its device
        if placement.requested():
            (self.out_dir / "device_audit.json").write_text(json.dumps(placement.report(), indent=2))
        (self.out_dir / "env.json").write_text(json.dumps(env, indent=2))
        self.finished = True
        verdicts = Verdicts(summary, self.out_dir)
        failed = [c.id for c in self.claims if c.robust and not c.holds]
        if failed and strict_mode():
            print(verdicts)
            raise ClaimFailed(f"{self.slug} seed {self.seed}: robust claim(s) {failed} did not hold")
        if not in_ipython():
            print(verdicts)
        return verdicts


class Verdicts(dict):
    """What ``run.finish()`` returns: the ``metrics.json`` summary (a dict), shown as a table.

    Jupyter draws the HTML table (holds / does not hold marked, evidence folded away);
    papermill logs and plain scripts get the text table.
    """

    def __init__(self, summary: dict, out_dir: Path | None = None):
        super().__init__(summary)
        self.out_dir = out_dir

    def text(self) -> str:
        claims = self.get("claims", [])
        if not claims:
            return f"{self.get('notebook')}: no claims recorded"
        width = min(max(len(c["text"]) for c in claims), 90)
        lines = [f"{'claim':<6} {'robust':<6} {'verdict':<13} text", "-" * (30 + width)]
        for c in claims:
            text = c["text"] if len(c["text"]) <= 90 else c["text"][:87] + "..."
            lines.append(f"{c['id']:<6} {'yes' if c['robust'] else '':<6} "
                         f"{'holds' if c['holds'] else 'does not hold':<13} {text}")
        held = sum(c["holds"] for c in claims)
        lines.append(f"\n{held}/{len(claims)} claims hold; results in {self.out_dir} "
                     f"({self.get('duration_s', 0):.1f} s)")
        return "\n".join(lines)

    __str__ = __repr__ = text

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(self.text())

    def _repr_html_(self) -> str:
        from html import escape
        rows = []
        for c in self.get("claims", []):
            mark = ('<td style="color:#2e933c;font-weight:600">&#10004; holds</td>' if c["holds"]
                    else '<td style="color:#d1495b;font-weight:600">&#10008; does not hold</td>')
            ev = ", ".join(f"{escape(str(k))} = {escape(_short(v))}"
                           for k, v in c.get("evidence", {}).items())
            evidence = f"<details><summary>evidence</summary>{ev}</details>" if ev else ""
            rows.append(f"<tr><td><b>{escape(c['id'])}</b></td>"
                        f"<td>{'robust' if c['robust'] else ''}</td>{mark}"
                        f"<td style='text-align:left'>{escape(c['text'])}{evidence}</td></tr>")
        held = sum(c["holds"] for c in self.get("claims", []))
        return ("<table><thead><tr><th>claim</th><th></th><th>verdict</th>"
                "<th style='text-align:left'>what is claimed</th></tr></thead><tbody>"
                + "".join(rows) + "</tbody></table>"
                f"<p>{held}/{len(self.get('claims', []))} claims hold &middot; "
                f"{escape(str(self.get('notebook')))} {escape(str(self.get('scale')))} seed "
                f"{self.get('seed')} &middot; {self.get('duration_s', 0):.1f} s &middot; "
                f"<code>{escape(str(self.out_dir))}</code></p>")


def _check_value(slug: str, name: str, value, allowed) -> None:
    """``value`` within an inclusive ``(low, high)`` range, or one of a list of choices."""
    if value is None:
        return
    if isinstance(allowed, tuple) and len(allowed) == 2:
        low, high = allowed
        if (low is not None and value < low) or (high is not None and value > high):
            span = f"{'' if low is None else low}..{'' if high is None else high}"
            raise ValueError(f"{slug}: {name} must be in {span}, got {value!r}")
    elif value not in allowed:
        raise ValueError(f"{slug}: {name} must be one of {sorted(allowed)}, got {value!r}")


def _short(value, n: int = 60) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def notebook_parameters(namespace: dict, slug: str) -> dict:
    """The parameters cell's values, read from a notebook's ``globals()``.

    The cell's annotations (``name: type = value``) name the parameters; papermill's injected
    cell may have replaced their values. Each non-None value must match its annotated type
    (an int is accepted for a float) so that a bad ``-p`` value fails here with its name.
    """
    annotations = namespace.get("__annotations__") or {}
    if not annotations:
        raise ValueError(f"{slug}: no annotated parameters found; write the cell tagged "
                         "'parameters' as `name: type = value  # help` lines before start()")
    missing = [name for name in RESERVED if name not in annotations]
    if missing:
        raise ValueError(f"{slug}: the parameters cell lacks {missing}; every notebook has "
                         f"{list(RESERVED)}")
    params = {}
    for name, kind in annotations.items():
        value = namespace.get(name)
        if value is not None and isinstance(kind, type):
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise TypeError(f"{slug}: parameter {name!r} must be {kind.__name__}, got "
                                f"{value!r} ({type(value).__name__}); fix the -p value")
        params[name] = value
    check_limits(params, slug)
    return params


def check_limits(params: dict, slug: str) -> None:
    """The limits the parameters cell declares (``[1..]``, ``(0..1]``, ``{a|b}`` at the end of a
    help comment) hold for ``params``: the same check ``workbench run`` makes before a job, made
    again in the kernel, so an interactive or plain papermill run fails at once, by name. A
    notebook that is not in ``notebooks/`` (a copy elsewhere) is not checked."""
    try:
        spec = parameters(notebooks_dir() / f"{slug}.ipynb")
    except (FileNotFoundError, NotebookError):
        return
    for name, value in params.items():
        if name in spec:
            check_limit(slug, name, value, spec[name])
    from .models import checkpoint         # a checkpoint the notebook cannot use: refused now
    for w in checkpoint.validate_params(slug, params, device=params.get("device"),
                                        scale=params.get("scale")):
        warnings.warn(w, stacklevel=3)


def start(slug: str, namespace: dict | None = None, /, **params) -> Run:
    """Begin a notebook's run: ``run = workbench.start("12-nfi", globals())``.

    With a namespace, the parameters are the names annotated in the parameters cell (see
    :func:`notebook_parameters`); keywords name them directly instead (or add to them).
    ``scale``, ``seed``, ``device`` and ``out_dir`` configure the run; the rest are the method's
    knobs, kept in ``params.json`` and applied to ``run.sizes(SIZES)``. The house plot style is set.
    """
    if namespace is not None:
        params = {**notebook_parameters(namespace, slug), **params}
    base = {k: params.pop(k) for k in RESERVED if k in params}
    run = Run(slug, params=params, **base)
    from . import plots
    plots.style()
    print(f"{slug}: scale={run.scale} seed={run.seed} device={run.device} out={run.out_dir}")
    if run.scale == "full":
        print(full_estimate(slug, run.params))
    return run


def full_estimate(slug: str, params: dict) -> str:
    """One line of ``workbench plan``'s estimate for a full run (DESIGN: printed before it runs);
    a notebook outside ``notebooks/`` or without a cost model gets none."""
    from . import plan
    try:
        knobs = {k: v for k, v in params.items()
                 if v is not None and k not in RESERVED and not isinstance(v, (list, dict))}
        est = plan.estimate(slug, notebooks_dir() / f"{slug}.ipynb", "full", knobs)
    except (LookupError, OSError, ValueError, TypeError, NotebookError):
        return f"{slug}: no estimate of this full run (workbench plan knows the shipped notebooks)"
    builds = f", after {plan.duration(est.build_seconds)} of zoo builds" if est.build_seconds \
        else ""
    return (f"{slug}: estimated {est.flops:.1e} FLOPs, peak {est.peak_bytes / 2**30:.1f} GiB, "
            f"about {plan.duration(est.seconds)} on one H100{builds} (workbench plan {slug[:2]})")


def show(obj) -> None:
    """Render the source of a function or class in the notebook (plain text elsewhere)."""
    import inspect
    src = inspect.getsource(obj)
    if in_ipython():
        from IPython.display import Markdown, display
        display(Markdown(f"```python\n{src}\n```"))
        return
    print(src)
