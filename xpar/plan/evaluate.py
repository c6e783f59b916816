"""The cost model over every candidate: step time and throughput (:mod:`xpar.plan.vtime`) joined
with memory per device (:mod:`xpar.plan.vmemory`), both equal to
:func:`xpar.estimate.cost.estimate` on each candidate's RunSpec."""
from __future__ import annotations

import numpy as np

from xpar.estimate.cost import TIME_TERMS
from xpar.plan.context import PlanContext, spec_of

TIME_KEYS = ("time_per_step_s", "bubble_ratio", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device",
             "hw_tflops_per_device", "mfu", "hfu", "offload_host_step_s", "offload_pcie_s") + tuple(
                 f"time_{k}" for k in TIME_TERMS)
"""Figures the planner reads from the step-time model (seconds, tokens/s, TFLOP/s, fractions)."""
MEMORY_KEYS = ("memory_params", "memory_grads", "memory_optimizer", "memory_activations", "memory_comm_buffers",
               "memory_framework_overhead", "memory_total", "memory_usable", "fits", "optimizer_elements",
               "host_bytes", "host_fits")
"""Figures the planner reads from the memory model (bytes per device on the most loaded device;
``host_bytes`` per node and ``host_fits`` for an offloaded optimizer)."""


def evaluate(ctx: PlanContext, cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Candidate columns plus :data:`TIME_KEYS` and :data:`MEMORY_KEYS`, one entry per candidate
    (arrays of length L >= 1). ``fits`` compares with the usable memory (device memory less
    ``ctx.hardware['memory_headroom']``); ``host_fits`` whether an offloaded optimizer's states fit the
    node's host memory (True without offload)."""
    from xpar.plan.vfive import evaluate_groups, grouped
    if grouped(cols):  # cp, ep or dtype columns: grouped by them (xpar.plan.vfive)
        return evaluate_groups(ctx, cols, TIME_KEYS, MEMORY_KEYS)
    base = spec_of(ctx, cols, 0)
    out = dict(cols)
    out.update(_memory(base, cols))
    out.update(_time(base, cols, out["memory_optimizer"], out["optimizer_elements"], out["memory_grads"]))
    return out


def _time(base, cols: dict[str, np.ndarray], memory_optimizer: np.ndarray,
          elements: np.ndarray, grads: np.ndarray) -> dict[str, np.ndarray]:
    from xpar.plan.vtime import time_columns
    res = time_columns(base, cols, memory_optimizer, elements, grads)  # the optimizer and gradient terms
    return {k: np.asarray(res[k]) for k in TIME_KEYS}


def _memory(base, cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from xpar.plan.vmemory import memory_columns
    res = memory_columns(base, cols)
    return {k: np.asarray(res[k]) for k in MEMORY_KEYS}

