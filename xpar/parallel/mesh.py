"""The device mesh: one mesh with the named axes of :data:`xpar.config.layout.AXES`."""
from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from xpar.config.layout import AXES


def build_mesh(device: str, pp: int, dp: int, tp: int) -> DeviceMesh:
    """A 3-D mesh of shape (pp, dp, tp) over the default process group, ranks placed as
    :meth:`xpar.config.layout.Layout.coords` says. Axes of size 1 are kept so code can always ask
    for ``mesh["dp"]``."""
    return init_device_mesh(device, (pp, dp, tp), mesh_dim_names=AXES)
