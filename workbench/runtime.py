"""The run of one notebook: parameters -> sizes, seed, device, run directory, results.

A notebook calls ``run = workbench.start("12-nfi", scale=scale, seed=seed, ...)`` once, after its
parameters cell, and ``run.finish()`` at the end. In between it reads its sizes with
``run.sizes(SIZES)``, records metrics with ``run.record``, states its claims with ``run.claim`` and
saves figures with ``run.savefig``. ``finish`` writes ``metrics.json`` (the contract with the report,
see DESIGN.md), ``params.json`` and ``env.json`` and prints the verdict table.

Strict mode (``WORKBENCH_STRICT=1``, set by the test suite) makes ``finish`` raise when a claim
marked ``robust=True`` does not hold.
"""
from __future__ import annotations

import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

SCALES = ("smoke", "full")
DEVICES = ("auto", "cpu", "cuda", "mps")


class ClaimFailed(AssertionError):
    """A robust claim did not hold while strict mode was on."""


def project_root() -> Path:
    """The checkout that holds ``pyproject.toml`` and ``notebooks/`` (or ``$WORKBENCH_HOME``)."""
    if os.environ.get("WORKBENCH_HOME"):
        return Path(os.environ["WORKBENCH_HOME"]).resolve()
    here = Path(__file__).resolve().parents[1]
    if (here / "notebooks").is_dir():
        return here
    return Path.cwd()


def cache_dir() -> Path:
    """Where built backbones and generated data live: ``$WORKBENCH_CACHE`` or ``data/cache``."""
    path = Path(os.environ.get("WORKBENCH_CACHE") or project_root() / "data" / "cache")
    path.mkdir(parents=True, exist_ok=True)
    return path


def strict_mode() -> bool:
    return os.environ.get("WORKBENCH_STRICT", "").lower() in ("1", "true", "yes")


def interactive() -> bool:
    """True in a live Jupyter session, False under papermill, nbval, CI or a plain script."""
    if os.environ.get("CI") or os.environ.get("WORKBENCH_BATCH") or strict_mode():
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and shell.__class__.__name__ == "ZMQInteractiveShell" \
        and not _parent_is_papermill()


def _parent_is_papermill() -> bool:
    """A kernel started by papermill or nbval (no one is watching it) rather than by a person."""
    try:
        cmd = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b"papermill" in cmd or b"pytest" in cmd


