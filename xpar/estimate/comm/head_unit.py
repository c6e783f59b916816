"""The output head as a dp unit of its own (``framework.head_unit_last``): on a one-stage pipeline of an untied
model, the root unit (embedding, final norm, output projection: :func:`xpar.estimate.memory.model_states.unit_elements`)
splits into the embedding, first in forward and last in backward, and the head (final norm and output projection,
with the logits' compute), last in forward and first in backward. Its all-gather is prefetched behind the last
block's forward and its reduction starts the backward, where the root's were exposed before the first block and after
the last (torchtitan, torchtitan/models/llama3/infra/parallelize.py ``apply_fsdp``: ``fully_shard(tok_embeddings)``,
each block, ``fully_shard([norm, output], reshard_after_forward=False)``; Megatron-Core,
megatron/core/optimizer/distrib_optimizer.py ``_compute_per_buffer_param_layout`` and
megatron/core/distributed/param_and_grad_buffer.py: parameters bucketed in reverse order, the output layer's bucket
reduced first, the embedding's last and gathered first). The head stays gathered from its forward to its backward:
no backward all-gather or copy; the embedding's backward gather is the root's (none: ``dp.root_kept``).

Units: seconds, as :mod:`xpar.estimate.comm.dp`; every time a float or an array over layouts.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np


def any_head(head: Any) -> bool:
    """Whether a head share (a float, or an array over layouts) splits any layout's root."""
    return bool(np.any(np.asarray(head) > 0))


def split_forward(values: Optional[list], head: Any) -> Optional[list]:
    """A forward-order per-unit list (root first) with the root split: the embedding's share (1 - ``head``) first,
    the head's (``head``) appended after the last unit; None stays None. ``head`` 0: the list and a unit of no time."""
    if values is None:
        return None
    return [values[0] * (1 - head)] + list(values[1:]) + [values[0] * head]


def split_compute(compute_f: list, compute_b: list, head: Any) -> tuple[list, list]:
    """(forward, backward) compute per unit with the root's compute (the logits) moved to the head unit where
    ``head`` > 0: last in forward, first in backward (backward order: root last in ``compute_b``)."""
    on = np.where(np.asarray(head) > 0, 1.0, 0.0) if isinstance(head, np.ndarray) else float(head > 0)
    fwd = [compute_f[0] * (1 - on)] + list(compute_f[1:]) + [compute_f[0] * on]
    bwd = [compute_b[-1] * on] + list(compute_b[:-1]) + [compute_b[-1] * (1 - on)]
    return fwd, bwd


def kept_head(backward_order: list, head: Any) -> list:
    """Backward-order per-unit values with the head's (first) set to 0 where ``head`` > 0: kept gathered from its
    forward (no backward all-gather, no copy)."""
    if not backward_order:
        return backward_order
    off = np.where(np.asarray(head) > 0, 0.0, 1.0) if isinstance(head, np.ndarray) else float(not head > 0)
    return [backward_order[0] * off] + list(backward_order[1:])
