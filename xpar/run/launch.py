"""Local worker launch and failure propagation.

``python -m xpar`` starts ``world size`` workers on this machine with
``torch.multiprocessing.start_processes``, forked from a fork server that imported torch once
(:mod:`xpar.run.forkserver`). If any worker raises or dies, the others are terminated, and
:class:`WorkerFailed` names the rank and its error.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import signal
import socket
import time
from pathlib import Path
from typing import Optional

import torch.multiprocessing as mp

from xpar.config.spec import RunSpec
from xpar.run.forkserver import WORKER_PRELOAD, end_orphans, in_callers_env, server_died, start_server, worker_entry
from xpar.run.exits import ServerDied, WorkerFailed  # noqa: F401  (WorkerFailed re-exported: xpar.run.launch.WorkerFailed)
from xpar.run.worker_files import HEARTBEAT_DIR, STATS_FILE, stats_fallback


PORT_FLOOR = 20000
"""Lowest port :func:`free_port` draws from (the range up to the kernel's ephemeral floor)."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the workers' rendezvous, drawn at random BELOW the kernel's ephemeral range
    (/proc/sys/net/ipv4/ip_local_port_range, Linux default 32768-60999): a port the kernel hands out itself (port 0,
    or any outgoing connection: gloo opens many) can be taken again by another process between this probe and rank
    0's bind (seen once in the suite: EADDRINUSE); one below that range is taken only by an explicit bind. Falls
    back to a kernel-chosen port where the range leaves no room or 50 draws find none free."""
    low = _ephemeral_floor()
    for _ in range(50 if low > PORT_FLOOR else 0):
        port = random.randrange(PORT_FLOOR, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_floor() -> int:
    """The lowest port of the kernel's ephemeral range (32768 where it cannot be read: Linux's default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def start_workers(entry, args: tuple, world: int, preload: tuple[str, ...] = WORKER_PRELOAD):
    """Start ``world`` processes running ``entry(rank, *args)``; return torch's ``ProcessContext`` (not joined).

    They are forked from this process's fork server (:func:`xpar.run.forkserver.start_server`, which
    imports ``preload`` where it starts it here), or spawned where the platform has none. Each takes this
    process's environment and working directory at the call, as a spawned process does, not the
    server's at its start, and ends itself once this process is gone (:func:`xpar.run.forkserver.in_callers_env`)."""
    method = start_server(preload)
    ctrl_c = signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    return mp.start_processes(in_callers_env, args=(entry, os.getpid(), dict(os.environ), os.getcwd(), ctrl_c, *args),
                              nprocs=world, join=False, start_method=method)


def _last_error_line(traceback_text: str) -> str:
    lines = [ln for ln in traceback_text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "unknown error"


PEER_GRACE_S = 3.0
"""Seconds the other ranks get to exit by themselves after one fails, so each writes its own error."""
PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing",
               "Broken pipe", "NCCL communicator was aborted")
"""Transport errors a rank raises when *another* rank died mid-collective (gloo's pair.cc, NCCL)."""


def _raised(ctx, first: int, first_msg: str) -> tuple[int, str]:
    """The rank to blame among those that raised: the first whose error is its own, not a peer's exit.

    torch's ``ProcessContext.join`` reports whichever failed sentinel it reads first; when rank 1 raises
    and rank 0's collective sees the closed connection, that can be rank 0 (seen with gloo in CI,
    tests/track/test_sweep.py). ``ctx.error_files`` hold every raised rank's pickled traceback.
    """
    if not any(e in first_msg for e in PEER_ERRORS):
        return first, first_msg
    for rank, path in enumerate(ctx.error_files):
        try:
            with open(path, "rb") as fh:
                msg = pickle.load(fh)
        except (OSError, EOFError, pickle.UnpicklingError):
            continue
        if rank != first and not any(e in msg for e in PEER_ERRORS):
            return rank, msg
    return first, first_msg


def _state(pid: int) -> str:
    """The kernel's state of process ``pid`` ('T (stopped)', 'S (sleeping)', ...), or ''."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def stalled_rank(out_dir: Path, timeout_s: float, now: Optional[float] = None) -> Optional[tuple[int, str]]:
    """(rank, why) of the worker whose heartbeat (xpar.run.worker.start_heartbeat) is the oldest and
    older than ``timeout_s``; None while every started worker beats. The rank named is the one
    that stopped, not one that waits for it in a collective (those keep beating)."""
    now = time.time() if now is None else now
    beats = []
    for f in (Path(out_dir) / HEARTBEAT_DIR).glob("rank*.json"):
        try:
            beat = json.loads(f.read_text())
            beat["t"] = max(beat["t"], f.stat().st_mtime)  # on a full disk a worker only touches the file
        except (OSError, ValueError):
            continue
        state = _state(beat["pid"])
        if state and not state.startswith(("Z", "X")):  # a rank that exited is judged by its exit code
            beats.append((beat["t"], int(f.stem[4:]), beat["pid"], state))
    if not beats:
        return None
    t, rank, pid, state = min(beats)
    if now - t <= timeout_s:
        return None
    return rank, (f"stopped progressing: no heartbeat for {now - t:.0f} s (run.heartbeat_timeout_s="
                  f"{timeout_s:g}); pid {pid} state {state}")


def hung_run(out_dir: Path, world: int, timeout_s: float, now: Optional[float] = None) -> Optional[tuple[int, str]]:
    """(rank, why) when every one of the ``world`` workers beats (xpar.run.worker.start_heartbeat) but none
    finished a step (or built its engine) for more than ``timeout_s``: they wait on each other, in a
    collective or a pipeline send/recv, which gloo does not time out. The rank named is the one
    furthest behind (fewest steps finished). None while any rank progresses, has not started or builds its engine."""
    now = time.time() if now is None else now
    beats = []
    for f in (Path(out_dir) / HEARTBEAT_DIR).glob("rank*.json"):
        try:
            beat = json.loads(f.read_text())
            beats.append((int(beat["step"]), float(beat["progress_t"]), int(f.stem[4:])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if len(beats) < world or min(beats)[0] < -1 or now - max(t for _, t, _ in beats) <= timeout_s:
        return None  # a rank not started or still building its engine (its collectives time out themselves)
    step, _, rank = min(beats)
    done = ", ".join(f"rank {r}: {s + 1}" for s, _, r in sorted(beats, key=lambda b: b[2]))
    return rank, (f"hung: no rank finished a step for {now - max(t for _, t, _ in beats):.0f} s "
                  f"(run.collective_timeout_s={timeout_s:g}); the ranks wait on each other in a collective or "
                  f"pipeline send/recv (steps done: {done}); for steps slower than that raise run.collective_timeout_s")


def _kill(p) -> None:
    if p.is_alive():
        p.kill()  # SIGKILL: a stopped process does not act on SIGTERM until continued


def launch_local(spec: RunSpec, out_dir: Path) -> list[dict]:
    """Run all ranks as local processes; return the per-rank stats gathered by rank 0.

    Raises:
        WorkerFailed: the first worker that raised or exited non-zero (the rest are ended).
        KeyboardInterrupt: re-raised after ending the workers.
    """
    ctx = start_workers(worker_entry, (spec.to_dict(), str(out_dir), free_port()), spec.world_size)
    try:
        while not ctx.join(timeout=1.0, grace_period=PEER_GRACE_S):
            stopped = (stalled_rank(out_dir, spec.heartbeat_timeout_s)
                       or hung_run(out_dir, spec.world_size, spec.collective_timeout_s))
            if stopped is not None:
                _kill(ctx.processes[stopped[0]])
                raise WorkerFailed(*stopped)
    except mp.ProcessRaisedException as e:
        rank, msg = _raised(ctx, e.error_index, e.msg)
        try:
            (out_dir / f"worker_{rank}.traceback.txt").write_text(msg)
        except OSError:  # a full disk: the error line below still says what failed
            pass
        raise WorkerFailed(rank, _last_error_line(msg), msg) from None
    except mp.ProcessExitedException as e:
        raise WorkerFailed(e.error_index, exit_reason(ctx, e.exit_code)) from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(10)
            if p.is_alive():
                p.kill()
    return read_stats(out_dir)


def exit_reason(ctx, code: int) -> str:
    """Why a worker of ``ctx`` (torch.multiprocessing's context) ended with exit status ``code``: 'killed by signal
    X' or 'exited with code N'.

    Raises:
        ServerDied: the fork server that started the workers ended (:func:`xpar.run.forkserver.server_died`);
            its workers are ended by pid first."""
    if server_died(code):
        end_orphans([p.pid for p in ctx.processes])
        raise ServerDied()
    return f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def read_stats(out_dir: Path) -> list[dict]:
    """The per-rank stats rank 0 wrote (:func:`xpar.run.worker.run_rank`): ``ranks.json`` in the run's
    folder, or, where that disk was full, its copy in the system's temporary folder
    (:func:`xpar.run.worker_files.stats_fallback`).

    Raises:
        WorkerFailed: neither could be read (rank 0 could write neither).
    """
    for path in (out_dir / STATS_FILE, stats_fallback(out_dir)):
        try:
            stats = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if path != out_dir / STATS_FILE:
            path.unlink(missing_ok=True)
        return stats
    raise WorkerFailed(0, f"its gathered stats could be written neither to {out_dir / STATS_FILE} nor to "
                          f"{stats_fallback(out_dir)} (a full disk?); free space, or pass "
                          f"hydra.run.dir=<a folder with space>")
