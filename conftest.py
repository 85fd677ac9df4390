"""Root pytest set-up, shared by tests/ and the notebooks nbval executes: robust claims are
enforced (a failing one raises in run.finish()) and matplotlib never needs a screen."""
import os

os.environ["WORKBENCH_STRICT"] = "1"
os.environ.setdefault("MPLBACKEND", "Agg")
