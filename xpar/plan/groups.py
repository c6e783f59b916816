"""The plan's list of distinct choices: layouts grouped by their degrees (tp, pp, dp, cp, ep, ZeRO
stage, etp), the best of each group in rank order, ties with the winner marked (within the estimator's
stated error, ``plan.tie_within``), and the axes that separate a group from the winner's."""
from __future__ import annotations

import numpy as np

DEGREES = ("tp", "pp", "dp", "cp", "ep", "zero", "etp")
"""The columns that make a degree group (a choice of devices per axis and of sharding); schedule,
v, b, m, sp, recompute, offload and dtype vary inside a group."""


def degree_columns(res: dict[str, np.ndarray]) -> tuple[str, ...]:
    """The columns of :data:`DEGREES` that the candidate figures hold (cp and ep where searched)."""
    return tuple(k for k in DEGREES if k in res)


def group_heads(res: dict[str, np.ndarray], ranked: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The best layout of each degree group, best first, and the size of each group.

    Args:
        res: candidate columns (one row per layout); ``ranked``: rows that fit, best first.
    Returns:
        (heads, sizes): row indices into ``res`` of each group's best layout in rank order, and the
        number of fitting layouts in that group (same length).
    """
    first, inverse = _groups(res, ranked)
    sizes = np.bincount(inverse, minlength=len(first))
    order = np.argsort(first)  # first occurrence in rank order = the group's best
    return ranked[first[order]], sizes[order]


def group_ranks(res: dict[str, np.ndarray], ranked: np.ndarray) -> np.ndarray:
    """For each of ``ranked``, the 1-based rank of its degree group (1: the winner's group)."""
    first, inverse = _groups(res, ranked)
    rank_of_group = np.empty(len(first), dtype=int)
    rank_of_group[np.argsort(first)] = np.arange(1, len(first) + 1)
    return rank_of_group[inverse]


def _groups(res: dict[str, np.ndarray], ranked: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique over the degree columns of ``ranked``: each group's first position in ``ranked``
    and each row's group."""
    if not len(ranked):
        return np.zeros(0, dtype=int), np.zeros(0, dtype=int)
    keys = np.stack([np.asarray(res[k])[ranked] for k in degree_columns(res)], axis=1)
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    return first, inverse.reshape(-1)


def ties(res: dict[str, np.ndarray], rows: np.ndarray, best: int, within: float) -> np.ndarray:
    """Whether each of ``rows`` is within ``within`` (a fraction, e.g. 0.05) of the winner's
    tokens/s: closer than the estimator's stated error, so the order between them is not known."""
    return np.asarray(res["tokens_per_s"])[rows] >= (1 - within) * float(res["tokens_per_s"][best])


def differing_axes(res: dict[str, np.ndarray], i: int, best: int) -> str:
    """The degrees in which layout ``i`` differs from the winner, as 'tp 8->4, pp 8->16' ('' for none)."""
    words = {"zero": "ZeRO"}
    return ", ".join(f"{words.get(k, k)} {res[k][best]}->{res[k][i]}" for k in degree_columns(res)
                     if res[k][i] != res[k][best])
