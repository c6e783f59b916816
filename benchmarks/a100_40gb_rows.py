"""The refusal hunt's A100-40GB rows (benchmarks/refusal_hunt.md) before and after the 40 GB presets (issue 43).

    python benchmarks/a100_40gb_rows.py   (prints a markdown table)

Each row: the hunt's command ('before': the 80GB preset with hardware.device_memory_gb=40 and the profile it
typed) and the command its source supports ('after': conf/hardware/a100_40gb_*.yaml or p4d_24xlarge_node.yaml,
the NICs the source states, the framework profile of the trainer it names), estimated as `python -m xpar
run.mode=estimate` does (composed by Hydra, validated, memory-checked), against the published figure.
Published figures of kind 'wall' are whole-run averages (tokens over wall-clock GPU time: restarts, evaluation and
checkpoints included): a lower bound of the step rate, not an error target. The rows and their sources are in
tests/data/a100_40gb_published.csv (read by no loader: no fit moves).
"""
from __future__ import annotations

import argparse
import csv
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from xpar.config.checks import ConfigError  # noqa: E402
from xpar.estimate.cost import estimate  # noqa: E402
from xpar.estimate.preflight.check import check_run  # noqa: E402
from xpar.plan.verify import compose_line  # noqa: E402

ROWS = REPO / "tests" / "data" / "a100_40gb_published.csv"
METRIC = {"hw_tflops": "hw_tflops_per_device", "model_tflops": "tflops_per_device",
          "tokens_per_s_per_gpu": "tokens_per_s_per_device", "mfu": "mfu"}
"""Published metric (csv column ``metric``) -> the Estimate's field."""


def figure(overrides: str, metric: str):
    """(value of ``metric``, step seconds) of the estimate of ``overrides``, or (None, the refusal's first line)."""
    try:
        spec = check_run(compose_line("python -m xpar " + overrides))
    except ConfigError as e:
        return None, str(e).strip().splitlines()[0][:90]
    e = estimate(spec)
    return getattr(e, METRIC[metric]), e.time_per_step_s


def rows() -> list[dict]:
    with open(ROWS) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def line(row: dict) -> str:
    common = "run.mode=estimate tracking=off parallel.micro_batches=auto " + row["model_layout"]
    metric = row["metric"] or "tokens_per_s_per_gpu"  # no published figure: the rate shown
    pub = float(row["published"]) if row["published"] else None
    cells = [row["id"], f"{metric} {row['published'] or '-'} ({row['kind'] or '-'})"]
    for which in ("before", "after"):
        value, extra = figure(f"{common} {row[which]}", metric)
        if value is None:
            cells.append(f"refused: {extra}")
            continue
        err = f", {value / pub - 1:+.1%}" if pub else ""
        cells.append(f"{value:.4g} (step {extra:.2f} s{err})")
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print("| run | published | before (hunt's command) | after (preset, source's settings) |")
    print("|---|---|---|---|")
    for row in rows():
        print(line(row), flush=True)


if __name__ == "__main__":
    main()
