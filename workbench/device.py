"""Seeds, devices and fast math: the ground floor that models, methods, experiments and the run
all stand on.

:func:`seed_everything` seeds Python, numpy and torch; :func:`pick_device` turns a notebook's
``device`` parameter into a ``torch.device``; :func:`run_device` is that device as a run holds it
(under the device audit, the audit's sentinel, see ``placement.py``); :func:`fast_math` is the
bf16/TF32 block of the LM training loops. Nothing here imports from the workbench above the
ground floor, and torch loads only when a function runs (the CLI imports the run, which imports
this module, without torch). The scales live here too: every layer reads them.
"""
from __future__ import annotations

import os
import random

import numpy as np

DEVICES = ("auto", "cpu", "cuda", "mps")

# smoke: CI's mechanics check (at most 90 s on 2 CPU cores); mid: each paper's effect given a fair
# chance on a reader's laptop (at most 15 minutes a seed on 2 cores); full: one GPU
SCALES = ("smoke", "mid", "full")
# mid trains the methods longer on the zoo a laptop has (the shipped smoke models): its room is
# in the method's own sizes, not in a larger backbone
ZOO_SCALES = {"smoke": "smoke", "mid": "smoke", "full": "full"}


def zoo_scale(scale: str) -> str:
    """The zoo size (``smoke`` or ``full``) that a run at ``scale`` loads, builds and caches under:
    ``mid`` runs on the smoke zoo, so a mid run reuses every shipped model, pool and fine-tune."""
    try:
        return ZOO_SCALES[scale]
    except KeyError:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}") from None


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
        # cuBLAS needs this workspace setting for deterministic matmuls (set before first use)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # deterministic kernels where PyTorch has them; warn_only: an op without one still runs
    # (e.g. scatter_add on CUDA) and says so, rather than stopping a notebook
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
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


def run_device(device: str = "auto"):
    """:func:`pick_device`, except on a CPU under the device audit (``WORKBENCH_DEVICE_AUDIT=1``):
    then the audit is installed and the device is its sentinel ``cpu:0``, a device that code
    reaches only by being handed it (placement.py)."""
    dev = pick_device(device)
    from . import placement
    if dev.type == "cpu" and placement.requested():
        placement.start()
        return placement.SENTINEL
    return dev


def fast_math(device, enabled: bool = True):
    """bf16 autocast and TF32 matmuls on CUDA for a training or evaluation block; nothing
    elsewhere (a CPU run is bit for bit what it was): ``with fast_math(run.device): ...``.

    Used by the LM training loops (zoo builds, LoRA fine-tunes, FURA, NBDiff). Not where a
    claim is about precision itself: Hestia's (10) and NFI's (12) numerics are measured in the
    dtypes they name, and 14's quantizers compare reconstruction errors in float32; those run
    without it (their SIZES cells say so)."""
    import contextlib
    import torch
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if not enabled or dev.type != "cuda":
        return contextlib.nullcontext()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return torch.autocast("cuda", dtype=torch.bfloat16)
