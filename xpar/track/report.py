"""Report: the headline figures of a run, one dataclass for measured runs and estimates,
and its console table.

Metric definitions:

- ``throughput/tokens_per_s``: global tokens per step / median step time, over timed steps
  (warm-up excluded); ``throughput/tokens_per_s_per_device`` divides by the world size.
- ``throughput/tflops_per_device``: model FLOPs per step (xpar.estimate.compute.flops, non-causal
  attention, no recompute) / step time / world size, in TFLOP/s (1e12 FLOP/s).
- ``throughput/mfu``: tflops_per_device / the hardware's dense peak for the dtype;
  ``throughput/hfu`` the same with hardware FLOPs (recompute included).
- ``memory/peak_bytes_per_device``: the most loaded rank's bytes
  (:mod:`xpar.parallel.memory_accounting` for measured runs, :mod:`xpar.estimate.memory.per_device` for
  estimates), with the breakdown ``memory/<term>_bytes``.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional

from xpar.config.schema import SUMMARY_METRICS
from xpar.config.spec import RunSpec
from xpar.track.bubble import summarize
from xpar.estimate.step_parts import compute_peak, step_rates
from xpar.estimate.memory.model_states import STATE_BYTES, zero_model_state_bytes
from xpar.track.timing import step_time_stats
from xpar.models.shapes import param_count

MEASURED_TERMS = ("params", "grads", "optimizer", "activations")
"""The terms a measured run accounts (the first four of xpar.estimate.memory.per_device.MEMORY_TERMS)."""

RATES = ("tokens_per_s", "tflops_per_device", "mfu", "hfu")
"""The rates a Report carries, as :func:`xpar.estimate.step_parts.step_rates` computes them for a measured
step and :func:`xpar.estimate.cost.estimate` for an estimated one (the Estimate's fields of these names)."""


@dataclass
class Report:
    """Headline figures. Units: seconds, tokens/s, TFLOP/s (1e12 FLOP/s), bytes."""

    mode: str
    """'measured' (workers ran) or 'estimate' (cost model)."""
    layout: str
    world_size: int
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    hfu: float
    peak_bytes_per_device: float
    peak_rank: int
    memory: dict[str, float]
    """Breakdown of the peak rank: params, grads, optimizer, activations (+ estimate terms)."""
    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)
    """Further metrics by full name (pipeline/*, comm/*, estimate/*)."""
    timeline: Optional[dict] = None
    """Pipelined runs: one step's measured and simulated action times (xpar.track.bubble)."""
    artifacts: list[str] = field(default_factory=list)
    """Files to log with the run (estimates: figures, dry-run JSON); paths."""
    notes: list[str] = field(default_factory=list)
    """What the figures rest on, said under the table (estimates: the cost model's notes)."""

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_s / self.world_size

    @property
    def final_loss(self) -> Optional[float]:
        return self.losses[-1] if self.losses else None

    def metrics(self) -> dict[str, float]:
        """Summary metrics by their logged names."""
        out = {
            "throughput/tokens_per_s": self.tokens_per_s,
            "throughput/tokens_per_s_per_device": self.tokens_per_s_per_device,
            "throughput/step_time_s": self.step_time_s,
            "throughput/tflops_per_device": self.tflops_per_device,
            "throughput/mfu": self.mfu,
            "throughput/hfu": self.hfu,
            "memory/peak_bytes_per_device": self.peak_bytes_per_device,
        }
        out.update({f"memory/{k}_bytes": float(v) for k, v in self.memory.items()})
        out["memory/model_states_bytes"] = float(sum(self.memory.get(k, 0.0) for k in ("params", "grads", "optimizer")))
        if self.final_loss is not None:
            out["train/final_loss"] = self.final_loss
        out.update(self.extra)
        return out




