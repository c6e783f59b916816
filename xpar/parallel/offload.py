"""Activation offload (``parallel.activation_offload_layers=N``): the saved activations of the first N
transformer blocks are kept in host memory between their forward and their backward.

The mechanism is torch's documented one, ``torch.autograd.graph.save_on_cpu`` (torch/autograd/graph.py): a
saved-tensor hook pair that copies each tensor autograd saves to host memory (pinned where the device is CUDA, so
the copy runs asynchronously on the current stream) and back to its device when the backward reads it. It wraps
each offloaded block's forward, applied by the engine factory after recompute and before the dp wrapper (the
block's ``forward`` is replaced in place, as recompute does, so parameter names and FSDP2's hooks stay).

Two things ``save_on_cpu`` would do that Megatron-Core's --cpu-offloading does not, and which are kept here:

- parameters, and autocast's cached bf16 casts of them, stay where they are (Transformer Engine offloads
  activations, not weights: transformer_engine/pytorch/cpu_offload.py); they pass to the enclosing hooks (the
  memory accounting's :class:`xpar.parallel.memory_accounting.ActivationTracker`), as without offload;
- a DTensor (tensor parallelism) is offloaded as its local shard and rebuilt with its mesh and placements
  (``save_on_cpu``'s pinned copy allocates the global shape).

On a CPU, ``save_on_cpu`` keeps each tensor where it is (``Tensor.cpu`` of a CPU tensor is itself): the run
computes exactly as without offload. The offloaded tensors are not counted as device activations (the
estimate's L - N blocks held, xpar.estimate.memory.activation_offload, ``activation_offload_overlap`` false).
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from xpar.parallel.memory_accounting import ActivationTracker
from xpar.parallel.precision import is_param_cast


def _stays(t: torch.Tensor) -> bool:
    """Whether saved tensor ``t`` stays on its device: a parameter (a leaf that requires grad, or a view of one),
    autocast's cast of one (:func:`xpar.parallel.precision.is_param_cast`), or a meta tensor (the dry run)."""
    base = t._base if t._base is not None else t
    return (base.is_leaf and base.requires_grad) or bool(is_param_cast(base)) or t.device.type == "meta"


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """``save_on_cpu``'s hooks for activations; parameters and their casts go to the enclosing hooks (the
    module docstring). Enter it around a block's forward."""

    def __init__(self, pin_memory: bool):
        self.inner = torch.autograd.graph.save_on_cpu(pin_memory=pin_memory)
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> tuple:
        if _stays(t):
            tracker = ActivationTracker.active
            return ("kept", tracker._pack(t) if tracker is not None else t)
        if isinstance(t, DTensor):
            with torch.no_grad():
                local = t.to_local()
            return ("dtensor", self.inner.pack_hook(local), (t.device_mesh, t.placements, t.shape, t.stride()))
        return ("host", self.inner.pack_hook(t))

    def _unpack(self, packed: tuple) -> torch.Tensor:
        if packed[0] == "kept":
            return packed[1]
        local = self.inner.unpack_hook(packed[1])
        if packed[0] == "host":
            return local
        mesh, placements, shape, stride = packed[2]
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def offload_block(block: nn.Module, pin_memory: bool) -> nn.Module:
    """Replace ``block.forward`` by one that runs under :class:`OffloadHooks` (in place)."""
    forward = block.forward

    @functools.wraps(forward)
    def offloaded(*args: Any, **kwargs: Any):
        with OffloadHooks(pin_memory):
            return forward(*args, **kwargs)
    block.forward = offloaded
    return block


def apply_activation_offload(model: nn.Module, layers: Optional[int], device: str) -> nn.Module:
    """Offload the saved activations of the first ``layers`` transformer blocks of ``model`` (a whole model: pp 1,
    xpar.estimate.memory.activation_offload.offload_problems) to host memory, pinned where ``device`` is CUDA;
    ``layers`` None or 0: ``model`` unchanged. Returns ``model``."""
    for i, block in enumerate(model.layers.values()):
        if i < (layers or 0):
            offload_block(block, pin_memory=device.startswith("cuda"))
    return model
