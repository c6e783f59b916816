"""Context parallelism in the cost model: cp ranks share each sequence (Llama 3 paper Sec. 3.3.2;
torchtitan and Megatron-Core's context parallelism).

Per rank and micro-batch, a cp layout does the work of a dp layout with cp times the ranks and
1/cp of the micro-batch (:func:`fold_cp`): each rank holds s / cp tokens of each of the b
sequences, so its matmuls, activations, tp collectives and pipeline sends scale with b s / cp;
its queries attend over all s keys, so the attention scores cost (b s / cp) s, what b / cp whole
sequences cost; the gradients are reduced and ZeRO shards over dp x cp ranks (torchtitan shards
over dp_shard x cp, Megatron-Core's distributed optimizer over dp x cp). What cp adds
(:func:`cp_layer_times`): per layer and micro-batch, the exchange of K and V (2 b s kv / t elements)
as the framework runs it (``framework.cp_comm``: xpar.estimate.cp_exchange). Not counted: the
all-gathered K and V kept for backward beside the local activations. Units: seconds.
"""
from __future__ import annotations

from dataclasses import replace

from xpar.config.attention import tp_model
from xpar.config.remat import POLICIES, replayed_share
from xpar.config.spec import RunSpec
from xpar.estimate.cp_exchange import (CP_COMM_TYPES, a2a_layer_times, all_gather_layer_times,
                                       p2p_layer_times)
from xpar.estimate.memory.model_states import BYTES


def fold_cp(spec: RunSpec) -> RunSpec:
    """``spec`` as the cost model prices it (module docstring): cp > 1 becomes dp x cp ranks at
    micro-batch b / cp (a float); ``spec`` itself when cp = 1."""
    cp = spec.layout.cp
    if cp == 1:
        return spec
    b = spec.train.micro_batch_size / cp
    layout = replace(spec.layout, dp=spec.layout.dp * cp, cp=1, micro_batch_size=b)
    return replace(spec, layout=layout, train=replace(spec.train, micro_batch_size=b))


CP_REPLAY_POLICIES = tuple(name for name, p in POLICIES.items() if p.attention)
"""Recompute policies whose backward reruns the attention core, which needs the gathered K and V that no
policy keeps: each such block gathers them again (xpar's engine: 4 -> 8 all-gathers, issue 42)."""


def cp_replay(spec: RunSpec, fw) -> float:
    """Share of the blocks whose backward gathers K and V again (:data:`CP_REPLAY_POLICIES`,
    ``fw.recompute_replays_comm``: :func:`xpar.config.remat.replayed_share`); 0 without recompute."""
    return replayed_share(spec, fw, CP_REPLAY_POLICIES)


def cp_payload_bytes(spec: RunSpec) -> float:
    """Bytes of one layer's K and V all-gather per micro-batch on the unfolded ``spec`` (the
    gathered output, 2 b s kv_heads head_dim / t elements; their gradients' reduction in backward
    carries as many); 0 without cp."""
    if spec.layout.cp == 1:
        return 0.0
    kv = tp_model(spec).kv_heads  # as the tp ranks hold them (xpar.config.attention.tp_model: replicated or split)
    return 2 * spec.train.micro_batch_size * spec.seq_len * kv * spec.model.head_dim / spec.tp * BYTES[spec.train.dtype]


def cp_bytes_per_step(spec: RunSpec) -> float:
    """Bytes of the K and V all-gathers of one step on the fullest pipeline rank: its layers x m x
    :func:`cp_payload_bytes`, again in the backward of the recomputed blocks (:func:`cp_replay` under
    the spec's framework)."""
    layout = spec.layout
    layers = max(sum(len(layout.stage_layers(s)) for s in layout.stages_of(r)) for r in range(spec.pp))
    return layers * spec.micro_batches * cp_payload_bytes(spec) * (1 + cp_replay(spec, spec.framework))


def cp_layer_times(spec: RunSpec, fw=None) -> dict[str, float]:
    """Seconds of one layer's cp K/V exchange per micro-batch on the unfolded ``spec`` as the framework runs it
    (``fw.cp_comm``: xpar.estimate.cp_exchange; ``fw``: its assumptions or config, default ``spec.framework``):
    ``f`` and ``b`` exposed in forward and backward, ``f_issued`` and ``b_issued`` the communication issued (equal
    where nothing is hidden); all 0 without cp. ``p2p`` with a sliding-window model is priced as ``all_gather``
    (:func:`cp_comm_of`): Transformer Engine's ring refuses sliding windows (its attention-with-cp tests: "No
    support for SWA with cp_comm_type={p2p, a2a+p2p}"), its all-gather cp takes ``window_size``
    (docs/concepts/kernels.md). The cp group is tp-strided (rank order pp, dp, cp, tp).

    Raises:
        ValueError: an unknown ``cp_comm``."""
    fw = spec.framework if fw is None else fw
    if spec.layout.cp == 1:
        return dict.fromkeys(("f", "b", "f_issued", "b_issued"), 0.0)
    kind = cp_comm_of(spec, fw)
    if kind == "p2p":
        return p2p_layer_times(spec, cp_payload_bytes(spec), fw)
    if kind == "a2a":
        return a2a_layer_times(spec)
    return all_gather_layer_times(spec, cp_payload_bytes(spec))


def cp_comm_of(spec: RunSpec, fw) -> str:
    """The exchange the framework runs for ``spec`` (:func:`cp_layer_times`): ``fw.cp_comm``, but ``all_gather`` for
    ``p2p`` with a sliding-window model.

    Raises:
        ValueError: an unknown ``cp_comm``."""
    if fw.cp_comm not in CP_COMM_TYPES:
        raise ValueError(f"framework.cp_comm={fw.cp_comm!r} is not one of {', '.join(CP_COMM_TYPES)}")
    return "all_gather" if fw.cp_comm == "p2p" and spec.model.sliding_window else fw.cp_comm
