"""The cost model against published training runs on the GPUs of 2025-26 (tests/data/blackwell_published.csv:
Megatron-Bridge's B200/GB200 rows with same-release H100 controls, torchtitan's H200 rows; issue 42): per row the
published and the estimated tokens/s per GPU and the signed error (positive: the estimate is faster), then the median
signed and |error| per GPU, per dense/MoE and per BF16/FP8. No row of this file is read by a fit
(xpar/calibrate/published.py SOURCES). Each FP8 row is priced with the recipe its note states
(:func:`recipe_of`, ``train.fp8_recipe``), beside the default recipe's figure (``before``), and the medians
are given per recipe group.

    python benchmarks/estimate_blackwell.py [--hardware GPU=field=value ...]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from xpar.calibrate.cp_fp8 import NEW_GPU_PRESETS, cp_fp8_case, published_figure  # noqa: E402
from xpar.calibrate.published import read_table  # noqa: E402
from xpar.estimate.cost import estimate  # noqa: E402

DATA = REPO / "tests" / "data" / "blackwell_published.csv"

RECIPE_OF_LABEL = {"FP8-CS": "current", "FP8": "current", "FP8-MX": "mxfp8", "MXFP8": "mxfp8"}
"""Megatron-Bridge's precision labels as train.fp8_recipe: its performance configs have two FP8 variants,
FP8_CS (current scaling) and FP8_MX (MXFP8) (scripts/performance/configs/llama3/llama3_workload_base_configs.py:
the 26.04.01 page's 'FP8' rows are the FP8_CS layouts, e.g. GB200 70B Megatron-FSDP at micro-batch 2)."""


def recipe_of(row: dict, label: str) -> str:
    """The FP8 recipe a row states: Megatron-Bridge's label (:data:`RECIPE_OF_LABEL`), torchao's 'tensorwise'
    (dynamic per-tensor scaling: an amax pass, then the cast) as ``current``; '' for a BF16 row."""
    if row["dtype"] != "fp8":
        return ""
    if "tensorwise" in row["note"]:
        return "current"
    return RECIPE_OF_LABEL[label]


def rows(overrides: dict = None) -> list[dict]:
    """Per row of :data:`DATA`: id, gpu, kind (dense/MoE), dtype, precision label, recipe, published and
    estimated tokens/s per GPU (``before``: at the default recipe, ``estimate``: at the row's), signed errors.
    ``overrides``: {gpu prefix: {hardware field: value}} (what-if checks)."""
    out = []
    for row in read_table(DATA):
        spec, assume, metric, published = cp_fp8_case(row, NEW_GPU_PRESETS)
        gpu = next(g for g in ("GB200", "B200", "H200", "H100") if row["gpu"].startswith(g))
        if overrides and gpu in overrides:
            spec = replace(spec, hardware=replace(spec.hardware, **overrides[gpu]))
        note = row["note"]
        label = note.split("precision '")[1].split("'")[0] if "precision '" in note else row["dtype"].upper()
        recipe = recipe_of(row, label)
        before = published_figure(estimate(spec, assume), spec, metric)
        if recipe:
            spec = replace(spec, train=replace(spec.train, fp8_recipe=recipe))
        got = published_figure(estimate(spec, assume), spec, metric)
        out.append({"id": row["id"], "gpu": gpu, "kind": "MoE" if row["moe"] == "true" else "dense",
                    "dtype": row["dtype"], "precision": label, "recipe": recipe or "bf16", "published": published,
                    "before": before / published - 1, "estimate": got, "error": got / published - 1})
    return out


def medians(res: list[dict], key, column: str = "error") -> list[tuple[str, int, float, float]]:
    """(group, rows, median signed error, median |error|) per value of ``key`` (a function of a row), of
    ``column`` ('error' at the row's recipe, 'before' at the default)."""
    groups = {}
    for r in res:
        groups.setdefault(key(r), []).append(r[column])
    return [(g, len(e), statistics.median(e), statistics.median(abs(x) for x in e)) for g, e in sorted(groups.items())]


def report(res: list[dict]) -> str:
    """The per-row table and the medians, as Markdown."""
    lines = ["| row | GPU | kind | precision | recipe | published tok/s/GPU | estimate | error (default recipe -> "
             "row's) |", "|---|---|---|---|---|---:|---:|---:|"]
    lines += [f"| {r['id']} | {r['gpu']} | {r['kind']} | {r['precision']} | {r['recipe']} | {r['published']:,.0f} | "
              f"{r['estimate']:,.0f} | {r['before']:+.1%} -> {r['error']:+.1%} |" for r in res]
    lines += ["", "| recipe group | rows | median error before -> after | median abs(error) before -> after |",
              "|---|---:|---:|---:|"]
    key = lambda r: f"{r['gpu']} {r['kind']} {r['recipe']}"  # noqa: E731
    for (g, n, mb, ab), (_, _, ma, aa) in zip(medians(res, key, "before"), medians(res, key)):
        lines.append(f"| {g} | {n} | {mb:+.1%} -> {ma:+.1%} | {ab:.1%} -> {aa:.1%} |")
    lines += ["", "| group | rows | median error | median abs(error) |", "|---|---:|---:|---:|"]
    for name, key in (("GPU", lambda r: r["gpu"]), ("kind", lambda r: f"{r['gpu']} {r['kind']}"),
                      ("dtype", lambda r: f"{r['gpu']} {r['dtype']}")):
        lines += [f"| {g} | {n} | {m:+.1%} | {a:.1%} |" for g, n, m, a in medians(res, key)]
    blackwell = [r["error"] for r in res if r["gpu"] in ("B200", "GB200")]
    lines.append(f"| B200 + GB200 | {len(blackwell)} | {statistics.median(blackwell):+.1%} | "
                 f"{statistics.median(abs(x) for x in blackwell):.1%} |")
    return "\n".join(lines)


def parse_overrides(items: list[str]) -> dict:
    """``GPU=field=value`` strings as {gpu: {field: float}}."""
    out = {}
    for item in items:
        gpu, field, value = item.split("=")
        out.setdefault(gpu, {})[field] = float(value)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", nargs="*", default=[],
                    help="what-if: GPU=field=value, e.g. B200=sustained_efficiency=0.7")
    print(report(rows(parse_overrides(ap.parse_args().hardware))))
