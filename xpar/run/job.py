"""What one Hydra job does: validate, execute or estimate, report, record."""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf

from xpar.config.checks import ConfigError
from xpar.config.cluster import adopt_submitit_tasks, placement_tags
from xpar.config.presets import dense_moe_notes, fp8_recipe_notes, kept_kv_heads_notes
from xpar.config.recorded import resolved_config
from xpar.config.spec import RunSpec
from xpar.config.torchrun import quiet_exit, torchrun_follower
from xpar.estimate.cost import estimate
from xpar.run.dryrun import PlanError
from xpar.run.estimate_mode import estimate_report
from xpar.run.fidelity import fidelity_metrics, contention, usable_cores
from xpar.estimate.preflight.check import check_run
from xpar.track.report import Report, layout_name, print_report, summarize_measured
from xpar.plan.command import run_plan
from xpar.run.checkpoint import tracking_link
from xpar.run.exits import ServerDied, WorkerFailed
from xpar.run.forkserver import start_server
from xpar.run.host_memory import keep_large_tensors_on_the_heap
from xpar.run.profile import PROFILE_STEPS
from xpar.run.resume import checkpointing
from xpar.track.naming import description, run_name as layout_run_name, sweep_child_name, ui_hint
from xpar.track.plots import record_step_split, record_timeline
from xpar.track.recorder import recording_gap
from xpar.track.run_dir import claim, free_sibling
from xpar.track.runs import TrackingUnavailable, log_report, mlflow_run, recording, default_uri, flatten, write_config
from xpar.track.sweep import sweep_tags


def fail(lines: str, code: int = 2) -> None:
    """Print the refusal ``lines`` and exit ``code``; under torchrun only rank 0 prints (:func:`quiet_exit`)."""
    if torchrun_follower():
        quiet_exit(code)
    print(f"xpar: invalid configuration:\n{lines}", file=sys.stderr)
    raise SystemExit(code)



def model_preset_notes(spec: RunSpec) -> list[str]:
    """Notes on the model's overrides against its preset (xpar.config.presets.kept_kv_heads_notes), on MoE fields
    set on a dense model (dense_moe_notes) and on an FP8 recipe set for a run that is not FP8 (fp8_recipe_notes),
    from Hydra's group choice and command-line overrides; [] outside a Hydra app."""
    if not HydraConfig.initialized():
        return []
    hc = HydraConfig.get()
    given = list(hc.overrides.task)
    return kept_kv_heads_notes(spec.model.n_heads, spec.model.n_kv_heads, hc.runtime.choices.get("model"),
                               given) + dense_moe_notes(spec.model.n_experts, given) + \
        fp8_recipe_notes([spec.train.dtype], given)


def run_job(cfg: DictConfig, out_dir: Path, start_dir: Path, sweep: Optional[dict] = None) -> Optional[Report]:
    """Validate ``cfg``, then execute or estimate it and record it.

    In a single run, invalid input exits 2 listing every violated constraint and a failed
    worker exits 1 naming its rank. Inside a sweep (``sweep`` given) errors are raised so
    that Hydra marks the job failed and goes on, and an invalid job is skipped when
    ``sweep.skip_invalid`` is set. Returns the Report on the process that records (None on
    non-zero torchrun ranks and skipped jobs). A folder of another run is refused first
    (:func:`own_folder`).
    """
    if cfg.run.mode == "plan":  # xpar plan: every layout ranked by the cost model (xpar.plan.command)
        return _plan_job(cfg, out_dir, start_dir, sweep)

    adopt_submitit_tasks()  # the tasks of a multi-task submitit job become this one job's ranks
    own_folder(out_dir, sweep)
    try:
        spec = check_run(cfg)
        spec = replace(spec, notes=list(spec.notes) + model_preset_notes(spec))
        spec, resume_meta = checkpointing(spec, start_dir)  # train.resume -> its checkpoint directory
    except ConfigError as e:
        if sweep is None:
            fail(str(e))
        if cfg.sweep.skip_invalid:
            print(f"xpar: skipping job {sweep['job_num']} (invalid):\n{e}", file=sys.stderr)
            return None
        raise
    config = resolved_config(cfg, spec)
    yaml = OmegaConf.to_yaml(OmegaConf.create(config))
    job = Job(spec, config, yaml, out_dir, start_dir, sweep, resume_meta)
    try:
        if spec.launcher == "torchrun":
            return _run_torchrun(job)
        if spec.mode == "estimate":
            return _run_estimate(job)
        start_server()  # the workers' imports now, beside this process's MLflow set-up
        from xpar.run.launch import launch_local  # lazy: torch (xpar.LAZY_IMPORTS)

        def body() -> tuple[Report, list[dict]]:
            stats = launch_local(spec, out_dir)
            return _summarize(spec, stats), stats
        return _record(job, body)
    except WorkerFailed as e:
        if sweep is not None:
            raise
        print(f"xpar: {e}" + ("" if isinstance(e, ServerDied) else f"\n(traceback in {out_dir})"), file=sys.stderr)
        raise SystemExit(1)
    except TrackingUnavailable as e:
        if sweep is not None:
            raise
        print(f"xpar: {e}", file=sys.stderr)
        raise SystemExit(2)


