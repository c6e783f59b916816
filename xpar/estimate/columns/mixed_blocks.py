"""FSDP unit times of models whose blocks differ in size (a MoE model with dense leading blocks,
``model.first_dense_layers``, ``model.moe_layer_freq``), whose dp collectives per unit depend on the blocks a rank holds.

Where :func:`blocks_vary`, each representative rank's own units
(:func:`xpar.estimate.comm.dp.unit_elements` of the candidate's placement) are timed by
:func:`xpar.estimate.comm.dp.unit_times` -- the scalar estimate's own call -- once per distinct (dp, tp,
ZeRO stage, pp, v, placement, slot). The middle slot is the middle rank the scalar estimate takes
as the slowest (below ZeRO-3 under pp without ep: rank 1; under ZeRO-3 or at ep > 1 the middle rank with the
most MoE blocks). Units: seconds.
"""
from __future__ import annotations

import numpy as np

from xpar.config.remat import RECOMPUTE
from xpar.estimate.comm.dp import unit_elements, unit_expert_elements, unit_times

UNIT_TIMES = {"g": "gather", "gb": "gather_backward", "r": "reduce", "cg": "copy_gather", "cr": "copy_reduce"}
"""Keys of the unit-time lists (and of xpar.estimate.columns.step_time's columns) -> xpar.estimate.comm.dp.unit_times keys."""


def blocks_vary(base) -> bool:
    """Whether the model's blocks differ in parameter elements (dense and MoE blocks)."""
    cfg = base.model
    return bool(cfg.n_experts) and 0 < cfg.moe_layers < cfg.n_layers


class UnitTimes:
    """Memoised unit times of representative ranks (:func:`slot_rank_moe`) for one base spec."""

    def __init__(self, base, assume, spec_at, by_rank: bool = False):
        """``spec_at``: :func:`xpar.estimate.columns.step_time.spec_at` (passed in: step_time imports this
        module); ``by_rank``: a slot is the pipeline rank itself (one layout's every rank), not
        :func:`slot_rank_moe`'s."""
        self.base, self.assume, self.spec_at, self.by_rank, self.memo = base, assume, spec_at, by_rank, {}
        self.specs: dict[tuple, object] = {}
        self.times: dict[tuple, dict] = {}  # by (dp, tp, zero, recompute, units): pp, v and the rank only pick units
        self.collectives: dict[tuple, dict] = {}  # by (dp, tp): seconds by (collective, bytes)

    def of(self, dp: int, tp: int, zero: int, recompute: str, pp: int, v: int, v_shaped: bool,
           slot: int) -> dict[str, list]:
        key = (dp, tp, zero, recompute, pp, v, v_shaped, slot)
        if key not in self.memo:
            if key[:-1] not in self.specs:  # one spec for the slots of a layout
                self.specs[key[:-1]] = self.spec_at(self.base, tp, pp, dp, 1, 1, v, "zbv" if v_shaped else "gpipe",
                                                    zero, False, recompute)
            spec = self.specs[key[:-1]]
            rank = slot if self.by_rank else slot_rank_moe(spec.layout, slot, self.base.model, zero)
            units = tuple(unit_elements(spec, rank))
            if key[:4] + units not in self.times:  # the units fix their experts (xpar.estimate.comm.dp.expert_split_times)
                t = unit_times(spec, self.assume, list(units), self.collectives.setdefault((dp, tp), {}),
                               unit_expert_elements(spec, rank))
                self.times[key[:4] + units] = {k: t[name] for k, name in UNIT_TIMES.items()}
            self.memo[key] = self.times[key[:4] + units]
        return self.memo[key]


def slot_rank_moe(layout, slot: int, cfg, zero: int = 3) -> int:
    """The pipeline rank a slot (xpar.estimate.columns.step_time.SLOTS: 0 first, 1 middle, 2 last) stands for: rank
    0; the first middle rank at ZeRO ``zero`` below 3 without ep (module docstring), else the middle rank holding
    the most MoE blocks (``cfg.is_moe_layer``; first on ties: under ZeRO-3 its gathers, at ep > 1 its all-to-alls,
    xpar.estimate.columns.ep_slots, make it the slowest); the last rank."""
    pp = layout.pp
    if slot == 0 or pp == 1:
        return 0
    if slot == 2:
        return pp - 1
    if zero < 3 and layout.ep == 1:
        return 1
    v_shaped = layout.has_last_stage(0) and layout.n_stages > 1
    middle = list(range(1, pp if v_shaped else pp - 1)) or [min(1, pp - 1)]

    def moe(r: int) -> int:
        return sum(cfg.is_moe_layer(i) for s in layout.stages_of(r) for i in layout.stage_layers(s))
    return max(middle, key=lambda r: (moe(r), -r))


def unit_columns(times: UnitTimes, rows: dict[str, np.ndarray], n: int) -> dict[str, list]:
    """Per unit kind (:data:`UNIT_TIMES`), n + 1 arrays over ``rows`` (root first, then the rank's
    n blocks in forward order): seconds. ``rows``: dp, tp, zero, recompute (a code:
    xpar.config.remat.RECOMPUTE's index), pp, v, v_shaped, slot, each an array over the same
    representative rows."""
    keys = np.stack([np.asarray(rows[k], dtype=np.int64) for k in ("dp", "tp", "zero", "recompute", "pp", "v",
                                                                     "v_shaped", "slot")], axis=1)
    _, first, inverse = np.unique(np.ravel_multi_index(keys.T, keys.max(axis=0) + 1), return_index=True,
                                  return_inverse=True)  # one int per row: numpy.unique(axis=0) sorts rows slowly
    uniq = keys[first]
    tables = {k: np.zeros((len(uniq), n + 1)) for k in UNIT_TIMES}
    for u, key in enumerate(uniq.tolist()):
        got = times.of(*key[:3], RECOMPUTE[key[3]], *key[4:6], bool(key[6]), key[7])
        for k in UNIT_TIMES:
            tables[k][u, :len(got[k])] = got[k]
    inverse = inverse.ravel()
    per_unit = {k: np.ascontiguousarray(tables[k][inverse].T) for k in UNIT_TIMES}  # one gather, rows as views
    return {k: list(per_unit[k]) for k in UNIT_TIMES}
