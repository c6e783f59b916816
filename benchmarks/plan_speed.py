"""Speed of the planner's vectorised step time (xpar.estimate.columns.step_time.time_columns): layouts per second.

    python benchmarks/plan_speed.py [--repeats 5] [--model 175b] [--hardware a100_80gb_1024gpu]
                                    [--global-batch 1536] [--generator space|own] [--with-memory]

Candidates: the planner's own space (xpar.plan.space.enumerate_layouts at the fixed global batch,
default), or with ``--generator own`` every layout from this file's generator -- tp in 1..8 dividing the
heads, kv heads and the device count; pp dividing the layers and the devices left; dp the rest;
every schedule, v in {2, 3, 4, 6, 8} dividing the layers per rank for the looped ones (2 for the
V-shaped, 1 for the others and without pp); ZeRO 0-3 (the stage that runs, duplicates dropped); sp
with tp > 1; recompute none/selective/full (no selective with split-backward schedules, which
validation refuses); micro-batch b in 1, 2, 4, 8 at the global batch, m = B / (b dp) where the
schedule accepts it. Prints the layout count, the wall time of the imports and of the first call
(cold: bubble simulations and shapes memoised on the way), then layouts/s of repeated calls
(median of ``--repeats``, with min and max): the planner's steady state. The optimizer term needs
each layout's optimizer bytes: zeros, or with ``--with-memory`` from xpar.estimate.columns.peak_memory (timed apart).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

T0 = time.perf_counter()
import pathlib  # noqa: E402

import numpy as np  # noqa: E402

from xpar.config.presets import preset_dict  # noqa: E402

from xpar.config.layout import SCHEDULES, microbatch_ok, zero_stage_run  # noqa: E402
from xpar.plan.context import COLUMNS, PlanContext, spec_of  # noqa: E402
from xpar.estimate.columns.step_time import time_columns  # noqa: E402

IMPORTS_S = time.perf_counter() - T0
CONF = pathlib.Path(__file__).resolve().parents[1] / "conf"




def _stages(schedule: str, pp: int, layers: int) -> list[int]:
    kind = SCHEDULES[schedule].stages_per_rank
    if pp == 1 or kind == "1":
        return [1]
    options = [2] if kind == "2" else [2, 3, 4, 6, 8]
    return [v for v in options if layers % (pp * v) == 0]


def candidates(model: dict, world: int, global_batch: int) -> dict[str, np.ndarray]:
    """Every layout of the module docstring, as xpar.plan.context columns."""
    heads, layers = model["n_heads"], model["n_layers"]
    kv = model.get("n_kv_heads") or heads
    rows = set()
    for tp in (t for t in range(1, 9) if heads % t == 0 and kv % t == 0 and world % t == 0):
        for pp in (p for p in range(1, world // tp + 1) if (world // tp) % p == 0 and layers % p == 0):
            dp = world // (tp * pp)
            for schedule in (["gpipe"] if pp == 1 else list(SCHEDULES)):
                for v in _stages(schedule, pp, layers):
                    for b in (1, 2, 4, 8):
                        if global_batch % (b * dp) or not microbatch_ok(schedule, pp, global_batch // (b * dp)):
                            continue
                        for zero in {zero_stage_run(schedule, pp, z) for z in range(4)}:
                            for sp in ((False, True) if tp > 1 else (False,)):
                                recs = ("none", "full") if SCHEDULES[schedule].zero_bubble else ("none", "selective",
                                                                                                  "full")
                                for rec in recs:
                                    rows.add((tp, pp, dp, b, global_batch // (b * dp), v, schedule, zero, sp, rec))
    rows = sorted(rows)
    return {k: np.array([r[i] for r in rows]) for i, k in enumerate(COLUMNS)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="175b")
    ap.add_argument("--hardware", default="a100_80gb_1024gpu")
    ap.add_argument("--framework", default="xpar")
    ap.add_argument("--global-batch", type=int, default=1536)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--generator", choices=("space", "own"), default="space")
    ap.add_argument("--with-memory", action="store_true",
                    help="optimizer bytes from xpar.estimate.columns.peak_memory (timed apart); default zeros")
    args = ap.parse_args()
    ctx = PlanContext(model=preset_dict("model", args.model), hardware=preset_dict("hardware", args.hardware),
                      train={"dtype": "bf16"}, framework=preset_dict("framework", args.framework))
    world = int(ctx.hardware["devices_per_node"]) * int(ctx.hardware.get("nodes", 1))
    t = time.perf_counter()
    if args.generator == "space":
        from xpar.plan.space import Constraints, enumerate_layouts

        cols = enumerate_layouts(ctx.model, world, int(ctx.hardware["devices_per_node"]), ctx.model["seq_len"],
                                 Constraints(global_batch=(args.global_batch, args.global_batch))).cols
    else:
        cols = candidates(ctx.model, world, args.global_batch)
    gen_s = time.perf_counter() - t
    n = len(cols["tp"])
    base = spec_of(ctx, cols, 0)
    (opt, grads), mem_s = (_state_bytes(base, cols) if args.with_memory
                           else ((np.zeros(n), np.zeros(n)), "zeros (--with-memory not given)"))
    t = time.perf_counter()
    first = time_columns(base, cols, opt, None, grads)
    cold_s = time.perf_counter() - t
    runs = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        time_columns(base, cols, opt, None, grads)
        runs.append(time.perf_counter() - t)
    med = statistics.median(runs)
    best = int(np.argmin(first["time_per_step_s"]))
    print(f"{args.model} on {world} {args.hardware} ({args.framework}), B={args.global_batch}: {n} layouts "
          f"({args.generator} generator, {gen_s:.2f} s)")
    print(f"imports {IMPORTS_S:.2f} s; optimizer and gradient bytes {mem_s}; first call {cold_s:.2f} s "
          f"({n / cold_s:,.0f} layouts/s)")
    print(f"repeated: {n / med:,.0f} layouts/s (median of {len(runs)}: {med * 1e3:.1f} ms; "
          f"min {min(runs) * 1e3:.1f} ms, max {max(runs) * 1e3:.1f} ms)")
    print(f"fastest: {dict((k, cols[k][best].item()) for k in COLUMNS)} "
          f"{first['time_per_step_s'][best]:.2f} s/step, MFU {first['mfu'][best]:.3f}")
    print(f"wall time including imports: {time.perf_counter() - T0:.2f} s; torch imported: {'torch' in sys.modules}")


def _state_bytes(base, cols) -> tuple[tuple[np.ndarray, np.ndarray], str]:
    try:
        from xpar.estimate.columns.peak_memory import memory_columns
    except ImportError:
        return (np.zeros(len(cols["tp"])), np.zeros(len(cols["tp"]))), "zeros (no xpar.estimate.columns.peak_memory)"
    t = time.perf_counter()
    mem = memory_columns(base, cols)
    return (mem["memory_optimizer"], mem["memory_grads"]), f"from xpar.estimate.columns.peak_memory in {time.perf_counter() - t:.2f} s"


if __name__ == "__main__":
    main()
