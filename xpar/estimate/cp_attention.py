"""The attention core under context parallelism as Transformer Engine's and torch's rings run it (issue 42).

The folded estimate (xpar.estimate.context_parallel.fold_cp) prices a cp rank's core as one causal kernel of
b / cp whole sequences of s keys. Frameworks that run the core per cp step (``framework.cp_attention_merge``:
Transformer Engine's AttnFuncWithCP, transformer_engine/pytorch/attention.py @v1.4 and
dot_product_attention/context_parallel.py; torch's _templated_ring_attention,
torch/distributed/tensor/experimental/_context_parallel/_attention.py) split each rank's s / cp queries into two
load-balanced chunks of c = s / (2 cp) tokens and run, per layer and micro-batch, cp kernels: step 0 causal over the
local 2c x 2c, then cp - 1 unmasked ones, the 2c queries against the first half-chunk of c keys (a step whose K/V
comes from a lower rank) or the second query chunk of c against 2c keys (a higher rank); the same in backward.
Each step's kernel runs over c or 2c keys, at its :func:`xpar.estimate.compute.kernels.sequence_rate` there, and
each step's partial output is merged by its log-sum-exp into an accumulator (forward), its dQ, dK and dV added into
theirs (backward): memory-bound passes the folded core has not. :func:`ring_extra_times` is the difference, the
``cp_attention`` term (xpar.estimate.columns.cp_ep.cp_columns). Units: seconds, bytes.
"""
from __future__ import annotations

from xpar.config.remat import POLICIES, spec_recompute
from xpar.config.spec import RunSpec
from xpar.estimate.compute.kernel_block import shape_of
from xpar.estimate.compute.kernel_costs import block_kinds, kernel_priced, training_device
from xpar.estimate.compute.kernels import attention_time, memory_time

MERGE_BYTES = {"bf16": 2, "fp32": 4}
"""framework.cp_attention_merge -> bytes of an accumulator element (out, dQ, dK, dV): Transformer Engine's ring keeps
them in q's dtype (``torch.empty_like(q)``), torch's in float32 (_SDPAMerger, convert_to_f32)."""
PARTIAL_BYTES = 2
"""Bytes of a step's partial output or gradient element (BF16, as the kernel writes it)."""
RING_KERNELS = {False: 2, True: 5}
"""Kernels a ring step launches, forward (the attention, the merge) and backward (FlashAttention's preprocess, main
and dQ conversion; the dQ and dK/dV additions)."""


def ring_step_times(b, s: int, cp: int, heads, kv_heads, qk_dim: int, v_dim: int, device, backward: bool) -> float:
    """Seconds of one rank's cp step kernels of one layer (module docstring): step 0 causal over 2c queries and keys,
    then cp - 1 unmasked steps (xpar.estimate.compute.kernels.UNMASKED_GAIN forward), half of them 2c queries x c
    keys and half c x 2c (the mean over the ranks); ``b`` sequences of ``s`` tokens, ``heads`` and ``kv_heads`` on
    the rank (after tp)."""
    c = s / (2 * cp)
    kw = dict(kv_heads=kv_heads, backward=backward)
    first = attention_time(b, 2 * c, 2 * c, heads, qk_dim, v_dim, device, causal=True, **kw)
    low = attention_time(b, 2 * c, c, heads, qk_dim, v_dim, device, causal=False, unmasked=True, **kw)
    high = attention_time(b, c, 2 * c, heads, qk_dim, v_dim, device, causal=False, unmasked=True, **kw)
    return float(first + (cp - 1) * (low + high) / 2)


def merge_bytes(b, s: int, cp: int, heads, kv_heads, qk_dim: int, v_dim: int, merge: str, backward: bool) -> float:
    """Bytes one rank's ring merges move per layer: the first step's partial written into the accumulator (read
    :data:`PARTIAL_BYTES`, write the accumulator), each later one read and added (read the partial, read and write the
    accumulator), over 2c query rows at step 0 and 1.5c on the mean later step; forward the output (v_dim a head),
    backward dQ (qk_dim, the query rows) and dK, dV (the K/V rows, the same counts)."""
    acc, c = MERGE_BYTES[merge], s / (2 * cp)
    rows = 2 * c * (PARTIAL_BYTES + acc) + (cp - 1) * 1.5 * c * (PARTIAL_BYTES + 2 * acc)
    width = heads * qk_dim + kv_heads * (qk_dim + v_dim) if backward else heads * v_dim
    return float(b * rows * width)


def ring_extra_times(spec: RunSpec, fw) -> dict[str, float]:
    """{f, b}: seconds per layer and micro-batch that one rank of the unfolded ``spec`` spends in the ring's step
    kernels, merges and launches beyond the folded core (mean over the block kinds; sliding-window blocks, which no
    ring runs: xpar.estimate.context_parallel.cp_comm_of, add nothing), at least 0: where the unmasked forward steps
    over long chunks outrun the folded causal kernel, the term takes no credit for it. Both 0 without cp, without
    ``fw.cp_attention_merge``, without flash attention, or where the kernel model does not price the hardware."""
    cp, merge = spec.layout.cp, fw.cp_attention_merge
    if cp == 1 or merge is None or not fw.flash_attention or not kernel_priced(spec.hardware, spec.train.dtype):
        return {"f": 0.0, "b": 0.0}
    device, b, s, tp = training_device(spec.hardware, fw.attention_kernel), spec.train.micro_batch_size, spec.seq_len, spec.tp
    out = {"f": 0.0, "b": 0.0}
    for (moe, local), w in block_kinds(spec.model).items():
        sh = shape_of(spec.model, moe=moe, local=local)
        if local and sh.window > 0:
            continue
        heads = sh.heads / tp
        kv = heads if sh.mla else max(1.0, sh.kv_heads / tp)
        for key, back in (("f", False), ("b", True)):
            ring = ring_step_times(b, s, cp, heads, kv, sh.qk_dim, sh.v_dim, device, back)
            moved = float(memory_time(merge_bytes(b, s, cp, heads, kv, sh.qk_dim, sh.v_dim, merge, back), device))
            folded = float(attention_time(b / cp, s, s, heads, sh.qk_dim, sh.v_dim, device, kv_heads=kv, backward=back))
            out[key] += w * max(0.0, ring + moved + cp * RING_KERNELS[back] * device.launch_s - folded)
    return out


def ring_rerun(spec: RunSpec, fw) -> float:
    """Share of the blocks whose backward reruns the attention core's forward, ring included: the recomputed share
    where its policy reruns the core (xpar.config.remat.POLICIES ``attention``), whatever ``fw`` replays of the
    communication."""
    name, share = spec_recompute(spec, fw.selective_recompute, fw.recompute_layer_fraction)
    return share if POLICIES[name].attention else 0.0

