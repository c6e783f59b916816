"""Megatron-Core's data-parallel buckets (``framework.bucket_rule`` 'megatron_core'): their size and how many a rank's
parameters make.

Size: where ``--ddp-bucket-size`` is unset, max(40M, 1M x dp) elements (megatron/core/distributed/
distributed_data_parallel.py ``DistributedDataParallel.__init__``, Megatron-LM commit 0fda386c, "Tune DDP bucket size
to improve speed at large DP counts"); NeMo's Megatron-Core optimizer leaves it so (megatron_gpt_model.py
``setup_mcore_distributed_parallel``: ``optim.ddp_bucket_size``, not ``bucket_cap_mb``).
Count: parameters laid out in reverse order, a bucket closed once it holds the bucket size, a parameter never split
(megatron/core/optimizer/distrib_optimizer.py ``_compute_per_buffer_param_layout``): counted on a dense block's
tensors, the root as one tensor; ceil(elements / bucket) where blocks differ (MoE). Each bucket is one reduce-scatter
and one all-gather (param_and_grad_buffer.py ``start_grad_sync`` / ``start_param_sync``). Units: elements.
"""
from __future__ import annotations

import math
from functools import lru_cache

from xpar.config.attention import tp_model
from xpar.config.spec import RunSpec
from xpar.estimate.memory.model_states import block_shapes

MIN_ELEMENTS = 40_000_000
"""Megatron-Core's smallest default bucket, elements (module docstring: ``max(40000000, 1000000 * dp_group.size())``)."""
ELEMENTS_PER_DP_RANK = 1_000_000
"""Megatron-Core's default bucket grows by this many elements per dp rank (the same line)."""


def bucket_elements(spec: RunSpec) -> int:
    """Elements per bucket: max(:data:`MIN_ELEMENTS`, :data:`ELEMENTS_PER_DP_RANK` x dp); dp is ``spec.dp`` (dp x cp
    where cp is folded into it)."""
    return max(MIN_ELEMENTS, ELEMENTS_PER_DP_RANK * spec.dp)


def bucket_count(spec: RunSpec, units: list[int], bucket: int) -> int:
    """Buckets the rank's ``units`` (elements each: the root, then its blocks) make at ``bucket`` elements (module
    docstring); at least 1."""
    blocks = [int(u) for u in units[1:] if u]
    sizes = tuple(math.prod(sh) for _, sh in block_shapes(tp_model(spec), spec.tp))
    if not blocks or spec.model.n_experts or any(b != sum(sizes) for b in blocks):
        return max(1, math.ceil(sum(int(u) for u in units) / bucket))
    return _closings(int(units[0]), sizes, len(blocks), bucket)


@lru_cache(maxsize=4096)
def _closings(root: int, block: tuple, n: int, bucket: int) -> int:
    """Buckets of the tensors root, then ``n`` blocks of ``block`` sizes in reverse order, each closed once it holds
    ``bucket`` elements or more, the rest one more (Megatron-Core's layout loop)."""
    count, held = 0, 0
    for size in (root,) + tuple(reversed(block)) * n:
        if not size:
            continue
        held += size
        if held >= bucket:
            count, held = count + 1, 0
    return max(1, count + (held > 0))
