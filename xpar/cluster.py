"""Where a run's ranks live: the launcher (local workers, torchrun, submitit), the number of
nodes and the devices per node, read from the launcher's environment. Torch-free.

- torchrun (torchelastic) sets ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (ranks on this node);
  nodes = WORLD_SIZE / LOCAL_WORLD_SIZE.
- submitit sets ``SUBMITIT_EXECUTOR`` (``slurm`` or ``local``) and its job environment
  (``SLURM_NTASKS``/``SLURM_JOB_NUM_NODES``, or ``SUBMITIT_LOCAL_*`` for the local executor).
- otherwise xpar started its own workers on this one machine.
"""
from __future__ import annotations

import os

from xpar.spec import RunSpec


def placement(spec: RunSpec) -> dict[str, object]:
    """{'launcher', 'nodes', 'devices_per_node'} of the ranks that run ``spec`` (estimates:
    the hardware preset's cluster)."""
    if spec.mode == "estimate":
        return {"launcher": "estimate", "nodes": spec.hardware.nodes,
                "devices_per_node": spec.hardware.devices_per_node}
    world = spec.world_size
    if os.environ.get("SUBMITIT_EXECUTOR") and os.environ.get("XPAR_SUBMITIT_TASKS"):
        nodes = int(os.environ.get("XPAR_SUBMITIT_NODES", "1"))
        return {"launcher": f"submitit-{os.environ['SUBMITIT_EXECUTOR']}", "nodes": nodes,
                "devices_per_node": world // nodes}
    if spec.launcher == "torchrun":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return {"launcher": "torchrun", "nodes": max(1, world // local), "devices_per_node": local}
    return {"launcher": "local", "nodes": 1, "devices_per_node": world}


def placement_tags(spec: RunSpec) -> dict[str, str]:
    """The placement as MLflow tags ``xpar.launcher``, ``xpar.nodes``, ``xpar.devices_per_node``."""
    return {f"xpar.{k}": str(v) for k, v in placement(spec).items()}
