"""A metric over seeds: its mean and spread, the same wherever it is shown.

``aggregate.csv`` and the report (``report.py``) and a notebook's "What we saw" (``results.py``,
from ``notebooks/results/``) both write ``mean ± std`` of a metric over a run's seeds; both take
it from :func:`mean_std`, so one number is one number. It imports nothing, torch least of all.
"""
from __future__ import annotations

import math
import statistics

__all__ = ["mean_std"]


def mean_std(values) -> tuple[float, float]:
    """The mean of ``values`` and their sample standard deviation (ddof 1: the seeds are a
    sample of the seeds one might have run), 0 for a single value; the spread is NaN where a
    value is infinite. ``values``: finite-or-infinite floats, at least one."""
    vals = [float(v) for v in values]
    mean = statistics.fmean(vals)
    if len(vals) < 2:
        return mean, 0.0
    try:
        return mean, statistics.stdev(vals)
    except (ValueError, OverflowError):     # an infinite value: no spread to give
        return mean, math.nan
