"""``xpar plan`` (``run.mode=plan``): every valid layout of a model on a cluster, ranked by the
cost model's tokens/s and explained.

Enumerate (:mod:`xpar.plan.space`), evaluate step time and memory on all candidates at once
(:mod:`xpar.plan.evaluate`), drop what does not fit, rank (:mod:`xpar.plan.rank`), explain the
winner (:mod:`xpar.plan.explain`), print the command line that reproduces it (checked: it
composes, validates and resolves to it), record an MLflow run tagged ``xpar.mode=plan`` with the ranked
table and the Pareto plot (:mod:`xpar.plan.record`), and on hardware=local run the top layouts
for real (:mod:`xpar.plan.execute`). Imports no torch, except to resolve hardware=local and to
run layouts for real.

Refusals (bad constraints, no layout passes the rules, no layout fits) are one line each and
exit 2; for a model that fits no layout, the smallest cluster, or the largest memory headroom,
that would work.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import numpy as np

from xpar.config.checks import ConfigError
from xpar.config.checks.environment import check_tracking_paths
from xpar.config.checks.hardware import UNCALIBRATED_LOCAL, part_memory_notes
from xpar.config.overrides import refuse
from xpar.config.presets import dense_moe_notes, fp8_recipe_notes, kept_kv_heads_notes
from xpar.plan.context import PlanContext, row
from xpar.plan.evaluate import evaluate
from xpar.plan.execute import execute_top
from xpar.plan.explain import device_name, label
from xpar.plan.inputs import PlanInputs, _hydra, auto_batch_notes, plan_inputs
from xpar.plan.offload_fit import with_offload
from xpar.plan.rank import feasible, order
from xpar.plan.record import record_plan
from xpar.plan.show import override_line, print_plan
from xpar.plan.space import Constraints, RULES, Space, enumerate_layouts
from xpar.plan.verify import composed_spec
from xpar.plan.yours import your_layout_lines

GB = 1e9


class PlanRefused(Exception):
    """The request cannot be planned; ``problems`` holds one line per reason."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))

    def __reduce__(self):
        """Pickled as its problem list (see xpar.config.checks.ConfigError.__reduce__)."""
        return type(self), (list(self.problems),)


@dataclass
class Plan:
    """A finished search at one device count. ``res``: candidate columns with the cost model's
    figures (:mod:`xpar.plan.evaluate`); ``ranked``: indices of the layouts that fit, best first."""

    inputs: PlanInputs
    ctx: PlanContext
    space: Space
    res: dict
    ranked: np.ndarray
    seconds: dict = field(default_factory=dict)
    clusters: list = field(default_factory=list)
    """(devices, best tokens/s or 0) of each device count tried (a devices range), by devices."""
    unsearched: tuple = ()
    """(below, above, count): whole-node counts between two tried ones that were not searched
    (more than :data:`BETWEEN_MAX`); () when every count below the one chosen was tried."""
    run_id: Optional[str] = None
    """The plan's MLflow run, once recorded."""
    notes: tuple = ()
    """Notes on the request that hold for every layout (:func:`request_notes`), printed under the plan."""
    yours: tuple = ()
    """Where the layout the command states ranks (:func:`xpar.plan.yours.your_layout_lines`); () for none."""

    @property
    def devices(self) -> int:
        """The devices each layout uses: tp x pp x cp x dp (dp = N / (tp pp cp), xpar.plan.space)."""
        cp = self.res["cp"][0] if "cp" in self.res else 1
        return int(self.res["tp"][0] * self.res["pp"][0] * cp * self.res["dp"][0])

    @property
    def best(self) -> int:
        return int(self.ranked[0])

    @property
    def dropped(self) -> dict[str, int]:
        """Layouts dropped by rule (:data:`RULES` keys), ``memory`` (do not fit device memory) and
        ``host_memory`` (fit it, but their offloaded optimizer states do not fit host memory)."""
        fits = self.res["fits"].astype(bool)
        host = int((fits & ~self.res["host_fits"].astype(bool)).sum()) if "host_fits" in self.res else 0
        return dict(self.space.dropped, memory=int((~fits).sum()), host_memory=host)


