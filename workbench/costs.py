"""What a computation costs, measured side by side: interleaved wall-clock timing, floating-point
operations and bytes moved.

A claim about overhead on a shared CPU ("B costs at most 10 % more than A", "B runs at least half
as fast as A") cannot rest on one timing of each: load arrives in bursts. :func:`interleaved`
times the callables in alternating rounds whose order flips every round (A B, B A, A B, ...:
ABBA), after an untimed warm-up of each, so neither always runs second and a burst hits a pair
alike; :func:`spread` summarises the per-round ratios (median, quartiles, range). Beside the
timing stand two counts no load can move: :func:`flops` (``torch.utils.flop_counter``: matrix
products, convolutions and attention only, elementwise work counts zero) and
:func:`bytes_moved` (the bytes every operator reads and writes, elementwise work included).
The counts say what a method adds in arithmetic and memory traffic; the timing what it costs on
this machine, Python and allocation included, within its spread.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["interleaved", "spread", "flops", "bytes_moved"]


def interleaved(fns: dict[str, Callable], repeats: int, warmup: int = 1,
                clock: Callable[[], float] | None = None) -> pd.DataFrame:
    """Wall seconds of each callable of ``fns`` over ``repeats`` rounds, one row a round, a
    column per name. Every round runs each callable once; the order reverses every round (ABBA
    for two), after ``warmup`` untimed calls of each (first-call costs: allocation, lazy init).
    ``clock`` reads the time (default ``time.perf_counter``; ``time.process_time``: the process's
    CPU seconds, which other jobs' load does not enter)."""
    clock = clock or time.perf_counter
    if repeats < 1 or len(fns) < 2:
        raise ValueError(f"need two or more callables and repeats >= 1, got {len(fns)}, {repeats}")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    rows, names = [], list(fns)
    for i in range(repeats):
        row = {}
        for name in (names if i % 2 == 0 else names[::-1]):
            t0 = clock()
            fns[name]()
            row[name] = clock() - t0
        rows.append(row)
    return pd.DataFrame(rows, columns=names)


def spread(ratios) -> dict:
    """Median, quartiles, range and count of per-round ratios (from :func:`interleaved`)."""
    r = np.asarray(ratios, dtype=float)
    return {"median": float(np.median(r)), "q1": float(np.quantile(r, 0.25)),
            "q3": float(np.quantile(r, 0.75)), "min": float(r.min()), "max": float(r.max()),
            "n": int(r.size)}


def flops(fn: Callable) -> int:
    """Floating-point operations of one call of ``fn``, backward included, as
    ``torch.utils.flop_counter.FlopCounterMode`` counts them (matrix products, convolutions,
    attention; elementwise operators count zero)."""
    with FlopCounterMode(display=False) as fc:
        fn()
    return int(fc.get_total_flops())


class _ByteCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:                            # views and aliases move nothing
            self.total += sum(t.numel() * t.element_size() for t in
                              tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        return out


def bytes_moved(fn: Callable) -> int:
    """Bytes one call of ``fn`` reads and writes, summed over every ATen operator it dispatches
    (backward included): each operator's tensor inputs and outputs, views and aliases left out.
    An upper bound on memory traffic with no operator fusion or cache reuse; unlike
    :func:`flops` it sees elementwise work."""
    with _ByteCounter() as bc:
        fn()
    return int(bc.total)
