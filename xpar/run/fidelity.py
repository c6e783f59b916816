"""How far an executed run's own estimate was from what happened (the closed loop).

Every measured run is also estimated on the hardware it ran on (:func:`xpar.estimate.cost.estimate`
with the spec's framework) and logs ``fidelity/step_time_ratio`` (estimated / measured median
step time), ``fidelity/peak_memory_ratio`` (estimated / measured peak bytes per device),
``fidelity/bubble_diff`` (estimated - measured idle fraction of the pipeline ranks, on the
measured definition: :func:`estimated_idle`, 0 - 0 without a pipeline) and
``fidelity/estimate_time_<term>_s`` (the estimate's step time by term).

Units: ratios, fractions, seconds.
"""
from __future__ import annotations

from typing import Optional

from xpar.config.spec import RunSpec
from xpar.estimate.context_parallel import cp_bytes_per_step
from xpar.estimate.columns.one_layout import layout_step
from xpar.estimate.cost import assumptions_for, estimate, waits_unstretched
from xpar.run.estimate_mode import comm_metrics
from xpar.estimate.expert_parallel import ep_bytes_per_step
from xpar.estimate.compute.host import host_costs, host_step, oversubscription
from xpar.track.report import Report


def fidelity_metrics(spec: RunSpec, report: Report, est=None) -> dict[str, float]:
    """The ``fidelity/*`` metrics of a measured ``report`` of ``spec`` (see module docstring);
    ``est``: the run's estimate (:func:`xpar.estimate.cost.estimate` of ``spec``) when the caller
    has it. Ratios are omitted where the measured figure is zero (nothing to compare)."""
    est = est if est is not None else estimate(spec)
    unstretched = waits_unstretched(spec, spec.world_size)  # as the estimate prices the waits
    out = {f"fidelity/estimate_time_{k}_s": float(v) for k, v in est.time_breakdown.items()}
    if report.step_time_s > 0:
        out["fidelity/step_time_ratio"] = est.time_per_step_s / report.step_time_s
    if report.peak_bytes_per_device > 0:
        out["fidelity/peak_memory_ratio"] = est.memory.total / report.peak_bytes_per_device
    measured_bubble = report.extra.get("pipeline/bubble_ratio", 0.0 if spec.pp == 1 else None)
    if measured_bubble is not None:
        idle = 0.0
        if spec.pp > 1:
            dp_end, fsdp = _dp_end(unstretched), unstretched.layout.zero_stage >= 2
            outside = _host_outside(unstretched) + (0.0 if fsdp else dp_end)
            idle = estimated_idle(est.time_breakdown, est.bubble_ratio, spec.pp, outside, dp_end if fsdp else 0.0)
        out["fidelity/bubble_diff"] = idle - measured_bubble
    out.update(estimated_comm(spec, est))
    return out


def estimated_comm(spec: RunSpec, est) -> dict[str, float]:
    """``fidelity/estimate_comm_<axis>_<kind>_bytes``: the estimate's payload bytes per step per
    device of each collective it counts (none where it counts 0), beside what the run measured (``comm/<axis>_<kind>_bytes``, the same
    convention: xpar.run.estimate_mode.comm_metrics), and ``fidelity/estimate_comm_dp_issued_s``."""
    out = {f"fidelity/estimate_{k.replace('/', '_')}": v for k, v in comm_metrics(spec, est.comm_bytes).items()
           if k.endswith("_bytes") and not k.endswith("_ring_bytes") and v}
    for group in ("dp", "edp"):
        if spec.layout.zero_stage == 1 and f"fidelity/estimate_comm_{group}_allgather_bytes" in out:
            # an executed ZeRO-1 is torch's ZeroRedundancyOptimizer: it broadcasts what the estimate gathers
            out[f"fidelity/estimate_comm_{group}_broadcast_bytes"] = out.pop(f"fidelity/estimate_comm_{group}_allgather_bytes")
    if spec.layout.ep > 1 and spec.layout.cp == 1:  # the token all-to-alls (xpar.parallel.expert), beside comm/ep_*
        out["fidelity/estimate_comm_ep_all_to_all_bytes"] = ep_bytes_per_step(spec)
    if spec.layout.cp > 1 and spec.layout.recompute == "none":  # the K/V all-gathers (xpar.parallel.context)
        out["fidelity/estimate_comm_cp_allgather_bytes"] = cp_bytes_per_step(spec)
    if spec.dp * spec.layout.cp > 1 and "dp" in est.comm_time:  # cp: dp x cp ranks (fold_cp)
        out["fidelity/estimate_comm_dp_issued_s"] = float(est.comm_time["dp"])
    return out


