"""How each framework exchanges K and V under context parallelism (cp), and what of it the attention hides
(``framework.cp_comm``, issue 42), per layer and micro-batch on one rank of the unfolded spec:
``all_gather`` (gathered before the core, gradients reduce-scattered after, exposed: the Llama 3 paper Sec.
3.3.2; Transformer Engine's AttnFuncWithCPAndKVAllGather; xpar/parallel/context.py; torch's context_parallel,
torch/distributed/tensor/experimental/_attention.py, at torchtitan's default allgather rotate method),
``p2p`` (Transformer Engine's ring, AttnFuncWithCPAndKVP2P in
transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py, the default of Megatron-Core's
``--cp-comm-type``: :func:`p2p_layer_times`) or ``a2a`` (DeepSpeed-Ulysses, Jacobs et al. 2023 Sec. 3.1;
Transformer Engine's AttnFuncWithCPAndQKVOA2A: :func:`a2a_layer_times`). docs/concepts/cost-model.md.
Units: seconds, bytes.
"""
from __future__ import annotations

import numpy as np

from xpar.config.attention import tp_model
from xpar.config.spec import RunSpec
from xpar.estimate.comm.collectives import collective_time, group_of, p2p_time
from xpar.estimate.compute import flops as fl
from xpar.estimate.compute.kernel_block import block_times, shape_of
from xpar.estimate.compute.kernel_costs import block_kinds, kernel_priced, training_device
from xpar.estimate.expert_parallel import alltoall_time
from xpar.estimate.memory.model_states import BYTES
from xpar.estimate.step_parts import compute_peak, matmul_efficiency

CP_COMM_TYPES = ("all_gather", "p2p", "a2a")
"""framework.cp_comm values (module docstring)."""


def attention_core_times(spec: RunSpec, fw) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's attention core per micro-batch on one rank of the unfolded
    ``spec`` (b sequences, s / cp queries each against all s keys: what b / cp whole sequences cost, as the
    folded estimate prices it, xpar.estimate.context_parallel.fold_cp). Where the hardware has the kernel
    figures, the kernel model's core (xpar.estimate.compute.kernels.attention_time at ``fw.attention_kernel``'s
    fractions, mean over the block kinds); else its FLOPs (whole s x s square, Narayanan et al. 2021) at the
    BF16 matmul rate, backward at twice the forward. ``fw``: the framework's assumptions or config."""
    cp, b, s = spec.layout.cp, spec.train.micro_batch_size, spec.seq_len
    hw, cfg = spec.hardware, spec.model
    if kernel_priced(hw, spec.train.dtype):
        device = training_device(hw, fw.attention_kernel)
        kw = dict(tp=spec.tp, dtype=spec.train.dtype, flash=fw.flash_attention, window_kernel=fw.sliding_window_kernel,
                  kv_over_tp=spec.framework.kv_heads_over_tp, fp8_recipe=spec.train.fp8_recipe)
        f = bw = 0.0
        for (moe, local), w in block_kinds(cfg).items():
            sh = shape_of(cfg, moe=moe, local=local)
            f += w * float(block_times(sh, b / cp, s, device, **kw).attention)
            bw += w * float(block_times(sh, b / cp, s, device, backward=True, **kw).attention)
        return f, bw
    rate = compute_peak(hw, "bf16") * matmul_efficiency(hw, cfg.hidden / spec.tp)
    if not rate:
        return 0.0, 0.0
    core = fl.forward_flops_per_token(tp_model(spec), s)["attention"] / cfg.n_layers
    f = (b / cp) * s / spec.tp * core / rate
    return f, 2 * f


def p2p_layer_times(spec: RunSpec, payload: float, fw) -> dict[str, float]:
    """{f, b: exposed seconds; f_issued, b_issued: the sends' seconds} of one layer's p2p ring per micro-batch, as
    Transformer Engine's AttnFuncWithCPAndKVP2P runs it. Forward: step i computes the local queries against the
    K/V chunk it holds while the next chunk is sent (``forward`` posts ``flash_attn_p2p_communicate`` for step
    i + 1, then runs step i): cp - 1 sends of one chunk, each behind one step's attention (1/cp of the rank's core,
    load-balanced chunks), exposed max(0, send - step); step 0 runs on the local chunk, no send before it.
    Backward: cp steps each sending while it computes: K/V at step 0, K/V and the accumulated dK/dV at steps
    1..cp-2 (``p2p_comm_buffers`` hold both), dK/dV alone at the last (``send_tensor[0]`` / ``[1]``).
    ``payload``: the bytes of the whole sequence's K and V on a rank
    (xpar.estimate.context_parallel.cp_payload_bytes), one chunk ``payload`` / cp. The ring's hops cross
    nodes where the cp group does (tp-strided: xpar.estimate.comm.collectives.group_of); every rank sends at
    once, so a hop across nodes has its device's share of the NICs (p2p_time)."""
    cp = spec.layout.cp
    across = group_of(spec.hardware, cp, spec.tp).nodes > 1
    one, two = (p2p_time(spec.hardware, k * payload / cp, across) for k in (1, 2))
    a_f, a_b = (x / cp for x in attention_core_times(spec, fw))
    f = (cp - 1) * max(0.0, one - a_f)
    b = 2 * max(0.0, one - a_b) + (cp - 2) * max(0.0, two - a_b)
    return {"f": f, "b": b, "f_issued": (cp - 1) * one, "b_issued": 2 * one + (cp - 2) * two}


def a2a_layer_times(spec: RunSpec) -> dict[str, float]:
    """{f, b, f_issued, b_issued} seconds of one layer's Ulysses all-to-alls per micro-batch (sequence-sharded
    to head-sharded before the core, back after), all exposed: forward Q, K, V and the output, backward dO, dQ,
    dK, dV; each rank's buffer b (s / cp) x heads x head_dim / t elements for Q and the output, kv_heads for K
    and V (xpar.config.attention.tp_model), split over the cp group (xpar.estimate.expert_parallel.alltoall_time)."""
    cp, m = spec.layout.cp, tp_model(spec)
    rows = spec.train.micro_batch_size * spec.seq_len / cp * spec.model.head_dim / spec.tp * BYTES[spec.train.dtype]
    g = group_of(spec.hardware, cp, spec.tp)
    t = alltoall_time(spec.hardware, 2 * rows * m.n_heads, g) + alltoall_time(spec.hardware, 2 * rows * m.kv_heads, g)
    return {"f": t, "b": t, "f_issued": t, "b_issued": t}


def all_gather_layer_times(spec: RunSpec, payload: float) -> dict[str, float]:
    """{f, b, f_issued, b_issued} seconds of one layer's K/V all-gather (forward) and their gradients'
    reduce-scatter (backward) of ``payload`` bytes per micro-batch over the tp-strided cp group, exposed."""
    g = group_of(spec.hardware, spec.layout.cp, spec.tp)
    f = collective_time(spec.hardware, "allgather", payload, g)
    b = collective_time(spec.hardware, "reduce_scatter", payload, g)
    return {"f": f, "b": b, "f_issued": f, "b_issued": b}
