"""One rank: process group, mesh, engine, training loop; rank 0 gathers every rank's stats.

Spawned by :mod:`xpar.run.launch` (local workers) or run in-process under torchrun. Workers
live in this normal module (not ``__main__``) so spawned children can unpickle them, and
receive the spec as a plain dict and the output directory explicitly (children see no
Hydra state).
"""
from __future__ import annotations

import json
import logging
import os
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Optional

import psutil
import torch
import torch.distributed as dist

from xpar.config.spec import RunSpec
from xpar.track.report import step_rates
from xpar.parallel.factory import build_engine
from xpar.parallel.mesh import build_mesh
from xpar.run import checkpoint
from xpar.run.console import StepLines
from xpar.run.exits import exit_worker
from xpar.run.host_memory import keep_large_tensors_on_the_heap
from xpar.run.profile import StepProfiler
from xpar.run.worker_files import HEARTBEAT_DIR, STATS_FILE, stats_fallback
from xpar.run.train import train
from xpar.track.journal import StepWriter, disk_warning


def run_rank(spec: RunSpec, out_dir: Path) -> Optional[list[dict]]:
    """Build and train this rank's part; return all ranks' stats on rank 0 (None elsewhere).

    Expects the default process group to be initialised. Rank 0 also writes them to
    ``out_dir/ranks.json``.
    """
    if spec.device == "cpu":
        torch.set_num_threads(spec.train.threads_per_worker)
        keep_large_tensors_on_the_heap()
    mesh = build_mesh(spec.device, spec.pp, spec.dp, spec.tp, spec.cp)
    engine = build_engine(spec, mesh)
    mark_progress(-1)
    if spec.fail_rank == dist.get_rank():
        raise RuntimeError(f"injected failure on rank {dist.get_rank()} (run.fail_rank)")
    if spec.hang_rank == dist.get_rank():  # its main thread stuck, its heartbeat beating, the others waiting
        time.sleep(spec.collective_timeout_s * 10)
    start, saver = _checkpoints(engine, out_dir)
    record_steps(engine, StepWriter(out_dir, dist.get_rank()), first=start.step if start else 0)
    lines = StepLines(engine, out_dir, dist.get_rank(), then=_progressing(saver))  # the console step line (xpar.run.console)
    if spec.train.profile:  # a torch.profiler trace of the last steps (xpar.run.profile)
        lines = StepProfiler(spec, out_dir, dist.get_rank(), first=start.step if start else 0, then=lines)
    stats = train(engine, show_progress=(dist.get_rank() == 0 and spec.progress), start=start, after_step=lines)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(stats, gathered, dst=0)
    if dist.get_rank() == 0:
        try:
            (out_dir / STATS_FILE).write_text(json.dumps(gathered, indent=1))
        except OSError as e:  # a full disk: the parent reads them from the temporary folder
            disk_warning(out_dir / STATS_FILE, e, f"the per-rank stats go to {stats_fallback(out_dir)}")
            try:
                stats_fallback(out_dir).write_text(json.dumps(gathered))
            except OSError:
                pass  # the parent says that neither could be written (xpar.run.launch.read_stats)
        return gathered
    return None


def _progressing(saver):
    """The ``after_step`` hook of :func:`xpar.run.train.train`: :func:`mark_progress`, then ``saver`` (checkpoints)."""
    def after_step(step, *args):
        mark_progress(step)
        if saver is not None:
            saver(step, *args)
    return after_step


def _checkpoints(engine, out_dir: Path):
    """(the history to start from, or None; the checkpoint saver, or None): loads
    ``train.resume`` (a checkpoint directory, resolved before the workers started) into
    ``engine`` and replays its history to this rank's step file (xpar.run.checkpoint)."""
    train_cfg = engine.spec.train
    start = saver = None
    if train_cfg.resume or train_cfg.checkpoint_every:
        if train_cfg.resume:
            meta = checkpoint.load(engine, Path(train_cfg.resume))
            start = checkpoint.history_of(meta, dist.get_rank())
            checkpoint.replay_history(out_dir, dist.get_rank(), start)
        if train_cfg.checkpoint_every:
            saver = checkpoint.Saver(engine, out_dir)
    return start, saver


def record_steps(engine, writer: StepWriter, first: int = 0) -> None:
    """Live metrics: after each ``engine.step`` (one optimizer step of the step loop), append
    its loss, wall seconds, pre-clip gradient norm and lr to this rank's step file (:class:`xpar.track.journal.StepWriter`, a
    line-buffered file append: microseconds). The seconds match the loop's own timing on CPU;
    on CUDA the device is synchronized first, as the loop does right after. Steps are
    numbered from ``first`` (a resumed run's first step)."""
    inner, device, count = engine.step, engine.spec.device, [first]
    every, last = max(1, engine.spec.train.log_every), engine.spec.train.steps - 1

    def step(inputs, targets):
        lr = engine.optimizer.param_groups[0]["lr"]  # the step's lr (its scheduler steps inside)
        t0 = time.perf_counter()
        loss = inner(inputs, targets)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        live = live_metrics(engine.spec, seconds) if (count[0] + 1) % every == 0 or count[0] == last else None
        writer(count[0], loss, seconds, engine.grad_norms[-1] if engine.grad_norms else None, lr, live)
        count[0] += 1
        return loss
    engine.step = step


