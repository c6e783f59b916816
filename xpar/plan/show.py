"""The plan on the console: the ranked table (rich), what was dropped and why, the winner's
reasoning, and the command line that reproduces it."""
from __future__ import annotations

import numpy as np

from xpar.estimate.columns.stage_split import split_fields
from xpar.plan.explain import device_name, explain
from xpar.plan.groups import differing_axes, group_heads, ties
from xpar.plan.rank import describe_gap, separating_terms
from xpar.plan.space import RULES

GB = 1e9
SKIP = ("plan.", "plan=", "run.mode=", "parallel.", "train.global_batch_size=", "train.micro_batch_size=",
        "hardware.memory_headroom=", "hardware.nodes=", "hardware.devices_per_node=",
        "framework.cpu_offload_optimizer=", "train.dtype=")
"""Overrides the reproducing line replaces with the winner's values."""


def override_line(plan) -> str:
    """``python -m xpar <user's overrides> <the winner's parallel.* and train batch>``: the run
    of the winning layout (hardware nodes and memory headroom as planned; a split with lighter
    ends as ``parallel.first_stage_layers`` / ``last_stage_layers``, :func:`split_overrides`)."""
    r, i, ctx = plan.res, plan.best, plan.ctx
    keep = [o for o in plan.inputs.overrides if not o.lstrip("+~").startswith(SKIP)]
    par = [f"parallel.dp={r['dp'][i]}", f"parallel.tp={r['tp'][i]}", f"parallel.pp={r['pp'][i]}",
           f"parallel.zero_stage={r['zero'][i]}", f"parallel.micro_batches={r['m'][i]}",
           f"parallel.schedule={r['schedule'][i]}", f"parallel.virtual_stages={r['v'][i]}",
           f"parallel.sequence_parallel={str(bool(r['sp'][i])).lower()}", f"parallel.recompute={r['recompute'][i]}",
           f"train.micro_batch_size={r['b'][i]}", f"train.global_batch_size={r['b'][i] * r['m'][i] * r['dp'][i]}"]
    if "act_offload" in r and r["act_offload"][i]:  # xpar.plan.offload_fit
        par.append(f"parallel.activation_offload_layers={r['act_offload'][i]}")
    if "offload" in r and (r["offload"][i] or ctx.framework.get("cpu_offload_optimizer")):
        par.append(f"framework.cpu_offload_optimizer={str(bool(r['offload'][i])).lower()}")
    preset = any(o.lstrip("+~").startswith("parallel=") for o in plan.inputs.overrides)  # may set cp, ep, a split
    par += [f"parallel.{k}={r[k][i]}" for k in ("cp", "ep") if k in r and (r[k][i] != 1 or preset)]
    par += [f"parallel.etp={r['etp'][i]}"] if "etp" in r and r["etp"][i] > 0 else []
    par += split_overrides(int(ctx.model["n_layers"]), int(r["pp"][i]), int(r["v"][i]), preset)
    if "dtype" in r or any(o.lstrip("+").startswith("train.dtype=") for o in plan.inputs.overrides):
        par.append(f"train.dtype={r['dtype'][i] if 'dtype' in r else ctx.train['dtype']}")
    hw = ctx.hardware
    if hw["name"] != "local" or int(hw.get("nodes") or 1) > 1:  # a local plan over nodes names them too
        par.append(f"hardware.nodes={hw['nodes']}")
        given = any(o.startswith("hardware.devices_per_node=") for o in plan.inputs.overrides)
        if given or int(hw["devices_per_node"]) != plan.inputs.devices_per_node:
            par.append(f"hardware.devices_per_node={hw['devices_per_node']}")
    if hw.get("memory_headroom"):
        par.append(f"hardware.memory_headroom={hw['memory_headroom']}")
    return "python -m xpar " + " ".join(keep + par)


def split_overrides(n_layers: int, pp: int, v: int, preset: bool) -> list[str]:
    """``parallel.first_stage_layers=F parallel.last_stage_layers=L`` where pp x v does not divide
    the blocks (:func:`xpar.estimate.columns.stage_split.split_fields`); both ``null`` where the split is even but a
    ``parallel=`` preset may set them (conf/parallel/deepseek_v3_2048gpu.yaml does); else none."""
    fields = split_fields(n_layers, pp, v)
    if not fields and not preset:
        return []
    return [f"parallel.{k}={fields.get(k, 'null')}" for k in ("first_stage_layers", "last_stage_layers")]


