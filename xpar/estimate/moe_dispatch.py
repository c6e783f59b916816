"""How a framework's MoE token dispatcher moves tokens, and what that costs beyond the all-to-all's bytes
(issue 42): ``framework.ep_dispatcher`` names one of :data:`DISPATCHERS`.

- Host synchronisation: a dropless dispatcher's token counts go to the host before it launches what follows
  (the all-to-all's split sizes, the grouped GEMM's m per expert): the stream drains, the GPU idles for the round
  trip (:data:`HOST_SYNC_US`) and the host's ``after_sync`` ops (``framework.host_op_us`` each); none when padded.
- Sorting by local expert: copies received grouped by source rank are reordered by local expert after the
  dispatch and back before the combine (one read and one write of every copy each way).
- Summing the copies back into tokens (``framework.moe_scatter``, :data:`SCATTERS`): a fused gather-and-sum
  streams; aten's atomic scatters run :data:`ATOMIC_SCATTER_SLOWDOWN` times slower (:func:`atomic_scatter_seconds`).
Priced per block by xpar.estimate.compute.kernel_block.block_times (both the estimate and the planner).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xpar.estimate.compute.kernels import HBM_FRACTION


@dataclass(frozen=True)
class Dispatcher:
    """What one dispatcher does per MoE layer forward on one rank."""

    syncs: int
    """Device->host synchronisations of a dropless layer forward (0 where the counts stay on the device)."""
    after_sync: int
    """Host ops between the synchronisation and the dispatcher's first long kernel (its all-to-all)."""
    sorts_by_local_expert: bool
    """A second permutation of the received copies by local expert (and its inverse before the combine)."""
    one_copy_per_node: bool
    """A token crosses to each other node holding one of its experts once, then reaches each rank holding one
    once over NVLink, its own rank included (bytes: xpar.estimate.expert_parallel.ep_shares); False: every routed
    copy is sent."""


DISPATCHERS = {
    # Megatron-Core MoEAlltoAllTokenDispatcher (--moe-token-dispatcher-type alltoall, its default), dropless:
    # preprocess() sets cuda_sync_point 'before_ep_alltoall' (tokens_per_expert to the host, then a stream
    # synchronize); after it the host launches the all-to-alls of the tokens and of their probabilities; the
    # received chunks are reordered by local expert (sort_chunks_by_idxs) when a rank holds several experts.
    # torchtitan's expert-parallel all-to-all does the same (split sizes .tolist(), then a permutation).
    "alltoall": Dispatcher(syncs=1, after_sync=2, sorts_by_local_expert=True, one_copy_per_node=False),
    # DeepEP normal kernels (Megatron-Core's flex dispatcher, DeepSeek's HAI-LLM): the host waits for the
    # receive counts inside dispatch() (notify_dispatch, a CPU busy-wait), then launches the one dispatch
    # kernel; received tokens are permuted once into expert order (the same bytes as the sender-side permute).
    "deepep": Dispatcher(syncs=1, after_sync=1, sorts_by_local_expert=False, one_copy_per_node=True),
    # HybridEP (Megatron-Core flex dispatcher, NVLink-domain aware): its blocking mode drains the stream after
    # the metadata preprocessing on every MoE layer forward (NVIDIA-NeMo/Automodel PR 3931), then one kernel.
    "hybridep": Dispatcher(syncs=1, after_sync=1, sorts_by_local_expert=False, one_copy_per_node=True),
    # A compiled step with device-side split sizes (JAX/XLA: MaxText's ragged all-to-all inside one jitted
    # program): nothing returns to the host; received copies are permuted by local expert as in alltoall.
    "ragged": Dispatcher(syncs=0, after_sync=0, sorts_by_local_expert=True, one_copy_per_node=False),
}
"""The dispatchers ``framework.ep_dispatcher`` names, each from its source (comments)."""

HOST_SYNC_US = 10.0
"""Microseconds of one device->host synchronisation's round trip with the stream already drained: submitting
a small cudaMemcpyAsync costs 5-7 us (Wu et al. 2026, "DualPath", Sec. 5.2), the blocked host wakes a few
microseconds after the copy lands. Assumed from these, not fitted."""


