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

from xpar.config.hardware import is_this_machine
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


def submitit_task_problems(launcher, job) -> list[str]:
    """Before a submitit sweep is submitted: each job of ``nodes`` x ``tasks_per_node`` > 1 tasks
    runs one rank per task (:func:`adopt_submitit_tasks`), so an executed layout (``job``: a composed
    job config) must have as many ranks (dp 'auto' fills them: tp x pp x cp must divide them).
    ``launcher``: ``hydra.launcher``. [] for other launchers, one-task jobs and estimates."""
    if launcher.get("submitit_folder") is None:  # not a submitit launcher (xpar.track.slurm's included)
        return []
    nodes, per_node = int(launcher.get("nodes") or 1), int(launcher.get("tasks_per_node") or 1)
    tasks, p, mode = nodes * per_node, job.parallel, job.run.mode
    if tasks <= 1 or mode in ("estimate", "plan") or (mode == "auto" and not is_this_machine(job.hardware)):
        return []
    fixed = int(p.tp) * int(p.pp) * int(p.get("cp", 1) or 1)
    ranks = int(p.dp) * fixed if str(p.dp).isdigit() else None
    if ranks == tasks or (ranks is None and tasks % fixed == 0):
        return []
    what = f"{ranks} ranks (dp={p.dp} x tp={p.tp} x pp={p.pp} x cp={p.get('cp', 1)})" if ranks else \
        f"tp x pp x cp = {fixed} ranks per replica"
    fit = ranks if ranks else fixed
    return [f"the layout needs {what} but each job has {nodes} node(s) x {per_node} task(s) = {tasks} tasks, one rank "
            f"per task: pass hydra.launcher.tasks_per_node={fit // nodes if fit % nodes == 0 else fit} "
            f"{'' if fit % nodes == 0 else 'hydra.launcher.nodes=1 '}or parallel.dp=auto with a layout whose "
            f"tp x pp x cp divides {tasks}."]
