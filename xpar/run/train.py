"""The step loop on one rank: data, timing, memory accounting, progress."""
from __future__ import annotations

import os
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from xpar.run.fidelity import cpu_share, task_cpu_ns, usable_cores
from xpar.track.timing import step_time_stats
from xpar.parallel.comm_log import CollectiveLog, ddp_comm
from xpar.parallel.factory import Engine
from xpar.parallel.memory_accounting import ActivationTracker, model_state_bytes
from xpar.parallel.mesh import replica_mesh
from xpar.parallel.tensor import count_tp_comm
from xpar.run.data import TokenSource

if TYPE_CHECKING:
    from xpar.run.checkpoint import History


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train(engine: Engine, show_progress: bool = False, start: Optional["History"] = None,
          after_step: Optional[Callable[[int, list, list, list], object]] = None) -> dict:
    """Run optimizer steps ``start.step`` (0 unless resuming) .. ``spec.train.steps - 1``; return stats.

    Memory and TP communication are accounted on this process's first step (see
    :func:`_step`); the step times of the timed steps (after ``warmup_steps``) carry no
    accounting overhead. ``start`` (:class:`xpar.run.checkpoint.History`): the steps before a
    resumed run's first, whose records begin the returned lists. ``after_step(step, losses,
    times, lrs)`` is called after each step (checkpoints, :class:`xpar.run.checkpoint.Saver`),
    outside the timed region.

    Returns a dict: ``rank``, ``coords`` (pp, dp, tp; cp when cp > 1), ``losses`` (mean over this
    rank's micro-batches per step, and over its cp group, :func:`cp_mean`; None where the rank sees
    no loss), ``step_times_s`` (wall seconds per step, warm-up included), ``step_time_stats`` (of the
    timed steps), ``grad_norms`` (pre-clip global gradient norm per step, equal on every rank),
    ``lrs`` (lr after each step's schedule update), ``memory`` (bytes: params, grads, optimizer,
    activations; bf16 adds params_master, params_compute; CUDA cuda_max_allocated), for pipelined runs
    ``pipeline``, on a CPU ``cpu_share`` (:func:`xpar.run.fidelity.cpu_share` over the timed
    steps), ``comm`` (tp: ``comm/tp_*_bytes``, :class:`xpar.parallel.tensor.TPCommCounter`; dp: the
    logged collectives, :class:`xpar.parallel.comm_log.CollectiveLog`), ``thread_cpu_s`` and
    ``core_wait_s`` per step outside the logged collectives, ``first_step`` (this process's first).
    """
    spec = engine.spec
    first = start.step if start is not None else 0
    data = TokenSource(spec)
    tracker = ActivationTracker([p for c in engine.chunks for p in c.parameters()])
    losses: list[Optional[float]] = list(start.losses) if start is not None else []
    times: list[float] = list(start.times) if start is not None else []
    lrs: list[float] = list(start.lrs) if start is not None else []
    comm: Optional[dict] = None
    progress = _progress(spec.train.steps, first) if show_progress else None
    _before_loop(spec)
    cpu_at_timed: Optional[dict] = None
    log, thread_cpu = CollectiveLog(comm_groups(engine), thread_core_s), []
    try:
        for step in range(first, spec.train.steps):
            if step == max(first, spec.train.warmup_steps) and spec.device == "cpu":
                cpu_at_timed = task_cpu_ns([os.getpid()], main_only=True)
            with log:
                loss, seconds, counter, cpu_s = _step(engine, data, step, tracker, accounting=(step == first))
            thread_cpu.append(tuple(a - b for a, b in zip(cpu_s, log.end_step())))  # less the collectives' own
            loss = cp_mean(loss, engine.mesh, spec.cp, spec.device)  # outside the step and its log
            times.append(seconds)
            if counter is not None:
                comm = counter.metrics()
            losses.append(loss)
            lrs.append(engine.optimizer.param_groups[0]["lr"])  # lr of the next step
            if after_step is not None:
                after_step(step, losses, times, lrs)
            if progress is not None:
                _advance(progress, step, spec.train.steps, loss)
    finally:
        if progress is not None:
            progress[0].stop()
    stats = _rank_stats(engine, tracker, losses, times, lrs)
    stats["first_step"] = first
    if cpu_at_timed is not None:  # the share of the timed steps this rank's thread had a core when it wanted one
        stats["cpu_share"] = cpu_share(cpu_at_timed, task_cpu_ns([os.getpid()], main_only=True))
    return dict(stats, **_comm_stats(engine, first, comm, log), thread_cpu_s=[c for c, _ in thread_cpu],
                core_wait_s=[w for _, w in thread_cpu], comm_exposed_s=log.exposed_per_step())


