"""The cp axis: context parallelism by all-gathering K and V (Llama 3 paper, Dubey et al. 2024,
Sec. 3.3.2).

The cp ranks of a group share each sequence. Causal load balancing (Megatron-Core, torchtitan,
Llama 3): the S tokens split into 2 cp equal chunks of c = S / (2 cp) tokens, and cp rank i
holds chunks i and 2 cp - 1 - i (inputs and targets alike, :func:`shard_sequence`), so every rank
holds S / cp tokens and the same share of the causal attention's work.

Design notes (what each step does and why, with sources): docs/concepts/design-notes.md.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from xpar.models.transformer import band_mask


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


def order_chunks(parts: list[torch.Tensor], cp: int) -> torch.Tensor:
    """The cp ranks' ``[B, K, S / cp, D]`` shards (rank order, as all-gathered) put back in
    sequence order: ``[B, K, S, D]`` (rank r's halves are chunks :func:`chunk_ids` (r))."""
    ordered: list = [None] * (2 * cp)
    for r, part in enumerate(parts):
        a, b = chunk_ids(cp, r)
        ordered[a], ordered[b] = part.chunk(2, dim=2)
    return torch.cat(ordered, dim=2)


class _AllGather(torch.autograd.Function):
    """All-gather over a process group, stacked: ``[*shape]`` -> ``[cp, *shape]`` in group-rank
    order. Backward: the sum over the cp ranks of each rank's gradient of the gathered tensor,
    its own slice kept -- a reduce-scatter (NCCL's ``reduce_scatter_tensor``); gloo has no
    reduce-scatter, so there it is an all-reduce of the whole ``[cp, *shape]`` gradient in fp32,
    then the slice (cp times the payload; a CPU run's; the NCCL branch is not run on this
    machine's tests, CPU only). Written here because torch 2.13's
    ``torch.distributed.nn.functional.all_gather`` backward on gloo scatters from group ranks as
    if they were global ranks and fails on any group that does not start at rank 0 (measured:
    "Global rank 0 is not part of group" at dp 2 x cp 2); its functional-collectives
    counterpart needs a reduce-scatter, which gloo lacks."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        cp = dist.get_world_size(group)
        out = torch.empty((cp * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_single(out, t.contiguous(), group=group)  # logged as comm/cp_allgather (train.comm_groups)
        return out.view(cp, *t.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        if dist.get_backend(group) == dist.Backend.NCCL:
            out = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, grad.flatten(0, 1).contiguous(), group=group)
            return out, None
        summed = grad.float().clone(memory_format=torch.contiguous_format)  # autograd's buffer is left as it is
        dist.all_reduce(summed, group=group)
        return summed[dist.get_rank(group)].to(grad.dtype), None


def gather_sequence(t_BKsD: torch.Tensor, group, cp: int) -> torch.Tensor:
    """All-gather ``t`` ``[B, K, S / cp, D]`` over the cp ``group`` (autograd-aware, :class:`_AllGather`)
    and put the chunks in sequence order: ``[B, K, S, D]``."""
    return order_chunks(list(_AllGather.apply(t_BKsD, group).unbind(0)), cp)


def attend_local_queries(q_BNsD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, cp: int,
                         rank: int, window: int = 0) -> torch.Tensor:
    """Causal attention of cp rank ``rank``'s queries ``[B, N, S / cp, D]`` over the whole
    sequence's K/V ``[B, K, S, D]`` (n_kv heads, repeated here for grouped-query attention);
    returns ``[B, N, S / cp, D]``. The query at global position p sees the keys at positions
    <= p (:func:`cp_positions`), and > p - ``window`` where > 0 (a local layer:
    xpar.models.transformer.band_mask): the rows of the single-process attention this rank holds."""
    n_q, n_kv, S = q_BNsD.shape[1], k_BKSD.shape[1], k_BKSD.shape[2]
    if n_kv != n_q:
        k_BKSD = k_BKSD.repeat_interleave(n_q // n_kv, dim=1)
        v_BKSD = v_BKSD.repeat_interleave(n_q // n_kv, dim=1)
    pos_q = cp_positions(q_BNsD.shape[2], q_BNsD.device, cp, rank)
    mask_sS = band_mask(pos_q, S, window)
    return F.scaled_dot_product_attention(q_BNsD, k_BKSD, v_BKSD, attn_mask=mask_sS)


def cp_attention(q_BNsD: torch.Tensor, k_BKsD: torch.Tensor, v_BKsD: torch.Tensor, group, cp: int,
                 rank: int, window: int = 0) -> torch.Tensor:
    """``Attention.core`` under context parallelism: all-gather this layer's K and V (n_kv heads,
    ``[B, K, S / cp, D]`` each, concatenated on the heads: one collective per layer) over the cp
    ``group``, then :func:`attend_local_queries` (within ``window`` keys where > 0). A local layer gathers the
    whole sequence too, as Transformer Engine's all-gather context parallelism does for sliding windows."""
    kv_B2KSD = gather_sequence(torch.cat([k_BKsD, v_BKsD], dim=1), group, cp)
    k, v = kv_B2KSD.chunk(2, dim=1)
    return attend_local_queries(q_BNsD, k, v, cp, rank, window)


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

