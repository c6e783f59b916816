"""The planner's dp timeline of many ranks at once (xpar.estimate.columns.step_time._dp_rows) equals each
rank's own: units of no time after a rank's blocks (first in backward order) change no figure, and
the per-chunk overlap (xpar.estimate.frameworks.dp_chunks) reads each rank's own units."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from xpar.estimate.comm.dp import dp_exposure
from xpar.estimate.step_parts import Assumptions

KEYS = ("per_microbatch", "end", "issued_per_microbatch", "issued_once", "first_backward")


def _rank(rng: np.random.Generator, n: int) -> dict:
    """One rank of ``n`` blocks: compute and collectives per unit (seconds), forward order, root first."""
    unit = {k: rng.uniform(0.001, 0.02, n + 1) for k in ("g", "r", "cg", "cr", "gb")}
    f, b = rng.uniform(0.005, 0.01, 2)
    return dict(unit, f=[0.002] + [f] * n, b=[b] * n + [0.003])


def _padded(ranks: list[dict], key: str, top: int) -> list[np.ndarray]:
    """Per unit, an array over ranks: each rank's values, zeros after its own (forward order)."""
    rows = [list(r[key]) + [0.0] * (top + 1 - len(r[key])) for r in ranks]
    return list(np.array(rows).T)


@pytest.mark.parametrize("prefetch", [True, False])
def test_ranks_of_different_blocks_in_one_timeline_equal_each_alone(prefetch):
    rng = np.random.default_rng(0)
    a = replace(Assumptions(), dp_overlap_per_chunk=True, fsdp_prefetch=prefetch, overlap_slowdown=0.1)
    layouts = [(z, pp, v, n) for z in range(4) for pp, v, n in ((1, 1, 9), (2, 2, 5), (4, 3, 7), (4, 1, 2))]
    ranks = [_rank(rng, n) for *_, n in layouts]
    z, pp, v, n = (np.array(c) for c in zip(*layouts))
    top = int(n.max())
    g, r, cg, cr, gb, f = (_padded(ranks, k, top) for k in ("g", "r", "cg", "cr", "gb", "f"))
    b = _padded([dict(b=x["b"][::-1]) for x in ranks], "b", top)[::-1]  # backward order: zeros first
    together = dp_exposure(z, pp, a, f, b, g, r, cg, cr, gb, v, n + 1)
    assert np.any(together["end"] > 0) and np.any(together["first_backward"] > 0)
    for i, x in enumerate(ranks):
        alone = dp_exposure(int(z[i]), int(pp[i]), a, x["f"], x["b"], *(list(x[k]) for k in ("g", "r", "cg", "cr",
                                                                                               "gb")), int(v[i]))
        assert {k: float(together[k][i]) for k in KEYS} == {k: float(alone[k]) for k in KEYS}, layouts[i]