def layout_name(spec: RunSpec) -> str:
    """``dp2-tp1-pp1-zero0-m1-b4`` (tag ``xpar.layout``, the console title); ``-sp`` after tp with
    sequence parallelism, ``-cp2`` after it under context parallelism, ``-ep2`` after that under
    expert parallelism (every axis above 1); the schedule under pp; ``-recompute_full`` (the policy)
    last where recompute is not none, so that layouts a sweep tells apart have different names."""
    lay = spec.layout
    cp, ep = lay.cp, lay.ep
    s = (f"dp{spec.dp}-tp{spec.tp}" + ("-sp" if lay.sequence_parallel else "") + (f"-cp{cp}" if cp > 1 else "")
         + (f"-ep{ep}" if ep > 1 else "")
         + f"-pp{spec.pp}-zero{lay.zero_stage}-m{spec.micro_batches}-b{spec.train.micro_batch_size}")
    if spec.pp > 1:
        s += f"-{lay.schedule}" + (f"-v{lay.virtual_stages}" if lay.virtual_stages > 1 else "")
    return s + (f"-recompute_{lay.recompute}" if lay.recompute != "none" else "")


def zero_paper_bytes(spec: RunSpec) -> float:
    """Model-state bytes per device by the ZeRO paper's formulas
    (:func:`xpar.estimate.memory.per_device.zero_model_state_bytes`) with the run's bytes per param
    (:data:`xpar.estimate.memory.per_device.STATE_BYTES`), for Psi = parameters / (tp*pp) and N = dp.
    Logged as ``memory/zero_paper_model_states_bytes`` beside the measured or estimated
    params + grads + optimizer bytes (ideal even shards; the run's own figure is exact)."""
    psi = param_count(spec.model).total / (spec.tp * spec.pp)
    P, G, K = STATE_BYTES[spec.train.dtype]
    return zero_model_state_bytes(psi, spec.layout.zero_stage, spec.dp, P, G, K)


def summarize_measured(spec: RunSpec, stats: list[dict]) -> Report:
    """Fold per-rank stats into a Report.

    Step time per step = max over ranks; the reported step time is the MEDIAN over timed
    steps (warm-up excluded), robust to the odd slow step of a shared CPU; its spread goes
    to ``extra``: ``throughput/step_time_{median,iqr,min,max,mean}_s`` and
    ``throughput/step_time_cv`` (xpar.track.timing.step_time_stats). The global loss of a step is
    the mean over ranks that see a loss (tp ranks hold equal copies, so this is the mean
    over dp replicas).
    """
    w = spec.train.warmup_steps
    per_step = [max(s["step_times_s"][i] for s in stats) for i in range(spec.train.steps)]
    timed = per_step[w:]
    spread = step_time_stats(timed)
    step_time = spread["median"]
    rate = step_rates(spec, step_time)  # as the estimate computes its rates
    totals = []
    for s in stats:
        mem = s["memory"]
        totals.append(mem.get("cuda_max_allocated") or sum(mem[k] for k in MEASURED_TERMS))
    peak_rank = max(range(len(stats)), key=lambda r: totals[r])
    losses = []
    for i in range(spec.train.steps):
        vals = [s["losses"][i] for s in stats if s["losses"][i] is not None]
        losses.append(statistics.fmean(vals))
    report = Report(
        mode="measured", layout=layout_name(spec), world_size=spec.world_size,
        step_time_s=step_time, **{k: rate[k] for k in RATES},
        peak_bytes_per_device=float(totals[peak_rank]), peak_rank=stats[peak_rank]["rank"],
        memory={k: float(stats[peak_rank]["memory"][k]) for k in MEASURED_TERMS},
        losses=losses, step_times_s=per_step)
    report.extra["memory/zero_paper_model_states_bytes"] = zero_paper_bytes(spec)
    report.extra.update({f"throughput/step_time_{k}_s" if k != "cv" else "throughput/step_time_cv": v
                         for k, v in spread.items()})
    if spec.pp > 1:
        pipeline, report.timeline = summarize(spec, stats)
        report.extra.update(pipeline)
    comm = [s["comm"] for s in stats if s.get("comm")]  # comm/<axis>_<kind>_*, time/comm_* per step per device
    if comm:
        report.extra.update({k: float(max(c.get(k, 0.0) for c in comm)) for k in sorted({k for c in comm for k in c})})
    report.extra.update(step_split(stats, w))
    exposed = [v for k, v in report.extra.items() if k.startswith("time/comm_") and k.endswith("_exposed_s")
               and k != "time/comm_exposed_s"]
    if exposed and "time/comm_exposed_s" in report.extra:  # the total of the collectives the table and figure list
        report.extra["time/comm_exposed_s"] = float(sum(exposed))
    return report


