"""Activation offload (``parallel.activation_offload_layers=N``): the saved activations of the first N
transformer blocks kept in host memory between their forward and their backward, with torch's documented
``torch.autograd.graph.save_on_cpu`` (torch/autograd/graph.py; pinned where the device is CUDA) around each
offloaded block's forward (replaced in place, as recompute does: parameter names and FSDP2's hooks stay).
Applied by the engine factory after recompute, before autocast and the dp wrapper.

As Megatron-Core's --cpu-offloading (Transformer Engine's cpu_offload), only activations move: parameters and
autocast's cached casts of them pass to the enclosing hooks (the memory accounting's tracker); a DTensor (tp)
goes as its local shard and comes back with its mesh and placements (``save_on_cpu``'s pinned copy would
allocate the global shape). On a CPU nothing is copied (``Tensor.cpu`` of a CPU tensor is itself), and the
offloaded tensors leave the measured activations: L - N blocks held, as the estimate says
(xpar.estimate.memory.activation_offload). Design notes: docs/concepts/design-notes.md.
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
