"""A process forked at start-up that imports slow modules while this one works, then runs one call.

``xpar plan`` spends most of its wall time importing MLflow and opening its SQLite store
(SQLAlchemy, alembic), as long as the search itself (benchmarks/README.md). The command forks
this helper before Hydra composes the config (:func:`start`); the helper imports MLflow on the
second core while the search runs on the first, and the plan's recording runs there (:func:`call`). The wall time becomes the longer
of the two paths instead of their sum. Where ``fork`` is not available, or the helper was not
started or has died, :func:`call` runs the function here, as before.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Optional

MLFLOW_MODULES = ("mlflow", "mlflow.store.tracking.sqlalchemy_store")
"""What ``xpar plan``'s recording imports (xpar.track.runs), the slow part first."""

_helper: Optional[tuple] = None  # (process, connection) of the started helper


def start(modules: tuple[str, ...] = MLFLOW_MODULES, warm: Optional[Callable[[], object]] = None) -> bool:
    """Fork the helper, which imports ``modules``, runs ``warm()`` (errors ignored: the call
    meets them again and reports them; Ctrl-C and SIGTERM held until it returns, so that a new
    SQLite store is never left half-built) and then waits for one :func:`call`. Returns False
    (and starts nothing) where the ``fork`` start method is not available."""
    global _helper
    import multiprocessing as mp
    if "fork" not in mp.get_all_start_methods():
        return False
    sys.stdout.flush()
    sys.stderr.flush()  # else the child would write this process's buffered output again at its exit
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(there, here, modules, warm), daemon=True, name="xpar-side")
    proc.start()
    there.close()
    _helper = (proc, here)
    return True


def _serve(conn, parents_end, modules: tuple[str, ...], warm: Optional[Callable[[], object]] = None) -> None:
    """The helper's body: import, wait for (function, args), send back (ok, value or exception).
    It closes its copy of the parent's end first, so that the parent's death (killed, or ended
    without a call) reaches it as end-of-file and it exits. Ctrl-C (sent to the whole process
    group) ends it quietly; the caller reports it."""
    parents_end.close()
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # the call imports it again and raises where it is reported
                pass
        if warm is not None:
            _held(warm)
        fn, args = conn.recv()
    except (KeyboardInterrupt, EOFError):
        return
    try:
        reply = (True, fn(*args))
    except BaseException as e:  # noqa: BLE001 (re-raised by the caller)
        reply = (False, e)
    try:
        conn.send(reply)
    except Exception as e:  # an unpicklable value or exception: its text
        conn.send((False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}"[:2000] or repr(e))))


def _held(fn: Callable[[], object]) -> None:
    """``fn()`` with SIGINT and SIGTERM blocked (delivered when it returns); its errors ignored."""
    import signal
    held = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        fn()
    except Exception:  # noqa: BLE001 (the call reports it)
        pass
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in the helper when :func:`start` started one that is alive (once: the helper
    ends after it), else in this process. Raises what ``fn`` raised; ``fn``, its arguments and
    its value must pickle."""
    global _helper
    helper, _helper = _helper, None
    if helper is None or not helper[0].is_alive():
        return fn(*args)
    proc, conn = helper
    try:
        conn.send((fn, args))
        ok, value = conn.recv()
    except EOFError:  # the helper died: run it here
        proc.join(5)
        return fn(*args)
    proc.join(30)
    if ok:
        return value
    raise value