def _host_outside(spec: RunSpec) -> float:
    """Seconds of the estimate's host_overhead term spent after the schedule (optimizer, clip and
    its all-reduces: xpar.estimate.compute.host.host_step), most on any pipeline rank, stretched as the
    estimate's terms are when workers outnumber cores."""
    h, lay = host_costs(spec), spec.layout
    outside = max(host_step(h, lay.layers_of(r), lay.has_first_stage(r), lay.has_last_stage(r)) for r in range(spec.pp))
    return outside * oversubscription(spec.hardware.cpu_cores, spec.world_size, spec.train.threads_per_worker or 1)


def _dp_end(spec: RunSpec) -> float:
    """Seconds of the estimate's dp_comm_exposed term left after the slowest pipeline rank's last
    backward (xpar.estimate.columns.step_time.Step's ``dp_end``: the last backward's reductions, ZeRO-1's gathers
    after the step), stretched as the estimate's terms are; the rest of the term, the FSDP
    gathers of every micro-batch, runs inside the stages' forward and backward. Under FSDP
    (ZeRO-2/3) torch runs that reduction in the schedule, after the stage's actions
    (``PipelineStage.perform_reduce_grad``, torch 2.13): inside the measured schedule time, and
    idle by the measured definition; otherwise it is outside the schedule (DDP's in the last
    backward counted there too)."""
    slow = layout_step(spec, assumptions_for(spec), 0.0, 0, 0.0).slowest  # the optimizer term is not read
    return float(slow["dp_end"][0]) * oversubscription(spec.hardware.cpu_cores, spec.world_size,
                                             spec.train.threads_per_worker or 1)


def estimated_idle(breakdown: dict[str, float], beta: float, pp: int, outside: float = 0.0,
                   idle_inside: float = 0.0) -> float:
    """The estimate's idle fraction of the ``pp`` pipeline ranks within the schedule, on the
    measured bubble's definition (xpar.track.bubble: 1 - sum busy / (pp x schedule time), busy being the
    stages' compute): 1 - (m x mean micro-batch time - pipeline sends) / schedule time, from the
    slowest rank's step-time terms (Estimate.time_breakdown, seconds) and the schedule's bubble
    ``beta``. The schedule's time is the compute, host, tp, send, dp and bubble terms, less
    ``outside`` (seconds after the schedule: :func:`_host_outside`, and :func:`_dp_end` without
    FSDP). Of it, the bubble term is beta / (1 - beta) x m x the mean micro-batch time of the
    other ranks (xpar.estimate.cost.fill_time), the rest m x the slowest rank's (dp gathers of
    each micro-batch in): together the mean over all ranks. ``idle_inside``: seconds of the
    schedule outside every stage's actions (FSDP's deferred gradient reduction, :func:`_dp_end`),
    idle on every rank; it is in the slowest rank's terms, not in the others' (the bubble term).
    Equals beta + sends / schedule time when the ranks are balanced; a rank lighter than the
    slowest idles too. 0 for an empty step or no bubble."""
    pipeline = sum(breakdown.get(k, 0.0) for k in ("matmul", "memory_bound", "tp_comm", "pp_comm", "bubble",
                                                   "dp_comm_exposed", "host_overhead")) - outside
    if not pipeline or not 0 < beta < 1:
        return 0.0
    bubble = breakdown.get("bubble", 0.0)
    others, slowest = bubble * (1 - beta) / beta, pipeline - bubble  # m x micro-batch time
    busy_per_rank = (others * (pp - 1) + slowest - idle_inside) / pp - breakdown.get("pp_comm", 0.0)
    return 1 - busy_per_rank / pipeline


