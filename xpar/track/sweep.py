"""Multirun sweeps grouped in MLflow, with a pre-flight check of every job.

:class:`SweepCallback` (registered in conf/config.yaml under ``hydra.callbacks``):

- ``on_multirun_start``: composes and validates every job of the sweep (the same
  composition the launcher will do) before the first job starts, then opens one parent
  MLflow run and writes its id to ``<sweep dir>/xpar_sweep_<sweep id>.json`` (one file per
  sweep, in a sweep folder it owns: xpar.track.run_dir), named to each job (in this process or
  another, e.g. submitit) by ``XPAR_SWEEP_FILE``; each job starts a nested child run.
- ``on_multirun_end`` and an ``atexit`` hook (Hydra skips the callback when a job failed):
  log the sweep's table (CSV), plots and best job to the parent, and end it FINISHED, or
  FAILED if any child failed. Idempotent.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from xpar.config.checks import ConfigError
from xpar.config.cluster import submitit_task_problems
from xpar.config.hydra_internals import split_sweep_arguments
from xpar.estimate.preflight.check import check_run
from xpar.track.naming import varying_keys
from xpar.track.recorder import bound_http
from xpar.track.slurm import announce_submissions

SWEEP_FILE = "xpar_sweep_{}.json"
"""The sweep's state, keyed by its id (two sweeps never share one)."""
SWEEP_ENV = "XPAR_SWEEP_FILE"


def job_overrides(config: DictConfig) -> tuple[list[list[str]], bool]:
    """The override list of every job the sweep can run, and whether that list is exact.

    Exact for Hydra's basic sweeper (its own expansion). For other sweepers (Optuna, ...)
    the discrete choices and ranges are expanded the same way and continuous intervals are
    left out, so the list covers every combination of the discrete parameters.
    """
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import IntervalSweep

    exact = "BasicSweeper" in str(config.hydra.sweeper.get("_target_", ""))
    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    args = params + list(config.hydra.overrides.task)
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    overrides = [o for o in parser.parse_overrides(args) if not isinstance(o.value(), IntervalSweep)]
    batches = split_sweep_arguments(overrides)
    return [list(job) for batch in batches for job in batch], exact


def preflight(config: DictConfig) -> list[tuple[int, list[str], list[str]]]:
    """Compose and validate every job; return (job number, overrides, problems) of the
    invalid ones. Under a submitit launcher, each job's ranks are held against its tasks
    (xpar.config.cluster.submitit_task_problems)."""
    from hydra.core.global_hydra import GlobalHydra

    jobs, _ = job_overrides(config)
    loader = GlobalHydra.instance().config_loader()
    bad = []
    for num, overrides in enumerate(jobs):
        cfg = loader.load_sweep_config(master_config=config, sweep_overrides=overrides)
        with_hydra = OmegaConf.to_container(cfg, resolve=False)
        with_hydra.pop("hydra", None)
        job = OmegaConf.create(with_hydra)
        tasks = submitit_task_problems(config.hydra.launcher, job)
        try:
            check_run(job)
        except ConfigError as e:
            bad.append((num, overrides, tasks + e.problems))
            continue
        if tasks:
            bad.append((num, overrides, tasks))
    return bad


def _sweep_dir(config: DictConfig) -> Path:
    d = Path(config.hydra.sweep.dir)
    return d if d.is_absolute() else Path(config.hydra.runtime.cwd) / d