def _comm_stats(engine: Engine, first: int, tp_comm: Optional[dict], log: CollectiveLog) -> dict:
    """``{'comm': ...}``: the tp counter's bytes, the logged collectives' means over this process's
    timed steps, DDP's logger figures; empty when there are none."""
    timed = max(0, engine.spec.train.warmup_steps - first)
    comm = {**(tp_comm or {}), **log.per_step(timed), **ddp_comm(engine.chunks)}
    return {"comm": comm} if comm else {}


def comm_groups(engine: Engine) -> dict:
    """The process groups whose Python-issued collectives are logged (:class:`CollectiveLog`):
    the dp wrappers' (dp, or the flattened dp x cp under context parallelism, logged as ``dp``:
    the estimate prices cp as dp x cp ranks, xpar.estimate.context_parallel.fold_cp), when it has
    more than one rank; the cp axis's (K/V all-gathers and their gradients' reduction,
    xpar.parallel.context), when cp > 1; under ep the ep group's (token all-to-all) and, when it has more
    than one rank, the expert-dp group's (``edp``: the routed experts' gradient reduction and ZeRO's gathers,
    xpar.parallel.expert; the estimate's ``comm/edp_*``)."""
    spec, out = engine.spec, {}
    if spec.dp * spec.cp > 1:
        out["dp"] = replica_mesh(engine.mesh).get_group()
    if spec.cp > 1:
        out["cp"] = engine.mesh["cp"].get_group()
    groups = getattr(engine, "expert_groups", None)
    if groups is not None:
        out["ep"] = groups.ep
        if dist.get_world_size(groups.expert_dp) > 1:
            out["edp"] = groups.expert_dp
    return out


def _advance(progress, step: int, total: int, loss: Optional[float]) -> None:
    progress[0].update(progress[1], advance=1, description=f"step {step + 1}/{total}"
                       + ("" if loss is None else f" rank 0 loss {loss:.4f}"))


def _before_loop(spec) -> None:
    """Reset CUDA's peak memory; warn once (rank 0) when local CPU workers oversubscribe cores."""
    if spec.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if dist.get_rank() == 0 and spec.device == "cpu" and spec.launcher == "local":
        warn_oversubscribed(spec.world_size, spec.train.threads_per_worker)


def _step(engine: Engine, data: TokenSource, step: int, tracker: ActivationTracker, accounting: bool):
    """One optimizer step: (this rank's loss or None, wall seconds, the TP counter or None, (seconds
    this thread ran on a core: its compute on a CPU, as a collective's wait sleeps; seconds it
    waited for a core)).

    Memory (saved activations, held gradients) and TP collectives are accounted on the
    first step of the process only (``accounting``) -- a warm-up step unless warmup_steps=0
    -- since every step has the same shapes and issues the same collectives; timed steps
    run bare."""
    spec, mesh = engine.spec, engine.mesh
    xs, ys = data.micro_batches(step, mesh["dp"].get_local_rank(), spec.device, mesh["cp"].get_local_rank())
    engine.optimizer.zero_grad(set_to_none=True)
    _sync(spec.device)
    t0, core0 = time.perf_counter(), thread_core_s()
    engine.accounting, engine.current_step = accounting, step
    with (tracker if accounting else nullcontext()), count_tp_comm(mesh["tp"] if accounting else None) as counter:
        loss = engine.step(xs, ys)
    _sync(spec.device)
    seconds, core1 = time.perf_counter() - t0, thread_core_s()
    return loss, seconds, counter, (core1[0] - core0[0], core1[1] - core0[1])


