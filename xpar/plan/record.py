"""The plan as an MLflow run (tag ``xpar.mode=plan``), recorded the way estimate runs are
(:func:`xpar.track.runs.mlflow_run`, its journal and end status): the config with the winner's layout resolved as params,
counts and the winner's figures as metrics, and as artifacts the ranked table (``plan_ranked.csv``:
every layout that fits, best first), the drop counts (``plan_dropped.csv``), the console text
(``plan.txt``) and the Pareto plot of memory per device against tokens/s (``plan_pareto.png``)."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional

import numpy as np

from xpar.config.recorded import resolved_config
from xpar.track.report import layout_name
from xpar.estimate.terms import AXIS_TIME_TERMS, TIME_TERMS, time_key
from xpar.plan.explain import device_name, explain, label
from xpar.plan.groups import group_ranks
from xpar.plan.rank import describe_gap, pareto_front, separating_terms
from xpar.plan.show import cluster_lines, dropped_lines
from xpar.track import side_process
from xpar.track.naming import ui_hint
from xpar.track.runs import mlflow_run, recording
from xpar.track.sweep import sweep_tags

GB = 1e9
CSV_COLUMNS = ("tp", "pp", "dp", "b", "m", "v", "schedule", "zero", "sp", "recompute", "offload", "tokens_per_s",
               "tokens_per_s_per_device", "mfu", "bubble_ratio", "time_per_step_s", "memory_total",
               "memory_usable", "host_bytes") + tuple(map(time_key, TIME_TERMS))
"""Columns of plan_ranked.csv (seconds, bytes, fractions), after ``rank``; then cp, ep, dtype and the cp/ep
terms where the plan searched them (:func:`csv_columns`), ``group`` (the rank of its degree group,
:mod:`xpar.plan.groups`) and ``separates``."""


def csv_columns(res: dict) -> tuple[str, ...]:
    """:data:`CSV_COLUMNS` plus the cp/ep/dtype columns and time terms ``res`` holds."""
    extra = ("cp", "ep", "dtype", "etp") + tuple(map(time_key, AXIS_TIME_TERMS))
    return CSV_COLUMNS + tuple(k for k in extra if k in res)


def csv_header(name: str) -> str:
    """``name`` with its unit in the header: ``time_*`` seconds (``_s``), ``memory_*`` bytes (``_bytes``);
    names that already say their unit (``tokens_per_s``, ``host_bytes``, ``mfu``, degrees) unchanged."""
    if name.startswith("time_") and not name.endswith("_s"):
        return name + "_s"
    if name.startswith("memory_") and not name.endswith("_bytes"):
        return name + "_bytes"
    return name


def write_ranked_csv(plan, path: Path) -> Path:
    """Every layout that fits, best first, with the term separating it from the best; seconds, bytes and
    fractions, each unit in its column's name (:func:`csv_header`)."""
    r, rows = plan.res, plan.ranked
    gaps = separating_terms(r, rows, plan.best)
    names = csv_columns(r)
    cols = [r[k][rows].tolist() for k in names] + [group_ranks(r, rows).tolist()]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("rank",) + tuple(map(csv_header, names)) + ("group", "separates"))
        w.writerows([n + 1, *vals, describe_gap(*gap)] for n, (vals, gap) in enumerate(zip(zip(*cols), gaps)))
    return path


