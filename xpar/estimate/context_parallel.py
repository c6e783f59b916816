"""Context parallelism in the cost model: cp ranks share each sequence (Llama 3 paper Sec. 3.3.2;
torchtitan and Megatron-Core's context parallelism).

Per rank and micro-batch, a cp layout does the work of a dp layout with cp times the ranks and
1/cp of the micro-batch (:func:`fold_cp`): each rank holds s / cp tokens of each of the b
sequences, so its matmuls, activations, tp collectives and pipeline sends scale with b s / cp;
its queries attend over all s keys, so the attention scores cost (b s / cp) s, what b / cp whole
sequences cost; the gradients are reduced and ZeRO shards over dp x cp ranks (torchtitan shards
over dp_shard x cp, Megatron-Core's distributed optimizer over dp x cp). What cp adds
(:func:`cp_layer_times`): per layer and micro-batch, an all-gather of K and V over the cp group
in forward and a reduce-scatter of their gradients in backward (the Llama 3 paper's all-gather
based context parallelism: 2 b s kv / t elements gathered), counted exposed (Llama 3 gathers
before it computes; a ring implementation would hide part of it behind the attention). Not
counted: the all-gathered K and V kept for backward beside the local activations. Units: seconds.
"""
from __future__ import annotations

from dataclasses import replace

from xpar.config.spec import RunSpec
from xpar.estimate.collectives import collective_time, group_of
from xpar.estimate.model_states import BYTES


def fold_cp(spec: RunSpec) -> RunSpec:
    """``spec`` as the cost model prices it (module docstring): cp > 1 becomes dp x cp ranks at
    micro-batch b / cp (a float); ``spec`` itself when cp = 1."""
    cp = spec.layout.cp
    if cp == 1:
        return spec
    b = spec.train.micro_batch_size / cp
    layout = replace(spec.layout, dp=spec.layout.dp * cp, cp=1, micro_batch_size=b)
    return replace(spec, layout=layout, parallel=replace(spec.parallel, dp=layout.dp, cp=1),
                   train=replace(spec.train, micro_batch_size=b))


def cp_layer_times(spec: RunSpec) -> dict[str, float]:
    """Seconds of one layer's cp collectives per micro-batch on the unfolded ``spec``: ``f`` (the
    all-gather of K and V, 2 b s kv_heads head_dim / t elements) and ``b`` (the reduce-scatter of
    their gradients, the same payload); 0 without cp. The cp group is tp-strided (rank order
    pp, dp, cp, tp)."""
    cp = spec.layout.cp
    if cp == 1:
        return {"f": 0.0, "b": 0.0}
    cfg = spec.model
    payload = 2 * spec.train.micro_batch_size * spec.seq_len * cfg.kv_heads * cfg.head_dim / spec.tp
    payload *= BYTES[spec.train.dtype]
    g = group_of(spec.hardware, cp, spec.tp)
    return {"f": collective_time(spec.hardware, "allgather", payload, g),
            "b": collective_time(spec.hardware, "reduce_scatter", payload, g)}
