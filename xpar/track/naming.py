"""Short, readable names for runs (the MLflow run name) and their one-paragraph description.

A run name lists the model, then every degree above 1 (tp, cp, ep, pp, dp; a degree of 1 is
never named; ``sp`` after tp with sequence parallelism) and the ZeRO stage, then (pipelines) the schedule and the micro-batch count m:
``tiny·zero3·dp2``, ``tiny·cp2``, ``moe_tiny·ep2·dp2``, ``mini·pp2·gpipe·m8``,
``70b·tp8·pp4·dp2·1f1b·m8 (estimate)``; a single-device run is the model's name alone. Run links
open MLflow 3.x's model-training view (``workflowType=machine_learning``), not its GenAI frame.
Torch-free.
"""
from __future__ import annotations

from xpar.config.cluster import placement
from xpar.config.spec import RunSpec

SEP = "·"


def run_name(spec: RunSpec) -> str:
    """The run's name from its layout (see the module docstring)."""
    lay = spec.layout
    parts = [spec.model.name]
    degrees = (("tp", spec.tp), ("cp", spec.cp), ("ep", spec.layout.ep), ("pp", spec.pp))
    parts += [f"{axis}{n}" + ("·sp" if axis == "tp" and lay.sequence_parallel else "") for axis, n in degrees if n > 1]
    parts += [f"zero{lay.zero_stage}"] * (lay.zero_stage > 0)
    parts += [f"dp{spec.dp}"] * (spec.dp > 1)
    if spec.pp > 1:
        v = lay.virtual_stages
        parts += [lay.schedule + (f"{SEP}v{v}" if v > 1 else ""), f"m{spec.micro_batches}"]
    name = SEP.join(parts)
    return name + " (estimate)" if spec.mode == "estimate" else name


def varying_keys(jobs: list[list[str]]) -> list[str]:
    """The override keys whose value differs between a sweep's jobs (``jobs``: each job's
    ``key=value`` overrides), in the order they first appear."""
    given = [dict(o.partition("=")[::2] for o in job) for job in jobs]
    keys = list(dict.fromkeys(k for job in given for k in job))
    return [k for k in keys if len({job.get(k) for job in given}) > 1]


def sweep_child_name(name: str, overrides: list[str], varying: list[str], job_num: int) -> str:
    """A sweep job's run name: the sweep keys that vary first (their last dotted part), so that
    the UI's cut-off column still tells the jobs apart: ``micro_batches=8·mini·pp2·gpipe·m8 #3``."""
    given = dict(o.partition("=")[::2] for o in overrides)
    lead = [f"{k.split('.')[-1].lstrip('+~')}={given[k]}" for k in varying if k in given]
    return SEP.join(lead + [name]) + f" #{job_num}"


def description(spec: RunSpec, overrides: str = "") -> str:
    """Markdown shown as the run's description in the MLflow UI (tag ``mlflow.note.content``)."""
    where = placement(spec)
    how = ("estimated by the analytic cost model (xpar/estimate), not run" if spec.mode == "estimate"
           else f"measured on {spec.world_size} {spec.hardware.device} worker(s), {where['nodes']} node(s), "
                f"launched by {where['launcher']}")
    lines = [f"**{run_name(spec)}**: model `{spec.model.name}`, dp={spec.dp} tp={spec.tp} pp={spec.pp}"
             f"{f' cp={spec.cp}' if spec.cp > 1 else ''}, "
             f"ZeRO stage {spec.layout.zero_stage}, micro-batch size b={spec.train.micro_batch_size}, "
             f"m={spec.micro_batches} micro-batches per step, {spec.train.dtype}; {how} "
             f"(hardware preset `{spec.hardware.name}`)."]
    if overrides:
        lines.append(f"Overrides: `{overrides}`")
    lines.append("Units: memory metrics in bytes (`*_bytes`), times in seconds (`*_s`), MFU/HFU and bubble "
                 "ratios as fractions of 1; the console shows GiB and %.")
    return "\n\n".join(lines)


UI_COMMAND = ("MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow server --workers 1 --host 127.0.0.1 --port 5000 "
              "--backend-store-uri {uri}")
"""The MLflow UI over a store: one web worker and no job-execution workers (``mlflow ui`` started 12
processes, answered after ~90 s here and ignored SIGTERM; this answers in ~10 s and stops on Ctrl-C)."""


ML_VIEW = "workflowType=machine_learning"
"""The URL parameter that opens MLflow 3.x's model-training frame (else the GenAI "Evaluations" one)."""


def run_page(experiment_id: str, run_id: str) -> str:
    """The UI route of a run's page in the model-training frame (``#/experiments/1/runs/<id>?...``)."""
    return f"#/experiments/{experiment_id}/runs/{run_id}?{ML_VIEW}"


def compare_page(experiment_id: str, run_ids: list[str]) -> str:
    """The UI route of MLflow's compare page of ``run_ids`` (``#/compare-runs?runs=[...]&experiments=[...]``,
    the lists JSON, URL-quoted as the UI writes them)."""
    import json
    from urllib.parse import quote

    runs, exps = quote(json.dumps(list(run_ids), separators=(",", ":"))), quote(json.dumps([str(experiment_id)]))
    return f"#/compare-runs?runs={runs}&experiments={exps}"


def ui_hint(uri: str, experiment_id: str, run_id: str, page: str = "") -> str:
    """Where to see a run in the MLflow UI: its page on a server, or how to start the UI on a
    SQLite store first (bound to this machine); ``page``: another route (:func:`compare_page`)."""
    page = page or run_page(experiment_id, run_id)
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/{page}"
    return f"{UI_COMMAND.format(uri=uri)}, then http://127.0.0.1:5000/{page}"
