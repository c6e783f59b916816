"""Expert parallelism (ep): each MoE layer's E routed experts split over ep ranks, tokens sent
to their experts' ranks and back by all-to-all (GShard, Lepikhin et al. 2020; Switch, Fedus et al.
2021; DeepSpeed-MoE and Megatron-Core's ``MoEAlltoAllTokenDispatcher``).

The ep ranks are taken inside dp x cp and add no ranks: consecutive flattened dp x cp indices
form an ep group, strided ones the expert-data-parallel group that reduces an expert's gradient
(neighbouring ranks, as Megatron-Core and torchtitan place them).

Design notes (what each step does and why, with sources): docs/concepts/design-notes.md.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from xpar.models.transformer import MoE
from xpar.parallel.precision import fsdp_policy
from xpar.parallel.torch_internals import composable_replicate, ddp_ignore_params

warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_to_all_single is deprecated")
"""torch 2.13 deprecates the autograd all-to-all of torch.distributed.nn for the functional
collectives' ``all_to_all_single_autograd``; it is kept here because it issues
``torch.distributed.all_to_all_single``, which xpar.parallel.comm_log records (axis ep)."""


@dataclass
class ExpertGroups:
    """This rank's expert-parallel process groups and its place in them."""

    ep: Any
    """The ep group (ep consecutive dp x cp ranks), over which tokens are exchanged."""
    expert_dp: Any
    """The expert-data-parallel group (dp * cp / ep ranks holding the same experts)."""
    ep_size: int
    ep_rank: int
    dp_cp: int
    """dp * cp: the ranks whose mean loss is the global loss (the expert gradients' divisor)."""


def dpcp_ranks(layout, pp: int, tp: int) -> list[int]:
    """Global ranks at pipeline rank ``pp`` and tensor rank ``tp``, by flattened dp x cp index
    i = d cp + c, in the rank order (pp, dp, cp, tp): rank = (pp dp cp + i) tp + tp_rank."""
    n = layout.dp * layout.cp
    return [(pp * n + i) * layout.tp + tp for i in range(n)]


def group_ranks(layout) -> tuple[list[list[int]], list[list[int]]]:
    """(every ep group's ranks, every expert-dp group's ranks), in a fixed order (each rank must
    create every group, in the same order: ``dist.new_group``)."""
    ep, eps, edps = layout.ep, [], []
    for p in range(layout.pp):
        for t in range(layout.tp):
            ranks = dpcp_ranks(layout, p, t)
            eps += [ranks[g:g + ep] for g in range(0, len(ranks), ep)]
            edps += [ranks[j::ep] for j in range(ep)]
    return eps, edps


def build_expert_groups(layout, rank: Optional[int] = None) -> ExpertGroups:
    """Create the ep and expert-dp groups (collective over the default group) and return this
    rank's."""
    rank = dist.get_rank() if rank is None else rank
    eps, edps = group_ranks(layout)
    mine = {}
    for kind, lists in (("ep", eps), ("expert_dp", edps)):
        for ranks in lists:
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = (g, ranks)
    ep_ranks = mine["ep"][1]
    return ExpertGroups(ep=mine["ep"][0], expert_dp=mine["expert_dp"][0], ep_size=len(ep_ranks),
                        ep_rank=ep_ranks.index(rank), dp_cp=layout.dp * layout.cp)


# --- dispatch arithmetic (pure, tested in one process) -------------------------------------------

