"""ZeRO-3 weak scaling and 3D against ZeRO-3 for GPT-3 175B, with the step-time breakdown.

    python benchmarks/estimate_scaling.py

Rows: GPT-3 175B with ZeRO-3 and no tp/pp on 384, 768, 1536 A100s at global batch 1536 (micro-
batch 4, 2, 1; full recompute), then TP8 x PP16 x DP8 (parallel=175b_1024gpu) against ZeRO-3 on
1024 GPUs, each on the Selene-class preset (8 x 200 Gb/s per node) and on a 4 x 100 Gb/s-per-node
fabric. Columns: model TFLOP/s per GPU and the share of the step of each term.
"""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from xpar.calibrate.published import make_spec, preset
from xpar.estimate.cost import TIME_TERMS, estimate, with_hardware

FABRICS = {"8x200G/node": {}, "4x100G/node": dict(inter_node_gb_per_s=12.5, nics_per_node=4)}


def _spec(gpus: int, tp: int, pp: int, b: int, m: int, schedule: str = "1f1b", v: int = 1):
    hw = preset("hardware", "a100_80gb_1024gpu")
    hw["nodes"] = gpus // 8
    par = dict(name="x", dp="auto", tp=tp, pp=pp, zero_stage=3 if tp * pp == 1 else 0, micro_batches=m,
               schedule=schedule, virtual_stages=v, recompute="full")
    return make_spec(preset("model", "175b"), par, hw, dict(micro_batch_size=b, global_batch_size="auto", dtype="bf16"))


def main() -> None:
    layouts = [(f"ZeRO-3 dp{n} b{1536 // n}", _spec(n, 1, 1, 1536 // n, 1)) for n in (384, 768, 1536)]
    layouts += [("ZeRO-3 dp1024 b1", _spec(1024, 1, 1, 1, 1)),
                ("TP8 PP16 DP8 (175b_1024gpu)", _spec(1024, 8, 16, 1, 192, "interleaved_1f1b", 2))]
    table = Table(title="GPT-3 175B on A100: model TFLOP/s per GPU and step-time shares")
    for col in ("layout", "fabric", "TFLOP/s", *TIME_TERMS):
        table.add_column(col, justify="right")
    for fabric, kw in FABRICS.items():
        for label, spec in layouts:
            e = estimate(with_hardware(spec, **kw))
            table.add_row(label, fabric, f"{e.tflops_per_device:.1f}",
                          *(f"{100 * e.time_breakdown[k] / e.time_per_step_s:.1f}%" for k in TIME_TERMS))
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