def _plan_job(cfg: DictConfig, out_dir: Path, start_dir: Path, sweep: Optional[dict]) -> None:
    """``xpar plan`` (run.mode=plan) as one job; a plan that could not be recorded exits 2."""
    own_folder(out_dir, sweep)
    try:
        run_plan(cfg, out_dir, start_dir, sweep=sweep)
    except TrackingUnavailable as e:
        if sweep is not None:
            raise
        print(f"xpar: the plan above was not recorded: {e}", file=sys.stderr)
        raise SystemExit(2)


def own_folder(out_dir: Path, sweep: Optional[dict]) -> None:
    """Claim ``out_dir`` for this run (xpar.track.run_dir): a single run's folder was claimed before
    Hydra started (xpar.__main__), a sweep job's is claimed here. A folder of another run exits 2
    (raises ConfigError in a sweep) before any worker starts. The ranks other than 0 of a torchrun
    or multi-task submitit job share their rank 0's."""
    import os

    if os.environ.get("RANK", "0") != "0":
        return
    why = claim(out_dir)
    if why is None:
        return
    line = (f"the output folder {out_dir} is another run's ({why}): a run never writes into another run's "
            f"records or checkpoints; give a new folder, e.g. hydra.run.dir={free_sibling(out_dir)}.")
    if sweep is None:
        fail(f"  - {line}")
    raise ConfigError([line])


class SweepJobFailed(CompactHydraException):
    """A sweep job that failed for a reason xpar states (a worker failed, an invalid configuration,
    the tracking store unavailable): Hydra ends the sweep with this one line (a
    CompactHydraException) instead of a traceback; the worker's traceback is in the job's folder."""


@dataclass
class Job:
    spec: RunSpec
    config: dict
    yaml: str
    out_dir: Path
    start_dir: Path
    sweep: Optional[dict]
    resume: Optional[dict] = None
    """The xpar.json of the checkpoint this run resumes from (xpar.run.checkpoint)."""


def _summarize(spec: RunSpec, stats: list[dict]) -> Report:
    """The measured Report, with how far the run's own estimate was (xpar.run.fidelity)."""
    report, est = summarize_measured(spec, stats), estimate(spec)  # the run's own estimate, once
    report.extra.update(fidelity_metrics(spec, report, est))
    report.notes.extend(fidelity_notes(spec, est))
    report.notes.extend(nonfinite_notes(spec, stats, report))
    report.notes.extend(contention_notes(spec, stats, report))
    if spec.train.profile:
        report.notes.append(f"train.profile=true: the last {PROFILE_STEPS} step(s) ran under torch.profiler (their "
                            f"times include its overhead); traces in profile/ of the run folder and the MLflow run")
    return report


def contention_notes(spec: RunSpec, stats: list[dict], report: Report) -> list[str]:
    """The workers' CPU share over the timed steps as ``system/workers_cpu_share`` in
    ``report.extra``, and the note of a run measured under contention (xpar.run.fidelity)."""
    share, note = contention(spec, stats, usable_cores()) if spec.launcher == "local" else (None, None)
    if share is not None:
        report.extra["system/workers_cpu_share"] = share
    return [note] if note else []


def nonfinite_notes(spec: RunSpec, stats: list[dict], report: Report) -> list[str]:
    """Counts of the non-finite and skipped steps (``train.on_nonfinite`` skip or ignore) as
    ``train/nonfinite_steps`` and ``train/skipped_steps`` in ``report.extra``, and the note that
    says such a run's throughput is not a clean measurement ([] for a finite run)."""
    bad, skipped = stats[0].get("nonfinite_steps") or [], stats[0].get("skipped_steps") or []
    report.extra["train/nonfinite_steps"] = float(len(bad))
    report.extra["train/skipped_steps"] = float(len(skipped))
    if not bad:
        return []
    what = "skipped" if skipped else "taken anyway (train.on_nonfinite=ignore)"
    return [f"diverged: {len(bad)} of {spec.train.steps} steps had a NaN/inf loss or gradient norm (first: step "
            f"{bad[0]}), their optimizer steps {what}; throughput and MFU are not a clean measurement"]


def fidelity_notes(spec: RunSpec, est=None) -> list[str]:
    """What the run's own estimate (the fidelity/* metrics; ``est`` when the caller has it)
    leaves out: its cost-model notes (a hardware without link, HBM or host figures times no
    communication, memory-bound or host work), and on an uncalibrated ``hardware=local`` how to
    measure them."""
    notes = [f"fidelity estimate: {n}" for n in (est if est is not None else estimate(spec)).notes]
    if spec.hardware.name == "local":
        notes.append("fidelity/* compare the run with an estimate on UNCALIBRATED hardware=local (no measured links, "
                     "HBM or host figures; ratios far from 1 are expected): `xpar calibrate hardware=local --name here`, "
                     "then hardware=calibrated_here, for an estimate that counts them")
    return notes