def seed_everything(seed: int) -> dict:
    """Seed Python, numpy and torch (CPU and CUDA); return the determinism settings used."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    os.environ["PYTHONHASHSEED"] = str(seed)
    info = {"seed": seed}
    try:
        import torch
    except ImportError:
        return info
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    info.update(cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
                cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
                deterministic_algorithms=bool(torch.are_deterministic_algorithms_enabled()))
    return info


def pick_device(device: str = "auto"):
    """``auto`` -> CUDA when present, else CPU. An explicit device must exist."""
    import torch
    if device not in DEVICES and not device.startswith("cuda:"):
        raise ValueError(f"device must be one of {DEVICES} (or 'cuda:N'), got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r} was asked for but CUDA is not available here; "
                           "use device='auto' or 'cpu'")
    if device == "mps" and not torch.backends.mps.is_available():
        raise RuntimeError("device='mps' was asked for but MPS is not available; use 'auto' or 'cpu'")
    return torch.device(device)


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


def _git_info(root: Path) -> dict:
    def git(*args):
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


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
            "packages": versions, "git": _git_info(project_root()),
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
        self.device = pick_device(device)
        self.out_dir = Path(out_dir) if out_dir else project_root() / "runs" / "interactive" / slug
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "figures").mkdir(exist_ok=True)
        self.params = {"scale": scale, "seed": self.seed, "device": device,
                       "out_dir": str(out_dir) if out_dir else None, **(params or {})}
        self.metrics: dict[str, Any] = {}
        self.claims: list[Claim] = []
        self.figures: list[str] = []
        self.resolved_sizes: dict | None = None
        self.finished = False

    # -- sizes -------------------------------------------------------------------------------
    def sizes(self, table: dict, **overrides) -> dict:
        """The row of ``table`` for this run's scale, with every non-None override applied.

        An override naming a size the table does not have is an error (a typo would otherwise
        be silently ignored).
        """
        if self.scale not in table:
            raise KeyError(f"SIZES has no row for scale {self.scale!r}; it has {sorted(table)}")
        row = dict(table[self.scale])
        for name, value in overrides.items():
            if name not in row:
                raise KeyError(f"override {name!r} is not a size of {self.slug}; "
                               f"sizes are {sorted(row)}")
            if value is not None:
                row[name] = type(row[name])(value) if isinstance(row[name], (int, float)) \
                    and not isinstance(row[name], bool) else value
        self.resolved_sizes = row
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

    def claim(self, id: str, text: str, holds, evidence: dict | None = None,
              robust: bool = False) -> Claim:
        """State claim ``id`` with a verdict computed from measurements.

        ``holds`` must be a boolean computed in the notebook (numpy bools are accepted);
        ``evidence`` holds the numbers behind it.
        """
        if not isinstance(holds, (bool, np.bool_)):
            raise TypeError(f"claim {id}: holds must be a computed bool, got {type(holds).__name__}")
        if any(c.id == id for c in self.claims):
            self.claims = [c for c in self.claims if c.id != id]   # re-running a cell replaces it
        c = Claim(id, text, bool(holds), bool(robust), _jsonable(evidence or {}))
        self.claims.append(c)
        mark = "holds" if c.holds else "does NOT hold"
        print(f"[{id}{' robust' if robust else ''}] {mark}: {text}")
        return c

    def savefig(self, fig, name: str, **kwargs) -> Path:
        """Save a matplotlib (png) or plotly (html) figure under ``figures/`` and return its path."""
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
        return path

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
                "claims": [c.__dict__ for c in self.claims], "figures": self.figures}

    def finish(self) -> dict:
        """Write ``metrics.json``, ``params.json``, ``env.json``; print the verdicts.

        In strict mode, raise :class:`ClaimFailed` when a robust claim does not hold.
        """
        summary = self.summary()
        (self.out_dir / "metrics.json").write_text(json.dumps(summary, indent=2))
        (self.out_dir / "params.json").write_text(json.dumps(summary["params"], indent=2))
        env = environment_info(self.device)
        env["determinism"] = self.determinism
        (self.out_dir / "env.json").write_text(json.dumps(env, indent=2))
        self.finished = True
        print(self.verdict_table())
        print(f"\nresults in {self.out_dir} ({summary['duration_s']:.1f} s)")
        failed = [c.id for c in self.claims if c.robust and not c.holds]
        if failed and strict_mode():
            raise ClaimFailed(f"{self.slug} seed {self.seed}: robust claim(s) {failed} did not hold")
        return summary

    def verdict_table(self) -> str:
        if not self.claims:
            return f"{self.slug}: no claims recorded"
        width = min(max(len(c.text) for c in self.claims), 90)
        lines = [f"{'claim':<6} {'robust':<6} {'verdict':<13} text", "-" * (30 + width)]
        for c in self.claims:
            text = c.text if len(c.text) <= 90 else c.text[:87] + "..."
            lines.append(f"{c.id:<6} {'yes' if c.robust else '':<6} "
                         f"{'holds' if c.holds else 'does not hold':<13} {text}")
        return "\n".join(lines)


def start(slug: str, scale: str = "smoke", seed: int = 0, device: str = "auto",
          out_dir: str | os.PathLike | None = None, **params) -> Run:
    """Begin a notebook's run; ``params`` are its method knobs, kept in ``params.json``."""
    run = Run(slug, scale=scale, seed=seed, device=device, out_dir=out_dir, params=params)
    print(f"{slug}: scale={scale} seed={run.seed} device={run.device} out={run.out_dir}")
    return run


def show(obj) -> None:
    """Render the source of a function or class in the notebook (plain text elsewhere)."""
    import inspect
    src = inspect.getsource(obj)
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
        if get_ipython() is not None:
            display(Markdown(f"```python\n{src}\n```"))
            return
    except ImportError:
        pass
    print(src)