def pareto_figure(plan, path: Path) -> Path:
    """Memory per device (GB) against tokens/s over the layouts that fit, the Pareto front (least
    memory for its throughput) drawn and the winner marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r, rows = plan.res, plan.ranked
    mem, tps = r["memory_total"][rows] / GB, r["tokens_per_s"][rows]
    front = pareto_front(mem, tps)
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(mem, tps, ".", ms=1.5, color="0.55", alpha=0.35, rasterized=True, label=f"{len(rows):,} layouts that fit")
    ax.plot(mem[front], tps[front], "o-", color="C0", ms=3, label="Pareto front")
    ax.plot([mem[0]], [tps[0]], "*", color="C3", ms=12, label="top layout")
    ax.axvline(float(r["memory_usable"][plan.best]) / GB, color="C1", ls="--", lw=1, label="usable memory")
    ax.set_xlabel("memory per device (GB, estimate)")
    ax.set_ylabel("tokens/s (estimate)")
    ax.set_title(f"xpar plan: model={plan.ctx.model['name']} on {plan.devices} x "
                 f"{device_name(plan.ctx.hardware)} (ESTIMATE)", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plan_metrics(plan) -> dict[str, float]:
    """plan/* counts and seconds, and the winner's figures under the names of a run's."""
    r, i = plan.res, plan.best
    out = {"plan/layouts_raw": plan.space.raw, "plan/layouts_valid": len(plan.space),
           "plan/layouts_fit": len(plan.ranked), "plan/devices": plan.devices}
    out.update({f"plan/dropped_{k}": v for k, v in plan.dropped.items()})
    out.update({f"plan/{k}_s": v for k, v in plan.seconds.items()})
    out["plan/layouts_per_s"] = len(plan.space) / max(plan.seconds.get("evaluate", 0.0), 1e-9)
    out.update({"throughput/tokens_per_s": r["tokens_per_s"][i], "throughput/mfu": r["mfu"][i],
                "throughput/step_time_s": r["time_per_step_s"][i], "pipeline/bubble_ratio": r["bubble_ratio"][i],
                "memory/peak_bytes_per_device": r["memory_total"][i]})
    return {k: float(v) for k, v in out.items()}


def write_artifacts(plan, line: str, out_dir: Path) -> list[Path]:
    """plan_ranked.csv, plan_dropped.csv, plan.txt and plan_pareto.png in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dropped = out_dir / "plan_dropped.csv"
    with open(dropped, "w", newline="") as f:
        csv.writer(f).writerows([("rule", "layouts")] + list(plan.dropped.items()))
    text = dropped_lines(plan) + cluster_lines(plan) + [""] + explain(plan.res, plan.ranked,
                                                                      np.ones(len(plan.space), bool), plan.ctx.hardware,
                                                                      plan.inputs.tie_within)
    text += [""] + list(plan.yours) if plan.yours else []
    (out_dir / "plan.txt").write_text("\n".join(text + ["", "Reproduce the top layout:", "  " + line]
                                               + [f"note: {n}" for n in plan.notes] + [""]))
    return [write_ranked_csv(plan, out_dir / "plan_ranked.csv"), dropped, out_dir / "plan.txt",
            pareto_figure(plan, out_dir / "plan_pareto.png")]


def write_executed(executed: list[dict], path: Path) -> Path:
    """The closed loop's table (xpar.plan.execute.comparison) as CSV."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(executed[0]))
        w.writeheader()
        w.writerows(executed)
    return path


def record_plan(plan, spec, cfg, line: str, out_dir: Path, start_dir: Path, executed: list = (),
                sweep: Optional[dict] = None) -> None:
    """One MLflow run for the plan (see the module docstring), with ``executed`` (the top layouts
    run for real: plan_execute.csv, ``plan/execute_<k>_*`` metrics), a child of ``sweep``'s parent
    run in a multirun (xpar.track.sweep.sweep_tags); prints where it went."""
    config = resolved_config(cfg, spec)  # params: the winner's layout resolved, never the unused defaults
    config["run"]["mode"] = "plan"
    config.pop("hydra", None)
    tags = {"xpar.mode": "plan", "xpar.model": plan.ctx.model["name"], "xpar.hardware": plan.ctx.hardware["name"],
            "xpar.layout": layout_name(spec),  # the winner's (xpar compare's layout column)
            "xpar.plan_top": label(plan.res, plan.best), "xpar.plan_command": line[:5000],
            "mlflow.note.content": f"xpar plan: every valid layout ranked by the cost model (estimates).\n\n{line}"}
    tags.update(sweep_tags(sweep))
    name = f"{plan.ctx.model['name']}·plan·{plan.devices} devices" + (f" #{sweep['job_num']}" if tags.get(
        "xpar.job_num") else "")
    paths = write_artifacts(plan, line, out_dir)
    points = plan_metrics(plan)
    if executed:
        paths.append(write_executed(list(executed), out_dir / "plan_execute.csv"))
        tags["xpar.plan_execute_sweep"] = executed[0].get("sweep_id", "")
        for k, row in enumerate(executed, 1):
            points.update({f"plan/execute_{k}_estimated_tokens_per_s": row["estimated_tokens_per_s"],
                           f"plan/execute_{k}_measured_tokens_per_s": row["measured_tokens_per_s"]})
    experiment_id, run_id, uri = side_process.call(log_plan, spec, config, start_dir, tags, name, out_dir, points,
                                                   paths)
    plan.run_id = run_id
    print(f"Recorded: {experiment_id}/{run_id} in {uri}\n"
          f"Open it: {ui_hint(uri, experiment_id, run_id)}")


def log_plan(spec, config: dict, start_dir: Path, tags: dict, name: str, out_dir: Path, points: dict,
             paths: list[Path]) -> tuple[str, str, str]:
    """The plan's MLflow run (xpar.track.runs.mlflow_run): params, ``points`` as metrics, ``paths``
    as artifacts; (experiment id, run id, tracking URI). Runs in the helper that imported MLflow
    while the plan was searched, when ``xpar plan`` started one (xpar.track.side_process).

    Raises:
        xpar.track.runs.TrackingUnavailable: the store cannot be reached or used."""
    import time

    import mlflow

    with mlflow_run(spec, config, start_dir, tags, name, out_dir) as run:
        with recording(run):
            now = int(time.time() * 1000)
            run.recorder.record("metrics", points=[[k, v, now, 0] for k, v in points.items()])
            for path in paths:
                run.recorder.record("artifact", path=str(path.resolve()), dir=None)
            run.recorder.stop_live()
            run.recorder.flush_bounded()
    return run.info.experiment_id, run.info.run_id, mlflow.get_tracking_uri()
