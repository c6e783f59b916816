"""Entry point: ``python -m xpar [overrides]`` and the ``xpar`` console script."""
from __future__ import annotations

import logging
import os
import sys
from functools import partial
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import xpar
from xpar.config.checks import ConfigError
from xpar.config.overrides import refuse_bad_overrides
from xpar.config.presets import conf_dir
import xpar.config.schema  # noqa: F401  (registers the schema)
from xpar.config.schema import SweepConfig
from xpar.help import print_help, plan_help_text, print_page
from xpar.plan.inputs import plan_argv
from xpar.run.exits import WorkerFailed, exit_worker
from xpar.run.job import SweepJobFailed, run_job
from xpar.track import side_process
from xpar.track.recorder import sync
from xpar.track.run_dir import claim_before_hydra
from xpar.track.runs import ignore_inherited_run, open_store, TrackingUnavailable, default_uri
from xpar.track.sweep import current_sweep, mark_interrupted

START_DIR = Path.cwd()


@hydra.main(version_base=None, config_path=str(conf_dir()), config_name="config")
def _hydra_main(cfg: DictConfig) -> Optional[float]:
    """One job; returns the value of ``sweep.metric`` (the objective for sweepers such as Optuna)."""
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    sweep = current_sweep()
    try:
        report = run_job(cfg, out_dir, START_DIR, sweep)
    except BrokenPipeError:  # whoever read stdout is gone (`xpar plan ... | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(141) from None
    except Exception as e:
        if sweep is not None:  # Hydra shows only the first failed job's error, at the end: say each one now
            logging.getLogger("xpar").error(f"job {sweep['job_num']} failed: {type(e).__name__}: {e}")
            if isinstance(e, (WorkerFailed, ConfigError, TrackingUnavailable)):  # a stated reason: no traceback
                raise SweepJobFailed(f"xpar: job {sweep['job_num']} failed: {type(e).__name__}: {e} "
                                     f"(its folder: {out_dir})") from None
        raise
    if report is None:  # a skipped invalid sweep job: None makes Optuna mark the trial FAIL (NaN crashed it)
        return None
    return report.metrics().get(cfg.sweep.metric)


def optuna_failure_rate(argv: list[str]) -> list[str]:
    """With the Optuna sweeper, ``hydra.sweeper.max_failure_rate`` from ``sweep.max_failure_rate``
    (unless given): the overrides to add. The plugin's own default, 0, ends the sweep at the
    first failed trial; xpar's goes on (failed and skipped trials are told to Optuna as FAIL)."""
    if not any(a.lstrip("+").startswith("hydra/sweeper=optuna") for a in argv) or \
            any(a.startswith("hydra.sweeper.max_failure_rate=") for a in argv):
        return []
    rate = next((a.split("=", 1)[1] for a in argv if a.startswith("sweep.max_failure_rate=")),
                SweepConfig.max_failure_rate)
    return [f"hydra.sweeper.max_failure_rate={rate}"]


def _sync(args: list[str]) -> int:
    """``xpar sync <run dir>...``: send what the journal kept (xpar.track.recorder.sync)."""
    if {"--help", "-h", "help"} & set(args):
        print("usage: xpar sync <run dir> [<run dir> ...]\n\nSend what each run's tracking journal "
              "(<run dir>/tracking_journal.jsonl) kept and the MLflow store has not taken; only adds what is "
              "missing.\nExit 0: all sent; 1: the store still fails; 2: no journal of a run there.")
        return 0
    if not args:
        print("xpar: invalid configuration:\n  - xpar sync needs a run's output directory, "
              "e.g. xpar sync outputs/<date>/<time>.", file=sys.stderr)
        return 2
    return max(sync(Path(a)) for a in args)


def tracking_on(argv: list[str]) -> bool:
    """Whether the overrides leave MLflow tracking on: the last ``tracking=<preset>`` or
    ``tracking.enabled=<bool>`` given decides (on by default)."""
    on = True
    for a in argv:
        key, _, value = a.lstrip("+").partition("=")
        if key == "tracking":
            on = value != "off"
        elif key == "tracking.enabled":
            on = value.strip().lower() not in ("false", "0", "no", "off", "n")
    return on