def sync_seconds(dispatcher: str, host_op_us: float, padded: bool) -> float:
    """Seconds a MoE layer forward idles the GPU at its dispatcher's host synchronisations: per sync the
    round trip (:data:`HOST_SYNC_US`) and the host ops issued before the next long kernel (``host_op_us``
    each); 0 when ``padded`` (capacity factor with padding: fixed shapes, nothing to synchronise).

    Raises:
        KeyError: ``dispatcher`` is not in :data:`DISPATCHERS`."""
    d = DISPATCHERS[dispatcher]
    return 0.0 if padded else d.syncs * (HOST_SYNC_US + d.after_sync * host_op_us) * 1e-6


SCATTERS = ("fused", "atomic")
"""How a framework reduces a MoE layer's routed copies back to their tokens (``framework.moe_scatter``):

- 'fused': one gather-and-sum kernel per token, no atomics (Transformer Engine's ``moe_unpermute`` and its
  permutation backward, which Megatron-Core and NeMo AutoModel run with ``moe_permute_fusion``);
- 'atomic': aten atomic scatters, twice per layer (torchtitan @022f885f). Forward, the combine:
  ``torchtitan/distributed/deepep/utils.py`` ``unpermute`` (``output_tokens.scatter_add_``, compiled, but Inductor
  hands bf16 scatter-adds back to aten: torch/_inductor/utils.py ``needs_fallback_due_to_atomic_add_limitations``;
  its own comment: "this takes up to 30% of training time") and, on torchtitan's all-to-all path, ``torchtitan/models/moe/moe.py``
  MoE.forward (``out.scatter_add``). Backward, the gradient of the token gather that made the copies: ``permute``'s
  ``tokens.index_select`` (its backward an ``index_add_`` into zeros) and MoE.forward's ``torch.gather`` (its
  backward a ``scatter_add``). Each adds (copies x hidden) bf16 elements atomically."""

ATOMIC_SCATTER_SLOWDOWN = 11.1
"""Times a streaming pass of the same bytes that aten's atomic scatter of a MoE layer's copies takes. Source: the
permutation benchmark of fanshiqing/grouped_gemm (tests/test_permuteTopK.py ``permute_topK_test``: the PyTorch
permutation is ``tokens.index_select(0, sorted_indices // topK)``, whose backward is aten's ``index_add_`` with one
atomic add an element, against the library's gather-and-sum kernel of the same gradient), as DeepLink-org/DLBlas
PR 66 (2025-08) prints it for 8192 tokens, hidden 4096, top-8 of 8 experts, fp16: 'pytorch bwd: 2.304 ms', 'cuda bwd:
0.207 ms' (11.1x; fp32, whose atomics are native 32-bit adds: 1.968 / 0.405 = 4.9x). The gather-and-sum moves its
(copies + tokens) x hidden x 2 bytes at 2.9 TB/s, a Hopper part's streaming rate, the rate :func:`memory_time`
prices; aten adds fp16 and bf16 alike (packed 32-bit atomics, ATen/native/cuda/KernelUtils.cuh
``fastSpecializedAtomicAdd``). Assumed to carry to other GPUs as a ratio to their streaming rate; pytorch/pytorch PR
182675 (GB200) and PR 183950 (B200) show aten's ``index_add_`` in bf16 1.5-4.7x slower than a TMA bulk-reduce kernel
of the same scatter, itself below a streaming pass. Not fitted to a training run."""


def atomic_scatter_seconds(copies, tokens, hidden: int, hbm_bytes_per_s: float):
    """Seconds of one aten bf16 atomic scatter of ``copies`` rows of ``hidden`` into ``tokens`` rows on a GPU of
    ``hbm_bytes_per_s`` (datasheet): (copies + tokens) x hidden x 2 bytes streamed at HBM_FRACTION of it
    (xpar.estimate.compute.kernels.memory_time), :data:`ATOMIC_SCATTER_SLOWDOWN` times. Arrays broadcast."""
    moved = (np.asarray(copies, dtype=float) + np.asarray(tokens, dtype=float)) * hidden * 2.0
    return ATOMIC_SCATTER_SLOWDOWN * moved / (HBM_FRACTION * hbm_bytes_per_s)
