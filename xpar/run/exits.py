"""How a worker process ends: :class:`WorkerFailed` (a worker raised or died) and
:func:`exit_worker` (a finished worker's exit). Torch-free, so that the command line and the job
name them without importing torch (:mod:`xpar.run.launch` and :mod:`xpar.run.worker` re-export them)."""
from __future__ import annotations

import logging
import os
import sys


class WorkerFailed(RuntimeError):
    """A worker raised or exited abnormally; ``rank`` is its global rank."""

    def __init__(self, rank: int, error: str, detail: str = ""):
        self.rank, self.error, self.detail = rank, error, detail
        super().__init__(f"worker rank {rank} failed: {error}")

    def __reduce__(self):  # picklable: launchers such as submitit send job errors between processes
        return (WorkerFailed, (self.rank, self.error, self.detail))


class ServerDied(WorkerFailed):
    """The fork server that started the local workers ended while they ran (xpar.run.forkserver.server_died): no
    worker failed, each was stopped."""

    TEXT = ("the fork server that starts xpar's local workers ended while they ran (killed from outside?); no worker "
            "failed, each was stopped: rerun the command")

    def __init__(self):
        super().__init__(-1, self.TEXT)

    def __str__(self) -> str:
        return self.TEXT

    def __reduce__(self):
        return (ServerDied, ())


def exit_worker() -> None:
    """End a finished worker process without Python finalization (exit status 0).

    torch 2.13 + gloo: a gloo thread may free the last reference to a collective's work
    while the interpreter finalizes; freeing needs the GIL, the thread is ended, and
    std::terminate aborts the process ("terminate called without an active exception",
    SIGABRT) after all work is done -- measured in ~10-20% of 2-rank runs, DDP and TP
    alike (backtrace: ProcessGroupGloo::runLoop -> ~AsyncWork -> ~ThreadLocalState ->
    take_gil -> pthread_exit). Nothing is left to clean up here: results are written.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