def sqlite_store(argv: list[str]) -> Optional[str]:
    """The SQLite tracking URI the overrides select (the default store in the start directory
    without ``tracking.uri``), for the helper to open while the plan is searched; None for any
    other store, an override Hydra cannot parse, and where this process opens the store before
    the plan is recorded (a multirun's parent run, ``plan.execute_top``'s runs): two processes
    building a new store at once break it (MLflow: "No such index ...")."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    executes = any(key == "plan.execute_top" and value not in ("0", "null")
                   for key, _, value in (a.partition("=") for a in argv))
    if executes or {"-m", "--multirun"} & set(argv):
        return None
    given = [a for a in argv if a.lstrip("+").startswith("tracking.uri=")]
    try:
        uri = OverridesParser.create().parse_overrides(given[-1:])[0].value() if given else None
    except Exception:  # noqa: BLE001 (refuse_bad_overrides says what is wrong with it)
        return None
    uri = uri or default_uri(START_DIR)
    return uri if isinstance(uri, str) and uri.startswith("sqlite:///") else None


def version_line() -> str:
    """``xpar --version``: xpar's version and those of the packages a run's figures depend on (torch,
    Hydra, MLflow), read from the installed distributions without importing them."""
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"
    return f"xpar {xpar.__version__} (torch {of('torch')}, hydra-core {of('hydra-core')}, mlflow {of('mlflow')})"


def _commands() -> None:
    """``xpar compare|help|sync|calibrate`` (run here, then exit) and ``xpar plan`` (its overrides
    become a run.mode=plan run's); anything else is left to Hydra."""
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "compare":
        from xpar.track.compare import main as compare_main  # lazy: pandas (xpar.LAZY_IMPORTS)
        raise SystemExit(compare_main(sys.argv[2:]))
    if command in ("--help", "-h", "help"):  # groups, presets, commands, where runs go
        print_help()
        raise SystemExit(0)
    if command == "sync":
        raise SystemExit(_sync(sys.argv[2:]))
    if command in ("--version", "-V"):  # Hydra's own --version printed "Hydra 1.3.8" and nothing of xpar
        print(version_line())
        raise SystemExit(0)
    if command == "calibrate":  # measure this machine into a hardware preset
        from xpar.calibrate.command import main as calibrate_main  # lazy: torch (xpar.LAZY_IMPORTS)
        raise SystemExit(calibrate_main(sys.argv[2:]))
    if command == "plan" and {"--help", "-h", "help"} & set(sys.argv[2:]):
        print_page(plan_help_text())
        raise SystemExit(0)
    if command == "plan":  # every layout ranked (xpar.plan): run.mode=plan
        sys.argv[1:] = plan_argv(sys.argv[2:])
        if tracking_on(sys.argv[1:]):
            uri = sqlite_store(sys.argv[1:])
            # imports MLflow (and opens or creates a SQLite store) on the other core while the plan is searched
            side_process.start(warm=None if uri is None else partial(open_store, uri))


def _before_hydra() -> None:
    """Commands, then refusals of bad overrides (exit 2), then the torchrun and Optuna arguments."""
    _commands()
    refuse_bad_overrides(sys.argv[1:])  # unknown groups, presets and keys, wrong types, output dir: exit 2
    rank = os.environ.get("RANK")
    if rank not in (None, "0") and "TORCHELASTIC_RUN_ID" in os.environ:
        # Only rank 0 writes .hydra/ and the job log; every rank shares one run dir.
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    if "TORCHELASTIC_RUN_ID" in os.environ and "XPAR_RUN_DIR" not in os.environ:
        os.environ["XPAR_RUN_DIR"] = f"outputs/torchrun-{os.environ['TORCHELASTIC_RUN_ID']}"
    extra, refused = claim_before_hydra(sys.argv[1:], START_DIR)  # a run owns its folder (xpar.track.run_dir)
    if refused:
        print(f"xpar: invalid configuration:\n  - {refused}", file=sys.stderr)
        raise SystemExit(2)
    sys.argv += extra + optuna_failure_rate(sys.argv[1:])


def _killed_runs() -> str:
    """What Ctrl-C left in MLflow, for its one line: the runs this process ended KILLED
    (xpar.track.runs.KILLED_RUNS: id, steps recorded, run folder), else the sweep's or none's."""
    runs = getattr(sys.modules.get("xpar.track.runs"), "KILLED_RUNS", [])
    if not runs:
        return "the MLflow run (if any) ended KILLED"
    return "; ".join(runs)


def interrupted_line(argv: list) -> str:
    """Ctrl-C's one line for the command ``argv`` (overrides as Hydra gets them): a plan that ran no layout for real
    (no run ended KILLED) has no workers and records nothing until it is done; anything else ended its workers."""
    runs = getattr(sys.modules.get("xpar.track.runs"), "KILLED_RUNS", [])
    if "run.mode=plan" in argv and not runs:
        return "xpar: interrupted; the plan stopped before its record: nothing was written to MLflow."
    return f"xpar: interrupted; workers ended, {_killed_runs()}."


def main() -> None:
    """``xpar compare ...`` compares recorded runs; ``xpar sync <run dir>`` sends what a run's
    journal kept to the store; ``xpar plan ...`` ranks every layout (run.mode=plan); anything else is a Hydra run: check
    preset names (exit 2 with the valid ones), then hand over to Hydra. Ctrl-C ends with one line
    and exit 130."""
    ignore_inherited_run()  # xpar owns its MLflow runs: an inherited MLFLOW_RUN_ID is dropped, said in one line
    try:
        _before_hydra()
    except KeyboardInterrupt:
        print("xpar: interrupted before anything ran.", file=sys.stderr)
        raise SystemExit(130)
    try:
        _hydra_main()
    except KeyboardInterrupt:
        mark_interrupted()  # a sweep's parent run ends KILLED (xpar.track.sweep.finish_sweep, at exit)
        print(interrupted_line(sys.argv[1:]), file=sys.stderr)
        raise SystemExit(130)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # A torchrun rank that finished (results logged) skips interpreter finalization,
        # where gloo can abort the process (see xpar.run.exits.exit_worker).
        exit_worker()


if __name__ == "__main__":
    main()