def step_split(stats: list[dict], warmup: int) -> dict[str, float]:
    """Where a rank's step went, as the mean over ranks of per-rank medians over the timed steps:
    ``time/compute_cpu_s`` (the rank's thread on a core: its compute on a CPU) and
    ``time/comm_exposed_s`` (blocked in the logged collectives, xpar.parallel.comm_log) and
    ``time/core_wait_s`` (runnable, waiting for a core: other processes on the machine's cores);
    their sum against the step time says how much of the step the three explain. Empty without
    CPU times. :func:`summarize_measured` then sets ``time/comm_exposed_s`` to the sum of the
    per-collective figures it reports (each the max over ranks of the rank's median), so that the
    total is never below one of its collectives."""
    timed = [s for s in stats if s.get("thread_cpu_s", [])[warmup:]]
    if not timed:
        return {}
    cpu = [statistics.median(s["thread_cpu_s"][warmup:]) for s in timed]
    wait = [statistics.median((s.get("core_wait_s") or [0.0])[warmup:] or [0.0]) for s in timed]
    exposed = [sum(v for k, v in (s.get("comm") or {}).items() if k.endswith("_exposed_s")) for s in timed]
    return {"time/compute_cpu_s": statistics.fmean(cpu), "time/comm_exposed_s": statistics.fmean(exposed),
            "time/core_wait_s": statistics.fmean(wait)}


def comm_cell(extra: dict, key: str) -> str:
    """The table cell of one ``comm/<axis>_<kind>_bytes`` metric: its bytes, and what a measured
    run logged beside them (calls, the estimate's bytes, exposed and issued seconds)."""
    stem = key[len("comm/"):-len("_bytes")]
    cell = format_bytes(extra[key])
    if f"comm/{stem}_calls" in extra:
        calls = extra[f"comm/{stem}_calls"]
        cell += f" in {calls:.0f} call{'' if round(calls) == 1 else 's'}"
    if f"fidelity/estimate_comm_{stem}_bytes" in extra:
        cell += f" (estimate {format_bytes(extra[f'fidelity/estimate_comm_{stem}_bytes'])})"
    if f"time/comm_{stem}_exposed_s" in extra:
        cell += (f"; {extra[f'time/comm_{stem}_exposed_s'] * 1e3:.1f} ms exposed,"
                 f" {extra[f'time/comm_{stem}_issued_s'] * 1e3:.1f} ms issued")
    return cell


def mfu_label(spec: RunSpec) -> str:
    """The MFU row's label: the dense peak it divides by, which depends on the training dtype
    (:func:`xpar.estimate.step_parts.compute_peak`: fp8 over the fp8 peak, e.g. 1979 TFLOP/s on an
    H100 SXM, half the MFU of the same FLOP/s in bf16); 'MFU' alone when no peak is known."""
    peak = compute_peak(spec.hardware, spec.train.dtype) / 1e12
    return f"MFU (of the {spec.train.dtype} peak, {peak:.4g} TFLOP/s)" if peak else "MFU"


def split_scope(spec: RunSpec, key: str) -> str:
    """The console label's scope of a step-split row (:func:`step_split`): 'per step', and for
    ``time/comm_exposed_s`` the axes whose time it leaves out. Only the collectives that
    :func:`xpar.run.train.comm_groups` logs are timed (dp, cp, ep); tp's DTensor collectives are
    counted in bytes only and pipeline sends are timed in the pipeline's records, so a tp or pp run's
    0.0 ms is not 'no communication'."""
    untimed = [axis for axis, degree in (("tp", spec.tp), ("pp", spec.pp)) if degree > 1]
    if key != "time/comm_exposed_s" or not untimed:
        return "per step"
    return f"per step; {' and '.join(untimed)} not timed"


def memory_unit(nbytes: float) -> tuple[str, float]:
    """The binary unit that shows ``nbytes`` with a leading digit: (name, bytes per unit)."""
    for name, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(nbytes) >= size:
            return name, size
    return "B", 1


def format_bytes(n: float) -> str:
    """``n`` bytes in the unit that suits it: '9.07 MiB', '52.30 GiB'."""
    unit, size = memory_unit(n)
    return f"{n / size:.2f} {unit}" if size > 1 else f"{n:.0f} B"


