"""The console step line: every ``train.log_every`` steps (and the last) one plain line, as torchtitan
prints every ``log_freq`` and Megatron-LM every ``--log-interval``::

    step: 10 loss: 7.8100 grad_norm: 1.20 memory: 31.40GiB(33.1%) tps: 6,543 tflops: 312.00 mfu: 31.6%

``tps`` is tokens/s per device (torchtitan's), ``tflops`` model TFLOP/s per device, ``mfu`` model
FLOPs utilisation, all of that one step (:func:`xpar.track.report.step_rates`); ``loss`` the mean
over the dp ranks (torchtitan's global average loss; the value MLflow records, :func:`dp_mean`); ``memory`` the
CUDA memory reserved (torchtitan's) or on a CPU the process's resident set, with its share of the
device's (host's) memory. Printed by the rank that sees the loss (the last pipeline stage's first
rank) to stdout, so a log file, SLURM or nohup shows progress as the run goes, and appended to the
run's log file (``xpar.log`` in the run folder).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from xpar.track.report import step_rates

RUN_LOG = "xpar.log"
"""The run's log file in its folder (Hydra's job log, ``hydra.job.name=xpar``)."""


def line_rank(layout) -> int:
    """The global rank that prints the step line: dp, cp and tp coordinate 0 on the pipeline rank
    holding the last stage (the one that computes the loss)."""
    return layout.rank(layout.stage_owner(layout.n_stages - 1), 0, 0, 0)


def memory_now(device: str) -> tuple[float, float]:
    """(bytes in use, bytes the device has): CUDA reserved and total, or the process's RSS and the
    host's memory on a CPU."""
    if device == "cuda":
        return float(torch.cuda.memory_reserved()), float(torch.cuda.get_device_properties(0).total_memory)
    import psutil
    return float(psutil.Process().memory_info().rss), float(psutil.virtual_memory().total)


def step_line(spec, step: int, loss: Optional[float], grad_norm: Optional[float], seconds: float) -> str:
    """The line of optimizer step ``step`` (0-based; printed 1-based as torchtitan does) that took
    ``seconds`` (wall)."""
    rate = step_rates(spec, seconds)
    used, total = memory_now(spec.device)
    parts = [f"step: {step + 1}", f"loss: {loss:.4f}" if loss is not None else "loss: -",
             f"grad_norm: {grad_norm:.2f}" if grad_norm is not None else "grad_norm: -",
             f"memory: {used / 2**30:.2f}GiB({100 * used / total:.1f}%)",
             f"tps: {rate['tokens_per_s'] / spec.world_size:,.0f}",
             f"tflops: {rate['tflops_per_device']:.2f}", f"mfu: {100 * rate['mfu']:.1f}%"]
    return " ".join(parts)


def dp_mean(loss: Optional[float], mesh, device: str = "cpu") -> Optional[float]:
    """The mean of ``loss`` over the dp ranks of ``mesh`` (each the loss of its own sequences; one
    all-reduce over the dp group, after the step): the loss the journal records, the mean over the
    ranks that see one. ``loss`` itself when dp = 1 or None (a pipeline rank without the last stage:
    its whole dp group sees none)."""
    dp = mesh["dp"].size()
    if dp == 1 or loss is None:
        return loss
    t = torch.tensor([loss], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=mesh["dp"].get_group())
    return float(t[0]) / dp


class StepLines:
    """``after_step`` hook of :func:`xpar.run.train.train`: prints the step line every
    ``train.log_every`` steps and at the last step, on :func:`line_rank` only, and appends it to
    ``<out_dir>/xpar.log``. ``then``: another hook called first (e.g. the checkpoint saver)."""

    def __init__(self, engine, out_dir: Path, rank: int, then=None):
        self.engine, self.log, self.then = engine, Path(out_dir) / RUN_LOG, then
        self.on = rank == line_rank(engine.spec.layout)

    def __call__(self, step: int, losses: list, times: list, lrs: list):
        if self.then is not None:
            self.then(step, losses, times, lrs)
        spec = self.engine.spec
        if (step + 1) % max(1, spec.train.log_every) and step != spec.train.steps - 1:
            return
        loss = dp_mean(losses[-1], self.engine.mesh, spec.device)  # every rank of the dp group takes part
        if not self.on:
            return
        norms = self.engine.grad_norms
        line = step_line(spec, step, loss, norms[-1] if norms else None, times[-1])
        print(line, flush=True)
        try:
            with open(self.log, "a") as f:
                f.write(line + "\n")
        except OSError:
            pass  # a full disk: the console has it, and the step files every step
