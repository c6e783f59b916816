"""Short, readable names for runs (the MLflow run name) and their one-paragraph description.

A run name lists the model, then the degrees above 1 and the ZeRO stage, then (pipelines) the
schedule and the micro-batch count m: ``tiny·zero3·dp2``, ``tiny·cp2·dp1``, ``mini·pp2·gpipe·m8``,
``70b·tp8·pp4·dp2·1f1b·m8 (estimate)``. Torch-free.
"""
from __future__ import annotations

from xpar.config.spec import RunSpec

SEP = "·"


def run_name(spec: RunSpec) -> str:
    """The run's name from its layout (see the module docstring)."""
    p = spec.parallel
    parts = [spec.model.name]
    parts += [f"tp{spec.tp}"] * (spec.tp > 1) + [f"cp{spec.cp}"] * (spec.cp > 1) + [f"pp{spec.pp}"] * (spec.pp > 1)
    parts += [f"zero{p.zero_stage}"] * (p.zero_stage > 0)
    if spec.dp > 1 or spec.tp * spec.pp == 1:
        parts.append(f"dp{spec.dp}")
    if spec.pp > 1:
        v = spec.layout.virtual_stages
        parts += [p.schedule + (f"{SEP}v{v}" if v > 1 else ""), f"m{spec.micro_batches}"]
    name = SEP.join(parts)
    return name + " (estimate)" if spec.mode == "estimate" else name


def description(spec: RunSpec, overrides: str = "") -> str:
    """Markdown shown as the run's description in the MLflow UI (tag ``mlflow.note.content``)."""
    from xpar.config.cluster import placement

    where = placement(spec)
    how = ("estimated by the analytic cost model (xpar/estimate), not run" if spec.mode == "estimate"
           else f"measured on {spec.world_size} {spec.hardware.device} worker(s), {where['nodes']} node(s), "
                f"launched by {where['launcher']}")
    lines = [f"**{run_name(spec)}**: model `{spec.model.name}`, dp={spec.dp} tp={spec.tp} pp={spec.pp}"
             f"{f' cp={spec.cp}' if spec.cp > 1 else ''}, "
             f"ZeRO stage {spec.parallel.zero_stage}, micro-batch size b={spec.train.micro_batch_size}, "
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


def ui_hint(uri: str, experiment_id: str, run_id: str) -> str:
    """Where to see a run in the MLflow UI: its page on a server, or how to start the UI on a
    SQLite store first (bound to this machine)."""
    page = f"#/experiments/{experiment_id}/runs/{run_id}"
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/{page}"
    return f"{UI_COMMAND.format(uri=uri)}, then http://127.0.0.1:5000/{page}"
