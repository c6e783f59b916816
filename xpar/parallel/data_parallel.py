"""The dp axis: DDP, ZeRO-1 (ZeroRedundancyOptimizer over DDP), ZeRO-2/3 (FSDP2).

ZeRO stages after Rajbhandari et al. 2020: stage 1 partitions optimizer states, stage 2
also gradients, stage 3 also parameters. Each function takes a module and the dp sub-mesh
and returns the wrapped module; the optimizer is built by :func:`build_optimizer`.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from xpar.parallel.expert import build_ep_optimizer
from xpar.parallel.precision import fsdp_policy
from xpar.parallel.torch_internals import composable_replicate


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: str) -> nn.Module:
    """Replicate the model on every dp rank; gradients all-reduced (averaged) in buckets
    during backward. ZeRO stage 0 and, with the ZeRO-1 optimizer, stage 1. On the meta device
    (the fake-process-group dry run, xpar.run.dryrun) the initial shape check and broadcast are
    skipped: they read values, which meta tensors do not have."""
    ids = [torch.cuda.current_device()] if device == "cuda" else None
    return DDP(model, device_ids=ids, process_group=dp_mesh.get_group(), init_sync=device != "meta")


def apply_replicate(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """DDP semantics (whole model per dp rank, gradients all-reduced and averaged over dp)
    for a model whose parameters are DTensors (tensor parallel), which DDP cannot wrap
    (its initial broadcast fails on DTensor): torch's composable ``replicate`` built on the
    FSDP2 machinery with a replicate-only dp mesh, per transformer block, then the root."""
    replicate = composable_replicate()
    for block in model.layers.values():
        replicate(block, mesh=dp_mesh)
    replicate(model, mesh=dp_mesh)
    return model


def keep_grads_placed(model: nn.Module) -> nn.Module:
    """Without a dp wrapper, torch's tensor parallelism leaves the vocabulary-parallel
    embedding's gradient whole (Replicate) beside its Shard(0) parameter (measured, torch 2.13);
    a post-accumulate-grad hook puts every DTensor gradient back on its parameter's placements
    (Replicate -> Shard is a local slice, no communication), so gradients are held as the
    parameters are, as under the wrapper."""
    for p in model.parameters():
        if hasattr(p, "placements"):
            p.register_post_accumulate_grad_hook(_grad_to_param_placements)
    return model


def _grad_to_param_placements(p: nn.Parameter) -> None:
    if p.grad is not None and tuple(p.grad.placements) != tuple(p.placements):
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def _has_dtensor_params(model: nn.Module) -> bool:
    return any(hasattr(p, "placements") for p in model.parameters())


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool,
               dtype: str = "fp32", root_reshard_after_forward: bool = False) -> nn.Module:
    """FSDP2 ``fully_shard`` per transformer block, then the root (embedding, norm, output).

    reshard_after_forward=False keeps the blocks' parameters unsharded from forward to
    backward (ZeRO-2: gradients and optimizer states sharded); True frees them after each
    block's forward and all-gathers again in backward (ZeRO-3). The root is kept unsharded
    from its forward to its backward unless ``root_reshard_after_forward`` (torch's default and
    advice for a root, whose output layer the backward needs first; re-gathering it cost 3 % of
    a tiny-model ZeRO-3 step here, benchmarks/overhead.py). Pipeline stages reshard their root
    too: a stage's forward of the next micro-batch is not followed by its own backward.
    ``dtype='bf16'``: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
    over fp32 sharded parameters (:func:`xpar.parallel.precision.fsdp_policy`).
    """
    mp = fsdp_policy(dtype)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward and root_reshard_after_forward,
                mp_policy=mp)
    return model


def wrap_dp(model: nn.Module, dp_mesh: DeviceMesh, zero_stage: int, device: str,
            dtype: str = "fp32", pipelined: bool = False) -> nn.Module:
    """Apply the dp-axis strategy for ``zero_stage`` (0..3) to a model or (``pipelined``) a
    pipeline stage. Under bf16, ZeRO-0/1 expect the model's forward already under autocast
    (:func:`xpar.parallel.precision.apply_autocast`)."""
    if zero_stage <= 1:
        if dp_mesh.size() == 1:  # one dp rank: no gradient to average, no wrapper (it only copied:
            return keep_grads_placed(model)  # 3-5 % of a tp step, benchmarks/overhead.py)
        if _has_dtensor_params(model):  # tensor parallel: DDP cannot wrap DTensor parameters
            return apply_replicate(model, dp_mesh)
        return apply_ddp(model, dp_mesh, device)
    return apply_fsdp(model, dp_mesh, reshard_after_forward=(zero_stage == 3), dtype=dtype,
                      root_reshard_after_forward=pipelined)


def build_optimizer(params: list[nn.Parameter], zero_stage: int, dp_mesh: DeviceMesh,
                    lr: float, weight_decay: float, chunks=None, expert_groups=None) -> torch.optim.Optimizer:
    """AdamW; for ZeRO-1 wrapped in ZeroRedundancyOptimizer, which keeps the states of about
    1/dp of the parameters per rank (whole parameters, assigned greedily by size) and
    broadcasts updated parameters after each step. Under expert parallelism (``expert_groups``)
    the experts' states are kept apart (xpar.parallel.expert.build_ep_optimizer)."""
    if expert_groups is not None:
        return build_ep_optimizer(chunks, expert_groups, zero_stage, dp_mesh.get_group(), lr, weight_decay)
    if zero_stage == 1:
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW,
                                       process_group=dp_mesh.get_group(), lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False)