def ranked_table(plan):
    """The best layout of each of the top ``top_k`` degree groups (:mod:`xpar.plan.groups`) as a rich
    Table: memory per device in GB, MFU, bubble ratio, tokens/s against the best (ties within
    ``plan.tie_within`` marked), the layouts in the group, and what separates it from the best."""
    from rich.table import Table

    r = plan.res
    heads, sizes = group_heads(r, plan.ranked)
    top, sizes = heads[:plan.inputs.top_k], sizes[:plan.inputs.top_k]
    tied = ties(r, top, plan.best, plan.inputs.tie_within)
    lo, hi = plan.inputs.constraints.global_batch
    batch = r["b"] * r["m"] * r["dp"]  # a range of global batches: each row's own, in a column
    t = Table(title=f"xpar plan: the best of the top {len(top)} of {len(heads):,} degree groups ({len(plan.ranked):,} "
                    f"layouts fit; model={plan.ctx.model['name']}, {plan.devices} x {device_name(plan.ctx.hardware)}, "
                    f"global batch {int(batch[plan.best]) if lo == hi else f'{lo}-{hi} (column B)'}) -- ESTIMATE; "
                    f"'tie': within {100 * plan.inputs.tie_within:.0f} % of the best, closer than the estimate's error")
    five = searched(plan)
    for col in ("#", "tp", "pp", "dp") + five + ("schedule", "b", "m") + (("B",) if lo != hi else ()) + (
            "ZeRO", "sp", "recompute", "offload", "tokens/s", "vs best", "MFU", "bubble", memory_header(plan),
            "layouts", "separates it from the best"):
        t.add_column(col, justify="left" if col in ("schedule", "recompute", "separates it from the best") else "right",
                     no_wrap=col != "separates it from the best", min_width=36 if col.startswith("separates") else None)
    for n, (i, size, tie) in enumerate(zip(top, sizes, tied), 1):
        t.add_row(str(n), *(str(r[k][i]) for k in ("tp", "pp", "dp") + five), *_row_tail(plan, i, n, tie, batch),
                  str(int(size)), separation(r, i, plan.best))
    return t


def more_ties_line(plan) -> list[str]:
    """A line where more degree groups tie with the winner (within ``plan.tie_within``) than the table's
    ``top_k`` rows show: how many more, and the ``plan.top_k`` that lists them all ([] otherwise)."""
    heads, _ = group_heads(plan.res, plan.ranked)
    tied = int(ties(plan.res, heads, plan.best, plan.inputs.tie_within).sum())
    more = tied - min(plan.inputs.top_k, len(heads))
    if more <= 0:
        return []
    return [f"{more} more degree group{'s tie' if more > 1 else ' ties'} with the best (within "
            f"{100 * plan.inputs.tie_within:.0f} %, closer than the estimate's error) below the table: "
            f"plan.top_k={tied} lists them all."]


def memory_header(plan) -> str:
    """The memory column's header: GB per device against the usable GB (device memory less the headroom)."""
    hw = plan.ctx.hardware
    usable = float(plan.res["memory_usable"][plan.best]) / GB if "memory_usable" in plan.res else 0.0
    headroom = float(hw.get("memory_headroom") or 0.0)
    return f"GB/device of {usable:.1f} usable" + (f" ({100 * headroom:.0f} % kept free)" if headroom else "")


def _row_tail(plan, i: int, n: int, tie: bool, batch) -> list[str]:
    """A table row from the schedule to the memory per device."""
    r, (lo, hi) = plan.res, plan.inputs.constraints.global_batch
    sched = (f"{r['schedule'][i]}" + (f" v{r['v'][i]}" if r["v"][i] > 1 else "")) if r["pp"][i] > 1 else "-"
    rel = r["tokens_per_s"][i] / r["tokens_per_s"][plan.best] - 1
    vs = "best" if n == 1 else _signed(rel) + (" tie" if tie else "")
    return [sched, str(r["b"][i]), str(r["m"][i]), *((str(int(batch[i])),) if lo != hi else ()),
            str(r["zero"][i]), "yes" if r["sp"][i] else "", str(r["recompute"][i]) + _act_offload_words(r, i),
            "yes" if "offload" in r and r["offload"][i] else "", f"{r['tokens_per_s'][i]:,.0f}", vs,
            f"{100 * r['mfu'][i]:.1f} %", f"{100 * r['bubble_ratio'][i]:.1f} %", f"{r['memory_total'][i] / GB:.1f}"]


