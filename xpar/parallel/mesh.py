"""The device mesh: one mesh with the named axes of :data:`xpar.config.layout.AXES`."""
from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from xpar.config.layout import AXES
from xpar.parallel.torch_internals import flatten_mesh, unflatten_mesh


def build_mesh(device: str, pp: int, dp: int, tp: int, cp: int = 1) -> DeviceMesh:
    """A 4-D mesh of shape (pp, dp, cp, tp) over the default process group, ranks placed as
    :meth:`xpar.config.layout.Layout.rank` says. Axes of size 1 are kept so code can always ask
    for ``mesh["dp"]``. With cp > 1 the dp and cp axes are also flattened into ``"dp_cp"``
    (torchtitan's ``dp_shard_cp``): the group over which the replicas' gradients are reduced."""
    mesh = init_device_mesh(device, (pp, dp, cp, tp), mesh_dim_names=AXES)
    if cp > 1:  # kept on the mesh: slicing a flattened dim from the root mesh is deprecated (torch 2.13 warns)
        mesh.xpar_dp_cp = flatten_mesh(mesh, ("dp", "cp"), "dp_cp")
    return mesh


def replica_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D sub-mesh of the ranks that hold the same parameters and average their gradients
    (DDP, ZeRO's sharding group): dp, or dp x cp (``"dp_cp"``) under context parallelism, whose
    ranks hold the same parameters and see different tokens of the same sequences."""
    if mesh["cp"].size() == 1:
        return mesh["dp"]
    flat = getattr(mesh, "xpar_dp_cp", None)
    return flat if flat is not None else mesh["dp_cp"]


def hsdp_mesh(dp_mesh: DeviceMesh, shard_size: int) -> DeviceMesh:
    """The 2-D (dp_replicate, dp_shard) mesh of hierarchical ZeRO (``parallel.zero_shard_size``):
    ``dp_mesh``'s ranks as dp / shard_size replicas of shard_size consecutive ranks, the shape
    FSDP2's ``fully_shard`` takes for HSDP (replicate over dim 0, shard over dim 1). Every rank
    must call it (it creates the groups)."""
    return unflatten_mesh(dp_mesh, (dp_mesh.size() // shard_size, shard_size), ("dp_replicate", "dp_shard"))
