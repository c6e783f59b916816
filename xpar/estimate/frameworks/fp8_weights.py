"""Transformer Engine's FP8 weight copies (``framework.fp8_weight_copies``): under train.dtype=fp8 each
linear layer of a block keeps, beside its bf16 weight, the FP8 cast of it and that cast's transpose for
the backward's data-gradient GEMM (transformer_engine/pytorch/module/linear.py: the weight workspace
cached across micro-batches, ``_fp8_workspaces``; Hopper's FP8 GEMMs take only the TN layout): +2 bytes
per linear weight element held whole on the device. By recipe and device
(xpar.estimate.compute.fp8_recipes.weight_copy_bytes): on Blackwell a tensor-scaled cast serves both
layouts, +1 byte; MXFP8 keeps rowwise and columnwise copies and their E8M0 scales, +2 1/16 bytes. With FP8
parameters (``fp8_param_gather``) the weight is that FP8 cast, its bf16 copy gone: the copies less the
2 bytes saved, at least 0 (Hopper: the transpose alone, +1 byte, less the byte saved, 0).
Under ZeRO-3 the weights are gathered per unit and the copies live with the unit: not counted.
Units: elements, bytes.
"""
from __future__ import annotations

from functools import lru_cache

from xpar.estimate.compute.fp8_recipes import DEFAULT, weight_copy_bytes

COPY_BYTES = 2
"""Bytes per linear weight element of the FP8 copy and its transpose."""


@lru_cache(maxsize=256)
def block_linear_numel(shapes: tuple) -> int:
    """Elements of the linear weights (2-D, not the MoE router) among a pipeline rank's blocks' parameters
    ``shapes`` ((name, tp-local shape) pairs: xpar.estimate.memory.model_states.param_shapes)."""
    total = 0
    for name, shape in shapes:
        if ".layers." in f".{name.split(':', 1)[-1]}" and len(shape) == 2 and not name.endswith("router.weight"):
            total += shape[0] * shape[1]
    return total


def fp8_weight_copy_bytes(dtype: str, zero_stage: int, linear_numel: int, o, recipe: str = DEFAULT,
                          mx_native: bool = False) -> int:
    """Bytes of the FP8 weight copies and transposes of a pipeline rank whose blocks' linear weights
    hold ``linear_numel`` elements (:func:`block_linear_numel`; module docstring) under FP8 ``recipe`` on a
    device with (``mx_native``: Blackwell) or without MXFP8 tensor cores: 0 unless ``dtype`` is fp8 with
    ``o.fp8_weight_copies`` at ZeRO stage < 3."""
    if not (getattr(o, "fp8_weight_copies", False) and dtype == "fp8" and zero_stage < 3):
        return 0
    width = weight_copy_bytes(recipe, mx_native)
    if getattr(o, "fp8_param_gather", False):
        width = max(0.0, width - COPY_BYTES)
    return int(round(width * linear_numel))
