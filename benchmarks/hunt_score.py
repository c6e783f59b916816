"""Re-score a held-out hunt: each command of a hunt's Runs table (benchmarks/refusal_hunt*.md), built as the CLI
builds it (Hydra composition, :func:`xpar.estimate.preflight.check.check_run`: validation and the memory check),
estimated, and set against the published figure of a sidecar csv (benchmarks/hunt<N>_published.csv).

    python benchmarks/hunt_score.py --hunt benchmarks/refusal_hunt2.md [--rows 1,2] [--published FILE] [--recipe]
                                    [--set KEY=VALUE ...]

``--recipe``: each row's command with what its source's recipe ran that the typed command leaves out
(benchmarks/hunt_recipes.py); ``--set``: overrides appended to every row's command (as benchmarks/plan_heldout.py).

Sidecar columns: ``row`` (the Runs table's #), ``metric``, ``published``, ``memory_gib`` (published peak per GPU in
GiB, blank if none), ``flops_per_token`` (the source's own FLOPs per token, forward and backward, where it counts
FLOPs otherwise than xpar's model FLOPs; blank: xpar's count), ``peak_tflops`` (the source's peak for an MFU in its
own count), ``note``, and optionally ``seen`` (what of the run tests/data or an earlier hunt holds -- the model and
GPU count at another release, layout or precision; blank: strictly fresh). Metrics and their signed error:

- ``tokens_per_s_gpu``: xpar's tokens/s per GPU / published - 1;
- ``step_s``: published step / xpar's step - 1 (positive: xpar too fast, as for throughput);
- ``model_tflops_gpu_full_attention``: xpar's model TFLOP/s per GPU (the full s x s attention square) / published - 1;
- ``model_tflops_gpu``: xpar's tokens/s per GPU x ``flops_per_token`` / published - 1 (the source's count);
- ``mfu``: xpar's MFU (its count, the preset's peak) or, with ``flops_per_token`` and ``peak_tflops``, xpar's
  tokens/s per GPU x flops_per_token / peak, against the published MFU.

Memory error: xpar's peak (GiB) / published - 1. Medians of |error| and signed, over all rows, dense, MoE (the
model has experts), FP8 (train.dtype fp8), CP (cp > 1), small rows (fewer than :data:`SMALL_PARAMS` parameters,
issue 42's small-model class: steps priced mostly by per-kernel and memory-bound costs) and, where the sidecar has a
``seen`` column, the strictly fresh rows (``seen`` blank). A row whose command is
refused is listed with the refusal's first line; one refused only for memory is scored and marked. One process.
"""
from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
import time
from pathlib import Path

from xpar.config.checks import ConfigError
from xpar.config.validate import validate
from xpar.estimate.cost import assumptions_for, estimate
from xpar.estimate.preflight.check import check_run
from xpar.models.shapes import param_count
from xpar.plan.verify import compose_line

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hunt_recipes import checked_sets, recipe_overrides, with_overrides  # noqa: E402 (a sibling script)

HERE = Path(__file__).resolve().parent
GIB = 2 ** 30
SMALL_PARAMS = 2e9
"""A model under this many parameters (total, experts included) is a 'small' row: issue 42's small models and the
hunts' briefs ('small models (< 2B params)')."""
METRICS = ("tokens_per_s_gpu", "step_s", "model_tflops_gpu_full_attention", "model_tflops_gpu", "mfu")


def refuse(line: str) -> None:
    """Bad input: ``line`` on stderr, exit code 2 (the project's rule for bad input).

    Raises:
        SystemExit: always, code 2."""
    print(f"hunt_score: {line}", file=sys.stderr)
    raise SystemExit(2)


def runs_table(path: Path) -> list[tuple[int, str, str]]:
    """(row number, run, command) of every row of the hunt's Runs table that has a command, accepted or not."""
    out = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.split(" | ")]
        if len(cells) < 6 or not cells[0].lstrip("| ").isdigit():
            continue
        m = re.search(r"`(python -m xpar [^`]+)`", cells[3])
        if m:
            out.append((int(cells[0].lstrip("| ")), cells[1], m.group(1)))
    return out


def sidecar_for(hunt: Path) -> Path:
    """benchmarks/refusal_hunt<N>.md -> benchmarks/hunt<N>_published.csv (N = 1 for refusal_hunt.md)."""
    n = re.sub(r"\D", "", hunt.stem) or "1"
    return hunt.parent / f"hunt{n}_published.csv"


