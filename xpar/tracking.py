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
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from xpar.spec import RunSpec

MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_CHARS = 6000  # MLflow's param value limit (3.x); longer values are truncated with a marker


def default_uri(start_dir: Path) -> str:
    return f"sqlite:///{(start_dir / 'mlflow.db').resolve()}"


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


class TrackingUnavailable(RuntimeError):
    """The tracking store cannot be reached or used; raised before any worker starts."""


def setup_experiment(uri: Optional[str], experiment: str, artifact_location: Optional[str],
                     start_dir: Path) -> str:
    """Point MLflow at ``uri`` (default: the SQLite store in ``start_dir``) with bounded HTTP
    retries, create the experiment with an explicit artifact location if missing; return its id."""
    import mlflow

    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    uri = uri or default_uri(start_dir)
    try:
        mlflow.set_tracking_uri(uri)
        exp = mlflow.get_experiment_by_name(experiment)
        if exp is not None:
            return exp.experiment_id
        if artifact_location is None and uri.startswith(("http://", "https://")):
            return mlflow.create_experiment(experiment)  # the server's --default-artifact-root decides
        location = artifact_location or (start_dir / "mlartifacts").resolve().as_uri()
        return mlflow.create_experiment(experiment, artifact_location=location)
    except Exception as e:  # unreachable server, unknown scheme, unwritable store
        raise TrackingUnavailable(f"cannot use the MLflow tracking store tracking.uri={uri}: "
                                  f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}. "
                                  f"Start the server, fix the URI, or use the default SQLite store "
                                  f"(omit tracking.uri) or tracking=off.") from None


def param_key(key: str) -> str:
    """A valid MLflow param/metric name: Hydra override prefixes (+, ++, ~) dropped and any
    character outside letters, digits, ``_ - . / :`` and space replaced by ``_``."""
    key = key.replace("+", "").replace("~", "")
    return re.sub(r"[^A-Za-z0-9_\-./: ]", "_", key)


class _Terminated(BaseException):
    pass


@contextmanager
def mlflow_run(spec: RunSpec, config: dict, start_dir: Path, tags: Optional[dict] = None,
               run_name: Optional[str] = None) -> Iterator[Any]:
    """Start an MLflow run for ``spec``; yield the active run.

    Logs the flattened resolved config as params and the run's tags on entry. Ends the run
    FINISHED on success, KILLED on KeyboardInterrupt/SIGTERM, FAILED on any other error
    (the error is re-raised).
    """
    import mlflow

    exp_id = setup_experiment(spec.tracking.uri, spec.tracking.experiment,
                              spec.tracking.artifact_location, start_dir)
    run = mlflow.start_run(experiment_id=exp_id, run_name=run_name or spec.tracking.run_name, tags=tags or {})
    old_term = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        raise _Terminated()

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        old_term = None
    try:
        params = flatten(config)
        items = list(params.items())
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            mlflow.log_params(dict(items[i:i + MAX_PARAMS_PER_BATCH]))
        yield run
    except (KeyboardInterrupt, _Terminated):
        mlflow.end_run("KILLED")
        raise KeyboardInterrupt from None
    except BaseException:
        mlflow.end_run("FAILED")
        raise
    else:
        mlflow.end_run("FINISHED")
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def log_report(report, stats: Optional[list[dict]], config_yaml: str, out_dir: Path) -> None:
    """Per-step loss and step time (one batch), summary metrics, and artifacts: the resolved
    config YAML and the per-rank stats JSON."""
    import mlflow
    from mlflow.entities import Metric

    client = mlflow.tracking.MlflowClient()
    run_id = mlflow.active_run().info.run_id
    now = int(time.time() * 1000)
    points = [Metric("train/loss", v, now, i) for i, v in enumerate(report.losses)]
    points += [Metric("train/step_time_s", v, now, i) for i, v in enumerate(report.step_times_s)]
    points += [Metric(k, float(v), now, 0) for k, v in report.metrics().items()]
    for i in range(0, len(points), 1000):
        client.log_batch(run_id, metrics=points[i:i + 1000])
    mlflow.log_text(config_yaml, "config.yaml")
    if stats is not None:
        mlflow.log_text(json.dumps(stats, indent=1), "ranks.json")
    (out_dir / "config.yaml").write_text(config_yaml)


