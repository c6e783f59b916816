"""Pipeline schedules: theoretical bubble ratios and a small replay simulator.

The bubble ratio is the idle fraction of the pipeline ranks within a step:
``1 - sum_ranks busy / (pp * makespan)``. The closed forms, with uniform per-stage times,
are the schedules' own (:data:`xpar.config.layout.SCHEDULES`, ``closed_form``; Narayanan et al.
state the bubble relative to the ideal time, (p - 1)/m and (p - 1)/(v m); as a fraction of
the step it becomes the forms there). Where a schedule has none (looped BFS, zero-bubble
schedules, Qi et al. 2024; interleaved with m < p), :func:`simulated_bubble` replays torch's
own action order; :func:`bubble_theory` picks one or the other, once for everyone.

An action is ``Action(kind, stage, mb)``, kind F (forward), B (full backward), I (backward
for inputs), W (backward for weights), as in torch's schedule IR. Times are in seconds (or
any one unit).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Mapping, Optional, Union

from xpar.config.layout import SCHEDULES
from xpar.parallel.torch_internals import schedule_ops

# Uniform durations per stage: backward = 2 x forward, split evenly into I and W.
UNIFORM = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Action:
    kind: str
    """'F', 'B', 'I' or 'W'."""
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


@dataclass
class SimResult:
    bubble_ratio: float
    """1 - sum busy / (pp * makespan)."""
    makespan: float
    busy: list[float]
    """Busy time of each rank."""
    times: dict[Action, tuple[float, float]]
    """(start, end) of every action."""


def closed_form_bubble(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """The schedule's closed-form bubble ratio (fraction of the step).

    Raises:
        ValueError: for schedules without a closed form, and for interleaved 1F1B with
            m < pp, where (p-1)/(v*m+p-1) does not hold (use :func:`simulated_bubble`).
    """
    if pp == 1:
        return 0.0
    form = SCHEDULES[schedule].closed_form
    value = form(pp, m, v) if form else None
    if value is None:
        raise ValueError(f"no closed-form bubble for schedule {schedule!r} at pp={pp}, m={m}; use simulated_bubble")
    return value


@lru_cache(maxsize=65536)
def bubble_theory(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """``pipeline/bubble_ratio_theory``: the closed form where the schedule has one, else its
    action list (torch's order) replayed with uniform stage times (:func:`simulated_bubble`),
    in closed form where that replay has one (:func:`replay_closed_form`)."""
    try:
        return closed_form_bubble(schedule, pp, m, v)
    except ValueError:
        replay = replay_closed_form(schedule, pp, m, v)
        return simulated_bubble(schedule, pp, m, v) if replay is None else replay


def replay_closed_form(schedule: str, pp: int, m: int, v: int = 1) -> Optional[float]:
    """:func:`simulated_bubble` (torch's order, uniform stage times) in closed form, for the
    schedules without one of their own; None for the others. With p = pp, per rank the step's
    work is 3 m (F = 1, B = 2 per micro-batch over its v stages) and the idle time is I / v
    (half-stage units), bubble = I / (3 m v + I):

    - looped_bfs, and interleaved 1F1B for m < p: I = 3 ((p - 1) + (v - 1) max(0, p - m)) (the
      fill and drain of one chunk per rank ahead; fewer than p micro-batches leave gaps);
    - zero_bubble (InterleavedZeroBubble): I = (p - 1) + v max(0, p - m) + (2 v - 2) max(0, p/2 - m)
      (the weight-gradient actions fill the drain);
    - zbv (v = 2): I = max(2 (2 p - 1 - m), p - 1); dualpipev (v = 2, m >= 2 p): I = p - 1.

    Found from the replay and equal to it within 1e-12 at pp 2, 3, 4, 5, 8, 16 for every m up to
    3 pp + 2 and at 4 pp, 5 pp + 1, 8 pp (v 2, 3, 4), at v 6 and 8 (pp 2, 4, 8), and at points of
    pp 12 and 32 (tests/plan/test_plan_vector.py keeps a small grid). Replaying takes 0.1-1 s per
    point (torch builds the action lists with their communication); a planner asks for hundreds."""
    p = pp
    if p == 1 or v < 1:
        return None
    if schedule == "looped_bfs" or (schedule == "interleaved_1f1b" and m < p):
        idle = 6 * ((p - 1) + (v - 1) * max(0, p - m))
    elif schedule == "zero_bubble":
        idle = 2 * (p - 1) + 2 * v * max(0, p - m) + (2 * v - 2) * max(0, p - 2 * m)
    elif schedule == "zbv" and v == 2:
        idle = 2 * max(2 * (2 * p - 1 - m), p - 1)
    elif schedule == "dualpipev" and v == 2:
        idle = 2 * (p - 1)
    else:
        return None
    return idle / (6 * m * v + idle)  # 2 I / (2 (3 m v) + 2 I): integers until the division


def gpipe_actions(pp: int, m: int) -> list[list[Action]]:
    """GPipe: all forwards, then all backwards (in micro-batch order, as torch's ScheduleGPipe)."""
    return [[Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]
            for r in range(pp)]


def one_f_one_b_actions(pp: int, m: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021 Fig. 4 top): rank r runs min(m, pp-r-1)
    warm-up forwards, then alternates F/B, then drains the remaining backwards."""
    out = []
    for r in range(pp):
        warm = min(m, pp - r - 1)
        acts = [Action("F", r, i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", r, warm + i), Action("B", r, i)]
        acts += [Action("B", r, i) for i in range(m - warm, m)]
        out.append(acts)
    return out


def split_backward_actions(pp: int, m: int, warm_up: list[int]) -> list[list[Action]]:
    """1F1B's order with each backward split into I then W, rank r starting with ``warm_up[r]``
    forwards: its activations peak at warm_up[r] + 1 micro-batches (freed at W)."""
    out = []
    for r in range(pp):
        warm = min(m, warm_up[r])
        acts = [Action("F", r, i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", r, warm + i), Action("I", r, i), Action("W", r, i)]
        for i in range(m - warm, m):
            acts += [Action("I", r, i), Action("W", r, i)]
        out.append(acts)
    return out


def zb_h1_actions(pp: int, m: int) -> list[list[Action]]:
    """ZB-H1's memory order (Qi et al. 2024 Sec. 3.1: "the peak memory the same as 1F1B"): rank r
    holds 1F1B's pp - r micro-batches. Its bubble is the paper's closed form
    (:data:`xpar.config.layout.SCHEDULES`), not this order's replay: the paper places the W passes
    in the drain, which this order, used for memory, does not."""
    return split_backward_actions(pp, m, [pp - r - 1 for r in range(pp)])


def zb_h2_actions(pp: int, m: int) -> list[list[Action]]:
    """ZB-H2's memory order (Qi et al. 2024 Sec. 3.1: extra forwards in the warm-up, peak memory
    (2p - 1) M_B on the first rank): rank r holds 2 (pp - r) - 1 micro-batches. Bubble: the
    paper's closed form, as for :func:`zb_h1_actions`."""
    return split_backward_actions(pp, m, [2 * (pp - r) - 2 for r in range(pp)])


def torch_actions(schedule: str, pp: int, m: int, v: Optional[int] = None) -> list[list[Action]]:
    """Per-rank compute order of a torch schedule, built offline (no process group) with the
    private ``get_schedule_ops`` (:func:`xpar.parallel.torch_internals.schedule_ops`).

    In torch 2.13 it returns, per rank, a list of ``_Action(stage_index, computation_type,
    microbatch_index, sub_actions)`` or None (idle slots). Idle slots and REDUCE_GRAD are
    dropped, OVERLAP_F_B is expanded into its sub-actions in order. Schedule1F1B labels the
    last rank's forwards 1..m instead of 0..m-1 (its executed order is F0, B0, F1, ...):
    where the labels of one kind on one stage are not exactly 0..m-1, they are renumbered
    by order of appearance (torch runs those in increasing order). Valid labels are kept,
    so LoopedBFS keeps its reversed backward order.
    """
    rec = SCHEDULES[schedule]
    ops = schedule_ops(rec.torch_name, pp, m, None if rec.stages_per_rank == "1" else (v or 2))
    out = []
    for rank_ops in ops:
        flat = [x for a in rank_ops if a is not None for x in (a.sub_actions or [a])]
        acts = [Action(a.computation_type.value, a.stage_index, a.microbatch_index) for a in flat
                if a.computation_type.value in ("F", "B", "I", "W")]
        out.append(_fix_labels(acts))
    return out


def _fix_labels(acts: list[Action]) -> list[Action]:
    """Renumber, by order of appearance, the micro-batches of each stage's forwards or
    backwards (B and I share one numbering) whose labels are not exactly 0..n-1; the k-th W
    of a stage then takes the label of its k-th I."""
    cls = lambda a: {"B": "BI", "I": "BI"}.get(a.kind, a.kind)  # noqa: E731
    groups: dict[tuple[int, str], list[int]] = {}
    for a in acts:
        groups.setdefault((a.stage, cls(a)), []).append(a.mb)
    bad = {k for k, mbs in groups.items() if k[1] != "W" and sorted(mbs) != list(range(len(mbs)))}
    seen: dict[tuple[int, str], int] = {}
    inputs: dict[int, list[int]] = {}
    out = []
    for a in acts:
        key = (a.stage, cls(a))
        if key in bad:
            seen[key] = seen.get(key, -1) + 1
            a = Action(a.kind, a.stage, seen[key])
        elif a.kind == "W" and (a.stage, "BI") in bad:
            seen[key] = seen.get(key, -1) + 1
            a = Action("W", a.stage, inputs[a.stage][seen[key]])
        if a.kind == "I":
            inputs.setdefault(a.stage, []).append(a.mb)
        out.append(a)
    return out


Durations = Union[Mapping[str, float], Callable[[Action], float]]


def simulate(actions_per_rank: list[list[Action]], durations: Durations = UNIFORM) -> SimResult:
    """Replay per-rank action lists with free communication.

    Each rank runs its list in order; an action also waits for its dependencies:
    F(s, i) after F(s-1, i); the backward (B or I) of (s, i) after F(s, i) and after the
    backward of (s+1, i); W(s, i) after I (or B) of (s, i). ``durations`` maps a kind to a
    time, or is a function of the action (per-stage or measured times).

    Returns:
        :class:`SimResult`; bubble = 1 - sum busy / (pp * makespan).

    Raises:
        ValueError: if the lists deadlock (an action waits on one never run before it).
    """
    dur = durations if callable(durations) else (lambda a: durations[a.kind])
    n_stages = 1 + max(a.stage for acts in actions_per_rank for a in acts)
    bwd = {(a.stage, a.mb): a for acts in actions_per_rank for a in acts if a.kind in "BI"}
    done: dict[Action, tuple[float, float]] = {}

    def deps(a: Action) -> list[Action]:
        s, i = a.stage, a.mb
        if a.kind == "F":
            return [Action("F", s - 1, i)] if s > 0 else []
        if a.kind in "BI":
            d = [Action("F", s, i)]
            return d + ([bwd[(s + 1, i)]] if s + 1 < n_stages else [])
        return [bwd[(s, i)]]  # W

    pos = [0] * len(actions_per_rank)
    clock = [0.0] * len(actions_per_rank)
    busy = [0.0] * len(actions_per_rank)
    remaining = sum(len(x) for x in actions_per_rank)
    while remaining:
        progressed = False
        for r, acts in enumerate(actions_per_rank):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                need = deps(a)
                if any(d not in done for d in need):
                    break
                start = max([clock[r]] + [done[d][1] for d in need])
                end = start + dur(a)
                done[a], clock[r], busy[r] = (start, end), end, busy[r] + (end - start)
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(acts[pos[r]]) for r, acts in enumerate(actions_per_rank) if pos[r] < len(acts)]
            raise ValueError(f"schedule deadlocks; next actions per rank: {stuck}")
    makespan = max(clock)
    return SimResult(1 - sum(busy) / (len(actions_per_rank) * makespan), makespan, busy, done)


def interleaved_actions(pp: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021 Sec. 2.2) in torch's order
    (``ScheduleInterleaved1F1B``, torch 2.13): micro-batches go in rounds of
    r = m // max(1, m // pp); rank k runs min(v m, (v - 1) r + 2 (pp - 1 - k)) warm-up forwards,
    then alternates one forward and one backward, then drains. The i-th forward is on local
    chunk (i // r) % v, micro-batch (i // (r v)) r + i % r; backwards go through the chunks
    in reverse. Stage of local chunk c on rank k: c pp + k. Equal to torch's list
    (tests/estimate/test_estimate_memory.py), without building torch's schedule (seconds at pp 64)."""
    r = m // max(1, m // pp)
    total = v * m
    out = []
    for k in range(pp):
        def fwd(i: int) -> Action:
            return Action("F", ((i // r) % v) * pp + k, (i // (r * v)) * r + i % r)

        def bwd(i: int) -> Action:
            return Action("B", (v - 1 - (i // r) % v) * pp + k, (i // (r * v)) * r + i % r)

        warm = min(total, (v - 1) * r + 2 * (pp - 1 - k))
        acts = [fwd(i) for i in range(warm)]
        for i in range(total - warm):
            acts += [fwd(warm + i), bwd(i)]
        acts += [bwd(i) for i in range(total - warm, total)]
        out.append(acts)
    return out


@lru_cache(maxsize=256)
def _schedule_actions(schedule: str, pp: int, m: int, v: int) -> tuple:
    if schedule == "gpipe":
        acts = gpipe_actions(pp, m)
    elif schedule == "1f1b":
        acts = one_f_one_b_actions(pp, m)
    elif schedule == "interleaved_1f1b":
        acts = interleaved_actions(pp, m, v)
    elif schedule in ("zb_h1", "zb_h2"):
        acts = zb_h1_actions(pp, m) if schedule == "zb_h1" else zb_h2_actions(pp, m)
    else:
        acts = torch_actions(schedule, pp, m, v)
    return tuple(tuple(a) for a in acts)


def schedule_actions(schedule: str, pp: int, m: int, v: int = 1) -> list[list[Action]]:
    """Action lists of an xpar schedule (memoised): analytic for gpipe, 1f1b and interleaved
    1F1B (checked against torch's) and for the estimate-only zb_h1 / zb_h2 (their memory order),
    torch's order for the others."""
    return [list(a) for a in _schedule_actions(schedule, pp, m, v)]


def simulated_bubble(schedule: str, pp: int, m: int, v: int = 1,
                     durations: Optional[Durations] = None) -> float:
    """Bubble ratio of ``schedule`` replayed with uniform per-stage durations (per stage of a
    rank holding v stages: F = 1/v, B = 2/v, I = W = 1/v) unless ``durations`` is given."""
    if pp == 1:
        return 0.0
    acts = schedule_actions(schedule, pp, m, v)
    n = 1 + max(a.stage for r in acts for a in r)
    per_rank = n // pp
    return simulate(acts, durations or {k: t / per_rank for k, t in UNIFORM.items()}).bubble_ratio


def peak_in_flight(actions: list[Action]) -> int:
    """Most forward chunks whose activations one rank holds at once: +1 at F, -1 when the
    weight gradient is done (B, or W after I; I alone keeps what W needs)."""
    live = peak = 0
    for a in actions:
        live += {"F": 1, "B": -1, "W": -1}.get(a.kind, 0)
        peak = max(peak, live)
    return peak
