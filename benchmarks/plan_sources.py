"""The plan of each refusal-hunt A100 run under the profile the hunt typed and under the one its source ran
(issue 44: what separates a plan's winner from a published layout when the profile offers a later stack).

    python benchmarks/plan_sources.py [--rows neox20b,opt175b]

Rows: tests/data/a100_40gb_published.csv (benchmarks/a100_40gb_rows.py compares their estimates with the
published figures). Each row is planned twice as benchmarks/plan_heldout.py plans a hunt command (its model,
hardware, framework profile and global batch; plan.* at their defaults): 'before', the hunt's command (an 80 GB
preset at 40 GB and the profile the hunt typed, e.g. framework=deepspeed, whose attention is FlashAttention and
whose tp layers may run Megatron's sequence parallelism), and 'after', the command its source supports (its
hardware preset and the trainer's profile of its year, e.g. megatron_deepspeed for GPT-NeoX's 2022 stack: fused
softmax, no sequence parallelism). Columns, the per-run lines and the summaries as plan_published.py /
plan_heldout.py. No figure of the cost model is set here: the difference between the two plans is what the
profiles offer and assume.
"""
from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

from plan_heldout import run_one
from plan_published import HEADER, row_line, summary
from xpar.plan.command import PlanRefused

ROWS = Path(__file__).resolve().parents[1] / "tests" / "data" / "a100_40gb_published.csv"
PREFIX = "python -m xpar run.mode=estimate tracking=off parallel.micro_batches=auto "
"""What every command starts with (as the hunt's commands)."""


def source_rows(wanted: set[str] | None = None) -> list[dict]:
    """The csv's rows (``id``, ``model_layout``, ``before``, ``after``, ...), all or those ``wanted`` by id."""
    with open(ROWS) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    return [r for r in rows if wanted is None or r["id"] in wanted]


def command(row: dict, which: str) -> str:
    """The command line of ``row`` under ``which`` ('before': the hunt's profile, 'after': the source's)."""
    return PREFIX + row["model_layout"] + " " + row[which]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help="comma-separated ids of tests/data/a100_40gb_published.csv (default: every one)")
    args = ap.parse_args()
    rows = source_rows(set(args.rows.split(",")) if args.rows else None)
    done: dict[str, list] = {"before": [], "after": []}
    t0, notes = time.perf_counter(), []
    print(HEADER)
    for num, row in enumerate(rows, 1):
        for which in done:
            try:
                f, why = run_one(num, f"{row['id']} ({which})", command(row, which))
            except PlanRefused as e:
                print(f"{row['id']} ({which}) plan refused: {e.problems[0][:150]}", flush=True)
                continue
            done[which].append(f)
            print(row_line(f), flush=True)
            notes.append(f"{row['id']} ({which})" + "".join(f"\n      {w}" for w in why))
    print("\nPer run: what separates the winner\n" + "\n".join(notes))
    for which, figures in done.items():
        print(f"\n-- {which}: {'the profile the hunt typed' if which == 'before' else 'the profile the source ran'}")
        summary(figures, time.perf_counter() - t0, len(figures))


if __name__ == "__main__":
    main()
