"""Workbench: the helper package behind the notebooks (see DESIGN.md).

Import is cheap: torch and matplotlib load only when a function that needs them runs.
"""
from .env import cache_dir, project_root
from .runtime import ClaimFailed, Run, seed_everything, show, start

__all__ = ["ClaimFailed", "Run", "cache_dir", "project_root", "seed_everything", "show", "start"]
__version__ = "0.1.0"
