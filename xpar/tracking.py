"""MLflow: one run per job, params, batched metrics, artifacts, and an honest end status.

Default store: ``sqlite:///<start dir>/mlflow.db`` with artifacts in ``<start dir>/mlartifacts``
(set explicitly, since SQLite fixes an experiment's artifact root at creation). The run ends
FINISHED, FAILED on an error, KILLED on Ctrl-C or SIGTERM; never left RUNNING.
"""
from __future__ import annotations

import json
import os
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


class _Terminated(BaseException):
    pass


@contextmanager
def mlflow_run(spec: RunSpec, config: dict, start_dir: Path, tags: Optional[dict] = None) -> Iterator[Any]:
    """Start an MLflow run for ``spec``; yield the active run.

    Logs the flattened resolved config as params and the run's tags on entry. Ends the run
    FINISHED on success, KILLED on KeyboardInterrupt/SIGTERM, FAILED on any other error
    (the error is re-raised).
    """
    import mlflow

    tr = spec.tracking
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    mlflow.set_tracking_uri(tr.uri or default_uri(start_dir))
    exp = mlflow.get_experiment_by_name(tr.experiment)
    if exp is None:
        location = tr.artifact_location or (start_dir / "mlartifacts").resolve().as_uri()
        exp_id = mlflow.create_experiment(tr.experiment, artifact_location=location)
    else:
        exp_id = exp.experiment_id
    run = mlflow.start_run(experiment_id=exp_id, run_name=tr.run_name, tags=tags or {})
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
