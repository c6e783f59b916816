"""The fork server local workers start from (Python's ``forkserver`` start method).

A worker spawned afresh imports torch and xpar's parallel stack: seconds of CPU each on a small
machine, once per worker. The fork server imports them once per ``xpar`` process and forks every
worker from that state, which is still a fresh interpreter's (no thread, no process group, no CUDA
context). :func:`start_server` starts it as soon as a run is known to execute, so its imports overlap
the parent's own set-up (MLflow). Torch-free: the parent imports torch only to launch.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

WORKER_PRELOAD = ("torch", "torch.distributed", "xpar.run.worker")
"""What the server imports before it forks a worker: what every worker imports first."""


def start_method() -> str:
    """'forkserver' where this platform has it, else 'spawn' (Windows)."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def start_server(preload: tuple[str, ...] = WORKER_PRELOAD) -> str:
    """Start this process's fork server with ``preload`` (nothing where it runs already, or where the
    platform has no fork server); return the start method workers use (:func:`start_method`). The
    server ends when this process does."""
    method = start_method()
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(list(preload))
        multiprocessing.forkserver.ensure_running()
    return method


def worker_entry(local_rank: int, *args) -> None:
    """A local worker's entry (:func:`xpar.run.worker.spawn_entry`), named without importing torch here:
    the launcher passes this function, the worker imports the worker module (the server has it already)."""
    from xpar.run.worker import spawn_entry  # lazy: torch (xpar.LAZY_IMPORTS)
    spawn_entry(local_rank, *args)
