"""The device mesh: one mesh with named axes (pp, dp, tp), tp innermost so that a tensor-
parallel group stays within a node (consecutive ranks)."""
from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("pp", "dp", "tp")


def build_mesh(device: str, pp: int, dp: int, tp: int) -> DeviceMesh:
    """A 3-D mesh of shape (pp, dp, tp) over the default process group.

    Rank r sits at (r // (dp*tp), (r // tp) % dp, r % tp). Axes of size 1 are kept so code
    can always ask for ``mesh["dp"]``.
    """
    return init_device_mesh(device, (pp, dp, tp), mesh_dim_names=AXES)
