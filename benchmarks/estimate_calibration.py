"""The cost model against every public source, fitted and held out (leave-one-source-out).

    python benchmarks/estimate_calibration.py [tests/data]

The few constants fitted are the matmul efficiencies, one per GPU family (hardware
``matmul_efficiency``), by :func:`xpar.calibrate.published.fit_efficiency` (median |error|); everything
else is physics with its source (NCCL's alpha-beta constants, datasheet bandwidths, framework
profiles). For each source it prints the median and max |error| with the constants fitted on
all sources ('calibration') and on all the *other* sources ('held out'): a family whose only
source is held out takes the A100 value, so the H100 row measures how the A100 fit transfers.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from xpar.calibrate import published as cal

DEFAULT = Path(__file__).resolve().parents[1] / "tests" / "data"


def _stats(errs: list[float]) -> tuple[float, float]:
    a = [abs(e) for e in errs]
    return statistics.median(a), max(a)


def main(data_dir: Path = DEFAULT) -> dict:
    cases = cal.load_cases(data_dir)
    res = cal.leave_one_source_out(cases)
    table = Table(title="Cost model vs public sources: |error| of the per-GPU throughput")
    for col in ("source", "rows", "GPU", "fit on all", "median", "max", "fit without it", "median (held out)",
                "max (held out)"):
        table.add_column(col, justify="right")
    for name, r in res.items():
        gpus = sorted({c[0] for c in cases[name]})
        cm, cx = _stats(r["calibration"])
        hm, hx = _stats(r["held_out"])
        table.add_row(name, str(len(cases[name])), " ".join(gpus), " ".join(f"{r['fit_all'][g]:.3f}" for g in gpus),
                      f"{100 * cm:.1f}%", f"{100 * cx:.1f}%", " ".join(f"{r['fit_without'][g]:.3f}" for g in gpus),
                      f"{100 * hm:.1f}%", f"{100 * hx:.1f}%")
    console = Console(width=160)
    console.print(table)
    for name, r in res.items():
        console.print(f"{name}: calibration errors {[f'{100 * e:+.1f}%' for e in r['calibration']]}; "
                      f"held out {[f'{100 * e:+.1f}%' for e in r['held_out']]}")
    for name in BREAKDOWN_SOURCES:
        console.print(_breakdown_table(name, cases[name], res[name]["fit_all"], data_dir))
    return res


BREAKDOWN_SOURCES = ("korthikanti_2022_table5", "smith_2022_mtnlg", "dgxc_nemo_h100_bf16")
"""Megatron-style tp x pp x dp checks whose rows are printed term by term (issue 9)."""


def _breakdown_table(name: str, cases: list, eff: dict, data_dir: Path) -> Table:
    """Per row of ``name``: layout, error and each time term's share of the estimated step."""
    from xpar.estimate.cost import TIME_TERMS
    rows = cal.read_table(Path(data_dir) / cal.SOURCES[name][0])
    table = Table(title=f"{name}: share of the estimated step by term (matmul efficiency as fitted)")
    for col in ("row", "gpus", "tp/pp/v", "error") + TIME_TERMS:
        table.add_column(col, justify="right")
    for row, case in zip(rows, cases):
        b = cal.breakdown(case, eff[case[0]])
        label = row.get("model") or f"{row['params_b']}B {row['mode']}"
        v = row.get("vp") or row.get("virtual_stages")
        table.add_row(label, row["gpus"], f"{row['tp']}/{row['pp']}/{v}", f"{100 * b['error']:+.1f}%",
                      *(f"{100 * b.get(t, 0.0):.1f}%" for t in TIME_TERMS))
    return table


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT)
