"""Several layouts of one MoE model on one cluster against xpar (issues 42, 44): each row's error, the order of a
model's layouts by xpar against the source's, the term that orders them wrongly, and where `xpar plan` ranks the
source's layouts.

    python benchmarks/moe_layouts.py [--plan]

Rows: tests/data/moe_layouts_h100.csv (a check-only source: no fit reads it) and the rows of
tests/data/cp_fp8_h100.csv named in :data:`SAME_TABLE` (the same published table), each estimated as
xpar.calibrate.cp_fp8.cp_fp8_case builds it; errors in the source's own figure (step time, or model TF/s in its
causal count: published_figure), signed (+: xpar faster). Per model and cluster: Spearman's rho and the share of
pairs xpar orders as the source does, over distinct layouts (a variant of a layout already listed, e.g. the same
layout with the all-to-all overlapped, is reported but not ranked: the loader prices no overlap); the most
discordant pair's time terms side by side. ``--plan``: the plan of the model, cluster, framework and global batch
(plan.* at their defaults, as benchmarks/plan_published.py) and the rank of each layout's degree group in it.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from xpar.calibrate.cp_fp8 import cp_fp8_case, published_figure
from xpar.calibrate.published import read_table
from xpar.estimate.compute.kernel_block import block_step_times, shape_of
from xpar.estimate.compute.kernels import device_of
from xpar.estimate.cost import estimate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_published import plan_of, row_figures  # noqa: E402 (a sibling script, not a package)

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
SAME_TABLE = ("zoo_qwen3_235b_bf16_256_seq4096_ep32",)
"""Rows of cp_fp8_h100.csv from the table moe_layouts_h100.csv continues (its first row, collected earlier)."""
LAYOUT_KEYS = ("tp", "pp", "vp", "cp", "ep", "etp", "dp", "zero", "micro_batch", "recompute")


def rows() -> list[dict]:
    """The rows with their case, estimate, error and layout label, grouped later by (model, gpus, seq, dtype)."""
    raw = [r for r in read_table(DATA / "cp_fp8_h100.csv") if r["id"] in SAME_TABLE]  # first: the base layouts
    raw += read_table(DATA / "moe_layouts_h100.csv")
    out = []
    for r in raw:
        spec, assume, metric, value = cp_fp8_case(r)
        est = estimate(spec, assume)
        got = published_figure(est, spec, metric)
        seconds = value if metric == "step_s" else est.time_per_step_s * got / value  # the source's step
        out.append(dict(id=r["id"], row=r, spec=spec, assume=assume, est=est, metric=metric, value=value,
                        got=got, error=value / got - 1 if metric == "step_s" else got / value - 1,
                        published_s=seconds, xpar_s=est.time_per_step_s,
                        layout=tuple(r[k] for k in LAYOUT_KEYS),
                        group=(r["model_name"], r["gpus"], r["seq"], r["dtype"])))
    return out


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties at their average rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho of two equally long lists (Pearson's r of their ranks); nan under 3 items."""
    if len(a) < 3:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def distinct(group: list[dict]) -> list[dict]:
    """The group's rows with a layout not listed before (variants of a listed layout dropped)."""
    seen, out = set(), []
    for g in group:
        if g["layout"] not in seen:
            seen.add(g["layout"])
            out.append(g)
    return out


def worst_pair(group: list[dict]) -> tuple:
    """The pair xpar orders against the source by the largest factor (published ratio x xpar's inverse ratio)."""
    best, worst = 1.0, None
    for a, b in itertools.permutations(group, 2):  # the source has a faster than b
        if a["published_s"] < b["published_s"] and a["xpar_s"] > b["xpar_s"]:
            f = b["published_s"] / a["published_s"] * a["xpar_s"] / b["xpar_s"]
            if f > best:
                best, worst = f, (a, b)
    return worst


def label(g: dict) -> str:
    r = g["row"]
    return (f"tp{r['tp']} pp{r['pp']} v{r['vp'] or 1} cp{r['cp'] or 1} ep{r['ep']} etp{r['etp'] or 1} dp{r['dp']} "
            f"Z{r['zero']} b{r['micro_batch']} {r['recompute'].split()[0]}")


def print_group(key: tuple, group: list[dict]) -> None:
    print(f"\n## {key[0]} on {key[1]} {group[0]['row']['gpu']}, seq {key[2]}, {key[3]}")
    print(f"{'row':<50} {'layout':<48} {'published':>10} {'xpar':>9} {'error':>7}")
    for g in sorted(group, key=lambda g: g["published_s"]):
        unit = "s" if g["metric"] == "step_s" else " TF"
        print(f"{g['id']:<50} {label(g):<48} {g['value']:>8.1f}{unit:<2} {g['got']:>7.1f}{unit:<2} {g['error']:>+7.1%}")
    print_residuals(group)
    ranked = distinct(group)
    pub, est = [g["published_s"] for g in ranked], [g["xpar_s"] for g in ranked]
    pairs = list(itertools.combinations(range(len(ranked)), 2))
    agree = sum((pub[i] - pub[j]) * (est[i] - est[j]) > 0 for i, j in pairs)
    print(f"{len(ranked)} distinct layouts: Spearman rho {spearman(pub, est):+.2f}, pairs in the source's order "
          f"{agree}/{len(pairs)}")
    pair = worst_pair(ranked)
    if pair:
        print_terms(*pair)