def search(inputs: PlanInputs, devices: Optional[int] = None, explain: bool = True) -> Plan:
    """Enumerate, evaluate and rank the layouts on ``devices`` (default: the first count).
    ``explain=False``: a refusal says only what failed (the searches behind a refusal's own
    suggestions, which would otherwise search for suggestions of their own).

    Raises:
        PlanRefused: no layout passes the rules (the constraint that empties the space and
            values that work), or none fits (the smallest cluster or largest headroom that would).
    """
    devices = devices or inputs.device_counts[0]
    ctx, t0 = inputs.at(devices), time.perf_counter()
    space = enumerate_layouts(ctx.model, devices, int(ctx.hardware["devices_per_node"]),
                              int(ctx.train["seq_len"]), inputs.constraints)
    if not len(space):
        raise PlanRefused([empty_space_line(inputs, devices, space) if explain else f"no layout passes on {devices}"])
    t1 = time.perf_counter()
    try:
        bases: dict = {}  # the validated specs evaluate prices with, reused by the offload rows
        res = with_offload(ctx, space.cols, evaluate(ctx, space.cols, bases), bases)  # activation offload where it fits
    except ConfigError as e:  # the hardware at this device count (e.g. nodes without an inter-node figure)
        raise PlanRefused([f"at plan.devices={devices}: {p}" for p in e.problems]) from None
    t2 = time.perf_counter()
    ranked = order(res, feasible(res))
    seconds = {"enumerate": t1 - t0, "evaluate": t2 - t1, "rank": time.perf_counter() - t2}
    plan = Plan(inputs, ctx, space, res, ranked, seconds)
    if not len(ranked):
        raise PlanRefused([nothing_fits_line(plan) if explain else f"no layout fits on {devices}"])
    return plan


def search_smallest(inputs: PlanInputs) -> Plan:
    """With a devices range: the plan on the smallest device count whose best layout reaches
    ``min_tokens_per_s``. The range's counts (its ends and the powers of two between) are tried in
    increasing order, then the whole-node counts between the last that fell short and the first
    that reached it (at most :data:`BETWEEN_MAX` of them, else ``unsearched`` says so); every count
    tried is kept in ``clusters``."""
    tried: list = []
    below = None
    for n in inputs.device_counts:
        plan = _reaching(inputs, n, tried)
        if plan is not None:
            return _smallest_between(inputs, plan, below, tried)
        below = n
    best = max(tried, key=lambda x: x[1])
    raise PlanRefused([f"no cluster in plan.devices={list(inputs.device_counts)} reaches plan.min_tokens_per_s="
                       f"{inputs.min_tokens_per_s:g}: the best is {best[1]:,.0f} tokens/s on {best[0]} devices; "
                       f"e.g. plan.min_tokens_per_s={0.9 * best[1]:.0f}, or a larger plan.devices range."])


def _reaching(inputs: PlanInputs, n: int, tried: list) -> Optional[Plan]:
    """The plan on ``n`` devices if its best layout reaches ``min_tokens_per_s``, else None;
    (n, its best tokens/s or 0) appended to ``tried``."""
    try:
        plan = search(inputs, n, explain=False)
    except PlanRefused:
        tried.append((n, 0.0))
        return None
    tried.append((n, float(plan.res["tokens_per_s"][plan.best])))
    return plan if tried[-1][1] >= (inputs.min_tokens_per_s or 0) else None


