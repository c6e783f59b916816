"""Why the winner wins, in a few lines from the numbers: which constraint binds (memory, the
pipeline bubble, communication) and what the best alternatives that differ from it in one
choice lose."""
from __future__ import annotations

from typing import Optional

import numpy as np

from xpar.estimate.terms import TERM_WORDS, time_key
from xpar.plan.groups import DEGREES, degree_columns
from xpar.plan.rank import describe_gap, feasible, separating_terms, terms

GB = 1e9
ALTERNATIVES = (("tp", "tp"), ("pp", "pp"), ("zero", "ZeRO stage"), ("recompute", "recompute"),
                ("schedule", "schedule"), ("b", "micro-batch size"), ("sp", "sequence parallelism"),
                ("offload", "optimizer offload"), ("cp", "cp"), ("ep", "ep"), ("dtype", "dtype"), ("etp", "etp"))
"""Columns along which the best different layout is reported, and their names in words."""


def device_name(hardware: dict) -> str:
    """The device of a hardware group in words: the GPU model, else the device kind."""
    return hardware.get("gpu") or f"{hardware.get('device', 'device')} worker"


def label(res: dict[str, np.ndarray], i: int) -> str:
    """A layout in one short line: degrees, schedule, micro-batching, ZeRO, sp, recompute."""
    pipe = f" {res['schedule'][i]}" + (f" v{res['v'][i]}" if res["v"][i] > 1 else "") if res["pp"][i] > 1 else ""
    sp = " sp" if res["sp"][i] else ""
    off = " offload" if "offload" in res and res["offload"][i] else ""
    off += f" act-offload={res['act_offload'][i]}" if "act_offload" in res and res["act_offload"][i] else ""
    five = "".join(f" {k}{res[k][i]}" for k in ("cp", "ep") if k in res and res[k][i] > 1)
    five += f" etp{res['etp'][i]}" if "etp" in res and res["etp"][i] > 0 else ""
    dtype = f" {res['dtype'][i]}" if "dtype" in res else ""
    return (f"tp{res['tp'][i]} pp{res['pp'][i]} dp{res['dp'][i]}{five}{pipe} b{res['b'][i]} m{res['m'][i]} "
            f"ZeRO-{res['zero'][i]}{sp}{off} recompute={res['recompute'][i]}{dtype}")


def step_shares(res: dict[str, np.ndarray], i: int) -> dict[str, float]:
    """Fraction of the step time of layout ``i`` in each term (they sum to 1)."""
    total = float(res["time_per_step_s"][i])
    return {k: float(res[time_key(k)][i]) / total for k in terms(res)}


def memory_line(res: dict[str, np.ndarray], ranked: np.ndarray, valid: np.ndarray) -> str:
    """Whether memory binds: the fastest valid layout of all (fitting or not) against the winner."""
    best, fits = ranked[0], feasible(res)
    idx = np.flatnonzero(valid)
    fastest = idx[np.argmax(res["tokens_per_s"][idx])]
    usable = float(res["memory_usable"][best]) / GB
    if fits[fastest] or res["tokens_per_s"][fastest] <= res["tokens_per_s"][best]:
        return (f"Memory does not bind: the fastest valid layout fits ({res['memory_total'][best] / GB:.1f} GB of "
                f"{usable:.1f} GB usable per device).")
    faster = int((valid & ~fits & (res["tokens_per_s"] > res["tokens_per_s"][best])).sum())
    gain = res["tokens_per_s"][fastest] / res["tokens_per_s"][best] - 1
    return (f"Memory binds: {faster:,} valid layouts would be faster but do not fit; the fastest, "
            f"{label(res, fastest)}, would give +{100 * gain:.0f} % tokens/s and needs "
            f"{res['memory_total'][fastest] / GB:.1f} GB per device ({usable:.1f} GB usable).")


def overhead_line(res: dict[str, np.ndarray], i: int) -> str:
    """Where the winner's step goes, the largest overhead (everything but matmul) named."""
    shares = step_shares(res, i)
    parts = ", ".join(f"{TERM_WORDS[k]} {100 * v:.0f} %" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])
                      if v >= 0.005)
    over = max((k for k in shares if k != "matmul"), key=lambda k: shares[k])
    if shares[over] < 0.005:
        return (f"Its step ({res['time_per_step_s'][i]:.3g} s): {parts}. No overhead is estimated (this hardware "
                f"has no figures for memory bandwidth or links).")
    kind = {"bubble": "the pipeline bubble", "memory_bound": "memory-bound work", "optimizer": "the optimizer step",
            "ep_imbalance": "the router imbalance (model.moe_imbalance)",
            "host_overhead": "host and framework overhead (operator dispatch, framework.layer_overhead_ms)"}
    binds = kind.get(over, "communication (" + TERM_WORDS[over] + ")")
    return (f"Its step ({res['time_per_step_s'][i]:.3g} s): {parts}. The largest overhead is {binds}, "
            f"{100 * shares[over]:.0f} % of the step.")