def task_cpu_ns(pids: list[int], main_only: bool = False) -> dict[tuple[int, int], tuple[int, int]]:
    """Per thread of the processes ``pids`` (Linux ``/proc/<pid>/task/<tid>/schedstat``): (ns on a
    core, ns runnable but waiting for one), keyed by (pid, tid); only each process's main thread
    with ``main_only`` (the one that computes: gloo's and other helper threads mostly wait);
    threads or processes that ended are left out; {} where the kernel does not expose schedstat."""
    import os

    out = {}
    for pid in pids:
        try:
            tids = [str(pid)] if main_only else os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    run, wait = f.read().split()[:2]
            except (OSError, ValueError):
                continue
            out[pid, int(tid)] = (int(run), int(wait))
    return out


def cpu_share(before: dict, after: dict) -> float:
    """The share of the time the threads wanted a core that they had one, between two
    :func:`task_cpu_ns` samples: sum of on-core ns / sum of (on-core + waiting) ns over the threads
    in both (1.0 when nothing ran). Below 1 when the threads outnumber the cores or other
    processes hold them: a step then takes about 1 / share of its uncontended time."""
    run = wait = 0
    for key, (r1, w1) in after.items():
        r0, w0 = before.get(key, (0, 0))
        run, wait = run + r1 - r0, wait + w1 - w0
    return run / (run + wait) if run + wait > 0 else 1.0


def machine_jiffies() -> tuple[int, int]:
    """(steal, total) clock ticks of all CPUs since boot (Linux ``/proc/stat``, its ``cpu`` line:
    steal is the time the hypervisor ran something else on this guest's vCPUs, which neither a
    task's CPU seconds nor its schedstat wait counts); (0, 0) where there is no such file."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks[:8])


def steal_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the machine's CPU time stolen by the hypervisor between two
    :func:`machine_jiffies` samples (0 when no time passed)."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def cores_got(share: float, workers: int, threads: int, cores: int, steal: float = 0.0) -> float:
    """The cores ``workers`` processes of ``threads`` torch threads effectively had when their
    threads ran ``share`` of the time they were runnable (:func:`cpu_share`) and the hypervisor
    stole ``steal`` of the machine's time (:func:`steal_fraction`): at most ``cores``, at least
    share x workers x threads, times 1 - steal; xpar.estimate.compute.host.oversubscription then
    stretches the estimate by workers x threads / that (1 / share when the workers saturate the
    cores)."""
    return max(1e-3, min(float(cores), share * workers * threads) * (1 - steal))


def usable_cores() -> int:
    """The cores this process (and the workers it starts) may run on: its CPU affinity."""
    import os
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


CONTENTION_SHARE = 0.8
"""A run is measured under contention when its workers' threads had a core for less than this share
of what their own number allows (min(1, cores / (workers x threads))): other processes held the
cores. In a pp sweep measured beside another job, the bubble at m = 8 read 0.170 against a theory
of 0.111 and nothing said the machine was busy."""


def contention(spec: RunSpec, stats: list[dict], cores: int) -> tuple[Optional[float], Optional[str]]:
    """(the mean CPU share of the workers over the timed steps, the note saying the run was measured
    under contention, or None). (None, None) on a GPU or where schedstat is missing. ``cores``: the
    cores the workers may use."""
    shares = [s["cpu_share"] for s in stats if s.get("cpu_share") is not None]
    if not shares:
        return None, None
    share = sum(shares) / len(shares)
    threads = spec.train.threads_per_worker or 1
    expected = min(1.0, cores / (len(stats) * threads))
    if share >= CONTENTION_SHARE * expected:
        return share, None
    return share, (f"measured under contention: the workers' threads had a core {share:.0%} of the time they "
                   f"wanted one, where {len(stats)} worker(s) on {cores} core(s) allow {expected:.0%}; other "
                   f"processes took the rest, so the step time, MFU and bubble read worse than this machine "
                   f"gives (metric system/workers_cpu_share, tag xpar.contention)")