def _smallest_between(inputs: PlanInputs, plan: Plan, below: Optional[int], tried: list) -> Plan:
    """``plan``, or the plan on a smaller whole-node count above ``below`` that also reaches the
    target (searched when there are at most :data:`BETWEEN_MAX`); ``clusters`` and ``unsearched`` set."""
    between = [] if below is None else whole_nodes_between(below, plan.devices, inputs.devices_per_node)
    unsearched = (below, plan.devices, len(between)) if len(between) > BETWEEN_MAX else ()
    for n in [] if unsearched else between:
        smaller = _reaching(inputs, n, tried)
        if smaller is not None:
            plan = smaller
            break
    plan.clusters, plan.unsearched = sorted(tried), unsearched
    return plan


# --- refusals -----------------------------------------------------------------------------

USER_RULES = {"max_tp": ("max_tp", "tp"), "pp_fixed": ("pp", "pp"), "schedule": ("schedules", "schedule"),
              "zero": ("zero_stages", "zero"), "recompute": ("recompute", "recompute"),
              "sequence_parallel": ("sequence_parallel", "sp"), "offload": ("offload", "offload"),
              "cp_seq": ("cp", "cp"), "ep": ("ep", "ep"), "etp": ("etp", "etp"), "max_cp": ("cp", "cp"),
              "max_ep": ("ep", "ep")}
"""Rules that come from a plan.* constraint: rule key -> (plan field, candidate column)."""
WHY_ASKED_DROPPED = {"offload": ("offload_hw", "offload_zero"), "max_cp": ("max_cp",), "max_ep": ("max_ep",)}
"""Rules that drop what a plan.* constraint asks for (rule key -> the rules that drop the layouts it
keeps): said with the constraint, since they are why nothing passes it."""
UNCONSTRAINED = Constraints(global_batch=(1, 1))
"""Constraints' defaults: what a plan.* field left unset allows."""


def empty_space_line(inputs: PlanInputs, devices: int, space: Space) -> str:
    """Why no layout passes the rules: the user's constraint that drops most, with the values
    that work without it; else the rule that drops most."""
    c, ctx = inputs.constraints, inputs.at(devices)
    where = f"model={ctx.model['name']} on {devices} devices, global batch {_batch(c.global_batch)}"
    for key, (name, col) in sorted(USER_RULES.items(), key=lambda kv: -space.dropped[kv[0]]):
        if not space.dropped[key]:
            continue
        free = replace(c, **{name: getattr(UNCONSTRAINED, name)})
        other = enumerate_layouts(ctx.model, devices, int(ctx.hardware["devices_per_node"]),
                                  int(ctx.train["seq_len"]), free)
        if len(other):
            works = sorted({v.item() for v in np.unique(other.cols[col])})
            return (f"no layout of {where} passes plan.{name}={_hydra(_given(inputs, name))}{_why(key, space)}; "
                    f"{col} values that work: {_hydra(works)}; e.g. plan.{name}={_example(name, works)}.")
    top = max(space.dropped, key=space.dropped.get)
    last = space.emptied_by
    why = f"the last are dropped because {RULES[last]}, " if last and last != top else ""
    return (f"no layout of {where} passes the rules; {why}most because {RULES[top]} "
            f"({space.dropped[top]:,} layouts); {_nearest_that_passes(inputs, devices)}.")


def _passes(inputs: PlanInputs, devices: int, batch: tuple[int, int]) -> bool:
    """Whether any layout of ``devices`` devices at global batch ``batch`` passes the rules."""
    ctx = inputs.at(devices)
    c = replace(inputs.constraints, global_batch=batch)
    return len(enumerate_layouts(ctx.model, devices, int(ctx.hardware["devices_per_node"]),
                                 int(ctx.train["seq_len"]), c)) > 0


def _fits(inputs: PlanInputs, devices: int, batch: tuple[int, int]) -> bool:
    """Whether some layout of ``devices`` devices at global batch ``batch`` passes the rules and
    fits the device (a full search)."""
    try:
        search(replace(inputs, constraints=replace(inputs.constraints, global_batch=batch)), devices, explain=False)
    except PlanRefused:
        return False
    return True


