"""Workbench: the helper package behind the notebooks (see docs/design.md).

Import is cheap: torch and matplotlib load only when a function that needs them runs.
"""
from .env import cache_dir, project_root
from .device import seed_everything
from .runtime import ClaimFailed, Run, show, start

__all__ = ["ClaimFailed", "Run", "cache_dir", "project_root", "seed_everything", "show", "start"]
__version__ = "0.1.0"
