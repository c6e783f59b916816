"""``xpar calibrate``: measure this machine into a hardware preset.

Everything is measured on ``workers`` local processes at once, as a run's workers compute and
communicate side by side (sharing cores, caches, memory bandwidth and the machine's other load).
Compute figures are the median over samples of step-length windows (:data:`STEP_WINDOW_S`), in
CPU seconds on a CPU with one thread per worker (:func:`compute_clock`: what the work costs a
core, whatever else the machine runs at the time; the estimate stretches a step for the share of
the cores its workers get); collectives the median over :data:`COLLECTIVE_REPS` calls, in wall
time, as a curve per collective and size (``ring_step_us_by_bytes``).

Design notes (what each step does and why, with sources): docs/concepts/design-notes.md.
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from xpar.calibrate.measure import MESSAGE_BYTES, QUICK_BYTES, measure_workers
from xpar.calibrate.preset import (
    fit_alpha_beta,
    fit_p2p_latency,
    preset_values,
    ring_step_curves,
    write_preset,
)
from xpar.config.presets import conf_dir
from xpar.config.hardware import CALIBRATED_PREFIX, host_memory_bytes
from xpar.estimate.preflight.check import HOST_MEMORY_USABLE, WORKER_BASELINE_BYTES
from xpar.run.fidelity import CONTENTION_SHARE, usable_cores
from xpar.track.runs import TrackingUnavailable, setup_experiment


def contention_warning(shares: dict, workers: int, threads: int, cores: int) -> Optional[str]:
    """The warning of a calibration measured under contention, or None: the mean CPU share the
    workers' threads had during the collectives (``shares``: by collective and size, fractions of 1,
    xpar.calibrate.measure.timed_share) below :data:`xpar.run.fidelity.CONTENTION_SHARE` of what
    ``workers`` x ``threads`` threads on ``cores`` cores allow: other load was calibrated in, and every
    estimate on the preset reads slower than this machine is."""
    values = [s for by_size in shares.values() for s in by_size.values() if isinstance(s, (int, float))]
    if not values:
        return None
    share, expected = sum(values) / len(values), min(1.0, cores / (workers * threads))
    if share >= CONTENTION_SHARE * expected:
        return None
    return (f"measured under contention: the workers had a core {share:.0%} of the time they wanted one, where "
            f"{workers} worker(s) x {threads} thread(s) on {cores} core(s) allow {expected:.0%}; other processes' "
            f"load is calibrated in (estimates on this preset read slower): calibrate again on a quieter machine")


def _log(result: dict, preset: Path, out_dir: Path, exp: str) -> str:
    """An MLflow run (tag xpar.mode=calibrate) in experiment ``exp`` with the preset's values as params,
    the raw curves as metrics and artifacts; its id."""
    import mlflow

    with mlflow.start_run(experiment_id=exp, run_name=f"calibrate {preset.stem}",
                          tags={"xpar.mode": "calibrate", "xpar.preset": preset.stem,
                                "xpar.contention": str(bool(result.get("contention"))).lower()}) as run:
        mlflow.log_params({f"hardware.{k}": v for k, v in result["preset"].items()})
        mlflow.log_metrics({f"calibrate/matmul_tflops_n{n}": r / 1e12 for n, r in result["matmul"].items()})
        mlflow.log_metric("calibrate/memory_bandwidth_tb_per_s", result["memory_bandwidth"] / 1e12)
        if result.get("block_s"):
            mlflow.log_metric("calibrate/reference_block_s", result["block_s"])
        mlflow.log_metric("calibrate/optimizer_ns_per_element", result["preset"]["optimizer_ns_per_element"])
        mlflow.log_metric("calibrate/sync_wait_us", result["preset"]["sync_wait_us"])
        mlflow.log_artifact(str(out_dir / "calibration.json"))
        mlflow.log_artifact(str(preset))
        return run.info.run_id


def calibrate(name: str, workers: int = 2, threads: int = 1, sizes=MESSAGE_BYTES, reps: int = 7,
              track: bool = True, out_dir: Path = Path("."), progress: bool = True, device: str = "cpu") -> dict:
    """Measure, fit, write the preset (and log it); returns what was measured and written.

    Raises:
        TrackingUnavailable: ``track`` and the store in this folder cannot be used; said before measuring."""
    import torch

    exp = setup_experiment(None, "xpar", None, Path.cwd()) if track else None
    measured = measure_workers(workers, sizes, reps, threads, device, progress=progress)
    coll, compute = measured["collectives"], measured["compute"]
    matmul, bandwidth, host = compute["matmul"], compute["memory_bandwidth"], compute["host"]
    alpha, beta = fit_alpha_beta(coll, workers)
    values = preset_values(matmul, bandwidth, alpha, beta, device, host, compute.get("block_s"),
                           name=f"{CALIBRATED_PREFIX}{name}")
    values["optimizer_ns_per_element"] = compute["optimizer_ns_per_element"]
    values["sync_wait_us"] = measured["sync_wait_s"] * 1e6
    p2p = fit_p2p_latency(coll, beta)
    if p2p is not None:
        values["p2p_latency_us"] = p2p * 1e6
    values["ring_step_us_by_bytes"] = ring_step_curves(coll, workers)
    busy = contention_warning(measured["collective_shares"], workers, threads, usable_cores())
    if busy:
        print(f"xpar calibrate: warning: {busy}", file=sys.stderr, flush=True)
    header = [f"Measured by `xpar calibrate` on {socket.gethostname()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())},",
              f"torch {torch.__version__}, {threads} thread(s) per worker, collectives on {workers} "
              f"{'nccl GPUs' if device == 'cuda' else 'gloo workers'}.",
              f"Select it with hardware=calibrated_{name}; raw curves in calibration.json / the MLflow run."]
    header += [f"WARNING: {busy}"] if busy else []
    out_dir.mkdir(parents=True, exist_ok=True)
    staged = write_preset(name, values, header, conf=_staging(out_dir))  # logged; conf/ gets it only at the end
    result = {"preset_file": str(conf_dir() / "hardware" / staged.name), "preset": values, "matmul": matmul,
              "memory_bandwidth": bandwidth, "collectives": coll, "collective_shares": measured["collective_shares"],
              "alpha_s": alpha, "beta_bytes_per_s": beta, "host": host, "block_s": compute.get("block_s"),
              "contention": busy}
    (out_dir / "calibration.json").write_text(json.dumps(result, indent=1, default=str))
    if track:
        result["run_id"] = _log(result, staged, out_dir, exp)
    write_preset(name, values, header)  # last: a calibration that failed writes no preset
    return result


def _staging(out_dir: Path) -> Path:
    """A config-tree-shaped folder in ``out_dir`` (``<out_dir>/hardware/``) for the preset before it is final."""
    (out_dir / "hardware").mkdir(parents=True, exist_ok=True)
    return out_dir


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="xpar calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("target", nargs="?", default="hardware=local", help="hardware=local (the machine measured)")
    ap.add_argument("--name", default=socket.gethostname().split(".")[0].replace("-", "_"),
                    help="the preset's name: conf/hardware/calibrated_NAME.yaml, hardware=calibrated_NAME "
                         "(letters, digits, _; default: this host's name)")
    ap.add_argument("--workers", type=int, default=2, help="local processes for the collectives")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (as train.threads_per_worker)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: bf16 GEMMs, HBM, nccl")
    ap.add_argument("--quick", action="store_true", help=f"{len(QUICK_BYTES)} message sizes, five repetitions (a smoke test)")
    ap.add_argument("--no-track", action="store_true", help="do not log an MLflow run")
    ap.add_argument("--out", type=Path, default=Path("outputs") / "calibrate",
                    help="folder for calibration.json (the raw curves) and the staged preset (default: %(default)s)")
    return ap.parse_args(argv)


def worker_problems(workers: int, threads: int, host_bytes: int) -> list[str]:
    """Why ``--workers`` / ``--threads`` cannot be measured on a host of ``host_bytes`` bytes, one line each ([] where
    they can): at least 2 workers (the collectives) and 1 thread, and no more workers than a run takes on this host
    (xpar.estimate.preflight.check.host_memory_problem: WORKER_BASELINE_BYTES each within HOST_MEMORY_USABLE of its
    memory); 1000 workers on a 25 GB host ran out of memory and never ended."""
    if workers < 2 or threads < 1:
        return [f"--workers must be >= 2 and --threads >= 1, got {workers} and {threads}; e.g. --workers 2 --threads 1."]
    usable = HOST_MEMORY_USABLE * host_bytes
    most = int(usable // WORKER_BASELINE_BYTES)
    if workers <= most:
        return []
    return [f"--workers {workers} need ~{workers * WORKER_BASELINE_BYTES / 1e9:.1f} GB ({WORKER_BASELINE_BYTES / 1e9:.2f} "
            f"GB per process with torch), more than the {usable / 1e9:.1f} GB usable ({HOST_MEMORY_USABLE:.0%} of "
            f"{host_bytes / 1e9:.1f} GB host memory); use at most {most}, e.g. --workers {min(most, 8)} "
            f"(the workers of the runs the preset is for)."]


def _device_problems(device: str, workers: int) -> list[str]:
    """CUDA calibration needs a CUDA build of torch and one GPU per worker."""
    if device != "cuda":
        return []
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < workers:
        fix = f"--workers {n}" if n >= 2 else "--device cpu (collectives need two GPUs)"
        return [f"--device cuda needs {workers} GPUs (one per worker) in a CUDA build of torch; this machine "
                f"has {n} (torch {torch.__version__}). Use {fix}."]
    return []


def _interrupt(signum, frame) -> None:
    """SIGTERM as Ctrl-C: the workers are ended and one line says so (:func:`main`)."""
    raise KeyboardInterrupt


def main(argv: Optional[list[str]] = None) -> int:
    """``xpar calibrate [hardware=local] [--name N] [--workers W] [--threads T] [--quick]``."""
    import re

    args = _args(sys.argv[1:] if argv is None else argv)
    problems = []
    if args.target != "hardware=local":
        problems.append(f"xpar calibrate measures this machine: give hardware=local (or nothing), got {args.target!r}.")
    if not re.fullmatch(r"[A-Za-z0-9_]+", args.name):
        problems.append(f"--name must be letters, digits and _, got {args.name!r}; e.g. --name my_box.")
    problems += worker_problems(args.workers, args.threads, host_memory_bytes())
    problems += _device_problems(args.device, args.workers)
    if problems:
        print("xpar: invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return 2
    quick = dict(sizes=QUICK_BYTES, reps=5) if args.quick else {}
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        r = calibrate(args.name, args.workers, args.threads, track=not args.no_track, out_dir=args.out,
                      device=args.device, **quick)
    except KeyboardInterrupt:
        print("xpar: calibrate interrupted; workers ended, no preset written.", file=sys.stderr)
        return 130
    except TrackingUnavailable as e:
        print(f"xpar: calibrate measured nothing: {e.problem}. Repair or move aside the store in this folder, "
              f"or pass --no-track.", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 (a measurement, the store or the disk: one line, no preset)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"xpar: calibrate failed, no preset written: {first}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old_term)
    p = r["preset"]
    print(f"wrote {r['preset_file']}: peak {p['peak_tflops'] * 1e3:.1f} GFLOP/s per worker, memory "
          f"{p['hbm_tb_per_s'] * 1e3:.1f} GB/s, collectives alpha {r['alpha_s'] * 1e6:.1f} us/step, "
          f"beta {r['beta_bytes_per_s'] / 1e9:.2f} GB/s; use it with hardware=calibrated_{args.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
