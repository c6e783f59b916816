"""What DeepSpeed's 2021 ZeRO-3 gathers and reduces, tensor by tensor (DeepSpeed v0.3.16, read at its tag).

DeepSpeed v0.3.x (the ZeRO-3 of Narayanan et al. 2021, Table 2) fetches the parameters of one
submodule at a time (``stage3.PartitionedParameterCoordinator.fetch_sub_module``), each tensor by
its own all-gather, and reduce-scatters each gradient tensor on its own
(``partition_parameters._reduce_scatter_gradient``). Two of its settings decide what moves:

- ``stage3_param_persistence_threshold`` (default 1e5 elements, ``persistent_parameters``): a
  tensor with fewer elements stays whole on every rank (``ds_persist``) and is never gathered;
  its gradient is reduce-scattered like the others. In a GPT block at h >= 1e5 / 4 this leaves the
  four weight matrices gathered; the biases and norms persist.
- ``stage3_max_reuse_distance`` (default 1e9 elements, ``_keep_for_later``): after a submodule
  runs, its parameters stay gathered only if the elements of the submodules run before its next
  use (``PrefetchCoordinator._distance_in_numel``: each step of the recorded trace counted) are
  fewer. Under full recompute the trace of a block's backward is its recomputed forward, then its
  backward in reverse order: submodule k is next used after the recompute of every later submodule
  and their backward, a distance of twice their elements. The last submodule (the MLP's second
  linear) is kept; the others, at GPT-3 sizes (8 h^2 >= 1e9 from h = 11,180), are gathered again
  for their backward. Without recompute every submodule is gathered once in each pass.

Submodules: a block's tensors grouped by module (name without its last part); with
``fused_qkv`` the query, key and value projections are one module (Megatron's
``query_key_value``, which the GPT of these runs used).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

QKV = ("attention.wq", "attention.wk", "attention.wv")
"""xpar's separate query, key and value projections (xpar.models.transformer)."""


@dataclass(frozen=True)
class BlockTraffic:
    """Per block and pass: tensors all-gathered (``gathered``; the forward, and the recompute),
    tensors gathered again in the backward (``regathered``) and their share of the block's
    elements (``regathered_share``, 0-1), gradient tensors reduce-scattered (``reduced``)."""
    gathered: int
    regathered: int
    regathered_share: float
    reduced: int


def modules(tensors: tuple, persist_numel: int, fused_qkv: bool) -> list[tuple[int, int, int, int]]:
    """(tensors gathered, their elements, tensors, elements) per submodule of a block in forward
    order. ``tensors``: (name, shape) pairs as :func:`xpar.estimate.model_states._stage_parts`
    gives them. A fused query/key/value module has one tensor per kind (weight, bias) and the
    three projections' elements; a tensor gathers if it has at least ``persist_numel`` elements."""
    out: dict[str, tuple] = {}
    for name, shape in tensors:
        mod, kind = name.rsplit(".", 1) if "." in name else (name, "")
        mod = "attention.qkv" if fused_qkv and mod in QKV else mod
        kinds, big, gathered, numel = out.get(mod, (frozenset(), frozenset(), 0, 0))
        n = math.prod(shape)
        if n >= persist_numel:
            big, gathered = big | {kind}, gathered + n
        out[mod] = (kinds | {kind}, big, gathered, numel + n)
    return [(len(big), gathered, len(kinds), numel) for kinds, big, gathered, numel in out.values()]


@lru_cache(maxsize=512)
def block_traffic(tensors: tuple, persist_numel: int, reuse_distance: float | None, recompute: str,
                  fused_qkv: bool) -> BlockTraffic:
    """:class:`BlockTraffic` of a block whose parameters are ``tensors`` ((name, tp-local shape)
    pairs, forward order). ``persist_numel``: tensors below it are never gathered (0: none
    persists); ``reuse_distance``: DeepSpeed's stage3_max_reuse_distance in elements (None: the
    block is one unit, gathered once for the recompute and its backward, FSDP's); ``recompute``:
    the layout's policy (only 'full' recomputes inside the backward); ``fused_qkv``: count the
    query, key and value projections as one module. Module docstring."""
    mods = modules(tensors, persist_numel, fused_qkv)
    total = sum(m[3] for m in mods) or 1
    regathered, share = 0, 0.0
    if reuse_distance is not None and recompute == "full":
        for k, (count, gathered, _, _) in enumerate(mods):
            if 2 * sum(m[3] for m in mods[k + 1:]) >= reuse_distance:
                regathered, share = regathered + count, share + gathered / total
    return BlockTraffic(sum(m[0] for m in mods), regathered, share, sum(m[2] for m in mods))
