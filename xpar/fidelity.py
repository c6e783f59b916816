"""How far an executed run's own estimate was from what happened (the closed loop).

Every measured run is also estimated on the hardware it ran on (:func:`xpar.estimate.cost.estimate`
with the spec's framework assumptions; a ``hardware=calibrated_<name>`` preset from
``xpar calibrate`` gives the estimate measured link and memory figures) and logs:

- ``fidelity/step_time_ratio``: estimated / measured step time (median of timed steps);
- ``fidelity/peak_memory_ratio``: estimated / measured peak bytes per device;
- ``fidelity/bubble_diff``: estimated - measured bubble ratio (0 - 0 without a pipeline:
  logged for every run, so every executed run carries the three);
- ``fidelity/estimate_time_<term>_s``: the estimate's step time by term, beside the measured
  run's figures.
"""
from __future__ import annotations

from xpar.report import Report
from xpar.spec import RunSpec


def fidelity_metrics(spec: RunSpec, report: Report) -> dict[str, float]:
    """The ``fidelity/*`` metrics of a measured ``report`` of ``spec`` (see module docstring).

    Ratios are omitted where the measured figure is zero (nothing to compare)."""
    from xpar.estimate.cost import estimate

    est = estimate(spec)
    out = {f"fidelity/estimate_time_{k}_s": float(v) for k, v in est.time_breakdown.items()}
    if report.step_time_s > 0:
        out["fidelity/step_time_ratio"] = est.time_per_step_s / report.step_time_s
    if report.peak_bytes_per_device > 0:
        out["fidelity/peak_memory_ratio"] = est.memory.total / report.peak_bytes_per_device
    measured_bubble = report.extra.get("pipeline/bubble_ratio", 0.0 if spec.pp == 1 else None)
    if measured_bubble is not None:
        out["fidelity/bubble_diff"] = est.bubble_ratio - measured_bubble
    return out
