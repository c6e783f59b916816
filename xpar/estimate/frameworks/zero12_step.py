"""The fp32 gradient partition DeepSpeed's ZeRO-1/2 optimizer materialises at each step
(deepspeed/runtime/zero/stage_1_and_2.py ``DeepSpeedZeroOptimizer.step``: the rank's reduced
16-bit gradient partition is flattened and cast to the fp32 master's dtype, ``single_grad_partition``,
and handed to the optimizer as the master's ``.grad``): 4 bytes per element of the rank's optimizer
partition, beside the states (``MemoryOptions.fp32_grad_partition``; trainers built like it set
it too). Counted on top of the backward's activation peak, as the issue of published DeepSpeed
peaks above the states and activations asks: an upper bound where the step's own peak (the
activations freed) is below the backward's. Units: bytes.
"""
from __future__ import annotations

from xpar.config.spec import RunSpec
from xpar.estimate.memory.model_states import MemoryOptions, held_numel, most_loaded_dp_rank


def fp32_grad_partition_bytes(spec: RunSpec, pp_rank: int, o: MemoryOptions) -> float:
    """4 bytes per optimizer-partition element of pipeline rank ``pp_rank``'s most loaded dp rank
    under ZeRO-1/2 with 16-bit training where the framework keeps one (``o.fp32_grad_partition``;
    on the host with ``cpu_offload_optimizer``: 0 device bytes), else 0."""
    if not o.fp32_grad_partition or spec.layout.zero_stage not in (1, 2) or spec.train.dtype == "fp32" \
            or o.cpu_offload_optimizer:
        return 0.0
    dp_rank = most_loaded_dp_rank(spec, pp_rank, o.zero1)
    return 4.0 * held_numel(spec, pp_rank, dp_rank, o.zero1, o.replicated_embedding_grad)["optimizer"]
