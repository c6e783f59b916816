"""What one Hydra job does: validate, execute or estimate, report, record."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from xpar.report import Report, layout_name, print_report
from xpar.spec import RunSpec
from xpar.validate import ConfigError, validate


def fail(lines: str, code: int = 2) -> None:
    print(f"xpar: invalid configuration:\n{lines}", file=sys.stderr)
    raise SystemExit(code)


def run_job(cfg: DictConfig, out_dir: Path, start_dir: Path) -> Optional[Report]:
    """Validate ``cfg`` (exit 2 with every violated constraint), then run it and record it.

    Returns the Report on the process that records (None on non-zero torchrun ranks).
    """
    try:
        spec = validate(cfg)
    except ConfigError as e:
        fail(str(e))
    config = OmegaConf.to_container(cfg, resolve=True)
    yaml = OmegaConf.to_yaml(cfg, resolve=True)
    if spec.launcher == "torchrun":
        return _run_torchrun(spec, config, yaml, out_dir, start_dir)
    if spec.mode == "estimate":
        return _run_estimate(spec, config, yaml, out_dir, start_dir)
    from xpar.launch import WorkerFailed, launch_local

    def body() -> tuple[Report, list[dict]]:
        stats = launch_local(spec, out_dir)
        return _summarize(spec, stats), stats

    try:
        return _record(spec, config, yaml, out_dir, start_dir, body)
    except WorkerFailed as e:
        print(f"xpar: {e}\n(traceback in {out_dir})", file=sys.stderr)
        raise SystemExit(1)


def _summarize(spec: RunSpec, stats: list[dict]) -> Report:
    from xpar.report import summarize_measured
    return summarize_measured(spec, stats)


def _record(spec, config, yaml, out_dir, start_dir, body) -> Report:
    """Run ``body`` inside an MLflow run (when tracking is enabled); log and print."""
    tags = {"xpar.mode": spec.mode, "xpar.layout": layout_name(spec), "xpar.model": spec.model.name,
            "xpar.hardware": spec.hardware.name, "xpar.parallel": spec.parallel.name}
    if spec.notes:
        tags["xpar.notes"] = " | ".join(spec.notes)
    if not spec.tracking.enabled:
        report, stats = body()
        print_report(spec, report)
        return report
    from xpar.tracking import log_report, mlflow_run
    with mlflow_run(spec, config, start_dir, tags) as run:
        report, stats = body()
        log_report(report, stats, yaml, out_dir)
        where = f"{run.info.experiment_id}/{run.info.run_id} in {_uri()}"
    print_report(spec, report, where)
    return report


def _uri() -> str:
    import mlflow
    return mlflow.get_tracking_uri()


def _run_estimate(spec, config, yaml, out_dir, start_dir) -> Report:
    try:
        from xpar.estimate.run import estimate_report
    except ImportError:
        fail("  - run.mode=estimate is not available yet in this build; use hardware=local.")
    return _record(spec, config, yaml, out_dir, start_dir, lambda: (estimate_report(spec, out_dir), None))


def _run_torchrun(spec, config, yaml, out_dir, start_dir) -> Optional[Report]:
    """Under torchrun this process is one rank; rank 0 records."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from xpar.worker import run_rank

    if spec.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if spec.device == "cuda" else "gloo", timeout=timedelta(seconds=300))
    try:
        if dist.get_rank() != 0:
            run_rank(spec, out_dir)
            return None

        def body():
            stats = run_rank(spec, out_dir)
            return _summarize(spec, stats), stats
        return _record(spec, config, yaml, out_dir, start_dir, body)
    finally:
        dist.destroy_process_group()
