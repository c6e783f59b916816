"""The cp axis: context parallelism by all-gathering K and V (Llama 3 paper, Dubey et al. 2024,
Sec. 3.3.2).

The cp ranks of a group share each sequence. Causal load balancing (Megatron-Core, torchtitan,
Llama 3): the S tokens split into 2 cp equal chunks of c = S / (2 cp) tokens, and cp rank i
holds chunks i and 2 cp - 1 - i (inputs and targets alike, :func:`shard_sequence`), so every rank
holds S / cp tokens and the same share of the causal attention's work.

Per layer, each rank computes q, k, v of its own S / cp tokens, all-gathers k and v (its n_kv
heads, before grouped-query heads are repeated) over the cp group, puts the gathered chunks back
into sequence order and computes the attention of its queries, at their global positions,
against all S keys with the causal mask ``key position <= query position``. The all-gather is
autograd-aware (``torch.distributed.nn.functional.all_gather``; its backward sums the K/V
gradients of every rank's queries back onto the owner). RoPE and learned position embeddings
use the global positions (:func:`cp_positions`).

Everything else is per token: each rank's loss is the mean over its S / cp tokens of each
sequence, and averaging the gradients over dp x cp (:func:`xpar.parallel.mesh.replica_mesh`)
gives the gradient of the mean over all tokens, since every rank holds as many. The model knows
nothing of this: :func:`apply_cp` sets its two seams (``positions`` and ``Attention.core``,
xpar.models.transformer).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two sequence chunks (of 2 cp) cp rank ``rank`` holds: (rank, 2 cp - 1 - rank)."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x_BS: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This cp rank's tokens of ``x_BS`` ``[B, S, ...]``: chunks :func:`chunk_ids` of the 2 cp
    equal chunks along dim 1, concatenated: ``[B, S / cp, ...]``. cp = 1: ``x_BS`` itself."""
    if cp == 1:
        return x_BS
    chunks = x_BS.chunk(2 * cp, dim=1)
    a, b = chunk_ids(cp, rank)
    return torch.cat([chunks[a], chunks[b]], dim=1)


def cp_positions(S_local: int, device: torch.device, cp: int, rank: int) -> torch.Tensor:
    """Global positions ``[S_local]`` (int64) of the S_local = S / cp tokens cp rank ``rank``
    holds (:func:`shard_sequence` applied to 0..S-1)."""
    return shard_sequence(torch.arange(S_local * cp, device=device)[None], cp, rank)[0]


def gather_sequence(t_BKsD: torch.Tensor, group, cp: int) -> torch.Tensor:
    """All-gather ``t`` ``[B, K, S / cp, D]`` over the cp ``group`` (autograd-aware) and put the
    chunks in sequence order: ``[B, K, S, D]``."""
    from torch.distributed.nn.functional import all_gather

    parts = all_gather(t_BKsD.contiguous(), group=group)  # cp tensors, rank order
    ordered: list = [None] * (2 * cp)
    for r, part in enumerate(parts):
        a, b = chunk_ids(cp, r)
        ordered[a], ordered[b] = part.chunk(2, dim=2)
    return torch.cat(ordered, dim=2)


def cp_attention(q_BNsD: torch.Tensor, k_BKsD: torch.Tensor, v_BKsD: torch.Tensor, group, cp: int,
                 rank: int) -> torch.Tensor:
    """Causal attention of this rank's queries ``[B, N, S / cp, D]`` over the K/V of the whole
    sequence (gathered from the cp group, n_kv heads, then repeated for grouped-query attention);
    returns ``[B, N, S / cp, D]``. Query at global position p sees keys at positions <= p."""
    k, v = gather_sequence(k_BKsD, group, cp), gather_sequence(v_BKsD, group, cp)
    n_q, n_kv, S = q_BNsD.shape[1], k.shape[1], k.shape[2]
    if n_kv != n_q:
        k = k.repeat_interleave(n_q // n_kv, dim=1)
        v = v.repeat_interleave(n_q // n_kv, dim=1)
    pos_q = cp_positions(q_BNsD.shape[2], q_BNsD.device, cp, rank)
    mask_sS = torch.arange(S, device=q_BNsD.device)[None, :] <= pos_q[:, None]
    return F.scaled_dot_product_attention(q_BNsD, k, v, attn_mask=mask_sS)


def apply_cp(chunk: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Context parallelism on ``chunk`` (a :class:`xpar.models.transformer.Transformer`, whole or
    a pipeline stage) over the 1-D ``cp_mesh``, in place: global positions for the position
    embedding and RoPE, all-gather attention in every block. Apply before tensor parallelism and
    the dp wrappers (it sets attributes of the modules they wrap). Returns ``chunk``."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    positions = partial(cp_positions, cp=cp, rank=rank)
    chunk.positions = positions
    for block in chunk.layers.values():
        block.attention.positions = positions
        block.attention.core = partial(cp_attention, group=cp_mesh.get_group(), cp=cp, rank=rank)
    return chunk

