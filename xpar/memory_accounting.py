"""Memory accounting of a measured run: the bytes each rank holds, by term.

``memory/peak_bytes_per_device`` (defined in :mod:`xpar.report`): max over ranks of
accounted bytes on CPU = local parameter + gradient + optimizer-state bytes + peak bytes
saved for backward (each storage counted once), or torch.cuda.max_memory_allocated on
CUDA. Gradient bytes are the most held at once, FSDP2's unsharded gradients of a deferred
reduction included (:func:`model_state_bytes`).
"""
from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch import nn

from xpar.torch_private import fsdp_param_groups


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``t``'s data on this rank: a DTensor's local shard, the
    tensor inside an AsyncCollectiveTensor (functional-collective output under TP), or ``t``."""
    while True:
        inner = getattr(t, "_local_tensor", None)  # DTensor
        if inner is None:
            inner = getattr(t, "elem", None)  # AsyncCollectiveTensor (may sit inside a DTensor)
        if not isinstance(inner, torch.Tensor):
            return t
        t = inner


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


class ActivationTracker:
    """Peak bytes saved for backward, via ``torch.autograd.graph.saved_tensors_hooks``.

    Each storage is counted once while any saved tensor refers to it; parameters (leaf
    tensors that require grad, and the storages of ``params``) are skipped. A saved tensor
    is released when autograd frees it (weakref finalizer), so micro-batches kept in
    flight by a pipeline schedule add up. Units: bytes.
    """

    def __init__(self, params: Iterable[torch.Tensor] = ()):
        self.skip = {_local(p).untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}  # storage ptr -> [refcount, bytes]
        self.current = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if (base.is_leaf and base.requires_grad) or t.device.type == "meta":
            return t
        storage = _local(t).untyped_storage()  # a DTensor (TP) is counted by its local shard
        key = storage.data_ptr()
        if key in self.skip:
            return t
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [1, storage.nbytes()]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        # The graph keeps a detached alias (same storage, no grad_fn): returning ``t`` itself
        # would make an output saved by its own node a reference cycle through the C++ graph,
        # which Python's GC cannot see; graphs kept with retain_graph=True and never released
        # (zero-bubble schedules' input/weight backward split) then leaked every step.
        saved = t.detach()
        weakref.finalize(saved, self._release, key)
        return saved

    def __enter__(self) -> "ActivationTracker":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def dp_full_param_bytes(p: torch.Tensor) -> int:
    """Bytes of ``p`` unsharded along the dp axis (still sharded along tp)."""
    if not hasattr(p, "placements"):
        return _nbytes(p)
    n = p.numel()
    for name, placement in zip(p.device_mesh.mesh_dim_names or (), p.placements):
        if placement.is_shard() and name != "dp":
            n //= p.device_mesh.size(p.device_mesh.mesh_dim_names.index(name))
    return n * p.element_size()


def fsdp_params(chunks: list[nn.Module]) -> list:
    """torch's ``FSDPParam`` objects of every FSDP2 module (``fully_shard`` or composable
    ``replicate``) in ``chunks``, each once; empty without FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    out, seen = [], set()
    for c in chunks:
        for mod in c.modules():
            if not isinstance(mod, FSDPModule):
                continue
            for group in fsdp_param_groups(mod):
                for fp in group.fsdp_params:
                    if id(fp) not in seen:
                        seen.add(id(fp))
                        out.append(fp)
    return out


def grad_bytes_held(chunks: list[nn.Module], fsdp_params_: list) -> int:
    """Gradient bytes this rank holds now: every parameter's ``.grad`` (shards under
    ZeRO-2/3) plus the gradients FSDP2 holds *unsharded along dp* for a reduction it has
    deferred; ``fsdp_params_`` from :func:`fsdp_params`.

    With ``set_requires_gradient_sync(False)`` (gradient accumulation without communication;
    torch's PipelineStage sets it for every backward) FSDP2 leaves each gradient on the
    unsharded parameter, ``FSDPParam._unsharded_param.grad``, or, with a mixed-precision
    reduce dtype, in ``FSDPParam.unsharded_accumulated_grad``; the sharded ``p.grad`` appears
    when the reduce-scatter runs and frees these. Both are private fields of torch 2.13's
    FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param.py), read because no public API
    exposes them. While a module is unsharded, ``module.parameters()`` yields the unsharded
    parameters themselves, so each parameter object is counted once. A DTensor gradient
    counts its tp-local part.
    """
    params = {id(p): p for c in chunks for p in c.parameters()}
    extra = 0
    for fp in fsdp_params_:
        params[id(fp.sharded_param)] = fp.sharded_param
        unsharded = getattr(fp, "_unsharded_param", None)  # absent before the first all-gather
        if unsharded is not None:
            params[id(unsharded)] = unsharded
        acc = getattr(fp, "unsharded_accumulated_grad", None)
        if acc is not None:
            extra += _nbytes(acc)
    return extra + sum(_nbytes(p.grad) for p in params.values() if p.grad is not None)


def model_state_bytes(chunks: list[nn.Module], optimizer: torch.optim.Optimizer, zero_stage: int,
                      grads_peak: int = 0) -> dict[str, int]:
    """Accounted bytes of this rank's model states (call after a step, before zero_grad).

    params: local shards under ZeRO-3; under ZeRO-2 the dp-unsharded size, since FSDP2
    with reshard_after_forward=False holds the whole parameters from forward to backward.
    grads: the most gradient bytes held at once: the local ``.grad`` tensors after the step,
    or ``grads_peak``, the largest :func:`grad_bytes_held` the engine probed during its steps
    (at micro-batch boundaries and before each pipeline stage's gradient reduction), when
    larger -- FSDP2 holding the whole unsharded gradients for a deferred reduction.
    optimizer: tensors in the optimizer state (the per-parameter step counters excluded);
    for ZeRO-1 only this rank's partition.
    """
    params = [p for c in chunks for p in c.parameters()]
    if zero_stage == 2:
        pbytes = sum(dp_full_param_bytes(p) for p in params)
    else:
        pbytes = sum(_nbytes(p) for p in params)
    gbytes = max(grads_peak, sum(_nbytes(p.grad) for p in params if p.grad is not None))
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps a local AdamW
    obytes = sum(_nbytes(v) for state in inner.state.values() for k, v in state.items()
                 if torch.is_tensor(v) and k != "step")
    return {"params": pbytes, "grads": gbytes, "optimizer": obytes}
