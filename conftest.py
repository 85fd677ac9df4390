"""Root pytest set-up, shared by tests/ and the notebooks nbval executes: robust claims are
enforced (a failing one raises in run.finish()) and matplotlib never needs a screen."""
import os

os.environ["WORKBENCH_STRICT"] = "1"
os.environ.setdefault("MPLBACKEND", "Agg")


def pytest_configure(config):
    # Unit tests use tiny tensors: one thread is faster than two fighting over the cores.
    # (Notebooks run in their own kernels and choose for themselves.)
    import torch
    torch.set_num_threads(1)
