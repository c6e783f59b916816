"""Published layouts against `xpar plan` (issue 44's must-show): for each published run of tests/data/*.csv with
a full layout (xpar.calibrate.published: load_cases and cp_fp8_case), the plan of its model, hardware (the
row's cluster), framework profile and global batch, and where the published layout lands in it.

    python benchmarks/plan_published.py [--all | --moe] [--per-source 2] [--max-devices 4096]

Per run: the rank of the published layout's degree group (tp, pp, dp, cp, ep, ZeRO, etp) among the plan's
groups (0: not among the fitting ones), whether that group is in the space at all and, if not, the axis or the
rule that leaves it out; the published layout's memory against the plan's usable memory (device less the
headroom; 'mem'); the plan's claimed gain of its winner over the published layout (both by xpar's own estimate)
and of the best of the published group ('in grp': recompute, b, schedule, v); the distinct degree sets among the top 10 layouts, and the groups tied with the winner among the
top 10 groups. Then the summary the issue asks for. Runs that share a plan (same model, cluster, profile and
batch) are planned once. By default ``--per-source`` runs per source (spread over its device counts) and
clusters up to ``--max-devices`` (a few minutes on two cores); ``--all`` takes every run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from xpar.calibrate.cp_fp8 import cp_fp8_case
from xpar.calibrate.published import load_cases, make_spec, preset, read_table
from xpar.config.profile import FrameworkConfig
from xpar.estimate.cost import Assumptions, estimate
from xpar.plan.command import PlanRefused, search
from xpar.plan.groups import degree_columns, group_ranks
from xpar.plan.inputs import plan_inputs
from xpar.plan.verify import compose_line
from xpar.plan.yours import group_mask, layout_degrees, why_not

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
TOP = 10


def cases() -> list[tuple[str, object, object]]:
    """(source, spec, assumptions) of every published run with a full layout."""
    out = [(src, spec, a) for src, rows in load_cases(DATA).items() for _, spec, a, _, _ in rows]
    for row in read_table(DATA / "cp_fp8_h100.csv"):
        case = cp_fp8_case(row)
        if case is not None:
            spec, a = case[0], case[1]
            if "DualPipe" in row["note"]:  # DeepSeek's own framework and schedule (conf/framework/hai_llm.yaml)
                spec, a = dualpipe(spec), Assumptions.from_config(FrameworkConfig(**preset("framework", "hai_llm")))
            out.append(("cp_fp8:" + row["id"], spec, a))
    return out


def dualpipe(spec):
    """``spec`` under DualPipeV (v 2; conf/parallel/deepseek_v3_2048gpu.yaml: 1 block on the first stage, none on
    the last), as DeepSeek-V3 was trained (the csv row gives no schedule)."""
    par = dict(asdict(spec.parallel_config()), schedule="dualpipev", virtual_stages=2, layer_split=None, first_stage_layers=1,
               last_stage_layers=0, micro_batches="auto")
    train = dict(asdict(spec.train), micro_batch_size=1, global_batch_size=spec.train.global_batch_size)
    return make_spec(asdict(spec.model), par, asdict(spec.hardware), train)


def framework_dict(a) -> dict:
    """The framework group of assumptions ``a``: its profile's preset with ``a``'s values."""
    base = preset("framework", a.name)
    names = {f.name for f in fields(FrameworkConfig)}
    for f in fields(a):
        if f.name in names:
            v = getattr(a, f.name)
            base[f.name] = list(v) if isinstance(v, tuple) else v
    return base


def plan_of(spec, a):
    """The plan of the run: its model, hardware, framework and global batch (plan.* at their defaults)."""
    cfg = compose_line("python -m xpar hardware=h100_80gb_node train=cluster run.mode=plan")
    train = {k: v for k, v in asdict(spec.train).items() if k not in ("global_batch_size", "micro_batch_size")}
    cfg = OmegaConf.merge(cfg, {"model": asdict(spec.model), "hardware": asdict(spec.hardware),
                                "framework": framework_dict(a), "train": train,
                                "plan": {"global_batch_size": int(spec.train.global_batch_size)}})
    inputs, problems = plan_inputs(cfg, [])
    if problems:
        raise PlanRefused(problems)
    return search(inputs)


def row_figures(src: str, spec, a, plan) -> dict:
    """The per-run figures of the module docstring."""
    r = plan.res
    deg = layout_degrees(spec, r)
    mine = group_mask(r, deg)
    ranks = group_ranks(r, plan.ranked)
    hit = np.flatnonzero(mine[plan.ranked])
    pub = estimate(spec, Assumptions.from_config(FrameworkConfig(**framework_dict(a))))
    top_sets = {tuple(r[k][i] for k in degree_columns(r)) for i in plan.ranked[:TOP]}
    heads = [plan.ranked[np.flatnonzero(ranks == g)[0]] for g in range(1, min(TOP, ranks.max()) + 1)]
    tied = sum(r["tokens_per_s"][i] >= (1 - plan.inputs.tie_within) * r["tokens_per_s"][plan.best] for i in heads)
    group = plan.ranked[mine[plan.ranked]]
    inside = float(r["tokens_per_s"][group[0]] / plan.devices / pub.tokens_per_s_per_device - 1) if len(group) else 0.0
    usable = float(r["memory_usable"][plan.best])
    tie = bool(len(group)) and r["tokens_per_s"][group[0]] >= (1 - plan.inputs.tie_within) * r["tokens_per_s"][plan.best]
    return dict(src=src, devices=plan.devices, deg=deg, in_space=bool(mine.any()), inside=inside, tie=tie,
                pub_fits=pub.memory.total <= usable, pub_mem=pub.memory.total / usable,
                fits=bool(mine.any() and r["fits"][mine].any()),
                why="" if mine.any() else why_not(plan, deg), rank=int(ranks[hit[0]]) if len(hit) else 0,
                groups=int(ranks.max()), gain=float(r["tokens_per_s"][plan.best] / pub.tokens_per_s_per_device
                                                    / plan.devices - 1),
                sets=len(top_sets), tied=int(tied), best=_label(r, plan.best))


def _label(r, i) -> str:
    words = {"zero": "Z"}
    return " ".join(f"{words.get(k, k)}{r[k][i]}" for k in degree_columns(r)) + \
        f" {r['schedule'][i]} v{r['v'][i]} b{r['b'][i]} {r['recompute'][i]}"


def choose(all_cases: list, per_source: int, max_devices: int, every: bool) -> list:
    """Runs to plan: every one, or ``per_source`` per source spread over its device counts, up to ``max_devices``."""
    if every:
        return all_cases
    by_src: dict[str, list] = {}
    for c in all_cases:
        if c[1].layout.world_size <= max_devices:
            by_src.setdefault(c[0].split(":")[1].split("_")[0] if c[0].startswith("cp_fp8:") else c[0], []).append(c)
    out = []
    for cs in by_src.values():
        cs = sorted(cs, key=lambda c: c[1].layout.world_size)
        step = max(1, len(cs) // per_source) if per_source else 1
        out += cs[::step][:per_source] if len(cs) > per_source else cs
    return out


def key_of(spec, a) -> tuple:
    """What a run's plan depends on: runs with the same key share one plan (FP8 runs of different scaling recipes
    do not: train.fp8_recipe prices their casts)."""
    return (repr(asdict(spec.model)), repr(asdict(spec.hardware)), repr(framework_dict(a)),
            spec.train.global_batch_size, spec.seq_len, spec.train.dtype, spec.train.fp8_recipe)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="every run (tens of minutes on two cores)")
    ap.add_argument("--per-source", type=int, default=2)
    ap.add_argument("--max-devices", type=int, default=4096)
    ap.add_argument("--moe", action="store_true", help="only the runs of MoE models (every one up to --max-devices)")
    args = ap.parse_args()
    t0, plans, rows = time.perf_counter(), {}, []
    every = cases()
    if args.moe:
        every = [c for c in every if c[1].model.n_experts and c[1].layout.world_size <= args.max_devices]
    chosen = choose(every, args.per_source, args.max_devices, args.all or args.moe)
    print(f"{len(chosen)} of {len(every)} published runs with a full layout"
          + ("" if args.all else f" ({args.per_source} per source, <= {args.max_devices} devices)"))
    print(HEADER)
    for src, spec, a in chosen:
        k = key_of(spec, a)
        try:
            plans[k] = plans[k] if k in plans else plan_of(spec, a)
        except PlanRefused as e:
            print(f"{src[:52]:<52} refused: {e.problems[0][:150]}")
            continue
        rows.append(row_figures(src, spec, a, plans[k]))
        print(row_line(rows[-1]), flush=True)
    summary(rows, time.perf_counter() - t0, len(plans))


HEADER = (f"{'source / run':<46} {'GPUs':>5} {'published group':<30} {'space':<12} {'mem':>5} {'rank':>5} {'gain':>7} "
          f"{'in grp':>7} {'sets':>4} {'ties':>4}  plan's best")
"""The column heads of :func:`row_line`."""


def row_line(f: dict) -> str:
    """One run's figures (:func:`row_figures`) as a line under :data:`HEADER`."""
    space = "in" + ("" if f["fits"] else ", none fits") if f["in_space"] else f"OUT: {f['why']}"
    return (f"{f['src'][:46]:<46} {f['devices']:>5} {_deg(f['deg']):<30} {space:<12} {100 * f['pub_mem']:>4.0f}% "
            f"{f['rank'] or '-':>5} {100 * f['gain']:>+6.1f}% {100 * f['inside']:>+6.1f}% {f['sets']:>4} "
            f"{f['tied']:>4}  {f['best']}")