def _act_offload_words(r, i: int) -> str:
    """' + offload 64 blocks' where layout ``i`` offloads activations (xpar.plan.offload_fit), else ''."""
    return f" + offload {r['act_offload'][i]} blocks" if "act_offload" in r and r["act_offload"][i] else ""


def separation(res, i: int, best: int) -> str:
    """'tp 8->4; +3.1 % pipeline bubble': the degrees in which layout ``i`` differs from the best and
    the step-time term that separates them most ('' for the best itself)."""
    if i == best:
        return ""
    gap = describe_gap(*separating_terms(res, np.array([i]), best)[0])
    return "; ".join(x for x in (differing_axes(res, i, best), gap) if x)


def searched(plan) -> tuple[str, ...]:
    """The cp, ep, dtype and etp columns the plan searched over more than one value (shown then)."""
    return tuple(k for k in ("cp", "ep", "dtype", "etp") if k in plan.res and len(np.unique(plan.res[k])) > 1)


def _signed(rel: float) -> str:
    """'-1.8 %', or '0.0 %' for a tie (no sign)."""
    return "0.0 %" if abs(rel) < 0.0005 else f"{100 * rel:+.1f} %"


def dropped_lines(plan) -> list[str]:
    """Layouts tried, valid, fitting, and the count each rule dropped (non-zero ones)."""
    d, s = plan.dropped, plan.seconds
    n = len(plan.space)
    lines = [f"{plan.space.raw:,} layouts in the space, {n:,} valid, {len(plan.ranked):,} fit; evaluated in "
             f"{s.get('evaluate', 0):.2f} s ({n / max(s.get('evaluate', 0), 1e-9):,.0f} layouts/s), "
             f"enumerated in {s.get('enumerate', 0):.2f} s. Dropped:"]
    words = dict(RULES, memory="does not fit device memory (cost model, with the memory headroom)",
                 host_memory="offloaded optimizer states do not fit the node's host memory (hardware.host_memory_gb)")
    lines += [f"  {v:>12,}  {words[k]}" for k, v in d.items() if v]
    return lines


def cluster_lines(plan) -> list[str]:
    """With a devices range: the best tokens/s on each device count tried."""
    if not plan.clusters:
        return []
    out = [f"Smallest cluster reaching {plan.inputs.min_tokens_per_s:,.0f} tokens/s: {plan.devices} devices."]
    if plan.unsearched:
        below, above, count = plan.unsearched
        out = [f"First cluster tried that reaches {plan.inputs.min_tokens_per_s:,.0f} tokens/s: {plan.devices} devices; "
               f"the {count} whole-node counts between {below} and {above} were not searched (plan.devices=<N> "
               f"searches one)."]
    out += [f"  {n:>6} devices: " + (f"{tps:,.0f} tokens/s" if tps else "no layout fits") for n, tps in plan.clusters]
    return out


def print_plan(plan, line: str) -> None:
    """Everything above, on the console."""
    from rich.console import Console

    table = ranked_table(plan)
    console = Console(width=max(200, Console().width))
    if not console.is_terminal:  # a pipe or file: as wide as the table and its title, never cut
        need = Console(width=100_000).measure(table).maximum
        console = Console(width=max(200, need, len(str(table.title or "")) + 4))
    console.print(table)
    why = explain(plan.res, plan.ranked, _valid(plan), plan.ctx.hardware, plan.inputs.tie_within)
    for text in more_ties_line(plan) + dropped_lines(plan) + cluster_lines(plan) + [""] + why + ([""] + list(plan.yours) if plan.yours else []):
        console.print(text, highlight=False, markup=False)
    console.print("\nReproduce the top layout:\n  " + line, highlight=False, markup=False, soft_wrap=True)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)


def _valid(plan) -> np.ndarray:
    return np.ones(len(plan.space), dtype=bool)
