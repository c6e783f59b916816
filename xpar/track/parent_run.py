"""The parent MLflow run of a sweep: created before the first job, closed with the sweep
table, plots and the best job after the last (:mod:`xpar.track.sweep` calls these)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from xpar.track.compare import headline_table, write_plots
from xpar.track.runs import (
    MAX_PARAM_CHARS,
    MAX_PARAMS_PER_BATCH,
    owner_tags,
    param_key,
    setup_experiment,
)
from xpar.track.naming import compare_page, ui_hint
from xpar.track.report import format_bytes


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
            "mlflow.runName": f"sweep {sweep_id}", **owner_tags()}
    if n_jobs is not None:
        tags["xpar.n_jobs"] = str(n_jobs)
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


def close_parent_run(info: dict, sweep_dir: Path, interrupted: bool = False) -> Optional[dict]:
    """Log the sweep table (CSV), plots and best job (among FINISHED children) on the parent
    run and end it: FINISHED, FAILED if a child failed or an expected job left no run, KILLED
    if ``interrupted`` (Ctrl-C), with the jobs that never started as tag ``xpar.jobs_not_started``.
    No-op if ended."""
    import mlflow

    client = mlflow.tracking.MlflowClient(info["uri"])
    pid = info["parent_run_id"]
    if client.get_run(pid).info.status != "RUNNING":
        return None
    status, summary = "KILLED" if interrupted else "FAILED", None
    try:
        runs = mlflow.search_runs(experiment_ids=[info["experiment_id"]],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{pid}'")
        table = headline_table(runs)
        client.log_text(pid, table.to_csv(index=False), "sweep_table.csv")
        metric = f"metrics.{info['metric']}"
        done, best = (runs[runs["status"] == "FINISHED"] if len(runs) else runs), None
        if len(done) and metric in done and done[metric].notna().any():
            best = done.loc[done[metric].idxmax() if info["goal"] == "max" else done[metric].idxmin()]
            client.set_tag(pid, "xpar.best_job", f"{best.get('tags.xpar.job_num')} {best.get('tags.xpar.overrides')}")
            client.set_tag(pid, "xpar.best_run_id", best["run_id"])
            client.log_metric(pid, f"best/{info['metric']}", float(best[metric]))
        busy = runs["tags.xpar.contention"] == "true" if "tags.xpar.contention" in runs else []
        summary = {"table": table, "best": best, "run_ids": list(runs["run_id"]) if len(runs) else [],
                   "contention": set(runs.loc[busy, "tags.xpar.job_num"]) if len(busy) else set()}
        for path in write_plots(runs, sweep_dir / "plots"):
            client.log_artifact(pid, str(path), "plots")
        expected = (info.get("n_jobs") or len(runs)) - len(info.get("skipped") or [])
        failed = (runs["status"] != "FINISHED").any() if len(runs) else True
        status = "FAILED" if failed or len(runs) < expected else "FINISHED"
        if interrupted:
            status = "KILLED"
            if info.get("n_jobs") is not None:
                client.set_tag(pid, "xpar.jobs_not_started", str(max(0, expected - len(runs))))
    finally:
        client.set_terminated(pid, status)
    return None if summary is None else {**summary, "status": status}


def print_sweep_summary(info: dict, summary: dict) -> None:
    """The end of a multirun on the console: the jobs skipped as invalid in its title, a row per job (layout, the
    swept overrides where layouts repeat
    (:func:`swept_overrides`), tokens/s, peak memory, bubble, status; '(estimate)' after the status of a job the cost model estimated), the sweep id, the best job by ``sweep.metric`` and the ``xpar compare`` line."""
    from rich.console import Console
    from rich.table import Table

    skipped = info.get("skipped") or []  # sweep.skip_invalid: said before the jobs ran, hundreds of lines above
    table = Table(title=f"sweep {info['sweep_id']}: {len(summary['table'])} job(s), parent run {summary['status']}"
                        + (f"; {len(skipped)} skipped as invalid (job {', '.join(map(str, skipped))}: "
                           f"invalid_jobs.csv on the parent run)" if skipped else ""))
    swept = swept_overrides(summary["table"])
    for col in ("job", "layout") + (("swept",) if swept else ()) + ("tokens/s", "peak memory/device", "bubble", "status"):
        table.add_column(col, justify="right" if col not in ("layout", "swept", "status") else "left",
                         overflow="fold" if col in ("layout", "swept") else "ellipsis")
    for i, (_, row) in enumerate(summary["table"].iterrows()):
        table.add_row(str(row.get("job")), str(row.get("layout")), *([swept[i]] if swept else []),
                      _num(row.get("tokens_per_s"), "{:,.0f}"),
                      _memory(row.get("peak_gib_per_device")), _num(row.get("bubble"), "{:.3f}"),
                      str(row.get("status")) + (" (estimate)" if row.get("mode") == "estimate" else "")
                      + (" (contention)" if str(row.get("job")) in summary["contention"] else ""))
    console = Console(stderr=True)
    if not len(summary["table"]):  # nothing ran (sbatch refused, every job skipped): nothing to compare
        console.print(f"sweep {info['sweep_id']}: no job ran; parent run {summary['status']}", soft_wrap=True)
        return
    console.print(table)
    best = summary.get("best")
    if best is not None:
        console.print(f"best by {info['metric']} ({info['goal']}): job {best.get('tags.xpar.job_num')} "
                      f"({best.get('tags.xpar.overrides')}), run {best['run_id']}")
    if summary["contention"]:
        console.print(f"{len(summary['contention'])} job(s) measured under contention (tag xpar.contention): "
                      f"other processes took the cores; their times read worse than this machine gives")
    if summary.get("run_ids"):  # MLflow's compare page of the children (xpar.track.naming.compare_page)
        page = compare_page(info["experiment_id"], summary["run_ids"])
        console.print(f"compare in MLflow: {ui_hint(info['uri'], info['experiment_id'], '', page)}",
                      soft_wrap=True, highlight=False)
    console.print(f"compare: xpar compare --sweep {info['sweep_id']}   (tag xpar.sweep_id={info['sweep_id']})",
                  soft_wrap=True, highlight=False)


def swept_overrides(table) -> list[str]:
    """Per job (row of :func:`xpar.track.compare.headline_table`), the overrides of its command line
    (tag ``xpar.overrides``) that not every job shares: what the sweep changed, e.g. ``hardware=a100_80gb_8gpu``.
    [] where the layout names already tell every job apart (a sweep over micro-batches or tp: its
    layouts dp2-m1, dp2-m2 differ) or no job has its overrides; a sweep over hardware, model,
    seq_len or lr runs one layout name for every job, and its rows could not be told apart."""
    layouts = [str(v) for v in table.get("layout", [])]
    words = [str(v).split() if isinstance(v, str) else [] for v in table.get("overrides", [])]
    if len(set(layouts)) == len(layouts) or not any(words):
        return []
    shared = set.intersection(*(set(w) for w in words))
    return [" ".join(w for w in ws if w not in shared) or "-" for ws in words]


def _memory(gib) -> str:
    """Peak memory in the unit that suits it (9.07 MiB, not 0.00886 GiB)."""
    try:
        nbytes = float(gib) * 2 ** 30
    except (TypeError, ValueError):
        return "-"
    return "-" if nbytes != nbytes else format_bytes(nbytes)


def _num(value, fmt: str) -> str:
    try:
        return "-" if value is None or value != value else fmt.format(float(value))
    except (TypeError, ValueError):
        return "-"
