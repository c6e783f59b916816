"""Run one layout N times (``python -m xpar`` subprocesses, tracking off) and print its
throughput's location and spread: tokens/s median, min-max and coefficient of variation.

    python benchmarks/repeat.py                              # parallel=dp, 5 runs
    python benchmarks/repeat.py --runs 5 parallel=zero3 train.steps=20

Each run's tokens/s is xpar's own (global tokens per step / median timed step time), read
from its ``ranks.json`` via :func:`xpar.track.report.summarize_measured` on the validated spec.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(overrides: list[str], out_dir: Path) -> float:
    """One ``python -m xpar`` run into ``out_dir``; its tokens/s."""
    from tests.conftest import (
        spec_for,  # the same composition and validation as the CLI
    )
    from xpar.track.report import summarize_measured

    cmd = [sys.executable, "-m", "xpar", "tracking=off", "run.progress=false",
           f"hydra.run.dir={out_dir}", *overrides]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    stats = json.loads((out_dir / "ranks.json").read_text())
    spec = spec_for(*overrides, local_devices=len(stats))
    return summarize_measured(spec, stats).tokens_per_s


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("overrides", nargs="*", default=["parallel=dp"])
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    rates = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            rates.append(run_once(args.overrides, Path(tmp) / f"run{i}"))
            print(f"run {i + 1}/{args.runs}: {rates[-1]:,.0f} tokens/s", flush=True)
    med, mean = statistics.median(rates), statistics.fmean(rates)
    cv = statistics.stdev(rates) / mean if len(rates) > 1 else 0.0
    print(f"{' '.join(args.overrides)}: tokens/s median {med:,.0f}, min-max {min(rates):,.0f}-"
          f"{max(rates):,.0f}, CV {cv:.1%} over {len(rates)} runs")
    return {"median": med, "min": min(rates), "max": max(rates), "cv": cv, "runs": rates}


if __name__ == "__main__":
    main()
