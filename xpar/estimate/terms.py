"""The one registry of the cost model's figures: every key list of the estimate, the planner's
columns and the plan's record derives from the term records here.

Units: step-time terms in seconds per step on the slowest rank (they sum to the step time);
memory terms in bytes on the most loaded device; rates in tokens/s, 1e12 FLOP/s or fractions of
peak. A new term is one record here, then its formula in the model (xpar.estimate.cost,
xpar.estimate.memory.per_device); tests/estimate/test_terms.py checks that the planner reports only these keys.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Term:
    """One term of the step time: its key, its words in the plan's explanation, and the
    parallel axis whose layouts alone have it ('' for every layout)."""

    name: str
    words: str
    axis: str = ""


TIME = (
    Term("matmul", "matmul"),
    Term("memory_bound", "memory-bound work"),
    Term("tp_comm", "tp communication"),
    Term("pp_comm", "pp send/recv"),
    Term("bubble", "pipeline bubble"),
    Term("dp_comm_exposed", "exposed dp communication"),
    Term("optimizer", "optimizer step"),
    Term("host_overhead", "host and framework overhead (operator dispatch; framework.layer_overhead_ms)"),
    Term("cp_comm", "cp K/V exchange", axis="cp"),
    Term("cp_attention", "cp attention steps and merges (xpar.estimate.cp_attention)", axis="cp"),
    Term("ep_comm", "expert all-to-alls", axis="ep"),
    Term("ep_imbalance", "router imbalance", axis="ep"),
    Term("act_offload", "activation offload copies over the host link (parallel.activation_offload_layers)",
         axis="offload"),
)
"""The step-time terms (``Estimate.time_breakdown``, metrics ``estimate/time_<term>_s``)."""
TIME_TERMS = tuple(t.name for t in TIME if not t.axis)
"""The terms of every layout."""
AXIS_TIME_TERMS = tuple(t.name for t in TIME if t.axis in ("cp", "ep"))
"""The terms of context- and expert-parallel layouts only (0 or absent elsewhere)."""
SETTING_TIME_TERMS = tuple(t.name for t in TIME if t.axis == "offload")
"""The terms of a setting the planner does not search (activation offload: estimates only, absent elsewhere)."""
TERM_WORDS = {t.name: t.words for t in TIME}

STATE_TERMS = ("params", "grads", "optimizer")
"""Model states (bytes)."""
MEMORY_TERMS = STATE_TERMS + ("activations", "comm_buffers", "framework_overhead")
"""The terms of a device's peak memory, named the same in estimates, reports and metrics."""

RATE_KEYS = ("tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "hw_tflops_per_device", "mfu", "hfu")
"""Figures proportional to 1 / step time (xpar.estimate.cost.rates)."""
COMM_ISSUED_KEYS = ("dp_comm_issued_s", "tp_comm_issued_s", "pp_comm_issued_s")
"""Seconds of communication issued per step on the slowest rank (``Estimate.comm_time``)."""
OFFLOAD_KEYS = ("offload_host_step_s", "offload_pcie_s")
"""An offloaded optimizer's host step and exposed PCIe copies (0 without offload)."""
MEMORY_FIT_KEYS = ("memory_usable", "fits", "optimizer_elements", "host_bytes", "host_fits")
"""Usable device bytes and the fit, the optimizer's elements, host bytes per node and their fit."""


def time_key(term: str) -> str:
    """The column of a step-time term: ``time_<term>``."""
    return f"time_{term}"


def memory_key(term: str) -> str:
    """The column of a memory term: ``memory_<term>``."""
    return f"memory_{term}"


PLAN_TIME_KEYS = ("time_per_step_s", "bubble_ratio") + RATE_KEYS + OFFLOAD_KEYS + tuple(map(time_key, TIME_TERMS))
"""Step-time columns the planner reports for every candidate."""
COLUMN_TIME_KEYS = (("time_per_step_s",) + tuple(map(time_key, TIME_TERMS)) + ("bubble_ratio",) + RATE_KEYS
                    + COMM_ISSUED_KEYS + OFFLOAD_KEYS)
"""Step-time columns of the column model (xpar.estimate.columns.step_time.time_columns): the planner's and the
communication issued."""
PLAN_MEMORY_KEYS = tuple(map(memory_key, MEMORY_TERMS)) + ("memory_total",) + MEMORY_FIT_KEYS
"""Memory columns the planner reports for every candidate (bytes; ``fits`` and ``host_fits`` bool)."""
COLUMN_MEMORY_KEYS = PLAN_MEMORY_KEYS[:7] + ("memory_pp_rank",) + MEMORY_FIT_KEYS
"""Memory columns of the column model (xpar.estimate.columns.peak_memory.memory_columns): the planner's and the
pipeline rank of the peak."""


def figure_keys() -> frozenset[str]:
    """Every figure key the cost model's columns may carry."""
    axis = tuple(map(time_key, AXIS_TIME_TERMS + SETTING_TIME_TERMS))
    return frozenset(PLAN_TIME_KEYS + COLUMN_TIME_KEYS + PLAN_MEMORY_KEYS + COLUMN_MEMORY_KEYS + axis)
