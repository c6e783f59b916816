"""Pipeline bubble ratio of a measured run, three ways, and the timeline of one step.

- ``pipeline/bubble_ratio`` (measured): 1 - sum_ranks busy / (p x step time) per step and
  pipeline, busy = wall time inside the stages' forward/backward chunks; mean over timed steps.
- ``pipeline/bubble_ratio_sim``: the executed action order replayed with the measured durations
  and free communication (:func:`xpar.estimate.schedule.simulate`).
- ``pipeline/bubble_ratio_theory``: the schedule's closed form, else torch's action list
  replayed with uniform durations (:func:`xpar.estimate.schedule.bubble_theory`).
- ``pipeline/bubble_overhead`` = measured - simulated (communication, synchronisation, jitter).

Units: fractions of the step time. Derivation: docs/concepts/cost-model-derivations.md.
"""
from __future__ import annotations

import statistics
from typing import Optional

from xpar.config.spec import RunSpec
from xpar.estimate.schedule import Action, bubble_theory, simulate


def pipelines(stats: list[dict], pp: int) -> list[list[dict]]:
    """The ranks' pipeline records grouped by (dp, cp, tp) (cp: 0 where the run has none), each
    group ordered by pp rank."""
    groups: dict[tuple[int, int, int], dict[int, dict]] = {}
    for s in stats:
        if "pipeline" in s:
            c = s["coords"]
            groups.setdefault((c["dp"], c.get("cp", 0), c["tp"]), {})[c["pp"]] = s["pipeline"]
    return [[g[r] for r in range(pp)] for _, g in sorted(groups.items())]


def step_bubbles(pipeline: list[dict], step: int) -> dict:
    """Measured and simulated bubble of one step of one pipeline (records ordered by pp
    rank); also the per-rank measured and simulated action times for a timeline. ``step`` is
    the run's step number; a resumed run's records start at its first step (``first_step``)."""
    steps = [rank["steps"][step - rank.get("first_step", 0)] for rank in pipeline]
    p = len(steps)
    span = max(st["span"] for st in steps)
    measured = [sorted(st["actions"], key=lambda a: a[3]) for st in steps]
    busy = sum(a[4] - a[3] for acts in measured for a in acts)
    order = [[Action(k, s, mb) for k, s, mb, _, _ in acts] for acts in measured]
    dur = {Action(k, s, mb): t1 - t0 for acts in measured for k, s, mb, t0, t1 in acts}
    sim = simulate(order, lambda a: dur[a])
    simulated = [[[a.kind, a.stage, a.mb, *sim.times[a]] for a in acts] for acts in order]
    return {"measured": 1 - busy / (p * span), "simulated": sim.bubble_ratio,
            "step_time_s": span, "sim_step_time_s": sim.makespan,
            "actions": measured, "sim_actions": simulated}


def summarize(spec: RunSpec, stats: list[dict]) -> tuple[dict[str, float], Optional[dict]]:
    """(metrics for Report.extra, timeline of the median timed step of the first pipeline)."""
    pp, m = spec.pp, spec.micro_batches
    v = spec.layout.virtual_stages
    first = max((pl.get("first_step", 0) for pls in pipelines(stats, pp) for pl in pls), default=0)
    timed = range(max(spec.train.warmup_steps, first), spec.train.steps)  # a resumed run: its own steps
    per_step = [[step_bubbles(pl, i) for i in timed] for pl in pipelines(stats, pp)]
    measured = [b["measured"] for pl in per_step for b in pl]
    simulated = [b["simulated"] for pl in per_step for b in pl]
    th = bubble_theory(spec.layout.schedule, pp, m, v)
    extra = {
        "pipeline/bubble_ratio": statistics.fmean(measured),
        "pipeline/bubble_ratio_median": statistics.median(measured),
        "pipeline/bubble_ratio_sim": statistics.fmean(simulated),
        "pipeline/bubble_ratio_theory": th,
    }
    extra["pipeline/bubble_overhead"] = extra["pipeline/bubble_ratio"] - extra["pipeline/bubble_ratio_sim"]
    first = per_step[0]
    k = sorted(range(len(first)), key=lambda i: first[i]["measured"])[len(first) // 2]
    chosen = first[k]
    timeline = {"schedule": spec.layout.schedule, "pp": pp, "m": m, "v": v,
                "step": timed[k], "theory": th,
                **{key: chosen[key] for key in ("measured", "simulated", "step_time_s", "sim_step_time_s",
                                                "actions", "sim_actions")}}
    return extra, timeline