def offload_line(res: dict[str, np.ndarray], i: int, hardware: dict) -> str:
    """What offloading the optimizer costs layout ``i`` ('' when it does not offload): the host
    AdamW step and the exposed PCIe copies per step (xpar.estimate.memory.offload), and the host memory
    its states take per node."""
    if "offload" not in res or not res["offload"][i]:
        return ""
    host, pcie = float(res["offload_host_step_s"][i]), float(res["offload_pcie_s"][i])
    share = (host + pcie) / float(res["time_per_step_s"][i])
    return (f"Optimizer offloaded to host memory (ZeRO-Offload's schedule, xpar.estimate.memory.offload): +{host:.3g} s "
            f"host AdamW, +{pcie:.3g} s PCIe per step ({100 * share:.1f} % of the step); its states take "
            f"{float(res['host_bytes'][i]) / GB:,.0f} GB of the node's {float(hardware.get('host_memory_gb') or 0):,.0f} "
            f"GB host memory.")


def alternative_lines(res: dict[str, np.ndarray], ranked: np.ndarray, tie_within: float = 0.0) -> list[str]:
    """For each choice in :data:`ALTERNATIVES`, the best feasible layout that differs from the
    winner in it, not already printed (for a degree axis: not of a degree group already printed,
    :mod:`xpar.plan.groups`): its tokens/s against the winner's and the term that separates them;
    'a tie' where it is within ``tie_within`` (plan.tie_within, a fraction) of the winner, as in the table."""
    best, out, shown = ranked[0], [], set()
    for col, words in ALTERNATIVES:
        if col not in res:
            continue
        degree = col in DEGREES
        key = (lambda i: tuple(res[k][i] for k in degree_columns(res))) if degree else (lambda i: i)
        other = (j for j in ranked[res[col][ranked] != res[col][best]] if key(j) not in shown)
        j = next(other, None)
        if j is None:
            continue
        shown.add(key(j))
        loss = 1 - res["tokens_per_s"][j] / res["tokens_per_s"][best]
        term, frac = separating_terms(res, np.array([j]), best)[0]
        gap = f": {describe_gap(term, frac)}" if term else ""
        lost = "the same tokens/s" if abs(loss) < 0.0005 else f"-{100 * loss:.1f} % tokens/s"
        tie = f", a tie (within {100 * tie_within:g} %)" if tie_within and loss <= tie_within else ""
        out.append(f"  best with another {words} ({label(res, j)}): {lost}{tie}{gap}")
    return out


def explain(res: dict[str, np.ndarray], ranked: np.ndarray, valid: np.ndarray,
            hardware: Optional[dict] = None, tie_within: float = 0.0) -> list[str]:
    """The winner's reasoning: the memory line, where its step goes, an offloaded optimizer's
    cost, what alternatives lose. ``ranked``: feasible layouts best first; ``valid``: rows
    passing every rule but memory; ``hardware``: the hardware group (host memory); ``tie_within``: the
    alternatives within it of the winner are marked as ties (:func:`alternative_lines`)."""
    best = ranked[0]
    head = (f"Winner: {label(res, best)}: {res['tokens_per_s'][best]:,.0f} tokens/s, MFU "
            f"{100 * res['mfu'][best]:.1f} %, {res['memory_total'][best] / GB:.1f} GB per device.")
    off = offload_line(res, best, hardware or {})
    alternatives = alternative_lines(res, ranked, tie_within)  # none where the winner is the only layout that fits
    if not alternatives:  # the heading stood over nothing (deepseek_v3 on 80 H100s: 1 layout fits)
        alternatives = ["  none: no other layout fits." if len(ranked) == 1 else "  none differs in a searched axis."]
    return [head, memory_line(res, ranked, valid), overhead_line(res, best)] + ([off] if off else []) + [
        "What the next-best alternatives lose:"] + alternatives
