"""The plan's misses on a hunt, term by term (issue 44): for each row whose published degree group is outside the
plan's top 10 groups or whose winner claims more than 10 % over it, the published layout as typed, the best of its
degree group and the plan's winner side by side: tokens/s per device, the step's terms in ms per 1,000 tokens per
device (matmul, memory-bound work, bubble, tp, cp, ep and exposed dp communication, pp send/recv, host overhead,
the rest) and the memory as a share of the plan's usable memory.

    python benchmarks/plan_misses.py [--hunt benchmarks/refusal_hunt2.md] [--rows 5,6] [--recipe] [--all]

Rows and plans as benchmarks/plan_heldout.py builds them (its ``hunt_rows``; plan_published.py ``plan_of``); the
published layout's figures are the plan's own row of it (xpar.plan.yours.layout_row), which equal
``run.mode=estimate`` (tests/plan/test_plan_five.py). ``--all``: every row, missed or not. Prints markdown, one table
per row; the classification of each miss is in benchmarks/plan_misses.md.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from plan_heldout import HUNT, hunt_rows
from plan_published import plan_of, row_figures
from hunt_recipes import recipe_overrides, with_overrides
from xpar.config.validate import validate
from xpar.estimate.step_parts import assumptions_for
from xpar.plan.command import PlanRefused
from xpar.plan.rank import term_seconds_per_token, terms
from xpar.plan.verify import compose_line
from xpar.plan.yours import choices, group_mask, layout_row

SHOWN = {"matmul": "matmul", "memory_bound": "mem-bound", "bubble": "bubble", "tp_comm": "tp",
         "cp_comm": "cp", "ep_comm": "ep a2a", "dp_comm_exposed": "dp exp.", "pp_comm": "pp p2p",
         "host_overhead": "host"}
"""The step terms given a column each (xpar.estimate.terms names); the others are summed under 'rest'."""
DEG = ("tp", "pp", "dp", "cp", "ep", "etp", "zero")


def label(r: dict, i: int) -> str:
    """'tp2 pp8 dp32 ep64 Z1 | 1f1b v1 b1 sp1 none'."""
    deg = " ".join(f"{'Z' if k == 'zero' else k}{r[k][i]}" for k in DEG
                   if k in r and (r[k][i] != 1 or k in ("tp", "pp", "dp")))
    return f"{deg} \\| {choices(r, i)}"


def term_cells(r: dict, i: int) -> list[str]:
    """Each shown term and the rest, ms per 1,000 tokens per device (term seconds / tokens per device)."""
    per = term_seconds_per_token(r, np.array([i]))
    devices = float(r["tokens_per_s"][i] / r["tokens_per_s_per_device"][i])
    cells = [f"{1e6 * devices * float(per[k][0]):.2f}" if k in per else "-" for k in SHOWN]
    rest = sum(float(v[0]) for k, v in per.items() if k not in SHOWN)
    return cells + [f"{1e6 * devices * rest:.2f}"]


def table(num: int, name: str, command: str, extra: tuple) -> list[str]:
    """The row's markdown: a heading with the plan's figures, then published / group best / winner."""
    spec = validate(compose_line(with_overrides(command, extra)))
    a = assumptions_for(spec)
    plan = plan_of(spec, a)
    f = row_figures(f"#{num} {name}", spec, a, plan)
    r, best = plan.res, plan.best
    pub = layout_row(r, spec, f["deg"])
    group = plan.ranked[group_mask(r, f["deg"])[plan.ranked]]
    rows = [("published", pub), ("its group's best", int(group[0]) if len(group) else None), ("winner", best)]
    head = (f"### #{num} {name}: group rank {f['rank']} of {f['groups']}, claimed gain {100 * f['gain']:+.1f} % "
            f"(in group {100 * f['inside']:+.1f} %){' tie' if f['tie'] else ''}")
    cols = " | ".join(SHOWN.values())
    out = [head, "", f"| layout | tok/s/dev | {cols} | rest | mem % |", "|" + "---|" * (len(SHOWN) + 4)]
    for what, i in rows:
        if i is None:
            out.append(f"| {what}: not in the space | | " + " | " * (len(SHOWN) + 2))
            continue
        mem = 100 * float(r["memory_total"][i] / r["memory_usable"][i])
        out.append(f"| {what}: {label(r, i)} | {float(r['tokens_per_s_per_device'][i]):,.0f} | "
                   + " | ".join(term_cells(r, i)) + f" | {mem:.0f} |")
    return out + [""]


def missed(num: int, name: str, command: str, extra: tuple) -> bool:
    """Whether the row is a miss: published group outside the top 10 groups, or the winner's gain over 10 %."""
    spec = validate(compose_line(with_overrides(command, extra)))
    a = assumptions_for(spec)
    f = row_figures(f"#{num} {name}", spec, a, plan_of(spec, a))
    return not (0 < f["rank"] <= 10) or f["gain"] > 0.10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hunt", type=Path, default=HUNT)
    ap.add_argument("--rows", help="comma-separated row numbers (default: the missed ones)")
    ap.add_argument("--recipe", action="store_true", help="add each row's recipe (benchmarks/hunt_recipes.py)")
    ap.add_argument("--all", action="store_true", help="every accepted row, missed or not")
    args = ap.parse_args()
    wanted = {int(x) for x in args.rows.split(",")} if args.rows else None
    print(f"Terms in ms per 1,000 tokens per device; mem % of the plan's usable memory ({args.hunt.name})\n")
    for num, name, command in hunt_rows(args.hunt):
        if wanted is not None and num not in wanted:
            continue
        extra = recipe_overrides(args.hunt, num) if args.recipe else ()
        try:
            if wanted is None and not args.all and not missed(num, name, command, extra):
                continue
            print("\n".join(table(num, name, command, extra)), flush=True)
        except PlanRefused as e:
            print(f"### #{num} {name}: plan refused: {e.problems[0][:160]}\n", flush=True)


if __name__ == "__main__":
    main()
