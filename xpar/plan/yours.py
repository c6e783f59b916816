"""Your layout in the plan: where the layout a ``xpar plan`` command states (its ``parallel=`` preset or
``parallel.*`` keys, with ``train.micro_batch_size``) ranks among the plan's layouts, and what separates it
from the best of its degree group and from the winner, term by term (:func:`xpar.plan.rank.term_seconds_per_token`).
A layout outside the plan's space says which axis or rule leaves it out; one that does not fit says by how much.

The same functions give ``benchmarks/plan_published.py`` and ``plan_heldout.py`` the published layout's place.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from omegaconf import OmegaConf

from xpar.config.checks import ConfigError
from xpar.config.validate import validate
from xpar.estimate.cost import peak_memory
from xpar.estimate.terms import TERM_WORDS
from xpar.plan.explain import label
from xpar.plan.groups import degree_columns, differing_axes, group_ranks
from xpar.plan.rank import term_seconds_per_token, terms
from xpar.plan.space import enumerate_layouts

GB = 1e9
LAYOUT_KEYS = ("parallel=", "parallel.", "train.micro_batch_size=")
"""Overrides that state a layout: the plan then places it (other parallel.* keys are not the plan's)."""


def states_layout(overrides: list[str]) -> bool:
    """Whether the command line states a layout (:data:`LAYOUT_KEYS`; ``parallel.micro_batches`` alone does not)."""
    return any(o.lstrip("+~").startswith(LAYOUT_KEYS) and not o.startswith("parallel.micro_batches=")
               for o in overrides)


def stated_spec(cfg, global_batch: Optional[int], devices: int):
    """The RunSpec of the layout ``cfg`` states, validated as ``run.mode=estimate`` at the plan's global batch
    (``global_batch`` sequences; None keeps ``cfg``'s) on the plan's ``devices`` (hardware=local: the local devices
    the plan counted). Raises ConfigError where it does not validate."""
    over = {"run": {"mode": "estimate"}, "parallel": {"micro_batches": "auto"}}
    if global_batch:
        over["train"] = {"global_batch_size": int(global_batch)}
    return validate(OmegaConf.merge(cfg, over), local_devices=devices)


def layout_degrees(spec, res: dict) -> dict:
    """The degree group of ``spec``'s layout in the plan's columns ``res`` (ZeRO as it runs: 0 at dp 1;
    etp 0 where it equals tp, :mod:`xpar.plan.axes`)."""
    lay = spec.layout
    etp = lay.etp if lay.etp and lay.etp != lay.tp else 0
    d = dict(tp=lay.tp, pp=lay.pp, dp=lay.dp, cp=lay.cp, ep=lay.ep, zero=lay.zero_stage if lay.dp > 1 else 0, etp=etp)
    return {k: d[k] for k in degree_columns(res)} | ({"etp": etp} if etp else {})


def group_mask(res: dict, degrees: dict) -> np.ndarray:
    """Rows of the plan's columns ``res`` in the degree group ``degrees`` (:func:`layout_degrees`)."""
    mine = np.ones(len(res["tp"]), dtype=bool)
    for k, v in degrees.items():
        mine &= (np.asarray(res[k]) if k in res else np.zeros(len(mine), dtype=np.int64)) == v
    return mine


def layout_row(res: dict, spec, degrees: dict) -> Optional[int]:
    """The plan's row of ``spec``'s layout itself (its group, b, recompute; sp under tp; schedule and v under
    pp; no offload; its micro-batch count where the plan holds several), fitting or not; None when the space
    does not hold it."""
    lay = spec.layout
    mine = group_mask(res, degrees) & (res["b"] == lay.micro_batch_size) & (res["recompute"] == lay.recompute)
    if lay.tp > 1:
        mine &= res["sp"] == lay.sequence_parallel
    if lay.pp > 1:
        mine &= (res["schedule"] == lay.schedule) & (res["v"] == lay.virtual_stages)
    if "offload" in res:
        mine &= ~res["offload"].astype(bool)
    if "m" in res and (mine & (res["m"] == lay.micro_batches)).any():
        mine &= res["m"] == lay.micro_batches
    hit = np.flatnonzero(mine)
    return int(hit[0]) if len(hit) else None


def gap_words(res: dict, i: int, j: int, n: int = 2) -> str:
    """The ``n`` step terms where row ``i`` loses most to row ``j`` (seconds per token, as a share of ``j``'s
    step per token), and the term where it gains most: '+22.4 % matmul; +9.0 % pipeline bubble (saves ...)'."""
    mine, ref = term_seconds_per_token(res, np.array([i])), term_seconds_per_token(res, np.array([j]))
    total = sum(ref[k][0] for k in terms(res))
    diff = sorted(((float(mine[k][0] - ref[k][0]) / total, k) for k in terms(res)), reverse=True)
    words = [f"{100 * d:+.1f} % {TERM_WORDS[k]}" for d, k in diff[:n] if d > 0.0005]
    gains = [f"{100 * d:+.1f} % {TERM_WORDS[k]}" for d, k in diff[::-1][:1] if d < -0.0005]
    return "; ".join(words) + (f" (saves {gains[0]})" if gains else "") or "no term"


def choices(res: dict, i: int) -> str:
    """A row's choices inside its degree group: 'interleaved_1f1b v4 b1 sp1 selective'."""
    return f"{res['schedule'][i]} v{res['v'][i]} b{res['b'][i]} sp{int(res['sp'][i])} {res['recompute'][i]}"


def why_not(plan, degrees: dict) -> str:
    """The searched axis that leaves the degree group ``degrees`` out of ``plan``'s space, or the space's rule
    that drops it (a :data:`xpar.plan.space.RULES` key)."""
    c, ctx = plan.inputs.constraints, plan.ctx
    for k, dom in (("cp", c.cp), ("ep", c.ep), ("etp", c.etp), ("zero", c.zero_stages)):
        if k in degrees and degrees[k] not in dom:
            return f"{k} {degrees[k]} not in plan.{k}{'_stages' if k == 'zero' else ''} {list(dom)}"
    if "zero" in degrees and degrees["pp"] > 1 and degrees["zero"] not in c.pp_zero_stages:
        return f"ZeRO {degrees['zero']} with pp not in framework.pp_zero_stages {list(c.pp_zero_stages)}"
    space = enumerate_layouts(ctx.model, plan.devices, int(ctx.hardware["devices_per_node"]),
                              int(ctx.train["seq_len"]), c, watch=degrees)
    return f"rule {space.watch_dropped_by}" if space.watch_dropped_by else "not in the product of the plan's axes"


def your_layout_lines(plan, cfg, overrides: list[str]) -> list[str]:
    """Where the layout the command states ranks in ``plan`` (module docstring): [] when it states none.

    ``cfg``: the plan's composed config; ``overrides``: its command line. The stated layout is validated at the
    plan's global batch where that is one value; a layout that does not validate says why, in one line.
    """
    if not states_layout(overrides):
        return []
    lo, hi = plan.inputs.constraints.global_batch
    try:
        spec = stated_spec(cfg, lo if lo == hi else None, plan.devices)
    except ConfigError as e:
        return [f"Your layout (the command's parallel.*) is not placed: {e.problems[0]}"]
    lay = spec.layout
    head = (f"Your layout (tp{lay.tp} pp{lay.pp} dp{lay.dp}" + "".join(f" {k}{getattr(lay, k)}" for k in ("cp", "ep")
            if getattr(lay, k) > 1) + f" b{lay.micro_batch_size} ZeRO-{lay.zero_stage} recompute={lay.recompute})")
    if lay.world_size != plan.devices:
        return [f"{head} uses {lay.world_size} devices, the plan {plan.devices}: not placed."]
    deg = layout_degrees(spec, plan.res)
    mine = group_mask(plan.res, deg)
    if not mine.any():
        return [f"{head}: its degrees are not in the plan's space ({why_not(plan, deg)})."]
    i = layout_row(plan.res, spec, deg)
    return [f"{head}: {_offload_words(plan.res, i, spec)}{_placed(plan, i, mine)}"] + _separation(plan, i, mine)


def _offload_words(res: dict, i: Optional[int], spec) -> str:
    """Where the plan's row offloads another number of blocks' activations than the command states
    (xpar.plan.offload_fit: the fewest that fit): the stated layout's peak where it does not fit, and the plan's N;
    '' otherwise."""
    n = int(res["act_offload"][i]) if i is not None and "act_offload" in res else 0
    stated = spec.parallel.activation_offload_layers or 0
    if n == stated:
        return ""
    mem = peak_memory(spec)
    over = "" if mem.fits else f"as stated {mem.total / GB:.1f} GB per device does not fit {mem.usable / GB:.1f} GB usable; "
    return f"{over}with parallel.activation_offload_layers={n} (the plan's: the fewest blocks that fit, stated {stated}) "


def _placed(plan, i: Optional[int], mine: np.ndarray) -> str:
    """Its tokens/s against the winner's, its rank and its degree group's rank, or why it is not ranked."""
    res, best = plan.res, plan.best
    if i is None:
        return ("its degrees are in the plan's space, its own choices (schedule, v, b, sp, recompute) are not "
                "(plan.schedules, plan.recompute, plan.sequence_parallel, the micro-batch sizes searched)")
    rel = float(res["tokens_per_s"][i] / res["tokens_per_s"][best] - 1)
    tie = " (a tie)" if plan.inputs.tie_within and rel >= -plan.inputs.tie_within else ""
    words = f"{res['tokens_per_s'][i]:,.0f} tokens/s, {100 * rel:+.1f} % against the best{tie}"
    if not res["fits"][i]:
        return (f"{words}, but {res['memory_total'][i] / GB:.1f} GB per device does not fit "
                f"{res['memory_usable'][i] / GB:.1f} GB usable")
    where = np.flatnonzero(plan.ranked == i)
    groups = group_ranks(res, plan.ranked)
    return (f"{words}; rank {where[0] + 1} of {len(plan.ranked):,} layouts that fit, its degree group "
            f"{groups[where[0]]} of {groups.max()}")


def _separation(plan, i: Optional[int], mine: np.ndarray) -> list[str]:
    """What separates it from its degree group's best and that best from the winner, term by term."""
    res, best = plan.res, plan.best
    group = plan.ranked[mine[plan.ranked]]
    if not len(group):
        return ["  no layout of its degree group fits the device memory (recompute, sp and b as searched)"]
    out = []
    g = int(group[0])
    if i is not None and i != g:  # what the slower of the two loses to the faster, term by term
        slower, faster = (i, g) if res["tokens_per_s"][g] >= res["tokens_per_s"][i] else (g, i)
        fit = "" if res["fits"][i] else " that fits"
        out.append(f"  the best of its degree group{fit} ({choices(res, g)}): {_gain(res, g, i)} tokens/s"
                   f"{'' if slower == i else ', as it pays'}: {gap_words(res, slower, faster)}")
    if g != best:
        out.append(f"  the winner ({differing_axes(res, best, g)}; {label(res, best)}): "
                   f"{_gain(res, best, g)} tokens/s over its group's best: {gap_words(res, g, best)}")
    else:
        out.append("  its degree group is the winner's")
    return out


def _gain(res: dict, i: int, j: int) -> str:
    return f"{100 * float(res['tokens_per_s'][i] / res['tokens_per_s'][j] - 1):+.1f} %"