def _record(job: Job, body) -> Report:
    """Run ``body`` inside an MLflow run (when tracking is enabled); log and print."""
    spec = job.spec
    tags = {"xpar.mode": spec.mode, "xpar.layout": layout_name(spec), "xpar.model": spec.model.name,
            "xpar.calibrated": str(spec.hardware.name != "local").lower(),
            "xpar.hardware": spec.hardware.name, "xpar.parallel": spec.parallel.name}
    if spec.notes:
        tags["xpar.notes"] = " | ".join(spec.notes)
    tags.update(placement_tags(spec))
    run_name, overrides = spec.tracking.run_name or layout_run_name(spec), ""
    if job.sweep and job.sweep.get("parent_run_id"):
        overrides = " ".join(job.sweep["overrides"])
        tags.update(sweep_tags(job.sweep))
        run_name = sweep_child_name(run_name, job.sweep["overrides"], job.sweep.get("varying", []),
                                    job.sweep["job_num"])
    tags["mlflow.note.content"] = description(spec, overrides)
    if not spec.tracking.enabled:
        report, stats = body()
        record_timeline(report.timeline, job.out_dir)
        record_step_split(report.extra, report.step_time_s, job.out_dir)
        print_report(spec, report)
        return report
    tags.update(_continue_run(job))
    write_config(job.out_dir, job.yaml)  # before any worker: a run that fails or is stopped keeps it (xpar.track.runs.RUN_FILES)
    with mlflow_run(spec, job.config, job.start_dir, tags, run_name, job.out_dir) as run:
        report, stats = body()
        with recording(run):  # a store failing here costs no result: journaled for `xpar sync`
            log_report(report, stats, job.yaml, job.out_dir)
            import mlflow
            mlflow.set_tag("xpar.peak_rank", str(report.peak_rank))  # an identifier: a tag, not a metric
            if report.extra.get("train/nonfinite_steps"):
                mlflow.set_tag("xpar.diverged", "true")
            if any(n.startswith("measured under contention") for n in report.notes):
                mlflow.set_tag("xpar.contention", "true")
            if report.notes:  # what the figures rest on (an estimate's cost-model notes), after the spec's
                mlflow.set_tag("xpar.notes", " | ".join(list(spec.notes) + list(report.notes)))
            for path in report.artifacts:  # estimate figures, dry-run detail
                mlflow.log_artifact(path)
            for path in sorted((job.out_dir / "profile").glob("*.json")):  # train.profile=true (xpar.run.profile)
                mlflow.log_artifact(str(path), "profile")
            record_timeline(report.timeline, job.out_dir)
            record_step_split(report.extra, report.step_time_s, job.out_dir)
        where = (f"{run.info.experiment_id}/{run.info.run_id} in {_uri()}\n"
                 f"Open it: {ui_hint(_uri(), run.info.experiment_id, run.info.run_id)}")
    gap = recording_gap(run.recorder)
    print_report(spec, report, gap or where)
    if gap and job.sweep is None:  # trained, but not all of it is in MLflow: the `xpar sync` line above says how
        raise SystemExit(1)
    return report


def _continue_run(job: Job) -> dict:
    """A resumed run: the tags linking it to its checkpoint; when it continues the
    checkpointed MLflow run, that run's id in ``MLFLOW_RUN_ID`` (mlflow.start_run resumes it and
    clears the variable). See :func:`xpar.run.checkpoint.tracking_link`."""
    import os

    if job.resume is None:
        return {}
    link = tracking_link(job.spec, job.resume, flatten(job.config), job.spec.tracking.uri or default_uri(job.start_dir))
    if link.note:
        print(link.note, file=sys.stderr)
    if link.run_id:
        os.environ["MLFLOW_RUN_ID"] = link.run_id
    return link.tags


def _uri() -> str:
    import mlflow
    return mlflow.get_tracking_uri()


def _run_estimate(job: Job) -> Report:
    try:
        return _record(job, lambda: (estimate_report(job.spec, job.out_dir), None))
    except PlanError as e:  # torch refused to build the layout in the dry run
        if job.sweep is not None:
            raise
        fail(f"  - {e}")


def _run_torchrun(job: Job) -> Optional[Report]:
    """Under torchrun this process is one rank; rank 0 records."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from xpar.run.worker import run_rank  # lazy: torch (xpar.LAZY_IMPORTS)

    spec, out_dir = job.spec, job.out_dir
    if spec.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:  # before gloo's threads allocate (xpar.run.host_memory)
        keep_large_tensors_on_the_heap()
    dist.init_process_group("nccl" if spec.device == "cuda" else "gloo", timeout=timedelta(seconds=spec.collective_timeout_s))
    try:
        if dist.get_rank() != 0:
            run_rank(spec, out_dir)
            return None

        def body():
            stats = run_rank(spec, out_dir)
            return _summarize(spec, stats), stats
        return _record(job, body)
    finally:
        dist.destroy_process_group()
