"""Memory accounting of a measured run: the bytes each rank holds, by term.

``memory/peak_bytes_per_device`` (defined in :mod:`xpar.track.report`): max over ranks of
accounted bytes on CPU = local parameter + gradient + optimizer-state bytes + peak bytes
saved for backward (each storage counted once), or torch.cuda.max_memory_allocated on
CUDA. Gradient bytes are the most held at once, FSDP2's unsharded gradients of a deferred
reduction included (:func:`model_state_bytes`).
"""
from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch
from torch import nn

from xpar.parallel.precision import is_param_cast
from xpar.parallel.torch_internals import fsdp_param_groups, fsdp_unsharded_grads


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

    Two kinds are told apart: ``peak`` counts activations; ``copies_peak`` counts the bf16
    weight copies autocast casts from fp32 parameters and the matmuls save for backward
    (:func:`xpar.parallel.precision.is_param_cast`) -- parameter bytes, reported under
    ``params``. Tensors kept outside autograd's hooks (selective checkpointing's cache) are
    reported with :meth:`hold`; the tracker inside its ``with`` block is ``ActivationTracker.active``.
    """

    active: Optional["ActivationTracker"] = None

    def __init__(self, params: Iterable[torch.Tensor] = ()):
        self.skip = {_local(p).untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list] = {}  # storage ptr -> [refcount, bytes, is_param_copy]
        self.current = self.peak = 0
        self.copies_current = self.copies_peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._outer: Optional[ActivationTracker] = None

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            if entry[2]:
                self.copies_current -= entry[1]
            else:
                self.current -= entry[1]
            del self.live[key]

    def _count(self, t: torch.Tensor, is_copy: bool) -> None:
        """Count ``t``'s storage (once while referenced); release it when ``t`` dies."""
        storage = _local(t).untyped_storage()  # a DTensor (TP) is counted by its local shard
        key = storage.data_ptr()
        if key in self.skip:
            return
        entry = self.live.get(key)
        if entry is not None:
            entry[0] += 1
        else:
            self.live[key] = [1, storage.nbytes(), is_copy]
            if is_copy:
                self.copies_current += storage.nbytes()
                self.copies_peak = max(self.copies_peak, self.copies_current)
            else:
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
        weakref.finalize(t, self._release, key)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if (base.is_leaf and base.requires_grad) or t.device.type == "meta":
            return t
        # The graph keeps a detached alias (same storage, no grad_fn): returning ``t`` itself
        # would make an output saved by its own node a reference cycle through the C++ graph,
        # which Python's GC cannot see; graphs kept with retain_graph=True and never released
        # (zero-bubble schedules' input/weight backward split) then leaked every step.
        saved = t.detach()
        self._count(saved, is_param_cast(base))
        return saved

    def hold(self, t: torch.Tensor) -> None:
        """Count ``t`` as an activation held until ``t`` is freed (a tensor kept for
        backward outside autograd's saved-tensor hooks)."""
        if t.device.type != "meta":
            self._count(t, False)

    def __enter__(self) -> "ActivationTracker":
        self._outer, ActivationTracker.active = ActivationTracker.active, self
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        ActivationTracker.active = self._outer


def dp_full_param_bytes(p: torch.Tensor) -> int:
    """Bytes of ``p`` unsharded along the dp axis (or the flattened dp x cp axis of context
    parallelism, xpar.parallel.mesh.replica_mesh, or HSDP's shard axis; still sharded along tp)."""
    if not hasattr(p, "placements"):
        return _nbytes(p)
    n = p.numel()
    for name, placement in zip(p.device_mesh.mesh_dim_names or (), p.placements):
        if placement.is_shard() and name not in ("dp", "dp_cp", "dp_shard"):  # dp_shard: HSDP (mesh.hsdp_mesh)
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
    exposes them (:func:`xpar.parallel.torch_internals.fsdp_unsharded_grads`). While a module is unsharded, ``module.parameters()`` yields the unsharded
    parameters themselves, so each parameter object is counted once. A DTensor gradient
    counts its tp-local part.
    """
    params = {id(p): p for c in chunks for p in c.parameters()}
    extra = 0
    for fp in fsdp_params_:
        params[id(fp.sharded_param)] = fp.sharded_param
        unsharded, acc = fsdp_unsharded_grads(fp)
        if unsharded is not None:
            params[id(unsharded)] = unsharded
        if acc is not None:
            extra += _nbytes(acc)
    return extra + sum(_nbytes(p.grad) for p in params.values() if p.grad is not None)


def model_state_bytes(chunks: list[nn.Module], optimizer: torch.optim.Optimizer, zero_stage: int,
                      grads_peak: int = 0, dtype: str = "fp32", copies_peak: int = 0) -> dict[str, int]:
    """Accounted bytes of this rank's model states (call after a step, before zero_grad).

    params: local shards under ZeRO-3; under ZeRO-2 the dp-unsharded size, since FSDP2
    with reshard_after_forward=False holds the whole parameters from forward to backward.
    grads: the most gradient bytes held at once: the local ``.grad`` tensors after the step,
    or ``grads_peak``, the largest :func:`grad_bytes_held` the engine probed during its steps
    (at micro-batch boundaries and before each pipeline stage's gradient reduction), when
    larger -- FSDP2 holding the whole unsharded gradients for a deferred reduction.
    optimizer: tensors in the optimizer state (the per-parameter step counters excluded);
    for ZeRO-1 only this rank's partition.

    With ``dtype='bf16'`` (mixed precision, :mod:`xpar.parallel.precision`) the stored
    parameters are the fp32 master weights, so params = ``params_master`` (fp32, local
    shards under ZeRO-2/3, whole under ZeRO-0/1) + ``params_compute`` (the bf16 copies the
    compute uses: under ZeRO-2 FSDP2's unsharded bf16 parameters, held from forward to
    backward; under autocast ``copies_peak``, the most bf16 weight copies held for backward
    (:class:`ActivationTracker`); under ZeRO-3 none lasting -- the all-gathered unit is
    transient and, as in fp32, not counted). Both parts are also returned by name; the
    "optimizer-side" states of the ZeRO paper's K = 12 are ``params_master + optimizer``.
    """
    params = [p for c in chunks for p in c.parameters()]
    local = sum(_nbytes(p) for p in params)
    out: dict[str, int] = {}
    if dtype == "fp32":
        out["params"] = sum(dp_full_param_bytes(p) for p in params) if zero_stage == 2 else local
    else:
        if zero_stage == 2:
            compute = sum(dp_full_param_bytes(p) // p.element_size() * 2 for p in params)
        else:
            compute = 0 if zero_stage == 3 else copies_peak
        out.update(params=local + compute, params_master=local, params_compute=compute)
    out["grads"] = max(grads_peak, sum(_nbytes(p.grad) for p in params if p.grad is not None))
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps a local AdamW
    out["optimizer"] = sum(_nbytes(v) for state in inner.state.values() for k, v in state.items()
                           if torch.is_tensor(v) and k != "step")
    return out
