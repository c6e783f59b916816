"""The step loop on one rank: data, timing, memory accounting, progress."""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from xpar.data import TokenSource
from xpar.metrics import ActivationTracker, model_state_bytes
from xpar.parallel.factory import Engine


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train(engine: Engine, show_progress: bool = False) -> dict:
    """Run ``spec.train.steps`` optimizer steps on this rank; return its stats.

    Returns a dict: ``rank``, ``coords`` (pp, dp, tp), ``losses`` (mean over this rank's
    micro-batches per step, None where the rank sees no loss), ``step_times_s`` (wall
    seconds per step, warm-up included), ``memory`` (bytes: params, grads, optimizer,
    activations; cuda_max_allocated on CUDA) and, for pipelined runs, ``pipeline``.
    """
    spec, mesh = engine.spec, engine.mesh
    device = spec.device
    data = TokenSource(spec)
    dp_rank = mesh["dp"].get_local_rank()
    params = [p for c in engine.chunks for p in c.parameters()]
    tracker = ActivationTracker(params)
    losses: list[Optional[float]] = []
    times: list[float] = []
    progress = _progress(spec.train.steps) if show_progress else None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        for step in range(spec.train.steps):
            xs, ys = data.micro_batches(step, dp_rank, device)
            engine.optimizer.zero_grad(set_to_none=True)
            _sync(device)
            t0 = time.perf_counter()
            with tracker:
                loss = engine.step(xs, ys)
            _sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            if progress is not None:
                progress[0].update(progress[1], advance=1,
                                   description=f"step {step + 1}/{spec.train.steps} loss {loss if loss is None else round(loss, 4)}")
    finally:
        if progress is not None:
            progress[0].stop()
    memory = model_state_bytes(engine.chunks, engine.optimizer, spec.parallel.zero_stage)
    memory["activations"] = tracker.peak
    if device == "cuda":
        memory["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    coords = [mesh[a].get_local_rank() for a in ("pp", "dp", "tp")]
    stats = {"rank": dist.get_rank(), "coords": dict(zip(("pp", "dp", "tp"), coords)),
             "losses": losses, "step_times_s": times, "memory": memory}
    if hasattr(engine, "pipeline_stats") and engine.pipeline_stats is not None:
        stats["pipeline"] = engine.pipeline_stats()
    return stats


def _progress(total: int):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn())
    task = p.add_task("starting", total=total)
    p.start()
    return p, task
