"""Live, bounded delivery of a run's records to the MLflow store, through the journal.

:class:`Recorder` (made by :func:`xpar.track.runs.mlflow_run`) journals every record first
(:class:`xpar.track.journal.Journal`), then hands it to the store. While workers train, a daemon
thread merges their per-step files every :data:`SHIP_INTERVAL_S` and sends what is new in one
``log_batch``: the step loop never waits for the store. Every HTTP call is bounded
(:func:`bound_http`); once the store fails it is retried only every :data:`RETRY_AFTER_S` in
the background, and the end of the run (last metrics, artifacts, final status) waits for it at
most :data:`END_BUDGET_S` in total. What the store did not take stays in the journal, replayed
by ``xpar sync <run dir>`` (:func:`sync`); the final status is always journaled, so a run is
never left RUNNING once synced.
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from xpar.track.report import NOT_ALL_RECORDED
from xpar.track.journal import Journal, StepMerger, step_points, JOURNAL_FILE

HTTP_TIMEOUT_S = 5
"""Seconds per HTTP request to a tracking server (MLflow's default is 120)."""
HTTP_RETRIES = 1
"""Retries per request (MLflow's default is 7, with exponential back-off: ~250 s when refused)."""
SHIP_INTERVAL_S = 1.0
"""Seconds between live deliveries of new step metrics."""
RETRY_AFTER_S = 2.0
"""Seconds before a failed store is tried again by the background thread."""
END_BUDGET_S = 4.0
"""Seconds the end of a run may wait for a tracking server in total (last records and final status)."""
SQLITE_END_BUDGET_S = 30.0
"""The same for a local SQLite store: no answer there means another process holds its write lock
(two runs ending at once on a loaded machine took over 4 s), not a store that is gone."""


def end_budget_s(uri: str) -> float:
    """:data:`SQLITE_END_BUDGET_S` for a SQLite store, else :data:`END_BUDGET_S`."""
    return SQLITE_END_BUDGET_S if uri.startswith("sqlite:") else END_BUDGET_S


def bound_http(timeout_s: int = HTTP_TIMEOUT_S, retries: int = HTTP_RETRIES) -> None:
    """Bound MLflow's HTTP calls: ``timeout_s`` per request, ``retries`` retries (MLflow reads
    these at each request; its back-off factor must be an integer, FACTS.md). Also keeps MLflow from printing
    '🏃 View run ... at: <url>' on each run it ends on a server (MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT, MLflow's
    mlflow/environment_variables.py): twice per run, above xpar's table, each a link that opens the GenAI view
    (no workflowType=machine_learning, docs/guides/troubleshooting.md); xpar prints its own."""
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(timeout_s)
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(retries)
    os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] = "1"


def deliver(client, run_id: str, rec: dict) -> None:
    """Send one journal record to the store (raises what the store raises)."""
    from mlflow.entities import Metric, Param, RunTag

    kind = rec["kind"]
    if kind == "metrics":
        pts = rec["points"]
        for i in range(0, len(pts), 1000):
            client.log_batch(run_id, metrics=[Metric(k, float(v), int(t), int(s)) for k, v, t, s in pts[i:i + 1000]])
    elif kind == "params":
        items = list(rec["params"].items())
        for i in range(0, len(items), 100):
            client.log_batch(run_id, params=[Param(k, v) for k, v in items[i:i + 100]])
    elif kind == "tags":
        client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in rec["tags"].items()])
    elif kind == "text":
        client.log_text(run_id, rec["text"], rec["file"])
    elif kind == "artifact":
        if Path(rec["path"]).exists():
            client.log_artifact(run_id, rec["path"], rec.get("dir"))
    elif kind == "end":
        client.set_terminated(run_id, rec["status"], end_time=rec["end_ms"])


def store_reason(e: Exception) -> str:
    """The line of a store error that says what happened: SQLAlchemy's ``(sqlite3.OperationalError)
    database or disk is full`` rather than its first line (an autoflush note), at most 200 characters; for a
    server that does not answer, the socket's reason (``no server answers ([Errno 111] Connection refused)``), not
    MLflow's 'API request to ... failed with exception HTTPConnectionPool(...): Max retries exceeded' cut mid-URL."""
    text = str(e)
    socket = re.search(r"\[Errno -?\d+\] [^'\")\]]+", text)  # urllib3's NewConnectionError inside MLflow's text
    if socket and ("HTTPConnectionPool" in text or "HTTPSConnectionPool" in text):
        return f"no server answers ({socket.group(0).strip()})"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    driver = [ln for ln in lines if ln.startswith("(") and "Error)" in ln]
    return (driver or lines or [""])[0][:200]


