"""Every private torch API xpar uses, behind one small function each (torch 2.13).

A torch upgrade that moves one of them breaks this module only, and
tests/parallel/test_private_apis.py names which one. Import torch lazily: the layout, validation and
the cost model never import torch.
"""
from __future__ import annotations

from typing import Any


def schedule_ops(torch_name: str, pp: int, m: int, v: Any) -> list:
    """Per-rank action lists of a pipeline schedule built offline, without a process group:
    ``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops`` (rank -> list of
    ``_Action(stage_index, computation_type, microbatch_index, sub_actions)`` or None)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    return get_schedule_ops(torch_name, pp, m, v)


def fake_store():
    """The store of torch's "fake" process-group backend
    (``torch.testing._internal.distributed.fake_pg.FakeStore``), for dry runs at any world size."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    return FakeStore()


def composable_replicate():
    """torch's composable ``replicate`` on FSDP2's machinery
    (``torch.distributed._composable.replicate_with_fsdp.replicate``): DDP semantics for
    DTensor parameters, which DDP itself cannot wrap."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    return replicate


def fsdp_param_groups(module) -> list:
    """FSDP2's parameter groups of a ``fully_shard``-ed module
    (``module._get_fsdp_state()._fsdp_param_groups``); no public API exposes the unsharded
    gradients a deferred reduction holds."""
    return list(module._get_fsdp_state()._fsdp_param_groups)


def dispatch_mode_base() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``: the base class of a mode that sees
    every op, used to count tensor-parallel collectives."""
    from torch.utils._python_dispatch import TorchDispatchMode
    return TorchDispatchMode


def functional_collectives():
    """The op namespace of functional collectives, ``torch.ops._c10d_functional``."""
    import torch
    return torch.ops._c10d_functional


def in_backward() -> bool:
    """Whether autograd is running a backward node now (``torch._C._current_autograd_node``)."""
    import torch
    return torch._C._current_autograd_node() is not None


def is_higher_order_op(func) -> bool:
    """Whether ``func`` is a higher-order operator (``torch._ops.HigherOrderOperator``)."""
    import torch
    return isinstance(func, torch._ops.HigherOrderOperator)


def fsdp_unsharded_grads(fsdp_param) -> tuple:
    """(unsharded parameter or None, accumulated unsharded gradient or None) that FSDP2 holds
    for a deferred reduction: ``FSDPParam._unsharded_param`` (its ``.grad``; absent before
    the first all-gather) and ``FSDPParam.unsharded_accumulated_grad`` (with a mixed-precision
    reduce dtype) of torch/distributed/fsdp/_fully_shard/_fsdp_param.py."""
    return getattr(fsdp_param, "_unsharded_param", None), getattr(fsdp_param, "unsharded_accumulated_grad", None)


def wrap_schedule_loss(schedule, wrap) -> None:
    """Replace a pipeline schedule's loss computation (``schedule._compute_loss``) by
    ``wrap(original)``, to time it with the last stage's forward."""
    schedule._compute_loss = wrap(schedule._compute_loss)


def tree_leaves(tree) -> list:
    """Leaves of a nested container (``torch.utils._pytree.tree_leaves``)."""
    from torch.utils import _pytree
    return _pytree.tree_leaves(tree)


def share_sac_storage(forward_ctx, recompute_ctx, storage) -> None:
    """Make the two contexts of ``create_selective_checkpoint_contexts`` use ``storage`` (a
    dict: op -> {invocation index: kept outputs}) as their cache -- their ``storage``
    attribute, torch 2.13's private layout -- so that what selective checkpointing keeps
    can be counted."""
    forward_ctx.storage = recompute_ctx.storage = storage


def dcp_metadata_globals() -> dict:
    """``(module, name) -> object`` for every global that ``torch.distributed.checkpoint``'s
    ``.metadata`` pickle references (torch 2.13, read from xpar's checkpoints of every layout):
    DCP's metadata dataclasses, the filesystem writer's private ``_StorageInfo``, the private
    ``torch.serialization._get_layout`` and ``torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING``,
    ``torch.Size`` and ``pathlib`` paths (dtypes are admitted by type). xpar's restricted
    unpickler admits these only (DCP itself unpickles ``.metadata`` unrestricted)."""
    import pathlib

    import torch
    import torch.serialization
    from torch.distributed.checkpoint import filesystem, metadata

    names = {metadata: ("Metadata", "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"),
             filesystem: ("_StorageInfo",), torch.serialization: ("_get_layout",),
             torch: ("Size",), pathlib: ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
    return {(m.__name__, n): getattr(m, n) for m, group in names.items() for n in group}


def flatten_mesh(mesh, dims: tuple, name: str):
    """The 1-D mesh over the ranks of ``mesh``'s ``dims`` together, named ``name``
    (``DeviceMesh._flatten``, torchtitan's way to build its ``dp_shard_cp`` mesh; no public API
    in torch 2.13): context parallelism's dp x cp replica group (xpar.parallel.mesh)."""
    return mesh[dims]._flatten(name)


def unflatten_mesh(mesh, sizes: tuple, names: tuple):
    """``mesh`` (1-D) as a mesh of shape ``sizes`` with dims ``names`` (``DeviceMesh._unflatten``, no
    public API in torch 2.13): hierarchical ZeRO's (replicate, shard) mesh (xpar.parallel.mesh.hsdp_mesh)."""
    return mesh._unflatten(0, tuple(sizes), tuple(names))


def ddp_ignore_params(module, names: list) -> None:
    """Make DDP leave the parameters ``names`` of ``module`` out of its gradient all-reduce
    (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``, no public API in
    torch 2.13): the routed experts, reduced over expert-dp instead (xpar.parallel.expert)."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
