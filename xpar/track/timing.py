"""Step-time statistics of a measured run (torch-free): location and spread of the timed steps."""
from __future__ import annotations

import statistics


def step_time_stats(times: list[float]) -> dict[str, float]:
    """Location and spread of step times (seconds): ``median``, ``iqr`` (75th - 25th
    percentile, linear interpolation), ``min``, ``max``, ``mean`` and ``cv`` (coefficient
    of variation: sample standard deviation / mean; 0 for fewer than 2 steps)."""
    if not times:
        return {}
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [times[0]] * 3
    mean = statistics.fmean(times)
    sd = statistics.stdev(times) if len(times) > 1 else 0.0
    return {"median": statistics.median(times), "iqr": q[2] - q[0], "min": min(times),
            "max": max(times), "mean": mean, "cv": sd / mean if mean else 0.0}