def published(path: Path) -> dict[int, list[dict]]:
    """Sidecar rows by hunt row number (a row may carry several metrics); {} if there is no sidecar.

    Raises:
        SystemExit: code 2, a metric not in :data:`METRICS` (one line, the valid ones)."""
    if not path.exists():
        return {}
    out: dict[int, list[dict]] = {}
    for r in csv.DictReader(path.open()):
        if r["metric"] not in METRICS:
            refuse(f"{path.name} row {r['row']}: metric {r['metric']!r}; values that work: {', '.join(METRICS)}")
        out.setdefault(int(r["row"]), []).append(r)
    return out


def build(command: str):
    """(spec, refusal): the spec as the CLI builds it, and the first refusal line (None if accepted). A command
    refused only by the memory check is still built (its spec, the refusal); one refused by validation or by
    Hydra's composition (an unknown group, preset or key) gives (None, refusal)."""
    try:
        cfg = compose_line(command)
    except Exception as e:  # noqa: BLE001 (Hydra's composition errors: an unknown group, preset or key)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    try:
        return check_run(cfg), None
    except ConfigError as e:
        first = e.problems[0].splitlines()[0]
        try:
            return validate(compose_line(command)), "memory: " + first
        except ConfigError:
            return None, first


def xpar_figure(metric: str, est, pub: dict) -> float:
    """xpar's figure of ``metric`` (module docstring), in the published figure's unit."""
    fpt = float(pub["flops_per_token"]) if pub.get("flops_per_token") else None
    direct = {"tokens_per_s_gpu": "tokens_per_s_per_device", "step_s": "time_per_step_s",
              "model_tflops_gpu_full_attention": "tflops_per_device"}
    if metric in direct:
        return getattr(est, direct[metric])
    if metric == "model_tflops_gpu":
        return est.tokens_per_s_per_device * fpt / 1e12 if fpt else est.tflops_per_device
    if fpt and pub.get("peak_tflops"):
        return est.tokens_per_s_per_device * fpt / (float(pub["peak_tflops"]) * 1e12)
    return est.mfu


def signed_error(metric: str, xpar: float, pub: float) -> float:
    """Positive when xpar is too fast: throughput-like xpar / published - 1, step times published / xpar - 1."""
    return pub / xpar - 1 if metric == "step_s" else xpar / pub - 1


def score_row(num: int, name: str, command: str, pubs: list[dict]) -> dict:
    """The row's figures: kinds (dense/MoE, FP8, CP), refusal, xpar's step and peak, and per published metric
    (xpar, published, error); the memory error where a peak is published."""
    spec, refusal = build(command)
    row = dict(num=num, name=name, refusal=refusal, scores=[], mem=None, seen=seen_of(pubs))
    if spec is None:
        return row
    est = estimate(spec, assumptions_for(spec))
    row.update(moe=bool(spec.model.n_experts), fp8=spec.train.dtype == "fp8", cp=spec.cp > 1,
               small=param_count(spec.model).total < SMALL_PARAMS,
               step=est.time_per_step_s, tok=est.tokens_per_s_per_device, peak=est.memory.total / GIB)
    for p in pubs:
        x, v = xpar_figure(p["metric"], est, p), float(p["published"])
        row["scores"].append((p["metric"], v, x, signed_error(p["metric"], x, v)))
        if p.get("memory_gib"):
            row["mem"] = (float(p["memory_gib"]), row["peak"], row["peak"] / float(p["memory_gib"]) - 1)
    return row


def seen_of(pubs: list[dict]) -> str | None:
    """The row's ``seen`` text from its sidecar rows ('' when blank: strictly fresh); None when the sidecar has no
    ``seen`` column (the row is then in no fresh/seen group)."""
    if not any("seen" in p for p in pubs):
        return None
    return next((p["seen"].strip() for p in pubs if (p.get("seen") or "").strip()), "")


def row_line(r: dict) -> str:
    """One scored row as printed."""
    head = f"#{r['num']:<3} {r['name'][:44]:<44}"
    if "step" not in r:
        return f"{head} refused: {r['refusal'][:110]}"
    kinds = "".join(k for k, on in (("M", r["moe"]), ("F", r["fp8"]), ("C", r["cp"])) if on) or "D"
    kinds += "S" if r.get("small") else ""
    cells = [f"{m} {_num(v)} xpar {_num(x)} {100 * e:+.1f}%" for m, v, x, e in r["scores"]] or ["(no published figure)"]
    mem = f"  mem {r['mem'][0]:.1f} xpar {r['mem'][1]:.1f} GiB {100 * r['mem'][2]:+.1f}%" if r["mem"] else ""
    flag = f"  [{r['refusal'][:60]}]" if r["refusal"] else ""
    return f"{head} {kinds:<3} {r['step']:9.3f} s {r['tok']:9,.0f} tok/s {r['peak']:6.1f} GiB | " \
           + "; ".join(cells) + mem + flag


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.4g}"