def cp_mean(loss: Optional[float], mesh, cp: int, device: str = "cpu") -> Optional[float]:
    """The loss a run reports: under context parallelism the mean of the cp ranks' losses (each
    the mean over its S / cp tokens of every sequence, as many on every rank: the mean over the
    whole sequences, the single-process loss); ``loss`` itself when cp = 1 or None (a pipeline
    rank without the last stage: its whole cp group sees none). The live step files
    (xpar.run.worker.record_steps) keep each rank's own loss, outside this all-reduce's cost;
    the journal logs their mean over the ranks that see one, the same value."""
    if cp == 1 or loss is None:
        return loss
    t = torch.tensor([loss], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=mesh["cp"].get_group())
    return float(t[0]) / cp


def thread_core_s() -> tuple[float, float]:
    """(seconds this thread ran on a core, seconds it was runnable but waited for one) so far: the
    thread's CPU clock (exact to the call), and Linux schedstat's run delay
    (:func:`xpar.run.fidelity.task_cpu_ns`; 0 where the kernel has none). schedstat's run time
    is not used: the running thread reads it as of its last tick or switch (4 ms here), which put
    the compute before each collective inside it (a ZeRO-2 step 0.8 explained, measured)."""
    got = task_cpu_ns([os.getpid()], main_only=True)
    return time.thread_time(), (next(iter(got.values()))[1] / 1e9 if got else 0.0)


def _rank_stats(engine: Engine, tracker: ActivationTracker, losses: list, times: list, lrs: list) -> dict:
    """This rank's stats dict (see :func:`train`) after the last step."""
    spec, mesh = engine.spec, engine.mesh
    memory = model_state_bytes(engine.chunks, engine.optimizer, spec.layout.zero_stage, engine.grads_peak,
                               dtype=spec.train.dtype, copies_peak=tracker.copies_peak)
    memory["activations"] = tracker.peak
    if spec.device == "cuda":
        memory["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    axes = ("pp", "dp", "cp", "tp") if spec.cp > 1 else ("pp", "dp", "tp")
    coords = [mesh[a].get_local_rank() for a in axes]
    stats = {"rank": dist.get_rank(), "coords": dict(zip(axes, coords)),
             "losses": losses, "step_times_s": times, "memory": memory,
             "grad_norms": list(engine.grad_norms), "lrs": lrs,
             "nonfinite_steps": list(engine.nonfinite_steps), "skipped_steps": list(engine.skipped_steps),
             "step_time_stats": step_time_stats(times[spec.train.warmup_steps:])}
    if getattr(engine, "pipeline_stats", None) is not None:
        stats["pipeline"] = _first_step(engine.pipeline_stats(), len(losses))
    return stats


def _first_step(record: dict, total: int) -> dict:
    """A resumed pipelined run records its steps from the resumed step on: say which (the
    bubble summary, xpar.track.bubble.summarize, indexes the records from there)."""
    return dict(record, first_step=total - len(record.get("steps") or []))


def warn_oversubscribed(workers: int, threads: int) -> Optional[str]:
    """One stderr line when ``workers`` x ``threads`` torch threads exceed this host's cores
    (step times then measure the OS scheduler); returns the line, or None."""
    import sys

    cores = usable_cores()
    if workers * threads <= cores:
        return None
    line = (f"xpar: warning: {workers} workers x {threads} threads = {workers * threads} threads on "
            f"{cores} cores; timings are oversubscribed (train.threads_per_worker, fewer workers)")
    print(line, file=sys.stderr, flush=True)
    return line


def _progress(total: int, completed: int = 0):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn())
    task = p.add_task("starting", total=total, completed=completed)
    p.start()
    return p, task
