"""Ranking the feasible layouts: order by estimated tokens/s, the step-time term that separates
each from the best, and the Pareto front of memory per device against tokens/s."""
from __future__ import annotations

import numpy as np

from xpar.estimate.terms import AXIS_TIME_TERMS, SETTING_TIME_TERMS, TERM_WORDS, TIME_TERMS, time_key


def terms(res: dict[str, np.ndarray]) -> tuple[str, ...]:
    """The step-time terms the candidate figures hold: TIME_TERMS, then cp's, ep's and activation offload's where
    present."""
    return TIME_TERMS + tuple(k for k in AXIS_TIME_TERMS + SETTING_TIME_TERMS if time_key(k) in res)


def feasible(res: dict[str, np.ndarray]) -> np.ndarray:
    """Layouts that fit: device memory (``fits``) and, for an offloaded optimizer, the node's
    host memory (``host_fits``, when the columns hold it)."""
    fits = np.asarray(res["fits"], dtype=bool)
    return fits & np.asarray(res["host_fits"], dtype=bool) if "host_fits" in res else fits


def order(res: dict[str, np.ndarray], keep: np.ndarray) -> np.ndarray:
    """Indices of the rows where ``keep`` holds, best first: highest tokens/s, then, among equal
    estimates, the simplest layout -- lowest ZeRO stage, fewest pipeline stages, fewest devices
    in a tp group, fewest micro-batches -- then least memory per device. Exact ties come where the hardware has no
    communication figures (an uncalibrated hardware=local: every layout estimated as its
    matmuls), and there the simplest is the one to run first."""
    idx = np.flatnonzero(keep)
    keys = (res["memory_total"][idx], res["m"][idx], res["tp"][idx], res["pp"][idx], res["zero"][idx],
            -res["tokens_per_s"][idx])
    return idx[np.lexsort(keys)]


def term_seconds_per_token(res: dict[str, np.ndarray], rows) -> dict[str, np.ndarray]:
    """Seconds per token of each step-time term at ``rows`` (term seconds / tokens per step;
    tokens per step = tokens/s x step time)."""
    tokens = res["tokens_per_s"][rows] * res["time_per_step_s"][rows]
    return {k: res[time_key(k)][rows] / tokens for k in terms(res)}


def separating_terms(res: dict[str, np.ndarray], rows: np.ndarray, best: int) -> list[tuple[str, float]]:
    """For each row, the term whose time per token exceeds the best layout's by the most, and by
    how much as a fraction of the best's step time per token ((term_i - term_best) / T_best, per
    token, so layouts at another global batch compare fairly); ('', 0.0) for the best itself."""
    mine, ref = term_seconds_per_token(res, rows), term_seconds_per_token(res, np.array([best]))
    names = terms(res)
    total = sum(ref[k][0] for k in names)
    diff = np.stack([(mine[k] - ref[k][0]) / total for k in names])
    out = []
    for j, r in enumerate(rows):
        k = int(np.argmax(diff[:, j]))
        out.append(("", 0.0) if r == best or diff[k, j] <= 0 else (names[k], float(diff[k, j])))
    return out


def describe_gap(term: str, frac: float) -> str:
    """'+18 % exposed dp communication' (or '' for none)."""
    if not term:
        return ""
    pct = 100 * frac
    return f"+{pct:.1f} % {TERM_WORDS[term]}" if pct < 9.95 else f"+{pct:.0f} % {TERM_WORDS[term]}"


def pareto_front(memory: np.ndarray, tokens_per_s: np.ndarray) -> np.ndarray:
    """Indices of the layouts no other beats on both less memory and more tokens/s, by increasing
    memory (ties in memory: the fastest only)."""
    idx = np.lexsort((-tokens_per_s, memory))
    fast = tokens_per_s[idx]
    before = np.concatenate([[-np.inf], np.maximum.accumulate(fast)[:-1]])
    return idx[fast > before]
