"""What a plan is evaluated on: the fixed context (model, hardware, sequence, dtype, framework)
and the candidate columns, one entry per layout (``dict[str, numpy.ndarray]``, length L):

- ``tp``, ``pp``, ``dp`` (int64; dp tp pp cp = the device count); ``b`` micro-batch size and
  ``m`` micro-batches per step (global batch B = b m dp sequences);
- ``v``: stages per pipeline rank (1; 2 for V-shaped schedules; virtual stages of looped ones),
  the pp v stages split evenly or with lighter ends (xpar.estimate.columns.stage_split);
- ``schedule`` (names of :data:`xpar.config.layout.SCHEDULES`), ``zero`` (the stage that runs,
  0..3), ``sp`` (bool, tp > 1 only), ``recompute`` ('none' | 'selective' | 'full');
- optional (:data:`OPTIONAL_COLUMNS`): ``offload`` (bool; absent: the framework's), ``cp`` and
  ``ep`` (int64; absent: 1; ep x etp inside tp x cp x dp), ``dtype`` (str; absent: ``train.dtype``),
  ``etp`` (int64, expert tensor-parallel degree; 0 or absent: tp), ``act_offload`` (int64, the blocks whose
  activations go to host memory, parallel.activation_offload_layers; absent: none; xpar.plan.offload_fit).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xpar.config.validate import validate
from xpar.estimate.columns.stage_split import split_fields

COLUMNS = ("tp", "pp", "dp", "b", "m", "v", "schedule", "zero", "sp", "recompute")
"""The candidate columns, in display order."""
OPTIONAL_COLUMNS = ("offload", "cp", "ep", "dtype", "etp", "act_offload")
"""Columns a candidate set may leave out (then the framework's setting holds for every candidate)."""


@dataclass(frozen=True)
class PlanContext:
    """The fixed part of every candidate: config-group dicts as composed by Hydra (the model and
    hardware presets, train values such as dtype and seq_len, the framework preset)."""

    model: dict
    hardware: dict
    train: dict = field(default_factory=dict)
    framework: dict = field(default_factory=dict)


def row(cols: dict[str, np.ndarray], i: int) -> dict[str, Any]:
    """Candidate ``i`` as plain Python values (int, str, bool), with the optional columns present."""
    return {k: cols[k][i].item() for k in COLUMNS + OPTIONAL_COLUMNS if k in cols}


def parallel_group(r: dict[str, Any], n_layers: int) -> dict:
    """The ``parallel`` group of one candidate row (:func:`row`) of a model of ``n_layers`` blocks,
    numbers resolved, the split's keys where pp x v does not divide the blocks
    (:func:`xpar.estimate.columns.stage_split.split_fields`)."""
    return dict(name="plan", dp=r["dp"], tp=r["tp"], pp=r["pp"], zero_stage=r["zero"], micro_batches=r["m"],
                schedule=r["schedule"], virtual_stages=r["v"], sequence_parallel=r["sp"],
                recompute=r["recompute"], cp=r.get("cp", 1), ep=r.get("ep", 1), etp=r.get("etp") or None,
                activation_offload_layers=r.get("act_offload") or None,
                **split_fields(n_layers, r["pp"], r["v"]))


def spec_of(ctx: PlanContext, cols: dict[str, np.ndarray], i: int):
    """The validated estimate-mode RunSpec of candidate ``i`` (through :mod:`xpar.config.validate`, as
    ``python -m xpar run.mode=estimate`` would build it). Slow (milliseconds): for tests, the top
    layouts and the override line, never for the search itself."""
    r = row(cols, i)
    train = dict(ctx.train, micro_batch_size=r["b"], global_batch_size=r["b"] * r["m"] * r["dp"])
    if r.get("dtype"):
        train["dtype"] = r["dtype"]
    cfg = {"model": dict(ctx.model), "parallel": parallel_group(r, int(ctx.model["n_layers"])),
           "hardware": dict(ctx.hardware),
           "train": train, "tracking": {"enabled": False}, "run": {"mode": "estimate", "progress": False}}
    if ctx.framework:
        cfg["framework"] = dict(ctx.framework)
    if "offload" in r:
        cfg["framework"] = dict(cfg.get("framework", {}), cpu_offload_optimizer=bool(r["offload"]))
    return validate(cfg)