class Recorder:
    """One run's journal and its delivery to the store (see the module docstring)."""

    def __init__(self, uri: str, run_id: str, out_dir: Path, world: int = 0):
        from mlflow.tracking import MlflowClient

        self.uri, self.run_id, self.out_dir, self.world = uri, run_id, Path(out_dir), world
        self.client = MlflowClient(uri)
        self.journal = Journal(self.out_dir)
        self.merger = StepMerger(self.out_dir, world)
        self.error: Optional[str] = None
        self.warn = True
        """Warn on the first failure that the run goes on retrying (:func:`sync` sends once and says so itself)."""
        self._failed_at = 0.0
        self._send_lock = threading.Lock()
        self._collect_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._deadline: Optional[float] = None
        if not self.journal.records("start"):
            self.journal.ack(self.journal.append("start", uri=uri, run_id=run_id, world=world, pid=os.getpid()))

    # -- delivery ---------------------------------------------------------------------------
    def collect_steps(self) -> int:
        """Journal the per-step metrics of steps every rank finished since the last call."""
        if not self.world:
            return 0
        with self._collect_lock:
            new = self.merger.new_steps(self.journal.steps_journaled())
            if new:
                self.journal.append("metrics", points=step_points(new))
            return len(new)

    def flush(self) -> bool:
        """Send every pending record in order; stop at the first failure. True if all went."""
        with self._send_lock:
            for rec in self.journal.pending():
                if self._deadline is not None and time.monotonic() > self._deadline:
                    return False
                try:
                    deliver(self.client, self.run_id, rec)
                except Exception as e:  # unreachable, refused, timed out, store error
                    self.mark_failed(e)
                    return False
                self.journal.ack(rec)
            self.error = None
            return True

    def mark_failed(self, e: Exception) -> None:
        first = self.error is None
        self.error = f"{type(e).__name__}: {store_reason(e)}"
        self._failed_at = time.monotonic()
        bound_http(timeout_s=1, retries=0)  # a store that failed once gets short calls from now on
        if first and self.warn:
            print(f"xpar: warning: the tracking store did not take a record ({self.error}); "
                  f"kept in {self.journal.path}, retried while the run lasts.", file=sys.stderr, flush=True)

    def _loop(self) -> None:
        while not self._stop.wait(SHIP_INTERVAL_S):
            self.collect_steps()
            if self.error is None or time.monotonic() - self._failed_at > RETRY_AFTER_S:
                self.flush()

    def start_live(self) -> None:
        """Deliver step metrics in the background while the workers train."""
        self._thread = threading.Thread(target=self._loop, name="xpar-tracking", daemon=True)
        self._thread.start()

    def stop_live(self) -> None:
        """Stop the background delivery; from now on the end budget runs."""
        if self._deadline is None:
            self._deadline = time.monotonic() + end_budget_s(self.uri)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(max(0.0, self._deadline - time.monotonic()))
            if self._thread.is_alive():  # blocked on a store that does not answer
                self.mark_failed(TimeoutError(f"no answer within the {end_budget_s(self.uri):g} s end budget"))
        self.collect_steps()

    def flush_bounded(self) -> bool:
        """:meth:`flush` in a helper thread, waited for until the end budget is spent."""
        if self.error is not None and time.monotonic() - self._failed_at < 0.5:
            return False  # it just failed: do not spend the budget on it again
        done: list[bool] = []
        t = threading.Thread(target=lambda: done.append(self.flush()), daemon=True)
        t.start()
        t.join(max(0.0, (self._deadline or time.monotonic() + end_budget_s(self.uri)) - time.monotonic()))
        if t.is_alive():
            self.mark_failed(TimeoutError(f"no answer within the {end_budget_s(self.uri):g} s end budget"))
        return bool(done and done[0])

    # -- records ---------------------------------------------------------------------------
    def record(self, kind: str, **data) -> None:
        self.journal.append(kind, **data)

    def finish(self, status: str) -> bool:
        """Journal the final status (after the steps finished so far) and try to deliver
        everything within the end budget. True if the store took it all."""
        self.stop_live()
        self.record("end", status=status, end_ms=int(time.time() * 1000))
        ok = self.flush_bounded()
        if not ok:
            n = len(self.journal.pending())
            print(f"xpar: the tracking store at {self.uri} did not take {n} record(s) "
                  f"({self.error or 'no answer in time'}); they are kept in {self.journal.path}. "
                  f"Send them with: xpar sync {self.out_dir}", file=sys.stderr, flush=True)
        return ok


