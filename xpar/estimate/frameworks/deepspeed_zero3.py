"""DeepSpeed's 2021 ZeRO-3 tensor by tensor: what it gathers and reduces, and the host time
(DeepSpeed v0.3.16, read at its tag; the ZeRO-3 of Narayanan et al. 2021, Table 2).

- Each submodule's tensors are all-gathered one by one through torch's list API; tensors under
  ``stage3_param_persistence_threshold`` stay whole, but are gathered back after each step
  (:func:`persist_time`: host ops growing with dp).
- ``stage3_max_reuse_distance``: a submodule's parameters stay gathered only if the elements run
  before its next use are fewer (under full recompute most are gathered again for the backward).
- Gradients: all-reduced flat per bucket (``reduce_scatter`` false, the default), or
  reduce-scattered per tensor (``zero3_reduce_host_ops_per_rank``).

Submodules: a block's tensors grouped by module (``fused_qkv``: Megatron's ``query_key_value``).
Units: seconds, elements. Derivation: docs/concepts/cost-model-derivations.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from xpar.config.attention import tp_model
from xpar.estimate.comm.collectives import collective_time, group_of
from xpar.estimate.comm.volume import allgather_bytes, allreduce_bytes
from xpar.estimate.memory.model_states import BYTES, block_shapes, tensor_counts

QKV = ("attention.wq", "attention.wk", "attention.wv")
"""xpar's separate query, key and value projections (xpar.models.transformer)."""


@dataclass(frozen=True)
class BlockTraffic:
    """Per block and pass: tensors all-gathered (``gathered``; the forward, and the recompute),
    tensors gathered again in the backward (``regathered``) and their share of the block's
    elements (``regathered_share``, 0-1), gradient tensors (``reduced``), tensors that persist
    (``persistent``)."""
    gathered: int
    regathered: int
    regathered_share: float
    reduced: int
    persistent: int


def modules(tensors: tuple, persist_numel: int, fused_qkv: bool) -> list[tuple[int, int, int, int]]:
    """(tensors gathered, their elements, tensors, elements) per submodule of a block in the order
    its parameters are registered (the forward's, but for SwiGLU's w2 and w3 of one size).
    ``tensors``: (name, shape) pairs as :func:`xpar.estimate.memory.model_states.block_shapes` gives them.
    A fused query/key/value module has one tensor per kind (weight, bias) holding the three
    projections' elements; a tensor gathers if it has at least ``persist_numel`` elements."""
    sizes: dict[str, dict[str, int]] = {}
    for name, shape in tensors:
        mod, kind = name.rsplit(".", 1) if "." in name else (name, "")
        mod = "attention.qkv" if fused_qkv and mod in QKV else mod
        kinds = sizes.setdefault(mod, {})
        kinds[kind] = kinds.get(kind, 0) + math.prod(shape)
    out = []
    for kinds in sizes.values():
        big = [n for n in kinds.values() if n >= persist_numel]
        out.append((len(big), sum(big), len(kinds), sum(kinds.values())))
    return out


@lru_cache(maxsize=512)
def block_traffic(tensors: tuple, persist_numel: int, reuse_distance: float | None, recompute: str,
                  fused_qkv: bool) -> BlockTraffic:
    """:class:`BlockTraffic` of a block whose parameters are ``tensors`` ((name, tp-local shape)
    pairs). ``persist_numel``: tensors below it persist (0: none); ``reuse_distance``: DeepSpeed's
    stage3_max_reuse_distance in elements (None: the block is one unit, gathered once for the
    recompute and its backward, FSDP's); ``recompute``: the layout's policy (only 'full' recomputes
    inside the backward); ``fused_qkv``: count the query, key and value projections as one module.
    Module docstring."""
    mods = modules(tensors, persist_numel, fused_qkv)
    total = sum(m[3] for m in mods) or 1
    regathered, share = 0, 0.0
    if reuse_distance is not None and recompute == "full":
        for k, (count, gathered, _, _) in enumerate(mods):
            if count and 2 * sum(m[3] for m in mods[k + 1:]) >= reuse_distance:
                regathered, share = regathered + count, share + gathered / total
    gathered, reduced = sum(m[0] for m in mods), sum(m[2] for m in mods)
    return BlockTraffic(gathered, regathered, share, reduced, reduced - gathered)


def traffic(spec, assume) -> BlockTraffic:
    """What ZeRO-3 moves per (dense) block of ``spec``'s model under ``assume`` (Assumptions):
    :func:`block_traffic` of :func:`xpar.estimate.memory.model_states.block_shapes`. A MoE model's expert
    blocks are priced as its dense block (DeepSpeed v0.3 ran no MoE; this is a what-if)."""
    return block_traffic(block_shapes(tp_model(spec), spec.tp), assume.zero3_persist_numel, assume.zero3_reuse_distance,
                         spec.layout.recompute, assume.fused_qkv)


