"""Held-out check of `xpar plan` (issue 44's must-show): the accepted commands of benchmarks/refusal_hunt.md
(published GPU layouts typed as a user types them), each built as the CLI builds it (Hydra composition and
:func:`xpar.config.validate.validate`), planned with its model, hardware, framework profile and global batch
(benchmarks/plan_published.py ``plan_of``), and the published layout's place in that plan. For another hunt
(``--hunt``) what tests/data or an earlier hunt holds of a row is its sidecar's ``seen`` column (benchmarks/hunt_score.py).

    python benchmarks/plan_heldout.py [--rows 4,5,14] [--max-devices 8192] [--hunt benchmarks/refusal_hunt2.md]
                                      [--recipe] [--set model.moe_routing=round_robin ...]

``--recipe``: each row's command with what its source's recipe ran that the typed command leaves out
(benchmarks/hunt_recipes.py: the benchmark gates of NeMo AutoModel and torchtitan); ``--set``: overrides appended to
every row's command. Each row that gets overrides lists them under 'Per run'.

Columns and summary as plan_published.py (its ``row_figures``, ``row_line``, ``summary``), then per run: what
tests/data holds of it ('seen'), and where the claimed gain comes from: the published row against the best of its
degree group (its own schedule, v, b, sp, recompute) and that best against the winner (the degrees), each with the
two step terms (per token, as a share of the better one's step) that separate them most. Summaries: every accepted
command; the published runs (rows 19 and 24 are a project preset and an issue's test item); those whose model no
tests/data file holds.
"""
from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

try:
    from hunt_score import published, sidecar_for
    from hunt_recipes import checked_sets, recipe_overrides, with_overrides
    from plan_published import HEADER, plan_of, row_figures, row_line, summary
except ModuleNotFoundError:  # imported as benchmarks.plan_heldout (tests/estimate/test_hunt_score.py)
    from benchmarks.hunt_score import published, sidecar_for
    from benchmarks.hunt_recipes import checked_sets, recipe_overrides, with_overrides
    from benchmarks.plan_published import HEADER, plan_of, row_figures, row_line, summary
from xpar.config.validate import validate
from xpar.estimate.step_parts import assumptions_for
from xpar.plan.command import PlanRefused
from xpar.plan.groups import differing_axes
from xpar.plan.verify import compose_line
from xpar.plan.yours import choices, gap_words, group_mask, layout_row

HUNT = Path(__file__).resolve().parent / "refusal_hunt.md"
NOT_PUBLISHED = {19: "conf/parallel/70b_64gpu.yaml (the project's preset)", 24: "issue 43's vocabulary-padding item"}
SEEN = {
    1: "known_runs.csv gpt_neox_20b (memory)", 2: "known_runs.csv opt_175b (memory)",
    3: "bigscience_bloom_2022.csv, known_runs.csv", 8: "dgxc_nemo_h100_bf16.csv (model; other layouts)",
    9: "dgxc_nemo_h100_bf16.csv (this layout)", 10: "dgxc_nemo_h100_bf16.csv (model, H100)",
    11: "dgxc_nemo_h100_bf16.csv, known_runs.csv (model; tp 2/4)", 15: "llmfoundry_mpt_a100.csv (7b, other GPUs)",
    17: "smith_2022_mtnlg.csv", 18: "narayanan_2021_table2_ptdp.csv", 20: "cp_fp8_h100.csv dsv3_paper",
    25: "llama3_2024_table4.csv, cp_fp8_h100.csv", 27: "cp_fp8_h100.csv", 28: "cp_fp8_h100.csv",
    29: "cp_fp8_h100.csv", 30: "cp_fp8_h100.csv", 31: "cp_fp8_h100.csv", 32: "cp_fp8_h100.csv",
    34: "megatron_2021_table1.csv", 35: "known_runs.csv, torchtitan_h100_2024.csv",
}
"""What of each row a tests/data file holds (the brief's 'none of them is in tests/data' does not hold for these)."""


def seen_rows(hunt: Path) -> dict[int, str]:
    """What tests/data or an earlier hunt holds of each row of ``hunt``: :data:`SEEN` for refusal_hunt.md, else the
    non-blank ``seen`` cells of its sidecar (benchmarks/hunt<N>_published.csv, hunt_score's columns); {} if neither."""
    if hunt.resolve() == HUNT:
        return dict(SEEN)
    out = {}
    for num, pubs in published(sidecar_for(hunt)).items():
        text = next(((p.get("seen") or "").strip() for p in pubs if (p.get("seen") or "").strip()), "")
        if text:
            out[num] = text
    return out


def hunt_rows(path: Path = HUNT) -> list[tuple[int, str, str]]:
    # --hunt: another hunt's Runs table in the same columns (benchmarks/refusal_hunt2.md); NOT_PUBLISHED describes
    # refusal_hunt.md's rows only, SEEN too (another hunt's come from its sidecar: seen_rows)
    """(row number, run, command) of each accepted row of the hunt's Runs table (on main, the branch's result)."""
    out = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.split(" | ")]
        if len(cells) < 6 or not cells[0].lstrip("| ").isdigit():
            continue
        result = cells[4].split("<br>")[-1]
        command = re.search(r"`(python -m xpar [^`]+)`", cells[3])  # as hunt_score.runs_table: text beside it ignored
        if command and re.sub(r"^branch: ", "", result).startswith("accepted"):
            out.append((int(cells[0].lstrip("| ")), cells[1], command.group(1)))
    return out


