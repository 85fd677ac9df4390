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


# nbval waits a hard-coded 5 s for each of a cell's output messages once the cell has replied.
# On the loaded 2-core CI machine 04's nine-minute GRPO cell (its first run) finished, but its
# outputs came later than that, and the run failed on a cell that had worked (nbval issues
# #136 and #231: the wait is not configurable). 120 s still fails a kernel that has hung.
NBVAL_OUTPUT_TIMEOUT = 120


def pytest_collection_modifyitems(items):
    for item in items:
        if type(item).__name__ == "IPyNbCell" and hasattr(item, "output_timeout"):
            item.output_timeout = NBVAL_OUTPUT_TIMEOUT