def recording_gap(recorder: Recorder) -> Optional[str]:
    """None when the store took every record of the run, else the line that says how much it
    did not: metric points (of those journaled) and other records, and the ``xpar sync`` that
    delivers them (the summary then does not say "Recorded in MLflow")."""
    pending = recorder.journal.pending()
    if not pending:
        return None
    points = sum(len(r.get("points", [])) for r in recorder.journal.records("metrics"))
    missing = sum(len(r.get("points", [])) for r in pending if r["kind"] == "metrics")
    others = sum(r["kind"] != "metrics" for r in pending)
    return (f"{NOT_ALL_RECORDED}: {missing} of {points} metric points and {others} other record(s) are only in the "
            f"journal {recorder.journal.path}; send them with: xpar sync {recorder.out_dir}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (OSError, TypeError):
        return False
    return True


def sync(run_dir: Path) -> int:
    """``xpar sync <run dir>``: send what the journal holds and the store has not taken (and
    the steps the workers recorded after it). Only adds what is missing: a status the journal
    holds was observed and is sent; a run whose recording process died without journaling one
    keeps the terminal status the store has (FINISHED, FAILED, KILLED), and ends KILLED only
    where the store still says RUNNING (:func:`unobserved_end`). Returns the exit status: 0 all
    sent, 1 the store still failed, 2 no journal of a run there (missing, empty or damaged)."""
    run_dir = Path(run_dir)
    start = _journal_start(run_dir)
    if isinstance(start, str):
        print(f"xpar: invalid configuration:\n  - {start}", file=sys.stderr)
        return 2
    bound_http()
    rec = Recorder(start["uri"], start["run_id"], run_dir, start.get("world") if isinstance(start.get("world"), int) else 0)
    rec.warn = False  # one line: its own, below, not the live run's 'retried while the run lasts'
    rec.collect_steps()
    if not rec.journal.records("end") and not _alive(start.get("pid")):
        status = unobserved_end(rec.client, start["run_id"])
        if status is not None:
            rec.record("end", status=status, end_ms=int(time.time() * 1000))
    n = len(rec.journal.pending())
    if rec.flush():
        print(f"xpar: synced {n} record(s) of run {start['run_id']} to {start['uri']}.")
        return 0
    print(f"xpar: the tracking store at {start['uri']} still fails ({rec.error}); "
          f"{len(rec.journal.pending())} record(s) kept in {rec.journal.path}.", file=sys.stderr)
    return 1


def _journal_start(run_dir: Path):
    """The journal's ``start`` record (a dict), or the line that refuses the folder (a str)."""
    if not (run_dir / JOURNAL_FILE).is_file():
        return (f"no tracking journal in {run_dir} ({JOURNAL_FILE}); give the output directory of a run, "
                f"e.g. outputs/<date>/<time>.")
    starts = Journal(run_dir).records("start")
    start = starts[0] if starts else {}
    if not (isinstance(start.get("uri"), str) and isinstance(start.get("run_id"), str)):
        return (f"{run_dir / JOURNAL_FILE} names no run (no start record with a store and a run id): it is empty, "
                f"damaged or not one xpar wrote; give the output directory of a run xpar recorded.")
    return start


def unobserved_end(client, run_id: str) -> Optional[str]:
    """The status to journal for a run whose recording process is gone without one: None where the
    store already holds a terminal status (kept: xpar did not observe another) or cannot be asked
    now (the next sync decides); KILLED where it still says RUNNING (as
    :func:`xpar.track.runs.end_orphaned_runs` ends such a run)."""
    try:
        status = client.get_run(run_id).info.status
    except Exception:  # unreachable store: flush fails and says so
        return None
    return "KILLED" if status in ("RUNNING", "SCHEDULED") else None