def _deg(d: dict) -> str:
    return " ".join(f"{'Z' if k == 'zero' else k}{v}" for k, v in d.items() if (v != 1 or k in ("tp", "pp", "dp")) and not (k == "etp" and v == 0))


def summary(rows: list[dict], seconds: float, n_plans: int) -> None:
    """The issue's must-show over the runs planned."""
    if not rows:
        sys.exit("no run planned")
    n = len(rows)
    top = sum(1 <= f["rank"] <= TOP for f in rows)
    out = sum(not f["in_space"] for f in rows)
    print(f"\n{n} runs, {n_plans} plans, {seconds:.0f} s")
    print(f"published group in the top {TOP} groups: {top}/{n} = {100 * top / n:.0f} % (issue: >= 80 %); "
          f"winner's group: {sum(f['rank'] == 1 for f in rows)}/{n}; outside the space: {out}/{n} (issue: 0)")
    ties = sum(f["tie"] for f in rows)
    print(f"published group tied with the winner (its best within plan.tie_within of the winner's tokens/s, marked "
          f"'tie' in the plan's table): {ties}/{n} = {100 * ties / n:.0f} %; in the top {TOP} groups or tied: "
          f"{sum(f['tie'] or 1 <= f['rank'] <= TOP for f in rows)}/{n}")
    print(f"claimed gain of the winner over the published layout: median {100 * statistics.median(f['gain'] for f in rows):+.1f} % "
          f"(issue: <= 5 %); max {100 * max(f['gain'] for f in rows):+.1f} %")
    over = [f for f in rows if not f["pub_fits"]]
    print(f"published layouts above the plan's usable memory (device less its headroom) by xpar's estimate: "
          f"{len(over)}/{n}; median gain within the published group (recompute, b, schedule, v): "
          f"{100 * statistics.median(f['inside'] for f in rows):+.1f} %")
    shown = statistics.median(min(TOP, f["groups"]) for f in rows)
    print(f"distinct degree sets in the plan's table (its top {TOP} rows, one per degree group, ties marked): median "
          f"{shown:g} (issue: >= 6); among the {TOP} best layouts ungrouped: median "
          f"{statistics.median(f['sets'] for f in rows):g}; groups tied with the winner in the top {TOP} groups: "
          f"median {statistics.median(f['tied'] for f in rows):g}")


if __name__ == "__main__":
    main()