def why_lines(plan, spec, f: dict) -> list[str]:
    """Where the claimed gain comes from: the published row against its group's best (its own choices), the
    group's best against the winner (the degrees); each with the terms that separate them."""
    r, best = plan.res, plan.best
    mine = group_mask(r, f["deg"])
    group = plan.ranked[mine[plan.ranked]]
    pub = layout_row(r, spec, f["deg"])
    out = []
    if pub is None:
        out.append("published choices not in the space")
    elif len(group) and pub != group[0]:
        fit = "" if r["fits"][pub] else f", does not fit ({r['memory_total'][pub] / 1e9:.1f} GB)"
        out.append(f"own choices {choices(r, pub)}{fit} -> {choices(r, group[0])}: {gap_words(r, pub, int(group[0]))}")
    if not len(group):
        out.append("published group: none fits" if mine.any() else "published group outside the space")
    elif group[0] != best:
        out.append(f"degrees {differing_axes(r, best, int(group[0]))} (+ {choices(r, best)}): "
                   f"{gap_words(r, int(group[0]), best)}")
    return out or ["the winner"]


def run_one(num: int, name: str, command: str) -> tuple[dict, list[str]]:
    """The run's figures (plan_published.row_figures) and where its claimed gain comes from."""
    spec = validate(compose_line(command))
    a = assumptions_for(spec)
    plan = plan_of(spec, a)
    f = row_figures(f"#{num} {name}", spec, a, plan)
    return f, why_lines(plan, spec, f)


def plan_rows(rows: list[tuple[int, str, str]], hunt: Path, max_devices: int, recipe: bool,
              sets: tuple[str, ...]) -> tuple[list[dict], list[str]]:
    """Each row planned (its command with the recipe's overrides when ``recipe``, then ``sets``), its line printed:
    (the figures of the rows planned, their 'Per run' notes); a refused plan is printed and left out."""
    done, notes = [], []
    for num, name, command in rows:
        t = time.perf_counter()
        extra = (recipe_overrides(hunt, num) if recipe else ()) + sets
        try:
            f, why = run_one(num, name, with_overrides(command, extra))
        except PlanRefused as e:
            print(f"#{num} {name[:40]:<40} plan refused: {e.problems[0][:160]}", flush=True)
            continue
        if f["devices"] > max_devices:
            continue
        f["num"] = num
        done.append(f)
        print(row_line(f), flush=True)
        notes.append(f"#{num:<3} {time.perf_counter() - t:5.1f} s  seen: {SEEN.get(num, '-')}"
                     f"{'; NOT PUBLISHED: ' + NOT_PUBLISHED[num] if num in NOT_PUBLISHED else ''}"
                     + "".join(f"\n      {w}" for w in (*why, *(["with " + " ".join(extra)] if extra else []))))
    return done, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help="comma-separated row numbers of the hunt (default: every accepted one)")
    ap.add_argument("--max-devices", type=int, default=16384)
    ap.add_argument("--hunt", type=Path, default=HUNT, help="a hunt's markdown (Runs table of refusal_hunt.md's columns)")
    ap.add_argument("--recipe", action="store_true", help="add what each row's recipe ran (benchmarks/hunt_recipes.py)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="an override appended to every row's command")
    args = ap.parse_args()
    sets = checked_sets(args.set, "plan_heldout")
    if args.hunt.resolve() != HUNT:
        seen = seen_rows(args.hunt)
        SEEN.clear()
        SEEN.update(seen)
        NOT_PUBLISHED.clear()
    wanted = {int(x) for x in args.rows.split(",")} if args.rows else None
    rows = [r for r in hunt_rows(args.hunt) if wanted is None or r[0] in wanted]
    print(f"{len(rows)} accepted commands of {args.hunt.name}")
    print(HEADER)
    t0 = time.perf_counter()
    done, notes = plan_rows(rows, args.hunt, args.max_devices, args.recipe, sets)
    print("\nPer run: seconds to plan, what tests/data holds, what separates the winner")
    print("\n".join(notes))
    summary(done, time.perf_counter() - t0, len(done))
    left = ", ".join(str(k) for k in NOT_PUBLISHED) or "none"
    for title, keep in ((f"published runs (left out: rows {left})", lambda f: f["num"] not in NOT_PUBLISHED),
                        ("held out: none of the run in tests/data or an earlier hunt (SEEN, or the sidecar's seen column)",
         lambda f: f["num"] not in SEEN | NOT_PUBLISHED)):
        sub = [f for f in done if keep(f)]
        print(f"\n-- {title}: rows {', '.join(str(f['num']) for f in sub)}")
        summary(sub, 0.0, len(sub))


if __name__ == "__main__":
    main()
