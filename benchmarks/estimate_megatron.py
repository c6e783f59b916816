"""The cost model against Narayanan et al. 2021 Table 1 (Megatron-LM, GPT on A100-80GB).

    python benchmarks/estimate_megatron.py [path/to/megatron_2021_table1.csv]

Prints, per row, the layout, the published and predicted TFLOP/s per GPU (hardware FLOPs,
full recompute counted, as the paper), the error, and where the predicted step time goes.
Assumptions (micro-batch size 1, v = smallest divisor > 1 of layers per rank, Megatron 2021
framework behaviour) are those of :func:`xpar.calibrate.published.megatron_2021_spec`.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from xpar.calibrate.published import megatron_2021_spec, read_table
from xpar.estimate.cost import Assumptions, estimate

DEFAULT = Path(__file__).resolve().parents[1] / "tests" / "data" / "megatron_2021_table1.csv"


def main(path: Path = DEFAULT) -> list[float]:
    table = Table(title="Cost model vs Megatron-LM 2021 Table 1 (TFLOP/s per GPU, hardware FLOPs)")
    for col in ("params (B)", "t x p x d", "v", "m", "paper", "model", "error", "matmul", "mem-bound",
                "tp", "pp", "bubble", "dp", "MFU"):
        table.add_column(col, justify="right")
    errors = []
    for row in read_table(path):
        spec = megatron_2021_spec(row)
        est = estimate(spec, Assumptions.megatron_2021())
        ref = float(row["tflops_per_gpu"])
        err = est.hw_tflops_per_device / ref - 1
        errors.append(err)
        share = {k: v / est.time_per_step_s for k, v in est.time_breakdown.items()}
        v = spec.layout.virtual_stages if spec.layout.schedule == "interleaved_1f1b" else 1
        table.add_row(row["params_b"], f"{spec.tp}x{spec.pp}x{spec.dp}", str(v), str(spec.micro_batches),
                      f"{ref:.0f}", f"{est.hw_tflops_per_device:.1f}", f"{100 * err:+.1f}%",
                      *(f"{100 * share[k]:.0f}%" for k in ("matmul", "memory_bound", "tp_comm", "pp_comm", "bubble")),
                      f"{100 * share['dp_comm_exposed']:.1f}%", f"{est.mfu:.2f}")
    console = Console()
    console.print(table)
    abs_err = [abs(e) for e in errors]
    console.print(f"median |error| {100 * statistics.median(abs_err):.1f}%   max |error| {100 * max(abs_err):.1f}%   "
                  f"mean error {100 * statistics.fmean(errors):+.1f}%")
    return errors


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT)
