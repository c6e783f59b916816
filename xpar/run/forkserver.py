"""The fork server local workers start from (Python's ``forkserver`` start method, on Linux).

A worker spawned afresh imports torch and xpar's parallel stack: seconds of CPU each on a small
machine, once per worker. The fork server imports them once per ``xpar`` process and forks every
worker from that state, which is still a fresh interpreter's (no thread, no process group, no CUDA
context). :func:`start_server` starts it as soon as a run is known to execute, so its imports overlap
the parent's own set-up (MLflow). What a library reads from the environment when it is loaded
(``OMP_*``, ``LD_PRELOAD``, ``TORCH_LOGS``) is read once, in the server, at its start.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

import psutil

WORKER_PRELOAD = ("xpar.run.quiet_server", "torch", "torch.distributed", "xpar.run.worker")
"""What the server imports before it forks a worker: what every worker imports first (after
:mod:`xpar.run.quiet_server`, which keeps Ctrl-C from the server while it imports)."""
ORPHAN_EXIT = 75
"""Exit status of a worker that ended itself because xpar, the process that launched it, was gone."""
WATCH_S = 1.0
"""Seconds between a worker's checks that xpar still runs."""


def start_method() -> str:
    """'forkserver' on Linux; 'spawn' elsewhere (macOS: forking a process that loaded its system
    frameworks is unsafe, CPython's reason for spawn there; Windows has no fork)."""
    linux = sys.platform.startswith("linux") and "forkserver" in multiprocessing.get_all_start_methods()
    return "forkserver" if linux else "spawn"


def start_server(preload: tuple[str, ...] = WORKER_PRELOAD) -> str:
    """Start this process's fork server with ``preload`` (nothing where it runs already, or where the
    platform has no fork server); return the start method workers use (:func:`start_method`). The
    server ends when this process does."""
    method = start_method()
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(list(preload))
        # first the resource tracker, which the server's start would start: its start ends by unblocking SIGINT in
        # this thread (multiprocessing/resource_tracker.py ensure_running, bpo-33613: the same blocking trick)
        multiprocessing.resource_tracker.ensure_running()
        with sigint_blocked():
            multiprocessing.forkserver.ensure_running()
    return method


@contextmanager
def sigint_blocked():
    """Ctrl-C blocked in this thread while the server starts: a blocked signal mask survives fork and exec, so the
    server holds a Ctrl-C pending from its first instruction (its own imports of the standard library come before
    :mod:`xpar.run.quiet_server`'s, which ignores it and lifts the block; a Ctrl-C there had printed the server's
    traceback under load). Here the Ctrl-C is not lost: it stays pending and is raised (KeyboardInterrupt) when the
    block ends, or at once where another thread of this process takes it. An ignored SIGINT, the earlier way, was
    lost in that window (a run went on to exit 0). Nothing is changed outside the main thread (where Python runs
    signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a Ctrl-C of the window is raised here


def in_callers_env(rank: int, entry, launcher_pid: int, env: dict, cwd: str, ctrl_c: bool, *args) -> None:
    """A worker's first call: take the launcher's environment and folder ``env``, ``cwd`` (the server's
    are those of its start), Python's default Ctrl-C handler where ``ctrl_c`` (the launcher's SIGINT is not
    ignored, as a spawned worker would find it; the server ignores it), and a watch that
    ends this worker (exit :data:`ORPHAN_EXIT`) once xpar, ``launcher_pid``, is gone or a zombie (killed
    with SIGKILL: nothing records the run any more; the worker's parent is the server, which outlives
    xpar while its workers run); then ``entry(rank, *args)``."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    signal.signal(signal.SIGINT, signal.default_int_handler if ctrl_c else signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a server without xpar.run.quiet_server keeps it
    launcher = psutil.Process(launcher_pid)

    def watch():
        while not _gone(launcher):
            time.sleep(WATCH_S)
        os._exit(ORPHAN_EXIT)
    threading.Thread(target=watch, name="xpar-launcher-watch", daemon=True).start()
    entry(rank, *args)


def _gone(proc: psutil.Process) -> bool:
    """Whether ``proc`` has ended (its pid gone or reused) or is a zombie its own parent has not reaped."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


SERVER_EXIT = 255
"""The exit status multiprocessing reports for every worker of a fork server that ended (its status pipe closed)."""


def server_died(exit_code: int) -> bool:
    """Whether a worker's ``exit_code`` means this process's fork server ended while it ran (killed from outside):
    :data:`SERVER_EXIT` and no live fork server among this process's children. A worker that itself exits 255
    while the server runs is a worker's failure."""
    if exit_code != SERVER_EXIT or start_method() != "forkserver":
        return False
    return not any(_forked(c) and not _gone(c) for c in psutil.Process().children())


def end_orphans(pids: list) -> None:
    """SIGKILL the workers ``pids`` whose fork server ended: multiprocessing no longer sees them (it reads their
    status from the server), so a launcher that goes on (a sweep's next job) would leave them running. Only
    processes that still run the server's command line are ended (not a reused pid)."""
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if _forked(proc) and not _gone(proc):
                proc.kill()
        except psutil.Error:
            continue


def _forked(proc: psutil.Process) -> bool:
    """Whether ``proc`` runs the fork server's command line (the server, or a worker it forked)."""
    try:
        return "multiprocessing.forkserver" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def worker_entry(local_rank: int, *args) -> None:
    """A local worker's entry (:func:`xpar.run.worker.spawn_entry`), named without importing torch here:
    the launcher passes this function, the worker imports the worker module (the server has it already)."""
    from xpar.run.worker import spawn_entry  # lazy: torch (xpar.LAZY_IMPORTS)
    spawn_entry(local_rank, *args)