def _first_that_works(candidates, passes, fits):
    """The first candidate that ``passes`` and ``fits``, else the first that ``passes``, else None
    (``fits``, a full evaluation, is asked only of candidates that pass)."""
    first = None
    for c in candidates:
        if passes(c):
            if fits(c):
                return c
            first = first if first is not None else c
    return first


def _nearest_that_passes(inputs: PlanInputs, devices: int) -> str:
    """'e.g. plan.global_batch_size=B' (the nearest batch some layout passes at: a multiple of a dp
    the devices allow) 'or plan.devices=N' (the nearest whole-node count that passes at the batch
    given), each checked, and one where a layout also fits preferred; else the bare advice."""
    lo, hi = inputs.constraints.global_batch
    fixes = []
    dps = [d for d in range(1, devices + 1) if devices % d == 0]
    batches = sorted({max(d, round(lo / d) * d) for d in dps} - {lo}, key=lambda b: (abs(b - lo), b))[:16]
    b = _first_that_works(batches if lo == hi else [], lambda b: _passes(inputs, devices, (b, b)),
                          lambda b: _fits(inputs, devices, (b, b)))
    if b is not None:
        fixes.append(f"plan.global_batch_size={b}")
    node = inputs.devices_per_node
    one_node = inputs.ctx.hardware.get("inter_node_gb_per_s") is None  # no figure to price a second node with
    counts = [n for n in sorted({devices + k * node for k in range(-4, 5)} - {devices},
                                key=lambda n: (abs(n - devices), n))
              if n >= node and n % node == 0 and not (one_node and n > node)]
    n = _first_that_works(counts, lambda n: _passes(inputs, n, (lo, hi)), lambda n: _fits(inputs, n, (lo, hi)))
    if n is not None:
        fixes.append(f"plan.devices={n}")
    return "e.g. " + " or ".join(fixes) if fixes else "try another global batch (plan.global_batch_size) or device count"


def _why(key: str, space: Space) -> str:
    """' (what it keeps is dropped: <rule>, n layouts)' for a constraint of :data:`WHY_ASKED_DROPPED`."""
    related = [k for k in WHY_ASKED_DROPPED.get(key, ()) if space.dropped.get(k)]
    if not related:
        return ""
    top = max(related, key=space.dropped.get)
    return f" (what it keeps is dropped: {RULES[top]}, {space.dropped[top]:,} layouts)"


def _given(inputs: PlanInputs, name: str):
    v = getattr(inputs.constraints, name)
    return list(v) if isinstance(v, tuple) else v


def _example(name: str, works: list):
    return f"[{_hydra(works[0])}]" if name in ("schedules", "zero_stages", "recompute", "sequence_parallel",
                                               "offload", "cp", "ep", "etp") else works[-1]


def _batch(span: tuple[int, int]) -> str:
    return str(span[0]) if span[0] == span[1] else f"[{span[0]}, {span[1]}]"


def nothing_fits_line(plan: Plan) -> str:
    """No layout fits: by how much the leanest misses -- device memory, or, where layouts fit
    the device only with the optimizer offloaded, the node's host memory -- and what would fit
    one: the largest memory headroom, a larger host, or the smallest cluster (whole nodes,
    doubling, up to 64x)."""
    res, ctx = plan.res, plan.ctx
    fits = res["fits"].astype(bool)
    where = (f"no layout of model={ctx.model['name']} fits on {plan.devices} x {device_name(ctx.hardware)} "
             f"({plan.space.raw:,} tried, {len(plan.space):,} valid)")
    if fits.any():  # they fit the device, none the host (rank.feasible)
        return _host_memory_line(plan, where, fits)
    host_ok = res["host_fits"].astype(bool) if "host_fits" in res else np.ones(len(fits), dtype=bool)
    pool = np.flatnonzero(host_ok) if host_ok.any() else np.arange(len(fits))
    lean = int(pool[np.argmin(res["memory_total"][pool])])
    dev_mem = float(ctx.hardware.get("device_memory_gb") or 0) * GB  # refused as null before (xpar.config.checks.hardware)
    need = float(res["memory_total"][lean])
    head = (f"{where}: the leanest, {label(res, lean)}, needs {need / GB:.1f} GB per device, "
            f"{float(res['memory_usable'][lean]) / GB:.1f} GB usable")
    if need <= dev_mem and host_ok[lean]:
        return head + f"; it fits with plan.memory_headroom={max(0.0, 1 - need / dev_mem) - 0.0005:.3f} or less."
    return head + "; " + _smallest_cluster(plan) + "."