def list_api_times(spec, assume, units: list[int], elem_bytes: int, kind: str) -> list[float]:
    """Seconds per unit that ZeRO-3 collectives issued per parameter tensor through torch's list
    API add: per rank and tensor, ``zero3_host_ops_per_rank`` host ops of ``host_op_us`` for a
    gather (DeepSpeed's narrow; torch's select and copy between the list and its flat buffer,
    ProcessGroupNCCL::allgather), ``zero3_reduce_host_ops_per_rank`` for a reduce-scatter (DeepSpeed's
    view and narrow; torch's select and copy), and one device copy of the bytes moved, read and
    written over HBM (pytorch/pytorch PR 33924 measured these copies: 4.6x the in-place all-gather
    on a DGX-1). ``kind``: 'gather' (the tensors a pass gathers), 'reduce' (every gradient tensor,
    when reduce-scattered), 'regather' (the backward's second gathers of a block; 0 for the root):
    counts from :func:`traffic`. A root with elements holds the whole model's embeddings, final norm
    and output (a stage's root holds at most those: the error is two tensors' host ops), its tensors
    all gathered. ``units``: elements per unit, root first; ``elem_bytes``: bytes per element moved."""
    t, root = traffic(spec, assume), tensor_counts(spec.model, spec.tp)[1]
    ops = assume.zero3_reduce_host_ops_per_rank if kind == "reduce" else assume.zero3_host_ops_per_rank
    per_tensor = ops * assume.host_op_us * 1e-6 * spec.dp
    hbm = (spec.hardware.hbm_tb_per_s or 0) * 1e12
    k_root, k_block, share = {"gather": (root, t.gathered, 1.0), "reduce": (root, t.reduced, 1.0),
                              "regather": (0, t.regathered, t.regathered_share)}[kind]

    def one(n: int, tensors: int, moved: float) -> float:
        return tensors * per_tensor + (2 * n * moved * elem_bytes / hbm if hbm else 0.0)
    return [one(units[0], k_root if units[0] else 0, 1.0 if k_root else 0.0)] + [one(n, k_block, share) for n in units[1:]]


def tensor_times(spec, assume, units: list[int], gather: list, reduce: list, allgather: Callable[[float], float],
                 elem_bytes: int, grad_bytes: int) -> tuple[list, list, list]:
    """(gather, reduce, gather in the backward) per unit, seconds: ``gather`` and ``reduce`` (the
    collectives' own times per unit, xpar.estimate.comm.dp.unit_times) with the list API's host ops and
    copies (:func:`list_api_times`; the reductions' only when reduce-scattered per tensor), and the
    backward's second gathers of a block (its ``regathered_share`` of the elements through
    ``allgather``: bytes -> seconds)."""
    gather = [g + x for g, x in zip(gather, list_api_times(spec, assume, units, elem_bytes, "gather"))]
    if assume.grad_reduce_scatter:
        reduce = [r + x for r, x in zip(reduce, list_api_times(spec, assume, units, grad_bytes, "reduce"))]
    share = traffic(spec, assume).regathered_share
    again = list_api_times(spec, assume, units, elem_bytes, "regather")
    regather = [x + allgather(share * n * elem_bytes) if i and share else 0.0 for i, (x, n) in enumerate(zip(again, units))]
    return gather, reduce, [g + r for g, r in zip(gather, regather)]


def persist_time(spec, assume, blocks: int) -> float:
    """Seconds per step that ZeRO-3's persistent tensors of a rank with ``blocks`` blocks cost
    (module docstring): after the step, one flat all-gather of them over dp and
    ``zero3_persist_host_ops_per_rank`` host ops per tensor and rank (the unpack loop of
    ``_allgather_params``); in each micro-batch after the first, one gather per tensor
    (``zero3_host_ops_per_rank`` per rank). 0 without persistence. The root's final norm (2
    tensors) is counted with the blocks'."""
    t = traffic(spec, assume)
    if not (assume.zero3_persist_numel and t.persistent):
        return 0.0
    k = t.persistent * blocks + 2
    host = assume.host_op_us * 1e-6 * spec.dp
    group = group_of(spec.hardware, spec.dp, spec.tp)
    after_step = collective_time(spec.hardware, "allgather", persist_bytes(spec, assume, blocks), group,
                                 assume.dp_collective)
    after_step += k * assume.zero3_persist_host_ops_per_rank * host
    return after_step + (spec.micro_batches - 1) * k * assume.zero3_host_ops_per_rank * host


def persist_bytes(spec, assume, blocks: int) -> float:
    """Bytes of the persistent tensors of ``blocks`` blocks in the training dtype (0 without persistence)."""
    if not assume.zero3_persist_numel:
        return 0.0
    return sum(math.prod(s) for _, s in _small(spec, assume.zero3_persist_numel)) * blocks * BYTES[spec.train.dtype]


def _small(spec, persist_numel: int) -> list:
    """The (name, shape) of one block's tensors under ``persist_numel`` elements."""
    return [(n, s) for n, s in block_shapes(tp_model(spec), spec.tp) if math.prod(s) < persist_numel]


def comm_bytes(spec, assume, pp_rank: int, base: dict) -> dict:
    """``base`` (xpar.estimate.comm.volume.comm_bytes_rank: bytes each device sends per step, by
    collective) with what DeepSpeed 2021's ZeRO-3 moves besides (ZeRO-3 without pp, dp > 1; ``base``
    as is otherwise), each with the setting that prices its time: the backward's second gathers
    (``zero3_reuse_distance``), the persistent tensors gathered back after the step and in each
    micro-batch after the first (``zero3_persist_numel``), the gradients all-reduced rather than
    reduce-scattered (``grad_reduce_scatter`` false: twice the bytes)."""
    if not (spec.layout.zero_stage == 3 and spec.pp == 1 and spec.dp > 1):
        return base
    out, t, e, dp, m = dict(base), traffic(spec, assume), BYTES[spec.train.dtype], spec.dp, spec.micro_batches
    blocks = spec.layout.layers_of(pp_rank)
    block = sum(math.prod(s) for _, s in block_shapes(tp_model(spec), spec.tp)) * e
    out["dp_allgather"] += allgather_bytes(t.regathered_share * block * blocks, dp) * m
    out["dp_allgather"] += allgather_bytes(persist_bytes(spec, assume, blocks), dp) * m if t.persistent else 0.0
    if not assume.grad_reduce_scatter:
        out["dp_allreduce"] += out["dp_reduce_scatter"] * allreduce_bytes(1.0, dp) / allgather_bytes(1.0, dp)  # 2x
        out["dp_reduce_scatter"] = 0.0
    return out


