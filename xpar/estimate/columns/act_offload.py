"""The activation offload's exposed copies per micro-batch of every candidate
(``parallel.activation_offload_layers``: :mod:`xpar.estimate.memory.activation_offload`), for the
step-time columns (:mod:`xpar.estimate.columns.step_time`) and so for the scalar estimate, which is
their one-row case. Units: seconds per micro-batch. No torch import.
"""
from __future__ import annotations

import numpy as np

from xpar.config.spec import RunSpec
from xpar.estimate.columns.keys import by_key, spec_at
from xpar.estimate.memory.activation_host import block_bytes_of
from xpar.estimate.memory.activation_offload import exposed_time, offload_layers
from xpar.estimate.memory.model_states import MemoryOptions


def act_offload_columns(base: RunSpec, a, r: dict, c: dict) -> np.ndarray:
    """Seconds per micro-batch the offload's device -> host (forward) and host -> device (backward)
    copies leave exposed, per candidate ``r`` (:func:`xpar.estimate.columns.step_time.candidate_rows`),
    from one block's forward and backward compute in ``c`` (``mm_f + mem_f``, ``mm_b + mem_b``:
    xpar.estimate.step_parts.layer_costs, seconds per micro-batch) and one block's saved bytes at the
    candidate's tp, micro-batch size and sequence parallelism; over ``base.hardware.pcie_gb_per_s``
    (per device and direction). Zeros without offload or host link figure. ``a``: the Assumptions."""
    n, link = offload_layers(base), base.hardware.pcie_gb_per_s or 0
    if n == 0 or not link > 0:
        return np.zeros(len(r["tp"]))
    o = MemoryOptions.of(a)
    block = by_key([r["tp"], r["b"], r["sp"]], lambda t, b, sp: {"x": block_bytes_of(
        spec_at(base, t, 1, 1, b, 1, 1, "gpipe", 0, sp, "none"), o)}, ("x",))["x"]
    return exposed_time(block, link, base.model.n_layers, n, c["mm_f"] + c["mem_f"], c["mm_b"] + c["mem_b"],
                        a.activation_offload_overlap)
