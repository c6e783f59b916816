"""Seconds to start local workers: forked from xpar's fork server (xpar.run.forkserver) against
spawned afresh (torch.multiprocessing's ``spawn``, what xpar used before), in one run, alternated.

    python benchmarks/worker_start.py                 # 2 workers, 3 repetitions of each way
    python benchmarks/worker_start.py --workers 8 --repeat 5

Each trial is a fresh process (as ``python -m xpar`` is one): it imports torch (the launcher needs
it), starts the workers, each imports xpar's worker module (what a worker imports before it
builds its engine) and exits; medians and ranges of the trials' wall seconds per way. The fork
server's start is inside each trial, as in a run. On a machine with fewer cores than workers the
wall time is mostly CPU time; with as many cores the workers' imports overlap and the wall time
hides what forking saves.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def _worker(rank: int) -> None:
    import xpar.run.worker  # noqa: F401  (what a worker imports before it builds its engine)
    from xpar.run.exits import exit_worker
    exit_worker()  # as a run's worker ends, whichever way it started


def _trial(method: str, world: int) -> None:
    """Inside a trial's process: import torch, start ``world`` workers by ``method``, wait for them."""
    import torch.multiprocessing as mp

    from xpar.run.launch import start_workers

    if method == "forkserver":
        ctx = start_workers(_worker, (), world)
    else:
        ctx = mp.start_processes(_worker, nprocs=world, join=False, start_method="spawn")
    while not ctx.join():
        pass


def trial(method: str, world: int) -> float:
    """Wall seconds of one fresh process (``--trial``) starting ``world`` workers by ``method``."""
    start = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--trial", method, "--workers", str(world)], check=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--trial", choices=("forkserver", "spawn"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.trial:
        return _trial(args.trial, args.workers)
    got = {"forkserver": [], "spawn": []}
    for _ in range(args.repeat):
        for method in got:
            got[method].append(trial(method, args.workers))
    for method, walls in got.items():
        print(f"{method:10s} {args.workers} workers: median {statistics.median(walls):.2f} s "
              f"(min {min(walls):.2f}, max {max(walls):.2f}, n={len(walls)})")
    return got


if __name__ == "__main__":
    main()
