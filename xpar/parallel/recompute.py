"""Activation recomputation (``parallel.recompute``), per transformer block.

Applied by the engine factory after tensor parallelism and before the dp wrapper (TP -> AC
-> FSDP, as torchtitan), with ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
around each block's forward (the block's ``forward`` is replaced in place, so parameter
names do not change and FSDP2 / DDP hooks stay around the checkpointed region):

Design notes (what each step does and why, with sources): docs/concepts/design-notes.md.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from xpar.parallel.torch_internals import (
    functional_collectives,
    share_sac_storage,
    tree_leaves,
)
from xpar.parallel.memory_accounting import ActivationTracker

_aten, _funcol = torch.ops.aten, functional_collectives()
SAVE_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
            _funcol.all_reduce.default, _funcol.all_gather_into_tensor.default,
            _funcol.reduce_scatter_tensor.default, _funcol.wait_tensor.default}
"""Ops whose outputs selective recompute keeps; everything else is recomputed."""

MATMULS = {_aten.mm.default, _aten.addmm.default}
"""The ops a block's projections run (nn.Linear without and with bias)."""
KEPT_MATMULS = {"save_dot_except_mlp": 4, "save_qkv_proj": 3}
"""Matmuls per block whose outputs the MaxText policies keep, in forward order (wq wk wv wo)."""
MODES = ("none", "selective", "full", "op") + tuple(KEPT_MATMULS)
"""The policies xpar executes (xpar.config.remat.Policy.executes)."""


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep matmul and collective outputs, recompute the rest (see module docstring)."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def first_matmuls_policy(n_kept: int):
    """A policy for one block invocation that keeps the outputs of its first ``n_kept`` matmuls
    and recomputes everything else; forward and recompute count their matmuls apart, so the
    recompute keeps (reads back) the same ones."""
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in MATMULS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] <= n_kept:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


class _TrackedEntries(dict):
    """One op's entries (invocation index -> kept outputs) in selective checkpointing's
    storage; reports each kept tensor to the active tracker."""

    def __setitem__(self, idx, entry) -> None:
        tracker = ActivationTracker.active
        if tracker is not None:
            for leaf in tree_leaves(entry):
                val = getattr(leaf, "val", None)  # torch wraps each kept tensor in a _VersionWrapper
                if isinstance(val, torch.Tensor):
                    tracker.hold(val)
        super().__setitem__(idx, entry)


class _TrackedStorage(dict):
    def __missing__(self, key):
        self[key] = _TrackedEntries()
        return self[key]


def _tracked_contexts(mode: str = "selective"):
    """``create_selective_checkpoint_contexts`` with ``mode``'s policy, whose cache (op key ->
    {invocation index: kept outputs}, shared by the forward and recompute modes; torch
    2.13's private layout) reports kept tensors. The recompute mode reads it with ``get``,
    which a missing key does not create."""
    policy = first_matmuls_policy(KEPT_MATMULS[mode]) if mode in KEPT_MATMULS else selective_policy
    fwd, rec = create_selective_checkpoint_contexts(policy)
    storage = _TrackedStorage()
    share_sac_storage(fwd, rec, storage)
    return fwd, rec


def checkpoint_block(block: nn.Module, mode: str) -> nn.Module:
    """Replace ``block.forward`` by its checkpointed version for ``mode`` (in place)."""
    if mode == "none":
        return block
    forward = block.forward
    kw = {"context_fn": functools.partial(_tracked_contexts, mode)} if mode != "full" else {}

    @functools.wraps(forward)
    def recomputed(*args):
        return checkpoint(forward, *args, use_reentrant=False, **kw)
    block.forward = recomputed
    return block


def apply_recompute(model: nn.Module, mode: str, layers: Optional[int] = None) -> nn.Module:
    """Checkpoint the transformer blocks of ``model`` (whole model or pipeline stage): every
    one, or the first ``layers`` (parallel.recompute_layers)."""
    if mode not in MODES:
        raise ValueError(f"parallel.recompute={mode!r}; xpar executes {MODES}")
    for i, block in enumerate(model.layers.values()):
        if layers is None or i < layers:
            checkpoint_block(block, mode)
    return model
