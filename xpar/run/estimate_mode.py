"""Estimate mode: the Report of a layout beyond this machine, from the cost model and a
fake-process-group dry run of the real engine factory.

The Report has the fields and metric names of a measured run (xpar.track.report), with
``mode='estimate'``: throughput and MFU from :func:`xpar.estimate.cost.estimate`; memory by term
(``memory/<term>_bytes``) on the most loaded device; ``estimate/time_<term>_s``; the fit
(``estimate/memory_fits``, headroom, peak pipeline rank); the dry run's parameter bytes against
the cost model's (``estimate/dryrun_*``); an offloaded optimizer's parts (``estimate/offload_*``);
the bubble (``pipeline/bubble_ratio``, ``_theory``); ``comm/<group>_<collective>_bytes``.
Notes: the cost model's notes. Artifacts: memory per pipeline rank and the step-time breakdown.

Metric list: docs/reference/metrics.md. Units: seconds, bytes, fractions.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from xpar.config.checks.hardware import UNCALIBRATED_LOCAL
from xpar.config.spec import RunSpec
from xpar.estimate.comm.volume import ring_factor
from xpar.estimate.context_parallel import fold_cp
from xpar.estimate.cost import assumptions_for, estimate, peak_memory
from xpar.run.dryrun import PlanError, dry_run, gap_note, not_buildable, representative_ranks
from xpar.track.estimate_figures import write_figures
from xpar.estimate.memory.model_states import MEMORY_TERMS, expert_dp_size, peak_ranks
from xpar.estimate.memory.offload import OFFLOAD_TERMS
from xpar.track.report import RATES, Report, layout_name, zero_paper_bytes
from xpar.estimate.schedule import bubble_theory

DRYRUN_FILE = "dryrun.json"


TIME_ROUNDING_S = 1e-9
"""A step-time term this far below 0 is a difference's rounding (seconds), not a negative time."""


class EstimateError(PlanError):
    """The cost model gave a figure that is not finite, or negative: no usable estimate."""


def unusable_figures(report: Report) -> list[str]:
    """The figures of ``report`` that are not finite numbers >= 0, as ``name=value``: its
    throughput and memory headline, memory terms and step-time terms (``estimate/time_*_s``, to
    :data:`TIME_ROUNDING_S`)."""
    figures = {f"throughput/{k}": getattr(report, k) for k in ("step_time_s", "tokens_per_s", "tflops_per_device",
                                                               "mfu", "hfu")}
    figures["memory/peak_bytes_per_device"] = report.peak_bytes_per_device
    figures |= {f"memory/{k}_bytes": v for k, v in report.memory.items()}
    terms = {k: v for k, v in report.extra.items() if k.startswith("estimate/time_")}
    bad = [f"{k}={v:.4g}" for k, v in figures.items() if not (math.isfinite(v) and v >= 0)]
    return bad + [f"{k}={v:.4g}" for k, v in terms.items() if not (math.isfinite(v) and v >= -TIME_ROUNDING_S)]


def check_figures(report: Report) -> Report:
    """``report`` when every figure is usable (:func:`unusable_figures`).

    Raises:
        EstimateError: one line naming the figures and where to look."""
    bad = unusable_figures(report)
    if bad:
        raise EstimateError(f"the estimate is unusable, not recorded as finished: {', '.join(bad[:4])}"
                            f"{' ...' if len(bad) > 4 else ''} (not finite or negative); a figure of the model, "
                            f"layout or hardware is outside what the cost model prices: check the values given "
                            f"(xpar --help).")
    return report


def comm_metrics(spec: RunSpec, ring_bytes: dict[str, float]) -> dict[str, float]:
    """``comm/*`` metrics from the cost model's ring bytes per device (xpar.estimate.comm.volume): payload
    bytes per collective and group (dp, the routed experts' expert-dp ``edp`` where it is a group of its own, tp)
    and the ring bytes sent. The gradients reduce over dp x cp ranks (cp ranks hold the same parameters: the
    cp-folded spec's dp, as the engine's dp metrics count them)."""
    out: dict[str, float] = {}
    folded = fold_cp(spec)
    groups = (("dp", folded.dp), ("edp", expert_dp_size(folded) if "edp_allreduce" in ring_bytes else 1), ("tp", spec.tp))
    for group, n in groups:
        if n <= 1:
            continue
        ring = 0.0
        for coll in ("allreduce", "allgather", "reduce_scatter"):
            b = ring_bytes.get(f"{group}_{coll}", 0.0)
            out[f"comm/{group}_{coll}_bytes"] = b / ring_factor(coll, n)
            ring += b
        out[f"comm/{group}_ring_bytes"] = ring
    if spec.pp > 1:
        out["comm/pp_send_recv_bytes"] = ring_bytes.get("pp_send_recv", 0.0)
    return out


