"""How far an executed run's own estimate was from what happened (the closed loop).

Every measured run is also estimated on the hardware it ran on (:func:`xpar.estimate.cost.estimate`
with the spec's framework assumptions; a ``hardware=calibrated_<name>`` preset from
``xpar calibrate`` gives the estimate measured link and memory figures) and logs:

- ``fidelity/step_time_ratio``: estimated / measured step time (median of timed steps);
- ``fidelity/peak_memory_ratio``: estimated / measured peak bytes per device;
- ``fidelity/bubble_diff``: estimated - measured bubble ratio (0 - 0 without a pipeline:
  logged for every run, so every executed run carries the three). Both on the measured
  definition (xpar.bubble): the idle fraction of the pipeline ranks within the schedule's time,
  where a rank waiting for a send is idle too; the estimate's is :func:`estimated_idle` (its
  schedule bubble plus its exposed pipeline sends), which is the schedule's bubble when sends
  are free;
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
        out["fidelity/bubble_diff"] = (estimated_idle(est.time_breakdown) if spec.pp > 1 else 0.0) - measured_bubble
    return out


def estimated_idle(breakdown: dict[str, float]) -> float:
    """The estimate's idle fraction of the pipeline ranks within the schedule (the measured
    bubble's definition, xpar.bubble: 1 - sum busy / (pp x schedule time), busy being the stages'
    compute): (bubble + exposed pipeline sends) / (the schedule's time: compute, host time, tp
    collectives, sends and bubble) from the slowest rank's step-time terms
    (Estimate.time_breakdown, seconds); 0 for an empty step."""
    pipeline = sum(breakdown.get(k, 0.0) for k in ("matmul", "memory_bound", "tp_comm", "pp_comm", "bubble",
                                                   "host_overhead"))
    return (breakdown.get("bubble", 0.0) + breakdown.get("pp_comm", 0.0)) / pipeline if pipeline else 0.0