def open_parent_run(config, sweep_id: str, n_jobs: Optional[int], invalid: list) -> dict:
    """Create the parent run of a sweep (not made active, so jobs in this process can start
    their own runs). ``invalid``: (job number, overrides, problems) of the jobs pre-flight
    refused, logged as ``invalid_jobs.csv`` so the reasons stay beside the results.
    Returns what jobs need to find the parent."""
    import mlflow
    from omegaconf import OmegaConf

    start_dir = Path(config.hydra.runtime.cwd)
    tr = config.tracking
    exp_id = setup_experiment(tr.uri, tr.experiment, tr.artifact_location, start_dir)
    overrides = " ".join(config.hydra.overrides.task)
    params = dict(config.hydra.sweeper.get("params") or {})
    tags = {"xpar.sweep_id": sweep_id, "xpar.role": "sweep", "xpar.overrides": overrides[:5000],
            "mlflow.runName": f"sweep {sweep_id}"}
    client = mlflow.tracking.MlflowClient()
    run = client.create_run(exp_id, tags=tags)
    try:
        if params:
            client.log_batch(run.info.run_id, params=[mlflow.entities.Param(param_key(f"sweep.{k}"), str(v)[:MAX_PARAM_CHARS])
                                                       for k, v in list(params.items())[:MAX_PARAMS_PER_BATCH]])
        if invalid:
            import csv
            import io
            buf = io.StringIO()
            w = csv.writer(buf)
            w.writerow(["job", "overrides", "reason"])
            for num, overrides, problems in invalid:
                for p in problems:
                    w.writerow([num, " ".join(overrides), p])
            client.log_text(run.info.run_id, buf.getvalue(), "invalid_jobs.csv")
            client.set_tag(run.info.run_id, "xpar.invalid_jobs", str(len(invalid)))
    except Exception:  # never leave the parent RUNNING
        client.set_terminated(run.info.run_id, "FAILED")
        raise
    return {"sweep_id": sweep_id, "parent_run_id": run.info.run_id, "experiment_id": exp_id,
            "uri": mlflow.get_tracking_uri(), "n_jobs": n_jobs, "skipped": [n for n, _, _ in invalid],
            "metric": OmegaConf.select(config, "sweep.metric", default="throughput/tokens_per_s"),
            "goal": OmegaConf.select(config, "sweep.goal", default="max")}


def close_parent_run(info: dict, sweep_dir: Path) -> None:
    """Log the sweep table (CSV), plots and best job on the parent run and end it:
    FINISHED, or FAILED if a child failed or an expected job left no run. No-op if ended."""
    import mlflow

    from xpar.compare import headline_table, write_plots

    client = mlflow.tracking.MlflowClient(info["uri"])
    pid = info["parent_run_id"]
    if client.get_run(pid).info.status != "RUNNING":
        return
    status = "FAILED"
    try:
        runs = mlflow.search_runs(experiment_ids=[info["experiment_id"]],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{pid}'")
        table = headline_table(runs)
        client.log_text(pid, table.to_csv(index=False), "sweep_table.csv")
        metric = f"metrics.{info['metric']}"
        done = runs[runs["status"] == "FINISHED"] if len(runs) else runs
        if len(done) and metric in done and done[metric].notna().any():
            best = done.loc[done[metric].idxmax() if info["goal"] == "max" else done[metric].idxmin()]
            client.set_tag(pid, "xpar.best_job", f"{best.get('tags.xpar.job_num')} {best.get('tags.xpar.overrides')}")
            client.set_tag(pid, "xpar.best_run_id", best["run_id"])
            client.log_metric(pid, f"best/{info['metric']}", float(best[metric]))
        for path in write_plots(runs, sweep_dir / "plots"):
            client.log_artifact(pid, str(path), "plots")
        expected = (info.get("n_jobs") or len(runs)) - len(info.get("skipped") or [])
        failed = (runs["status"] != "FINISHED").any() if len(runs) else True
        status = "FAILED" if failed or len(runs) < expected else "FINISHED"
    finally:
        client.set_terminated(pid, status)
