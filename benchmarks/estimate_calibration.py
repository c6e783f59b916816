"""The cost model against every public source, fitted and held out (leave-one-source-out).

    python benchmarks/estimate_calibration.py [tests/data] [--markdown docs/accuracy/published.md]

``--markdown`` also writes the table as the documentation's accuracy page (generated, never typed).

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
    for line in layer_overhead_lines(cases, res):
        console.print(line)
    for name in BREAKDOWN_SOURCES:
        console.print(_breakdown_table(name, cases[name], res[name]["fit_all"], data_dir))
    return res


OVERHEAD_SOURCES = ("bigscience_bloom_2022", "smith_2022_mtnlg")
"""Megatron-DeepSpeed's runs: the cost per layer and micro-batch (framework.layer_overhead_ms) fitted on each, checked on the other."""


def layer_overhead_lines(cases: dict, res: dict) -> list[str]:
    """Megatron-DeepSpeed's ``layer_overhead_ms`` fitted on one of :data:`OVERHEAD_SOURCES` (at the
    all-source A100 efficiency), each source's median |error| with it, and without any."""
    from dataclasses import replace
    eff = res[OVERHEAD_SOURCES[0]]["fit_all"]["A100"]

    def median_error(name: str, ms: float) -> float:
        moved = [(g, sp, replace(a, layer_overhead_ms=ms), r, m) for g, sp, a, r, m in cases[name]]
        return 100 * statistics.median(abs(e) for e in cal.errors(moved, eff))
    out = []
    for fitted_on in OVERHEAD_SOURCES:
        ms = cal.fit_layer_overhead(cases[fitted_on], eff)
        got = ", ".join(f"{n} {median_error(n, 0.0):.1f}% -> {median_error(n, ms):.1f}%" for n in OVERHEAD_SOURCES)
        out.append(f"Megatron-DeepSpeed layer_overhead_ms fitted on {fitted_on}: {ms} ms; median |error| without -> with: {got}")
    return out


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


def markdown(res: dict, cases: dict) -> str:
    """The leave-one-source-out table as the docs' accuracy page (docs/accuracy/published.md)."""
    import datetime

    import torch
    lines = ["# Accuracy against published runs", "",
             f"Generated by `python benchmarks/estimate_calibration.py --markdown docs/accuracy/published.md` "
             f"on {datetime.date.today()} (torch {torch.__version__.split('+')[0]}); the public rows and their "
             "sources are in `tests/data/`. |error| of the per-GPU throughput, with the matmul efficiency "
             "fitted on all sources ('fit on all') and on all the *other* sources ('held out': a family "
             "whose only source is held out takes the A100 value).", "",
             "Held out first: the figure a source the fit never saw gets.", "",
             "| source | rows | GPU | median (held out) | max (held out) | fit without it | median (fit on all) | max "
             "(fit on all) | fit on all |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        gpus = sorted({c[0] for c in cases[name]})
        (cm, cx), (hm, hx) = _stats(r["calibration"]), _stats(r["held_out"])
        fit_all = " ".join(f"{r['fit_all'][g]:.3f}" for g in gpus)
        fit_without = " ".join(f"{r['fit_without'][g]:.3f}" for g in gpus)
        lines.append(f"| {name} | {len(cases[name])} | {' '.join(gpus)} | {100 * hm:.1f}% | {100 * hx:.1f}% | {fit_without} "
                     f"| {100 * cm:.1f}% | {100 * cx:.1f}% | {fit_all} |")
    lines += ["", "The one other fitted constant, Megatron-DeepSpeed's cost per layer and micro-batch "
              "(`framework.layer_overhead_ms`, conf/framework/deepspeed_bloom.yaml), fitted on each of its two sources "
              "and checked on the other (bigscience_bloom_2022's row above uses the value fitted on it; held out, "
              "the second line's):", ""] + [f"- {x}" for x in layer_overhead_lines(cases, res)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", nargs="?", type=Path, default=DEFAULT)
    ap.add_argument("--markdown", type=Path, help="also write the table as this markdown page")
    args = ap.parse_args()
    result = main(args.data)
    if args.markdown:
        args.markdown.write_text(markdown(result, cal.load_cases(args.data)))
