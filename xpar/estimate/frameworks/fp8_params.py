"""FP8 parameters in the data-parallel all-gather (Megatron-Core ``--fp8-param-gather``,
``framework.fp8_param_gather``): under train.dtype=fp8 the linear layers' compute weights are kept in FP8
(Transformer Engine's Float8Tensor: megatron/core/fp8_utils.py, distributed/param_and_grad_buffer.py),
so the distributed optimizer's and Megatron-FSDP's parameter all-gather moves 1 byte per element of a
block, not 2; the root (embedding, output layer, final norm) stays in bf16. Units: bytes per element.
"""
from __future__ import annotations

from xpar.config.spec import RunSpec
from xpar.estimate.memory.model_states import BYTES

FP8_BYTES = 1
"""Bytes of an FP8 element (E4M3 / E5M2)."""


def gather_widths(spec: RunSpec, assume, n_units: int) -> list[int]:
    """Bytes per element of each unit's parameter all-gather (units in forward order, the root first:
    xpar.estimate.comm.dp.unit_elements): the training dtype's, but :data:`FP8_BYTES` for the blocks under
    fp8 where the framework gathers FP8 parameters (``assume.fp8_param_gather``)."""
    e = BYTES[spec.train.dtype]
    if not (getattr(assume, "fp8_param_gather", False) and spec.train.dtype == "fp8") or n_units == 0:
        return [e] * n_units
    return [e] + [FP8_BYTES] * (n_units - 1)
