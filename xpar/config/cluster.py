"""Where a run's ranks live: the launcher (local workers, torchrun, submitit), the number of
nodes and the devices per node, read from the launcher's environment. Torch-free.

- torchrun (torchelastic) sets ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (ranks on this node);
  nodes = WORLD_SIZE / LOCAL_WORLD_SIZE.
- submitit sets ``SUBMITIT_EXECUTOR`` (``slurm`` or ``local``) and its job environment
  (``SLURM_NTASKS``/``SLURM_JOB_NUM_NODES``, or ``SUBMITIT_LOCAL_*`` for the local executor).
- otherwise xpar started its own workers on this one machine.

A submitit job with several tasks (``hydra/launcher=slurm``: nodes x tasks_per_node) runs ONE
xpar job across them: :func:`adopt_submitit_tasks` exports submitit's distributed environment
(``MASTER_ADDR`` = first host, ``MASTER_PORT`` from the job id, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), so each task becomes one rank exactly as under torchrun
(``env://`` initialisation, rank 0 records the MLflow run).
"""
from __future__ import annotations

import os

from xpar.config.spec import RunSpec


def adopt_submitit_tasks() -> bool:
    """Inside a submitit job of more than one task, export the torch.distributed variables of
    this task (submitit.helpers.TorchDistributedEnvironment) and ``XPAR_SUBMITIT_TASKS`` /
    ``XPAR_SUBMITIT_NODES``; return True. No-op (False) outside submitit, for one task, or when
    the variables are already set (torchrun started inside the task)."""
    if not os.environ.get("SUBMITIT_EXECUTOR") or ("RANK" in os.environ and "MASTER_ADDR" in os.environ):
        return False
    import submitit

    job = submitit.JobEnvironment()
    if job.num_tasks <= 1:
        return False
    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    os.environ["XPAR_SUBMITIT_TASKS"] = str(job.num_tasks)
    os.environ["XPAR_SUBMITIT_NODES"] = str(job.num_nodes)
    return True


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
