"""MLflow: one run per job, params, batched metrics, artifacts, and an honest end status.

Default store: ``sqlite:///<start dir>/mlflow.db`` with artifacts in ``<start dir>/mlartifacts``
(set explicitly, since SQLite fixes an experiment's artifact root at creation). The run ends
FINISHED, FAILED on an error, KILLED on Ctrl-C or SIGTERM; never left RUNNING.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from xpar.config.checks.environment import sqlite_path
from xpar.config.spec import RunSpec
from xpar.track.journal import unacknowledged, disk_warning
from xpar.track.plots import TIMELINE_FILE
from xpar.track.recorder import Recorder, bound_http, store_reason
from xpar.track.store_seed import seed_sqlite_store

MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_CHARS = 6000  # MLflow's param value limit (3.x); longer values are truncated with a marker


def default_uri(start_dir: Path) -> str:
    return f"sqlite:///{(start_dir / 'mlflow.db').resolve()}"


def open_store(uri: str) -> None:
    """Open the tracking store at ``uri`` once, creating it if new (a new SQLite store builds its
    tables, ~2 s here), so that a later run in this process finds it ready. Raises what MLflow
    raises for an unusable store."""
    import mlflow
    with store_lock(uri):
        seed_new_store(uri)
        mlflow.tracking.MlflowClient(tracking_uri=uri).search_experiments(max_results=1)


def seed_new_store(uri: str) -> None:
    """A new SQLite store at ``uri`` starts as a copy of one MLflow migrated once
    (xpar.track.store_seed); other URIs and existing stores as they are. Call under :func:`store_lock`."""
    db = sqlite_path(uri)
    if db is not None:
        seed_sqlite_store(db)


@contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Hold an exclusive lock on ``<db>.lock`` beside a SQLite store while a process creates or
    opens it (its tables, the experiment): two or three first runs started at once in a new
    directory ran MLflow's migrations concurrently ("duplicate column name") and broke the store
    for every later run. Other URIs: no lock (a server serialises its own store)."""
    import fcntl

    db = sqlite_path(uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def flatten(d: Any, prefix: str = "") -> dict[str, str]:
    """Nested dict -> {'a.b.c': 'value'} with values as strings (lists as JSON)."""
    out: dict[str, str] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    value = json.dumps(d) if isinstance(d, (list, tuple)) else str(d)
    if len(value) > MAX_PARAM_CHARS:
        value = value[:MAX_PARAM_CHARS - 20] + "...[truncated]"
    return {prefix[:-1]: value}


SYSTEM_METRICS_ENV = {"MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "true", "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "2",
                      "MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING": "1"}
"""System metrics (cpu/memory of the recording host, GPU through pynvml if installed) sampled
every 2 s, so that runs of a few seconds have points; the user's own settings win."""
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
"""MLflow 3.x's UI opens an experiment in the view this tag names (its JS enum ExperimentKind;
without it new experiments open in the GenAI view, with the runs one click away)."""


def system_metrics(spec: RunSpec) -> Optional[bool]:
    """MLflow's ``log_system_metrics`` for a run of ``spec``: None (the environment's setting,
    :data:`SYSTEM_METRICS_ENV`) for an executed run, False for an estimate or a plan on a cluster, whose
    host's CPU and memory say nothing of the devices estimated (a 64-GPU estimate logged 99.8 % host CPU)."""
    return None if spec.mode == "execute" else False


INHERITED_RUN_ENV = ("MLFLOW_RUN_ID",)
"""MLflow's run-selecting environment: ``mlflow.start_run`` would log into the run it names, in its
experiment, and rename it (mlflow#15713). xpar creates every run itself (``experiment_id`` is
always passed, so MLFLOW_EXPERIMENT_ID/NAME select nothing)."""


def ignore_inherited_run() -> None:
    """Drop an inherited ``MLFLOW_RUN_ID`` from this process (and the workers it starts), saying so
    in one line; a resumed run sets its own (xpar.run.job._continue_run)."""
    for key in INHERITED_RUN_ENV:
        value = os.environ.pop(key, None)
        if value is not None and os.environ.get("RANK", "0") == "0":
            print(f"xpar: ignoring {key}={value} from the environment: xpar records each run in a new MLflow run "
                  f"of its own (to continue a checkpointed run: train.resume=<its folder>).", file=sys.stderr)


class TrackingUnavailable(RuntimeError):
    """The tracking store cannot be reached or used; raised before any worker starts. ``problem``: the
    message without its advice (what the store said), for a command whose switches differ (calibrate)."""

    def __init__(self, message: str, problem: Optional[str] = None):
        super().__init__(message)
        self.problem = problem or message


def setup_experiment(uri: Optional[str], experiment: str, artifact_location: Optional[str],
                     start_dir: Path) -> str:
    """Point MLflow at ``uri`` (default: the SQLite store in ``start_dir``) with bounded HTTP
    retries, create the experiment with an explicit artifact location if missing; return its id."""
    import mlflow

    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    for key, value in SYSTEM_METRICS_ENV.items():  # MLflow's own system metrics (psutil; NVML where present)
        os.environ.setdefault(key, value)
    import logging
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # no start/stop lines on the console
    for name in ("mlflow.store.db.utils", "mlflow.system_metrics.system_metrics_monitor", "urllib3.connectionpool"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # a failing store's tracebacks and SQL: xpar's line says it
    uri = uri or default_uri(start_dir)
    try:
        with store_lock(uri):
            seed_new_store(uri)
            return _experiment_id(uri, experiment, artifact_location, start_dir)
    except Exception as e:  # unreachable server, unknown scheme, unwritable store
        problem = f"cannot use the MLflow tracking store tracking.uri={uri}: {_store_said(uri, e)}"
        advice = _path_advice(uri, start_dir) or _store_advice(uri, e)
        raise TrackingUnavailable(f"{problem}. {advice}", problem) from None


def _store_said(uri: str, e: Exception) -> str:
    """What the store said, in one short clause: for a server nobody answers at, the socket's reason
    (``no server answers there ([Errno 111] Connection refused)``), not MLflow's 400-character
    HTTPConnectionPool text cut mid-word; else the exception's first line (300 characters at most)."""
    import re
    text = str(e)
    refused = re.search(r"\[Errno -?\d+\] [^'\")]+", text)
    if uri.startswith(("http://", "https://")) and ("NewConnectionError" in text or "Max retries" in text):
        return f"no server answers there ({refused.group(0).strip() if refused else 'no connection'})"
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _path_advice(uri: str, start_dir: Path) -> Optional[str]:
    """For a ``tracking.uri`` that is a path (no scheme: ``other.db``, ``./mlruns``), which MLflow reads as
    its file store (in maintenance mode in MLflow 3, refused here with 'The filesystem tracking backend
    ... is in maintenance mode', mlflow/store/tracking/file_store.py): the SQLite URI of a file at that
    path (``<path>/mlflow.db`` for a folder), its folder created if missing; None for a URI."""
    if "://" in uri or uri.startswith("databricks"):
        return None
    path = Path(uri).expanduser()
    path = path if path.is_absolute() else start_dir / path
    if path.is_dir() or not path.suffix:
        path = path / "mlflow.db"
    return (f"tracking.uri={uri} is a path, which MLflow reads as its file store (not used by xpar); for a SQLite "
            f"file there pass tracking.uri=sqlite:///{path.resolve()}" + ("" if path.parent.is_dir() else
            f" (after mkdir -p {path.parent.resolve()})") + ", or omit tracking.uri for ./mlflow.db.")


def _store_advice(uri: str, e: Optional[Exception] = None) -> str:
    """What to do about a store that failed: a value MLflow refused (the store answered), a server
    to start, or a SQLite file to move aside."""
    from mlflow.exceptions import MlflowException
    if isinstance(e, MlflowException) and e.error_code == "INVALID_PARAMETER_VALUE":
        return ("The store is healthy and refused a value: fix it (e.g. a shorter tracking.experiment, "
                "tracking.experiment=xpar), or tracking=off.")
    if uri.startswith(("http://", "https://")):
        return f"Start the server{_serve_line(uri)}, fix the URI, or use the default SQLite store (omit tracking.uri) or tracking=off."
    db = sqlite_path(uri)
    if db is not None and db.exists():
        return (f"If {db} is damaged, move it aside (mv {db} {db}.broken) and run again: a new store is "
                f"created; or pass tracking.uri=sqlite:///<another file>, or tracking=off.")
    return "Fix the URI, use the default SQLite store (omit tracking.uri), or tracking=off."


def _serve_line(uri: str) -> str:
    """For a server URI on this host (127.0.0.1, localhost): `` (<the command that serves it>)``, the README's
    ``mlflow server`` line at its host and port, with ./mlflow.db as the store; '' for another host."""
    from urllib.parse import urlsplit
    parts = urlsplit(uri)
    if parts.hostname not in ("127.0.0.1", "localhost") or parts.scheme != "http":
        return ""
    port = parts.port or 80
    return (f" (MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow server --workers 1 --host {parts.hostname} "
            f"--port {port} --backend-store-uri sqlite:///$PWD/mlflow.db)")


def _experiment_id(uri: str, experiment: str, artifact_location: Optional[str], start_dir: Path) -> str:
    """The id of ``experiment`` in the store at ``uri``, created if missing."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is not None:
        end_orphaned_runs(mlflow.tracking.MlflowClient(uri), exp.experiment_id)
        return exp.experiment_id
    if artifact_location is None and uri.startswith(("http://", "https://")):
        return mlflow.create_experiment(experiment, tags=EXPERIMENT_TAGS)  # the server's --default-artifact-root decides
    location = artifact_location or (start_dir / "mlartifacts").resolve().as_uri()
    return mlflow.create_experiment(experiment, artifact_location=location, tags=EXPERIMENT_TAGS)


def owner_tags() -> dict:
    """Tags naming the process that records a run (host, pid and the pid's start time, so a
    reused pid is not taken for it): :func:`end_orphaned_runs` reads them."""
    import socket

    import psutil
    return {"xpar.host": socket.gethostname(), "xpar.pid": str(os.getpid()),
            "xpar.pid_started": f"{psutil.Process().create_time():.2f}"}


def _owner_alive(tags: dict) -> bool:
    """Whether the process named by :func:`owner_tags` still runs. This process always does.
    Start times are compared within 5 s: psutil derives them from /proc/stat's boot time, which
    moves by a second when the clock is adjusted (a sweep's parent was once ended KILLED by its
    own job so, in CI)."""
    import psutil
    try:
        if int(tags["xpar.pid"]) == os.getpid():
            return True
        proc = psutil.Process(int(tags["xpar.pid"]))
        return abs(proc.create_time() - float(tags.get("xpar.pid_started", 0))) < 5.0 and \
            proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, ValueError, KeyError):
        return False


def end_orphaned_runs(client, experiment_id: str) -> list[str]:
    """End KILLED the RUNNING runs of this host whose recording process is gone (``kill -9``
    of xpar or of a sweep's parent left them RUNNING forever), with the tag ``xpar.ended_by``
    saying so; a sweep's parent also gets ``xpar.jobs_not_started`` (its ``xpar.n_jobs`` less
    the jobs that left a run). Called by every later xpar command that opens the experiment
    (:func:`setup_experiment`). Returns their run ids."""
    import socket

    host, ended = socket.gethostname(), []
    for run in client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=500):
        tags = run.data.tags
        if tags.get("xpar.host") != host or "xpar.pid" not in tags or _owner_alive(tags):
            continue
        client.set_tag(run.info.run_id, "xpar.ended_by",
                       f"a later xpar command: its process {tags['xpar.pid']} on {host} was gone without ending it")
        if tags.get("xpar.role") == "sweep" and tags.get("xpar.n_jobs"):
            jobs = client.search_runs([experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{run.info.run_id}'")
            client.set_tag(run.info.run_id, "xpar.jobs_not_started", str(max(0, int(tags["xpar.n_jobs"]) - len(jobs))))
        client.set_terminated(run.info.run_id, "KILLED")
        ended.append(run.info.run_id)
    if ended:
        print(f"xpar: {len(ended)} run(s) left RUNNING by a process that is gone now ended KILLED "
              f"({', '.join(r[:8] for r in ended)}).", file=sys.stderr)
    for run_id in ended:
        _sync_hint(client.get_run(run_id).data.tags.get("xpar.out_dir"))
    return ended


def _sync_hint(out_dir: Optional[str]) -> None:
    """The ``xpar sync`` line for a killed run whose journal holds records (or whose workers' step
    files hold steps) the store has not acknowledged."""
    n = unacknowledged(Path(out_dir)) if out_dir else 0
    if n:
        print(f"xpar: its folder {out_dir} holds {n} record(s) or step(s) the store has not taken; "
              f"send them with: xpar sync {out_dir}", file=sys.stderr)


def param_key(key: str) -> str:
    """A valid MLflow param/metric name: Hydra override prefixes (+, ++, ~) dropped and any
    character outside letters, digits, ``_ - . / :`` and space replaced by ``_``."""
    key = key.replace("+", "").replace("~", "")
    return re.sub(r"[^A-Za-z0-9_\-./: ]", "_", key)


class _Terminated(BaseException):
    pass


@contextmanager
def mlflow_run(spec: RunSpec, config: dict, start_dir: Path, tags: Optional[dict] = None,
               run_name: Optional[str] = None, out_dir: Optional[Path] = None) -> Iterator[Any]:
    """Start an MLflow run for ``spec``; yield the active run (its :class:`xpar.track.recorder.Recorder`
    as ``run.recorder``).

    Every record goes through the run's journal in ``out_dir`` (a temporary folder if None);
    rank 0's per-step metrics are delivered live. Logs the flattened resolved config as params
    on entry. Ends the run FINISHED on success, KILLED on KeyboardInterrupt/SIGTERM, FAILED on
    any other error (re-raised): in the store, or in the journal for ``xpar sync``.
    """
    import tempfile

    import mlflow

    bound_http()
    exp_id = setup_experiment(spec.tracking.uri, spec.tracking.experiment,
                              spec.tracking.artifact_location, start_dir)
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="xpar-")).resolve()
    try:
        run = mlflow.start_run(experiment_id=exp_id, run_name=run_name or spec.tracking.run_name,
                               tags={**(tags or {}), **owner_tags(), "xpar.out_dir": str(out_dir)},
                               log_system_metrics=system_metrics(spec))
    except Exception as e:  # a store that reads but takes no write (a full disk, a read-only file)
        raise TrackingUnavailable(f"the MLflow store tracking.uri={mlflow.get_tracking_uri()} did not take a new run "
                                  f"({type(e).__name__}: {store_reason(e)}); "
                                  f"free space there or make it writable, or pass tracking=off.") from None
    recorder = Recorder(mlflow.get_tracking_uri(), run.info.run_id, out_dir,
                        spec.world_size if spec.mode == "execute" else 0)
    run.recorder = recorder
    with _sigterm_raises():
        try:
            recorder.record("params", params=flatten(config))
            recorder.flush()
            recorder.start_live()
            yield run
        except (KeyboardInterrupt, _Terminated):
            record_run_files(recorder, out_dir)
            _end(recorder, "KILLED")
            KILLED_RUNS.append(f"MLflow run {exp_id}/{run.info.run_id} ended KILLED with "
                               f"{recorder.journal.steps_journaled()} step(s) recorded, its config and log kept "
                               f"(run folder {out_dir})")
            raise KeyboardInterrupt from None
        except BaseException as e:
            if isinstance(e, Exception):  # why, on the run (a SystemExit's line is already on the console)
                recorder.record("tags", tags={"xpar.error": f"{type(e).__name__}: {e}"[:5000]})
            record_run_files(recorder, out_dir)
            _end(recorder, "FAILED")
            raise
        else:
            _end(recorder, "FINISHED")


KILLED_RUNS: list[str] = []
"""'MLflow run <experiment id>/<run id> ended KILLED with <n> step(s) recorded, ...' of each run
this process ended KILLED (:func:`mlflow_run`), for the one line xpar.__main__ prints on Ctrl-C."""

RUN_FILES = ("config.yaml", "xpar.log", "worker_*.traceback.txt")
"""The run folder's files a FAILED or KILLED run keeps in MLflow (artifact folder ``logs``, config.yaml
at the top): the resolved config (xpar.run.job writes it before any worker starts), the console's log
and each failed worker's traceback (xpar.run.launch)."""


def record_run_files(recorder, out_dir: Path) -> None:
    """Journal :data:`RUN_FILES` of ``out_dir`` as artifacts of a run that ends early: such a run
    reaches no :func:`log_report`, and its MLflow page held no artifact at all (no config, no
    traceback: a user saw FAILED and the error tag only)."""
    for pattern in RUN_FILES:
        for path in sorted(out_dir.glob(pattern)):
            recorder.record("artifact", path=str(path), dir=None if path.name == "config.yaml" else "logs")


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises in the main thread (so the run ends KILLED), restored on exit."""
    old_term = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        raise _Terminated()

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        old_term = None
    try:
        yield
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _end(recorder, status: str) -> None:
    """Final status to the store (or the journal), then end MLflow's active run locally
    (its own call is short once the store failed: :func:`xpar.track.recorder.bound_http`)."""
    import mlflow

    recorder.finish(status)
    try:
        mlflow.end_run(status)
    except Exception:  # the store is down: the journal holds the status for `xpar sync`
        pass


@contextmanager
def recording(run) -> Iterator[None]:
    """Around the logging after training: a store that fails there does not fail the run
    (what it did not take is journaled, and the summary is still printed)."""
    try:
        yield
    except Exception as e:
        recorder = getattr(run, "recorder", None)
        if recorder is None or not _is_store_error(e):
            raise
        recorder.mark_failed(e)
        timeline = recorder.out_dir / TIMELINE_FILE
        if timeline.is_file():
            recorder.record("artifact", path=str(timeline), dir=None)


def _is_store_error(e: Exception) -> bool:
    from mlflow.exceptions import MlflowException
    try:
        from requests.exceptions import RequestException
    except ImportError:  # pragma: no cover
        RequestException = OSError
    return isinstance(e, (MlflowException, RequestException, OSError, TimeoutError))


def write_config(out_dir: Path, config_yaml: str) -> None:
    """The resolved config as ``out_dir/config.yaml``; a disk that refuses it is a warning (the config
    still goes to MLflow, from the text)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(config_yaml)
    except OSError as e:
        disk_warning(out_dir / "config.yaml", e, "the resolved config goes to MLflow only")


def log_report(report, stats: Optional[list[dict]], config_yaml: str, out_dir: Path) -> None:
    """Summary metrics, the per-step metrics not yet delivered live (e.g. ranks on other
    nodes' disks), and artifacts: the resolved config YAML, the per-rank stats JSON and the
    report's files. Journaled first, then delivered within the end budget."""
    import mlflow

    write_config(out_dir, config_yaml)
    run = mlflow.active_run()
    recorder = getattr(run, "recorder", None)
    if recorder is None:  # a run not started by mlflow_run
        recorder = Recorder(mlflow.get_tracking_uri(), run.info.run_id, out_dir)
    recorder.stop_live()
    now = int(time.time() * 1000)
    done = recorder.journal.steps_journaled()
    points = [["train/loss", v, now, i] for i, v in enumerate(report.losses) if i >= done]
    points += [["train/step_time_s", v, now, i] for i, v in enumerate(report.step_times_s) if i >= done]
    norms = (stats[0].get("grad_norms") or []) if stats else []  # pre-clip global norm: equal on every rank
    points += [["train/grad_norm", float(v), now, i] for i, v in enumerate(norms) if i >= done]
    points += [[k, float(v), now, 0] for k, v in report.metrics().items()]
    recorder.record("metrics", points=points)
    recorder.record("text", text=config_yaml, file="config.yaml")
    if stats is not None:
        recorder.record("text", text=json.dumps(stats, indent=1), file="ranks.json")
    for path in getattr(report, "artifacts", None) or []:
        recorder.record("artifact", path=str(Path(path).resolve()), dir=None)
    recorder.flush_bounded()