class SweepCallback(Callback):
    """Pre-flight validation and MLflow parent/child grouping for ``-m`` sweeps."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if str(config.hydra.launcher.get("_target_", "")).endswith("SlurmLauncher"):
            announce_submissions()  # each job's SLURM id and log file, sbatch's refusal in one line
        bad = preflight(config)
        skip = bool(OmegaConf.select(config, "sweep.skip_invalid", default=False))
        if bad:
            lines = [f"  - job {n} ({' '.join(o)}): {p}" for n, o, probs in bad for p in probs]
            verb = "skipping" if skip else "stopping before any job runs:"
            print(f"xpar: pre-flight found {len(bad)} invalid job(s); {verb}\n" + "\n".join(lines),
                  file=sys.stderr)
            if not skip:
                print("  (set sweep.skip_invalid=true to run the valid jobs and skip these)", file=sys.stderr)
                raise SystemExit(2)
        if not OmegaConf.select(config, "tracking.enabled", default=True):
            return
        from xpar.track.parent_run import open_parent_run  # lazy: pandas (xpar.LAZY_IMPORTS)

        bound_http()
        sweep_dir = _sweep_dir(config)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        sweep_id = uuid.uuid4().hex[:8]
        jobs, exact = job_overrides(config)
        try:
            info = open_parent_run(config, sweep_id, n_jobs=len(jobs) if exact else None, invalid=bad)
        except Exception as e:  # Hydra would only warn; say it plainly and record jobs unparented
            print(f"xpar: could not open the sweep's MLflow parent run ({type(e).__name__}: {e}); "
                  f"each job is still recorded as its own run.", file=sys.stderr)
            return
        info["varying"] = varying_keys(jobs)  # named first in each child's run name
        self._file = sweep_dir / SWEEP_FILE.format(sweep_id)
        self._file.write_text(json.dumps(info))
        # Jobs re-resolve ${now:...} in hydra.sweep.dir; the environment (inherited by
        # launcher subprocesses such as submitit's) carries the one true location.
        os.environ[SWEEP_ENV] = str(self._file)
        logs = OmegaConf.select(config, "hydra.launcher.submitit_folder", default=None)
        if logs:  # submitit: every task's stdout/stderr lands there; the SLURM launcher prints each job's
            where = str(logs).replace("/%j", "").rstrip("/")  # file once sbatch gave its id (xpar.track.slurm)
            print(f"xpar: sweep {sweep_id}: each job's task logs go under {where}", file=sys.stderr)
        atexit.register(finish_sweep, self._file)
        _sigterm_interrupts()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if getattr(self, "_file", None) is not None:
            finish_sweep(self._file)


def _sigterm_interrupts() -> None:
    """SIGTERM to the sweep's process acts as Ctrl-C: the job running ends KILLED, then the parent
    run (xpar.__main__ marks the sweep interrupted; :func:`finish_sweep` at exit) with the jobs that
    never started counted. Python's default SIGTERM ended the process with no exit handler: the
    parent run stayed RUNNING forever."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)


def sweep_tags(sweep: Optional[dict]) -> dict:
    """The tags that make a job's run a child of its sweep's parent run (xpar.track.sweep): parent run,
    sweep id, job number, the job's overrides; {} outside a sweep or without a parent run."""
    if not sweep or not sweep.get("parent_run_id"):
        return {}
    return {"mlflow.parentRunId": sweep["parent_run_id"], "xpar.sweep_id": sweep["sweep_id"],
            "xpar.job_num": str(sweep["job_num"]), "xpar.overrides": " ".join(sweep["overrides"])[:5000]}


def current_sweep() -> Optional[dict]:
    """Inside a multirun job: the sweep's parent-run info plus this job's number and
    overrides; None in a single run."""
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    f = os.environ.get(SWEEP_ENV)
    found = [Path(f)] if f else sorted(Path(hc.runtime.output_dir).parent.glob(SWEEP_FILE.format("*")))
    info = json.loads(found[0].read_text()) if len(found) == 1 and found[0].is_file() else {}
    info.update(job_num=int(hc.job.num), overrides=list(hc.overrides.task))
    return info


_INTERRUPTED = []


def mark_interrupted() -> None:
    """The sweep was interrupted (Ctrl-C): its parent run ends KILLED."""
    _INTERRUPTED.append(True)


def finish_sweep(sweep_file: Path) -> None:
    """Summarise the sweep on its parent run and end it (FINISHED; FAILED when a child failed
    or a job is missing; KILLED after Ctrl-C). Safe to call twice."""
    from xpar.track.parent_run import close_parent_run, print_sweep_summary  # lazy: pandas (xpar.LAZY_IMPORTS)

    sweep_file = Path(sweep_file)
    if sweep_file.is_file():
        info = json.loads(sweep_file.read_text())
        summary = close_parent_run(info, sweep_file.parent, interrupted=bool(_INTERRUPTED))
        if summary is not None:
            print_sweep_summary(info, summary)