def _host_memory_line(plan: Plan, where: str, fits: np.ndarray) -> str:
    """Layouts fit device memory only with the optimizer offloaded, and their states exceed the
    node's host memory: the leanest host need against hardware.host_memory_gb, a host that holds
    it (that layout then fits both), and the smallest cluster."""
    res, hw = plan.res, plan.ctx.hardware
    rows = np.flatnonzero(fits)
    lean = int(rows[np.argmin(res["host_bytes"][rows])])
    need = float(res["host_bytes"][lean])
    host = math.ceil(need / GB / 10) * 10
    return (f"{where}: {len(rows):,} layouts fit device memory, all with the optimizer offloaded, and their states "
            f"exceed the node's host memory: the leanest on the host, {label(res, lean)}, needs {need / GB:,.0f} GB "
            f"per node, more than hardware.host_memory_gb={float(hw.get('host_memory_gb') or 0):g}; it fits with "
            f"hardware.host_memory_gb={host}, or {_smallest_cluster(plan)}.")


BETWEEN_MAX = 7
"""Whole-node sizes between the last doubling that failed and the first that fits which
:func:`_smallest_cluster` also searches (each a full search); past that it says they were not."""


def whole_nodes_between(below: int, above: int, devices_per_node: int) -> list[int]:
    """Device counts of whole nodes strictly between ``below`` and ``above``."""
    return list(range((below // devices_per_node + 1) * devices_per_node, above, devices_per_node))


def _first_fit(plan: Plan, sizes) -> tuple:
    """(devices, plan) of the first of ``sizes`` where some layout fits; (None, None) if none."""
    for n in sizes:
        try:
            return n, search(plan.inputs, n, explain=False)
        except PlanRefused:
            continue
    return None, None


def _smallest_cluster(plan: Plan) -> str:
    """'the smallest cluster that fits the model is N devices (hardware.nodes=k plan.global_batch_size=B):
    <layout>, T tokens/s', searched at 2x, 4x, ... 64x the devices (each a full search), then at
    the whole-node sizes between the last miss and the first fit where there are at most
    :data:`BETWEEN_MAX` (else the line says that those were not searched); B the layout's global
    batch, which an 'auto' batch would not keep at N devices."""
    dpn = plan.inputs.devices_per_node
    n, other = _first_fit(plan, [plan.devices * 2 ** k for k in range(1, 7)])
    if n is None:
        sizes = ", ".join(str(plan.devices * 2 ** k) for k in range(1, 7))
        return (f"no cluster of {sizes} devices (doubling) fits the model; sizes between were not searched (tp x pp must "
                f"divide the devices, pp x v stages split the {plan.ctx.model['n_layers']} layers evenly or with "
                f"lighter ends): plan.devices=<N> searches "
                f"one, or a smaller model or sequence")
    between = whole_nodes_between(n // 2, n, dpn)  # past the last doubling that failed
    claim, unsearched = "the smallest cluster that fits the model is", ""
    if len(between) <= BETWEEN_MAX:
        smaller, plan_there = _first_fit(plan, between)
        if smaller is not None:
            n, other = smaller, plan_there
    else:
        claim = "doubling the devices, the first cluster that fits the model is"
        unsearched = f"; the {len(between)} sizes between {n // 2} and {n} were not searched (plan.devices=<N> searches one)"
    nodes, i = max(1, n // dpn), other.best
    batch = int(other.res["b"][i] * other.res["m"][i] * other.res["dp"][i])  # kept: 'auto' grows with devices
    return (f"{claim} {n} devices (hardware.nodes={nodes} plan.global_batch_size={batch}): "
            f"{label(other.res, i)}, {other.res['tokens_per_s'][i]:,.0f} tokens/s{unsearched}")


# --- the command --------------------------------------------------------------------------

def run_plan(cfg, out_dir: Path, start_dir: Path, overrides: Optional[list[str]] = None,
             sweep: Optional[dict] = None) -> Optional[Plan]:
    """``run.mode=plan``: search, print, record, and on hardware=local execute the top layouts.
    ``overrides``: the command line (default: the running Hydra app's); ``sweep``: the multirun
    job's sweep (xpar.track.sweep.current_sweep), whose parent run the plan's run joins. Bad requests
    exit 2 with one line per problem."""
    t0 = time.perf_counter()
    inputs, problems = plan_inputs(cfg, overrides)
    problems += check_tracking_paths(cfg, start_dir)  # before the search, not after it
    if problems:
        refuse(problems)
    try:
        plan = search_smallest(inputs) if len(inputs.device_counts) > 1 else search(inputs)
        line, spec = reproduce(plan)
    except PlanRefused as e:
        refuse(e.problems)
    plan = replace(plan, notes=tuple(request_notes(spec, list(inputs.overrides)) + auto_batch_notes(cfg, inputs)),
                   yours=tuple(your_layout_lines(plan, cfg, list(inputs.overrides))))
    plan.seconds["plan"] = time.perf_counter() - t0
    print_plan(plan, line)
    executed = []
    if inputs.execute_top:
        executed = execute_top(plan, out_dir, start_dir)
    if cfg.tracking.enabled:
        record_plan(plan, spec, cfg, line, out_dir, start_dir, executed, sweep)
    return plan


def request_notes(spec, overrides: list[str]) -> list[str]:
    """The estimate's notes that no layout changes, for the plan's reader: hardware=local uncalibrated
    (xpar.config.checks.hardware.UNCALIBRATED_LOCAL), the hardware part kept under a changed
    ``hardware.device_memory_gb`` (xpar.config.checks.hardware.part_memory_notes) and the model preset's K/V heads
    kept under a changed ``model.n_heads`` (xpar.config.presets.kept_kv_heads_notes), an FP8 recipe where no FP8 is
    searched (fp8_recipe_notes). ``spec``: the winner's
    RunSpec; ``overrides``: the command line's (its ``model=`` choice, else the composed model's name)."""
    notes = part_memory_notes(spec.hardware) + ([UNCALIBRATED_LOCAL] if spec.hardware.name == "local" else [])
    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("model=")]
    preset = chosen[-1] if chosen else spec.model.name
    searched = [o.split("=", 1)[1] for o in overrides if o.startswith("plan.dtype=")]
    dtypes = [spec.train.dtype] + (["fp8"] if searched and "fp8" in searched[-1] else [])
    return notes + kept_kv_heads_notes(spec.model.n_heads, spec.model.n_kv_heads, preset, overrides) + \
        dense_moe_notes(spec.model.n_experts, overrides) + fp8_recipe_notes(dtypes, overrides)


def reproduce(plan: Plan):
    """The ``python -m xpar ...`` line of the winner, and its RunSpec: the line composed by Hydra,
    validated and resolving to the winner's layout (:func:`xpar.plan.verify.composed_spec`).

    Raises:
        PlanRefused: the line does not compose, validate or fit (a planner bug, said as such).
    """
    line = override_line(plan)
    spec, problem = composed_spec(line, row(plan.res, plan.best))
    if problem:
        raise PlanRefused([f"planner error: the top layout's command line does not reproduce it: {problem} "
                           f"(line: {line})"])
    return line, spec