def route_plan(experts_P: torch.Tensor, n_experts: int, ep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order of the (token, expert) pairs to send and the counts per destination expert.

    Args:
        experts_P: expert of each pair [P] (P = T k; pair p is token p // k, slot p % k).
    Returns:
        order_P: the pairs sorted by expert, stably (so by destination ep rank, as experts are
            contiguous per rank), token order kept within an expert;
        counts_RE: pairs sent to each ep rank's each local expert [ep, E / ep] (int64).
    """
    order_P = torch.argsort(experts_P, stable=True)
    counts_RE = torch.bincount(experts_P, minlength=n_experts).view(ep, n_experts // ep)
    return order_P, counts_RE


def group_received(recv_RE: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Rows received from the ep ranks (source-major, then local expert) regrouped by local expert.

    Args:
        recv_RE: rows received from each source ep rank for each local expert [ep, E_local].
    Returns:
        order_M: the received rows sorted by local expert (stably: source order kept) [M];
        per_expert: rows per local expert, in local expert order.
    """
    n_src, n_local = recv_RE.shape
    local_M = torch.arange(n_local).repeat(n_src).repeat_interleave(recv_RE.reshape(-1))
    return torch.argsort(local_M, stable=True), recv_RE.sum(0).tolist()


def inverse(order: torch.Tensor) -> torch.Tensor:
    """The inverse permutation: ``x[order][inverse(order)] == x``."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


# --- the all-to-all dispatch ---------------------------------------------------------------------

def _all_to_all(x_NH: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Autograd-aware variable-size all-to-all of rows (its backward is the reverse all-to-all)."""
    from torch.distributed.nn.functional import all_to_all_single

    out = x_NH.new_empty((sum(out_splits), x_NH.shape[1]))
    return all_to_all_single(out, x_NH.contiguous(), out_splits, in_splits, group=group)


class AllToAllDispatch:
    """``MoE.dispatch`` under ep: send each (token, expert) pair's hidden state to the expert's
    owner, compute the local experts, send the results back, weight by the gates and sum per
    token. The counts are exchanged first (an all-to-all of E int64s) so every rank knows its
    receive sizes. Shapes: x [T, H], gates and experts [T, k] -> [T, H]."""

    def __init__(self, groups: ExpertGroups, n_experts: int):
        self.groups, self.n_experts = groups, n_experts
        self.first = groups.ep_rank * (n_experts // groups.ep_size)

    def __call__(self, experts: nn.ModuleDict, x_TH: torch.Tensor, gates_TK: torch.Tensor,
                 experts_TK: torch.Tensor) -> torch.Tensor:
        g, k = self.groups, experts_TK.shape[1]
        order_P, send_RE = route_plan(experts_TK.reshape(-1), self.n_experts, g.ep_size)
        recv_RE = torch.empty_like(send_RE)
        dist.all_to_all_single(recv_RE.view(-1), send_RE.reshape(-1), group=g.ep)
        send, recv = send_RE.sum(1).tolist(), recv_RE.sum(1).tolist()
        token_P = order_P // k
        got_MH = _all_to_all(x_TH[token_P], recv, send, g.ep)
        order_M, per_expert = group_received(recv_RE)
        y_MH = self._compute(experts, got_MH[order_M], per_expert)[inverse(order_M)]
        back_PH = _all_to_all(y_MH, send, recv, g.ep)
        weighted_PH = back_PH * gates_TK.reshape(-1)[order_P, None]
        return torch.zeros_like(x_TH).index_add(0, token_P, weighted_PH)

    def _compute(self, experts: nn.ModuleDict, x_MH: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """Each local expert over its rows (contiguous, local expert order); every local expert
        runs, even on no rows, so its parameters always get a gradient."""
        parts = x_MH.split(per_expert)
        return torch.cat([experts[str(self.first + i)](x) for i, x in enumerate(parts)])


# --- the strategy over (module, groups) ----------------------------------------------------------

def expert_param_names(chunk: nn.Module) -> list[str]:
    """Names of the routed experts' parameters in ``chunk`` (``...feed_forward.experts.<e>...``)."""
    return [n for n, _ in chunk.named_parameters() if ".experts." in n]


def apply_ep(chunk: nn.Module, groups: ExpertGroups) -> nn.Module:
    """Keep this ep rank's experts in every MoE layer of ``chunk`` (on the meta device, before the
    init), install the all-to-all dispatch, and tell DDP to leave the experts' gradients alone
    (:func:`reduce_expert_grads` reduces them over expert-dp)."""
    for moe in (m for m in chunk.modules() if isinstance(m, MoE)):
        n = len(moe.experts)
        local = n // groups.ep_size
        first = groups.ep_rank * local
        for key in [k for k in moe.experts if not first <= int(k) < first + local]:
            del moe.experts[key]
        moe.dispatch = AllToAllDispatch(groups, n)
    ddp_ignore_params(chunk, expert_param_names(chunk))
    return chunk


def expert_params(chunks: list[nn.Module]) -> list[nn.Parameter]:
    """The routed experts' parameters of this rank's chunks (DDP- or FSDP-wrapped or not)."""
    return [p for c in chunks for n, p in c.named_parameters() if ".experts." in n]


def shard_experts(chunk: nn.Module, groups: ExpertGroups, reshard_after_forward: Optional[bool],
                  dtype: str = "fp32") -> None:
    """ZeRO-2/3 under ep: FSDP2 ``fully_shard`` each local expert over the expert-dp group (its
    replicas; torchtitan shards experts over ``dp_shard_mod_ep`` the same way), before the blocks
    are sharded over dp (which then leave the experts' parameters to these units). FSDP2 averages an
    expert's gradient over expert-dp; :func:`reduce_expert_grads` divides it by ep after the step's
    last backward: sum / (dp * cp), the global loss's gradient, as under DDP. (FSDP2's
    ``set_gradient_divide_factor(dp * cp)`` would do it in the reduce-scatter, but issues
    ``ReduceOp.PREMUL_SUM``, which gloo refuses, measured with torch 2.13.) ``reshard_after_forward``
    None: ZeRO-0/1 of a tp model, whose dp wrapper is torch's composable ``replicate``
    (xpar.parallel.data_parallel.apply_replicate): each expert replicated over expert-dp the same
    way, gradients averaged there. Every local expert runs
    every micro-batch (:meth:`AllToAllDispatch._compute`), so every expert-dp rank issues the same
    all-gathers and reduce-scatters."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    # an unnamed 1-D mesh: memory accounting (dp_full_param_bytes) counts an expert whole under ZeRO-2
    device = next(chunk.parameters()).device.type
    mesh = DeviceMesh.from_group(groups.expert_dp, "cpu" if device == "meta" else device)  # meta: the dry run
    for moe in (m for m in chunk.modules() if isinstance(m, MoE)):
        for expert in moe.experts.values():
            if reshard_after_forward is None:  # ZeRO-0/1 under tp: torch's composable replicate (DDP for DTensor models)
                composable_replicate()(expert, mesh=mesh)
            else:
                fully_shard(expert, mesh=mesh, reshard_after_forward=reshard_after_forward,
                            mp_policy=fsdp_policy(dtype))


@torch.no_grad()
def reduce_expert_grads(chunks: list[nn.Module], groups: ExpertGroups) -> None:
    """Sum the expert gradients over the expert-dp group (one flat buffer) and divide by dp * cp:
    the gradient of the global loss, the mean of the dp x cp ranks' (module docstring); under
    ZeRO-2/3 (FSDP2 averaged them over expert-dp: :func:`shard_experts`) divide by ep. Marks
    each expert parameter so the global norm sums its square over the ep group."""
    params = expert_params(chunks)
    for p in params:
        p._xpar_norm_groups = (groups.ep,)
    if any(hasattr(p, "placements") for p in params):  # FSDP2 averaged them over expert-dp (shard_experts)
        for p in params:
            if p.grad is not None:
                p.grad.div_(groups.ep_size)
        return
    for p in params:
        if p.grad is None:  # the same flat layout on every expert-dp rank
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if dist.get_world_size(groups.expert_dp) > 1:
        dist.all_reduce(flat, group=groups.expert_dp)
    flat /= groups.dp_cp
    for g, v in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(v.view_as(g))


# --- the optimizer ------------------------------------------------------------------------------

class SplitOptimizer(torch.optim.Optimizer):
    """Two optimizers stepped as one: the dense parameters' and the experts'. ZeRO-1 under ep:
    ZeroRedundancyOptimizer over dp would broadcast one ep rank's experts over the others', so the
    experts get their own, over the expert-dp group (ZeroRedundancyOptimizer there when it has
    more than one rank, else AdamW). ``param_groups`` are the parts' own dicts (an lr schedule
    sets both); ``state`` merges the parts' local states (memory accounting)."""

    def __init__(self, parts: list[torch.optim.Optimizer]):  # no super().__init__: the parts own the params
        self.parts = parts
        self.param_groups = [g for o in parts for g in o.param_groups]
        self.defaults = parts[0].defaults
        self._opt_called = False

    @property
    def state(self) -> dict:
        return {k: v for o in self.parts for k, v in getattr(o, "optim", o).state.items()}

    def step(self, closure=None):
        for o in self.parts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"parts": [o.state_dict() for o in self.parts]}

    def load_state_dict(self, state_dict: dict) -> None:
        for o, s in zip(self.parts, state_dict["parts"]):
            o.load_state_dict(s)


def build_ep_optimizer(chunks: list[nn.Module], groups: ExpertGroups, zero_stage: int, dp_group,
                       lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over this rank's parameters (ZeRO-0: experts are plain local parameters); ZeRO-1: a
    :class:`SplitOptimizer` of the dense parameters' ZeroRedundancyOptimizer over dp and the
    experts' over expert-dp (AdamW where expert-dp has one rank)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    kw = dict(lr=lr, weight_decay=weight_decay)
    params = [p for c in chunks for p in c.parameters()]
    if zero_stage != 1:
        return torch.optim.AdamW(params, foreach=False, **kw)
    experts = {id(p) for p in expert_params(chunks)}
    dense = [p for p in params if id(p) not in experts]
    local = [p for p in params if id(p) in experts]
    parts = [ZeroRedundancyOptimizer(dense, optimizer_class=torch.optim.AdamW, process_group=dp_group, **kw)]
    if dist.get_world_size(groups.expert_dp) > 1:
        parts.append(ZeroRedundancyOptimizer(local, optimizer_class=torch.optim.AdamW,
                                             process_group=groups.expert_dp, **kw))
    else:
        parts.append(torch.optim.AdamW(local, foreach=False, **kw))
    return SplitOptimizer(parts)