def memory_detail_metrics(mem) -> dict[str, float]:
    """``estimate/`` memory sub-terms of the peak device (bytes): params_master and
    params_compute (stored parameters, bf16 compute copies), activations_saved and
    activations_transient, each comm buffer (``estimate/buffer_<name>_bytes``) and
    ``memory_usable_bytes`` (device memory less hardware.memory_headroom)."""
    st, act = mem.detail.get("states", {}), mem.detail.get("activations", {})
    out = {f"estimate/{k}_bytes": float(st[k]) for k in ("params_master", "params_compute") if k in st}
    out.update({f"estimate/activations_{k}_bytes": float(act[k]) for k in ("saved", "transient") if k in act})
    out.update({f"estimate/buffer_{k}_bytes": float(v) for k, v in mem.detail.get("comm_buffers", {}).items()})
    out["estimate/memory_usable_bytes"] = float(mem.usable)
    return out


def offload_metrics(offload: dict) -> dict[str, float]:
    """``estimate/offload_<part>_s`` (:data:`OFFLOAD_TERMS`, seconds per step) and
    ``estimate/offload_host_bytes`` (per node) of an offloaded step; {} without offload."""
    out = {f"estimate/offload_{k}": float(offload[k]) for k in OFFLOAD_TERMS if k in offload}
    if "host_bytes" in offload:
        out["estimate/offload_host_bytes"] = float(offload["host_bytes"])
    return out


def estimate_report(spec: RunSpec, out_dir: Path) -> Report:
    """The Report of ``spec`` in estimate mode (see the module docstring), with the dry run
    unless ``spec.dry_run`` is False or the engine cannot build the layout (a note says why:
    :func:`xpar.run.dryrun.not_buildable`); figures and ``dryrun.json`` are written to ``out_dir``.

    Raises:
        xpar.run.dryrun.PlanError: torch refused to build a rank of the layout.
    """
    est = estimate(spec, assumptions_for(spec))
    mem = est.memory
    peak_dp, ranks = peak_ranks(fold_cp(spec), mem.pp_rank)  # dp: the dp x cp replica index under cp
    extra: dict[str, float] = {f"estimate/time_{k}_s": float(v) for k, v in est.time_breakdown.items()}
    extra.update({
        "estimate/hw_tflops_per_device": est.hw_tflops_per_device,
        "estimate/memory_fits": float(mem.fits),
        "estimate/device_memory_bytes": mem.device_memory,
        "estimate/memory_headroom_bytes": mem.device_memory - mem.total,
        "estimate/peak_pp_rank": float(mem.pp_rank),
        "estimate/microbatches_in_flight": float(mem.detail["activations"]["microbatches_in_flight"]),
    })
    extra.update(memory_detail_metrics(mem))
    extra.update(offload_metrics(est.offload))
    artifacts: list[str] = []
    dry_note = not_buildable(spec)  # then the dry run's note: why it was skipped, or where it disagrees
    if spec.dry_run and not dry_note:
        coords = representative_ranks(fold_cp(spec))  # dp: the dp x cp replica index under cp (dry_run)
        peak_coords = (mem.pp_rank, peak_dp, 0)  # the estimate's most loaded device, built too
        d = dry_run(spec, coords + ([peak_coords] if peak_coords not in coords else []))
        peak = next(r for r in d.ranks if (r.coords["pp"], r.coords["dp"], r.coords["tp"]) == peak_coords)
        extra.update({"estimate/dryrun_param_bytes": float(peak.dryrun["params"]),
                      "estimate/analytic_param_bytes": float(peak.analytic["params"]),
                      "estimate/dryrun_param_bytes_diff": float(d.max_diff),
                      "estimate/dryrun_ranks": float(len(d.ranks)), "estimate/dryrun_s": d.seconds})
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / DRYRUN_FILE
        path.write_text(json.dumps(d.to_dict(), indent=1))
        artifacts.append(str(path))
        dry_note = gap_note(spec, d)  # the engine and the cost model disagree on a built rank: a note, not only a metric
    if spec.pp > 1:
        extra["pipeline/bubble_ratio"] = est.bubble_ratio
        extra["pipeline/bubble_ratio_theory"] = bubble_theory(spec.layout.schedule, spec.pp, spec.micro_batches,
                                                              spec.layout.virtual_stages)
    extra.update(comm_metrics(spec, est.comm_bytes))
    report = Report(
        mode="estimate", layout=layout_name(spec), world_size=spec.world_size,
        step_time_s=est.time_per_step_s, **{k: getattr(est, k) for k in RATES}, peak_bytes_per_device=mem.total,
        peak_rank=ranks[0],
        memory={k: float(getattr(mem, k)) for k in MEMORY_TERMS}, extra=extra)
    report.extra["memory/zero_paper_model_states_bytes"] = zero_paper_bytes(spec)
    report.notes = list(est.notes) + ([UNCALIBRATED_LOCAL] if spec.hardware.name == "local" else []) \
        + ([dry_note] if spec.dry_run and dry_note else [])
    check_figures(report)
    report.artifacts = artifacts + [str(p) for p in _figures(spec, est, out_dir)]
    return report




def _figures(spec: RunSpec, est, out_dir: Path) -> list[Path]:
    per_rank = [peak_memory(spec, r) for r in range(spec.pp)]
    label = f"model={spec.model.name} {layout_name(spec)} on {spec.hardware.name} ({spec.world_size} devices)"
    return write_figures(per_rank, est.time_breakdown, label, out_dir)
