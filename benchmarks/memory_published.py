"""Published peak memory per device against the cost model's (issue 43's memory must-show on our own rows):
every run of tests/data with a published peak (known_runs.csv peak_gib, cp_fp8_h100.csv peak_memory_gib), its
estimate under its own framework profile, the error (estimate / published - 1: negative = xpar counts less than the
run allocated), and whether the source's figure is comparable to an eager run's peak (known_runs' peak_compare: torch's
reserved memory of a torch.compile or Float8 run is not what the model of eager bf16 kernels counts).

    python benchmarks/memory_published.py

Prints one line per run, then the median |error| and the runs more than 30 % below, over all rows and over the
comparable ones. Pure CPU, a few seconds.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from xpar.calibrate.known_runs import known_run_spec
from xpar.calibrate.cp_fp8 import cp_fp8_case
from xpar.calibrate.published import framework_assumptions, read_table
from xpar.estimate.cost import estimate
from xpar.estimate.memory import per_device as mem

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
GIB = 2 ** 30


def known_rows() -> list[dict]:
    """known_runs.csv rows with a published peak: id, framework, published and estimated GiB, comparable."""
    out = []
    for row in read_table(DATA / "known_runs.csv"):
        if not row["peak_gib"]:
            continue
        assume = framework_assumptions(row["framework"], recompute_layer_fraction=float(row["recompute_fraction"] or 1))
        est = mem.memory(known_run_spec(row), assume=assume)
        out.append(dict(id=row["id"], framework=row["framework"], published=float(row["peak_gib"]),
                        estimate=est.total / GIB, comparable=row["peak_compare"] == "yes"))
    return out


def cp_fp8_rows() -> list[dict]:
    """cp_fp8_h100.csv rows with a published peak whose layout the corpus builds (xpar.calibrate.cp_fp8.cp_fp8_case:
    torchtitan's nine H100-96GB FP8/CP rows, issue 42)."""
    out = []
    for row in read_table(DATA / "cp_fp8_h100.csv"):
        case = cp_fp8_case(row) if row["peak_memory_gib"] else None
        if case is None:  # no peak, another GPU or no full layout
            continue
        spec, assume, _, _ = case
        out.append(dict(id=row["id"], framework=assume.name, published=float(row["peak_memory_gib"]),
                        estimate=estimate(spec, assume).memory.total / GIB, comparable=False))
    return out


def summary(rows: list[dict], label: str) -> str:
    """Median |error|, the worst underestimate and the count more than 30 % below, of ``rows``."""
    errors = [r["estimate"] / r["published"] - 1 for r in rows]
    if not errors:
        return f"{label}: no rows"
    below = sum(e < -0.30 for e in errors)
    return (f"{label}: {len(errors)} runs, median |error| {100 * statistics.median(map(abs, errors)):.1f} %, "
            f"lowest {100 * min(errors):+.1f} %, {below} more than 30 % below")


def main() -> None:
    rows = known_rows() + cp_fp8_rows()
    print(f"{'run':<42} {'framework':<16} {'published':>9} {'estimate':>9} {'error':>7}  comparable")
    for r in rows:
        err = r["estimate"] / r["published"] - 1
        print(f"{r['id']:<42} {r['framework']:<16} {r['published']:>7.1f}Gi {r['estimate']:>7.1f}Gi "
              f"{100 * err:>+6.1f}%  {'yes' if r['comparable'] else 'no'}")
    print(summary(rows, "all"))
    print(summary([r for r in rows if r["comparable"]], "comparable (eager bf16)"))


if __name__ == "__main__":
    main()