def medians(rows: list[dict]) -> list[str]:
    """Median |error| and signed median of the first published metric per row: all, dense, MoE, FP8, CP, small
    (< :data:`SMALL_PARAMS` parameters), strictly fresh (where the sidecar has a ``seen`` column); memory."""
    scored = [r for r in rows if r["scores"]]
    groups = (("all", lambda r: True), ("dense", lambda r: not r["moe"]), ("MoE", lambda r: r["moe"]),
              ("FP8", lambda r: r["fp8"]), ("CP", lambda r: r["cp"]),
              ("MoE, FP8 or CP", lambda r: r["moe"] or r["fp8"] or r["cp"]),
              ("small (< 2B)", lambda r: r.get("small", False)))
    out = []
    for title, keep in groups:
        errs = [r["scores"][0][3] for r in scored if keep(r)]
        out.append(_median_line(title, errs, [r["num"] for r in scored if keep(r)]))
    if any(r.get("seen") is not None for r in scored):
        fresh = [r for r in scored if r.get("seen") == ""]
        out.append(_median_line("fresh (unseen)", [r["scores"][0][3] for r in fresh], [r["num"] for r in fresh]))
    mem = [r["mem"][2] for r in rows if r.get("mem")]
    out.append(_median_line("peak memory", mem, [r["num"] for r in rows if r.get("mem")]))
    return out


def _median_line(title: str, errs: list[float], nums: list[int]) -> str:
    if not errs:
        return f"{title:<15} no rows"
    return (f"{title:<15} n={len(errs):<3} median |error| {100 * statistics.median(abs(e) for e in errs):5.1f} %  "
            f"signed {100 * statistics.median(errs):+6.1f} %  max |error| {100 * max(abs(e) for e in errs):5.1f} %  "
            f"rows {','.join(map(str, nums))}")


def row_set(text: str) -> set[int]:
    """``--rows``: '1,4,7-9' -> {1, 4, 7, 8, 9}.

    Raises:
        SystemExit: code 2, a part that is not a number or a range (one line)."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if not lo.strip().isdigit() or (hi and not hi.strip().isdigit()):
            refuse(f"--rows {text}: {part!r} is not a row number; values that work: 1,4 or 1-19")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hunt", type=Path, required=True, help="a hunt's markdown (its Runs table)")
    ap.add_argument("--rows", help="row numbers, e.g. 1,4,7-9 (default: every row with a command)")
    ap.add_argument("--published", type=Path, help="the sidecar csv (default: benchmarks/hunt<N>_published.csv)")
    ap.add_argument("--recipe", action="store_true", help="add what each row's recipe ran (benchmarks/hunt_recipes.py)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="an override appended to every row's command")
    args = ap.parse_args()
    sets = checked_sets(args.set, "hunt_score")
    if not args.hunt.exists():
        refuse(f"--hunt {args.hunt}: no such file; values that work: "
               + ", ".join(str(p.relative_to(HERE.parent)) for p in sorted(HERE.glob("refusal_hunt*.md"))))
    pubs = published(args.published or sidecar_for(args.hunt))
    wanted = row_set(args.rows) if args.rows else None
    t0, rows, changed = time.perf_counter(), [], []
    print("#    run                                          kind   xpar step  tokens/s/GPU  peak | published "
          "metric, figure, xpar's, signed error (D dense, M MoE, F FP8, C CP, S small)")
    for num, name, command in runs_table(args.hunt):
        if wanted is None or num in wanted:
            extra = (recipe_overrides(args.hunt, num) if args.recipe else ()) + sets
            rows.append(score_row(num, name, with_overrides(command, extra), pubs.get(num, [])))
            print(row_line(rows[-1]), flush=True)
            changed += [f"#{num} " + " ".join(extra)] if extra else []
    print("".join(f"\nwith {c}" for c in changed))
    print(f"\n{len(rows)} rows, {time.perf_counter() - t0:.0f} s; medians of the first published metric per row:")
    print("\n".join(medians(rows)))


if __name__ == "__main__":
    main()