def expert_passes(g: dict) -> dict:
    """Per rank: micro-batches (GA), layers of the busiest stage, local experts, tokens each local expert computes
    per micro-batch (even routing, xpar.estimate.compute.kernel_block.expert_tokens), and their product of
    local experts x layer passes (one micro-batch through one layer, forward and backward)."""
    lay, tr, m = g["spec"].layout, g["spec"].train, g["spec"].model
    ga = tr.global_batch_size // (tr.micro_batch_size * lay.dp)
    layers = max(lay.layer_split) * lay.virtual_stages if lay.layer_split else -(-m.n_layers // lay.pp)
    tokens = tr.micro_batch_size * g["spec"].seq_len / (lay.cp * lay.tp)  # per rank entering the MoE (ETP 1)
    local = m.n_experts // lay.ep
    return dict(ga=ga, layers=layers, local=local, per_expert=tokens * m.moe_top_k * lay.ep / m.n_experts,
                expert_passes=local * layers * ga)


def expert_gemm(g: dict) -> tuple[float, float]:
    """(seconds, fraction of the BF16 peak) of one layer pass's routed-expert GEMMs, forward and backward, as the
    kernel model prices them (xpar.estimate.compute.kernel_block: grouped GEMMs of the local experts' tokens)."""
    spec, e = g["spec"], expert_passes(g)
    lay, m = spec.layout, spec.model
    dev = device_of(spec.hardware)
    t = block_step_times(shape_of(m), spec.train.micro_batch_size, spec.seq_len, dev, tp=lay.tp, cp=lay.cp, ep=lay.ep,
                         dtype=spec.train.dtype).experts
    flops = 6 * e["local"] * e["per_expert"] * 3 * m.hidden * m.expert_ffn_hidden  # gated: 3 matrices, fwd 2 + bwd 4
    return float(t), flops / float(t) / dev.peak_flops["bf16"]


def print_residuals(group: list[dict]) -> None:
    """The source's step less xpar's, per local expert and layer pass (the cost of many small local experts), beside
    the expert GEMMs' time and fraction of peak per layer pass as xpar prices them."""
    print(f"{'row':<50} {'GA':>4} {'layers':>6} {'local':>5} {'tok/expert':>10} {'expert ms':>9} {'of peak':>7} "
          f"{'residual s':>10} {'ms / (expert x layer pass)':>27}")
    for g in sorted(group, key=lambda g: g["published_s"]):
        e, res = expert_passes(g), g["published_s"] - g["xpar_s"]
        sec, frac = expert_gemm(g)
        print(f"{g['id']:<50} {e['ga']:>4} {e['layers']:>6} {e['local']:>5} {e['per_expert']:>10.0f} {1e3 * sec:>9.2f} "
              f"{frac:>7.0%} {res:>+10.2f} {1e3 * res / e['expert_passes']:>+27.3f}")


def print_terms(a: dict, b: dict) -> None:
    """Time terms of the worst-ordered pair: a is faster in the source, slower in xpar."""
    print(f"worst-ordered pair: source {a['id']} {a['published_s']:.1f} s < {b['id']} {b['published_s']:.1f} s; "
          f"xpar {a['xpar_s']:.2f} s > {b['xpar_s']:.2f} s. Terms (s, slowest rank):")
    ta, tb = a["est"].time_breakdown, b["est"].time_breakdown
    for k in sorted(set(ta) | set(tb), key=lambda k: -abs(ta.get(k, 0) - tb.get(k, 0))):
        if ta.get(k, 0) or tb.get(k, 0):
            print(f"  {k:<18} {ta.get(k, 0):>8.3f} {tb.get(k, 0):>8.3f} {tb.get(k, 0) - ta.get(k, 0):>+8.3f}")
    print(f"  {'residual':<18} {a['published_s'] - a['xpar_s']:>8.3f} {b['published_s'] - b['xpar_s']:>8.3f}"
          "  (published - xpar)")


def print_plan(group: list[dict]) -> None:
    """Where the plan of the group's model, cluster, framework and batch ranks each distinct layout's group."""
    first = group[0]
    plan = plan_of(first["spec"], first["assume"])
    print(f"plan: {len(plan.res['tp'])} layouts, {plan.devices} devices, winner {row_figures('', first['spec'], first['assume'], plan)['best']}")
    for g in distinct(group):
        f = row_figures(g["id"], g["spec"], g["assume"], plan)
        where = f"group rank {f['rank']} of {f['groups']}" if f["rank"] else (
            "in the space, none fits" if f["in_space"] else f"not in the space: {f['why']}")
        print(f"  {label(g):<48} source {g['published_s']:>5.1f} s: {where}; winner's claimed gain over it "
              f"{f['gain']:+.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", action="store_true", help="also plan each model (a minute or more per model)")
    args = ap.parse_args()
    all_rows = rows()
    groups: dict[tuple, list] = {}
    for g in all_rows:
        groups.setdefault(g["group"], []).append(g)
    for key, group in groups.items():
        print_group(key, group)
        if args.plan and len(distinct(group)) > 1:
            print_plan(group)
    errs = sorted(abs(g["error"]) for g in all_rows)
    print(f"\n{len(all_rows)} rows: median |error| {errs[len(errs) // 2]:.1%}, max {errs[-1]:.1%}")


if __name__ == "__main__":
    main()