NOT_ALL_RECORDED = "NOT all recorded in MLflow"
"""How the summary's last line starts when the store did not take every record
(:func:`xpar.track.recorder.recording_gap`)."""


def print_report(spec: RunSpec, report: Report, where: Optional[str] = None) -> None:
    """The console summary table (rich); ``where``: where the run was recorded, or the line
    saying what the store did not take (it starts with :data:`NOT_ALL_RECORDED`)."""
    from rich.console import Console
    from rich.table import Table

    title = ("ESTIMATE (analytic cost model, not measured)" if report.mode == "estimate"
             else "Measured on this machine")
    t = Table(title=f"xpar: model={spec.model.name} {report.layout} on {spec.hardware.name} -- {title}")
    t.add_column("figure")
    t.add_column("value", justify="right")
    rows = [
        ("world size (devices)", f"{report.world_size}"),
        ("global batch x seq", f"{spec.global_batch} x {spec.seq_len}"),
        ("step time", f"{report.step_time_s * 1e3:.1f} ms" if report.step_time_s < 10 else f"{report.step_time_s:,.1f} s"),
        ("tokens/s (global)", f"{report.tokens_per_s:,.0f}"),
        ("tokens/s per device", f"{report.tokens_per_s_per_device:,.0f}"),
        ("model TFLOP/s per device", f"{report.tflops_per_device:.4g}"),
        (mfu_label(spec), f"{report.mfu:.1%}" + ("" if spec.hardware.peak_tflops else " (no peak known)")),
        (f"peak memory per device (rank {report.peak_rank})", format_bytes(report.peak_bytes_per_device)),
    ]
    rows += [(f"  {k}", format_bytes(v)) for k, v in report.memory.items()]
    if report.final_loss is not None:
        rows.append(("loss first -> last", f"{report.losses[0]:.4f} -> {report.final_loss:.4f}"))
    for k, v in report.extra.items():
        if k.startswith("pipeline/"):
            rows.append((k, f"{v:.3f}"))
        elif k.startswith("comm/") and k.endswith("_bytes"):
            rows.append((f"{k} (per step per device)", comm_cell(report.extra, k)))
        elif k in ("time/compute_cpu_s", "time/comm_exposed_s", "time/core_wait_s"):
            rows.append((f"{k} ({split_scope(spec, k)})", f"{v * 1e3:.1f} ms"))
        elif k.startswith("estimate/"):  # breakdowns of an estimate
            rows.append((k, f"{v * 1e3:.1f} ms" if k.endswith("_s") else
                         format_bytes(v) if k.endswith(("_bytes", "_bytes_diff")) else f"{v:.4g}"))
        elif k in ("fidelity/step_time_ratio", "fidelity/peak_memory_ratio", "fidelity/bubble_diff"):
            label = "UNCALIBRATED hardware=local: xpar calibrate" if spec.hardware.name == "local" else \
                "own estimate vs measured"
            rows.append((f"{k} ({label})", f"{v:.3f}"))
    for r in rows:
        t.add_row(*r)
    console = Console(record=True)
    console.print(t)
    from rich.markup import escape
    for n in list(spec.notes) + list(report.notes):  # soft_wrap: a command in a note stays on one line
        console.print(f"[yellow]note:[/] {escape(n)}", highlight=False, soft_wrap=True)
    if report.artifacts:
        console.print(f"Files: {', '.join(report.artifacts)}", soft_wrap=True)
    if where and where.startswith(NOT_ALL_RECORDED):
        console.print(f"[red]{escape(where)}[/]", highlight=False, soft_wrap=True)
    elif where:  # one line per command, whatever the width (a log file: rich wraps at 80 columns)
        console.print(f"Recorded in MLflow: {escape(where)}", soft_wrap=True, highlight=False)
    to_log_files(console.export_text())


def to_log_files(text: str) -> None:
    """Append ``text`` to the log files the root logger writes (Hydra's job log, ``xpar.log`` in the
    run folder), not to the console again: the job log held nothing, xpar prints its results."""
    import logging
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            try:
                handler.acquire()
                handler.stream.write(text if text.endswith("\n") else text + "\n")
                handler.flush()
            except (OSError, ValueError, AttributeError):
                pass  # a full disk or a closed file: the console has it
            finally:
                handler.release()
