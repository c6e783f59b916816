"""The nearest memory settings that fit, for a memory refusal (:mod:`xpar.estimate.preflight.check`).

Where a run's source leaves recompute, sequence parallelism or the distributed optimizer unstated,
the framework's defaults may not fit; the refusal names the nearest settings that do on the same
devices. Besides preflight's one-change alternatives (ZeRO stage, recompute policy, sequence
parallelism, micro-batch size), partial full recompute: Megatron-LM's ``--recompute-granularity full
--recompute-method block --recompute-num-layers N`` (megatron/core/transformer/transformer_block.py
``_checkpointed_forward``: the first N blocks of each model chunk; ``parallel.recompute_layers``),
the fewest blocks that fit found by bisection (memory falls as N grows). Recompute policies tried
are those the framework runs (``framework.recompute``; null: xpar.config.remat.PLAN_RECOMPUTE).
Each setting returned passed validation and fits when followed. Units: bytes, seconds.
"""
from __future__ import annotations

from typing import Callable, Optional

from xpar.config.attention import is_mla
from xpar.config.remat import PLAN_RECOMPUTE, model_policies
from xpar.config.spec import RunSpec


def recompute_choices(spec: RunSpec) -> list[str]:
    """Recompute policies to try around ``spec``: those the framework runs (``framework.recompute``,
    null: PLAN_RECOMPUTE) that apply to its model, in the framework's order, but 'none' and the current; none
    under full recompute (nothing recomputes more). ``moe`` (Megatron-Core's ``--recompute-modules moe``) reruns the
    MoE layers only: nothing on a dense model, so not offered there, nor MLA's module policies without MLA
    (xpar.config.remat.model_policies, as xpar plan)."""
    runs = model_policies(spec.framework.recompute or PLAN_RECOMPUTE, spec.model.n_experts, is_mla(spec.model))
    now = spec.layout.recompute
    if now == "full" and spec.parallel.recompute_layers is None:
        return []
    return [r for r in runs if r not in ("none", now)]


def partial_recompute(spec: RunSpec, fits: Callable[[dict], Optional[RunSpec]]) -> Optional[tuple[dict, RunSpec]]:
    """The fewest blocks per model chunk to recompute fully that fit (``parallel.recompute=full
    parallel.recompute_layers=N``, 0 < N < the largest chunk's blocks): (parallel changes, the spec
    that fits) or None where the framework runs no full recompute, ``spec`` already recomputes fully,
    or every block recomputed is needed (then recompute=full alone is the setting). ``fits``: parallel
    changes -> the validated spec that fits, or None (preflight's check)."""
    runs = list(spec.framework.recompute or PLAN_RECOMPUTE)
    if "full" not in runs or (spec.layout.recompute == "full" and spec.parallel.recompute_layers is None):
        return None
    most = max(spec.layout.layer_split)
    lo, hi, best = 1, most - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        cand = fits({"recompute": "full", "recompute_layers": mid})
        if cand is None:
            lo = mid + 1
        else:
            best, hi = (mid, cand), mid - 1
    if best is None:
        return None
    return {"recompute": "full", "recompute_layers": best[0]}, best[1]