def live_metrics(spec, seconds: float) -> dict[str, float]:
    """This rank's live ``step/*`` metrics of a step that took ``seconds``: tokens/s (global), model
    TFLOP/s per device, MFU (fraction) as :func:`xpar.track.report.summarize_measured` defines them,
    and memory: CUDA allocated, reserved and peak allocated bytes, or on a CPU the process's
    resident set (RSS) bytes. torchtitan's names: throughput(tps) is tokens/s per device there."""
    rate = step_rates(spec, seconds)
    out = {f"step/{k}": rate[k] for k in ("tokens_per_s", "tflops_per_device", "mfu")}
    if spec.device == "cuda":
        out.update({"step/memory_allocated_bytes": float(torch.cuda.memory_allocated()),
                    "step/memory_reserved_bytes": float(torch.cuda.memory_reserved()),
                    "step/memory_max_allocated_bytes": float(torch.cuda.max_memory_allocated())})
    else:
        out["step/memory_rss_bytes"] = float(psutil.Process().memory_info().rss)
    return out


PG_TIMEOUT_MARGIN_S = 5.0
"""Seconds a local worker's process group waits past ``run.collective_timeout_s`` before gloo (NCCL) times
a collective or a pipeline recv out itself. xpar's launcher names a hang at the timeout from the heartbeats
(:func:`xpar.run.launch.hung_run`, polled every second, beats every :data:`HEARTBEAT_S`): its line names the
ranks and the steps they finished, gloo's only a recv that timed out; the two deadlines raced."""
HEARTBEAT_S = 1.0
"""Seconds between a local worker's heartbeats (xpar.run.launch watches them)."""
PROGRESS = {"t": time.time(), "step": -2}
"""When this worker last made progress and its last finished step (-2: building its engine, -1: built);
the heartbeat carries both, so a run whose ranks all wait on each other is named (xpar.run.launch.hung_run)."""


def mark_progress(step: int) -> None:
    """Record that this worker finished ``step`` (-1: its engine is built) now."""
    PROGRESS.update(t=time.time(), step=step)


def start_heartbeat(out_dir: Path, rank: int) -> None:
    """A daemon thread that writes ``{"pid", "t"}`` to ``<out_dir>/heartbeat/rank<rank>.json``
    every :data:`HEARTBEAT_S` (a worker whose xpar was killed ends itself: xpar.run.forkserver.in_callers_env). It keeps beating while the main thread waits in a collective
    (gloo and NCCL waits release the GIL); it stops when the process is stopped or dies."""
    import threading

    d = Path(out_dir) / HEARTBEAT_DIR
    d.mkdir(parents=True, exist_ok=True)
    path, tmp = d / f"rank{rank}.json", d / f".rank{rank}.tmp"
    def beat():
        while True:
            try:
                tmp.write_text(json.dumps({"pid": os.getpid(), "t": time.time(), "progress_t": PROGRESS["t"],
                                           "step": PROGRESS["step"]}))
                tmp.replace(path)
            except OSError:  # a full disk: the file's mtime still beats (xpar.run.launch.stalled_rank reads both)
                os.utime(path) if path.exists() else None
            time.sleep(HEARTBEAT_S)
    threading.Thread(target=beat, name="xpar-heartbeat", daemon=True).start()


def spawn_entry(local_rank: int, spec_dict: dict, out_dir: str, port: int) -> None:
    """Entry point of a local worker (:func:`xpar.run.launch.start_workers`). Its process group's timeout is
    :data:`PG_TIMEOUT_MARGIN_S` past ``run.collective_timeout_s``: the launcher names a hang at the timeout."""
    spec = RunSpec.from_dict(spec_dict)
    if spec.device == "cpu":  # before any thread of ours or gloo's allocates (xpar.run.host_memory)
        keep_large_tensors_on_the_heap()
    out = Path(out_dir)
    start_heartbeat(out, local_rank)
    logging.basicConfig(filename=out / f"worker_{local_rank}.log", level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.captureWarnings(True)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\..*")
    if spec.device == "cuda":
        torch.cuda.set_device(local_rank)
    backend = "nccl" if spec.device == "cuda" else "gloo"
    logging.getLogger("xpar.worker").info(
        "rank %d of %d (pid %d, %s, %s, coordinates pp/dp/tp %s, cp %d): %d steps", local_rank, spec.world_size,
        os.getpid(), spec.device, backend, spec.layout.coords(local_rank), spec.layout.cp_rank(local_rank),
        spec.train.steps)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=local_rank,
                            world_size=spec.world_size,
                            timeout=timedelta(seconds=spec.collective_timeout_s + PG_TIMEOUT_MARGIN_S))
    try:
        run_rank(spec, out)
    finally:
        dist.destroy_process_group()
    exit_worker()
