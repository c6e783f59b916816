"""Transient copies DeepSpeed's BF16_Optimizer and its engine make of the gradients (DeepSpeed 0.6-0.7, as
BLOOM ran it: deepspeed/runtime/bf16_optimizer.py, runtime/engine.py, runtime/pipe/engine.py), beside the
bf16 gradients and the unsharded fp32 accumulation buffer (``grad_bytes`` 6):

- after each micro-batch's backward, ``update_hp_grads`` adds every parameter's bf16 gradient into the
  fp32 buffer through ``lp.grad.to(fp32)``: a copy of one gradient at a time, the largest (the stage's
  embedding) beside the in-flight activations (``grad_accum_cast_bytes``: 4);
- at the flush, ``_bf16_reduce_grads`` all-reduces the flat fp32 buffer through
  ``allreduce_bucket``, which casts it whole to ``communication_data_type`` (bf16 where bf16 is on, ZeRO 0
  and the config leaves it unset: BLOOM's tr11 ds_config) and copies it back (``grad_reduce_cast_bytes``: 2).
  Its activations are freed by then; counted beside them: the caching allocator serves one block of the
  buffer's size from none of the activations' freed blocks, so the reserved memory (what nvidia-smi shows,
  BLOOM's published figures) holds both. An upper bound of the allocated peak. Units: bytes.
"""
from __future__ import annotations

import math

from xpar.config.spec import RunSpec
from xpar.estimate.memory.model_states import MemoryOptions, _stage_numels, shape_key


def gradient_cast_terms(spec: RunSpec, pp_rank: int, o: MemoryOptions) -> dict[str, float]:
    """Bytes of pipeline rank ``pp_rank``'s gradient casts: ``grad_reduce_cast`` (the stage's held elements
    x ``o.grad_reduce_cast_bytes``) and ``grad_accum_cast`` (its largest parameter tensor's elements x
    ``o.grad_accum_cast_bytes``); both 0 where the profile sets no width."""
    if not (o.grad_reduce_cast_bytes or o.grad_accum_cast_bytes):
        return {"grad_reduce_cast": 0.0, "grad_accum_cast": 0.0}
    whole, shapes = _stage_numels(*shape_key(spec), pp_rank)
    largest = max((math.prod(sh) for sh, _ in shapes), default=0)
    return {"grad_reduce_cast": float(whole * o.grad_reduce_cast_bytes),
            "grad_accum_cast": float(largest * o.grad_accum_cast_bytes)}
