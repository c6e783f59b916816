"""How long a local run will take, from the cost model, checked before any worker starts.

:func:`duration_problems` (called by :func:`xpar.estimate.preflight.check.check_run`) prints a warning when one
step is estimated above :data:`WARN_STEP_S` and refuses a run whose steps are estimated above
:data:`LONG_RUN_S` in total unless ``run.allow_long=true`` (a local run of hours must not
start without a word).
The estimate is :func:`xpar.estimate.cost.estimate` with this machine's measured peak
(median error 1.6 % on the calibration runs, tests/estimate/test_estimate_run.py).
"""
from __future__ import annotations

import sys

from xpar.config.spec import RunSpec
from xpar.estimate.cost import assumptions_for, estimate

WARN_STEP_S = 60.0
"""Seconds per step above which a warning line is printed."""
LONG_RUN_S = 3600.0
"""Seconds of estimated training (steps x step time) above which run.allow_long=true is required."""


def _human(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.2g} s"


def duration_problems(spec: RunSpec, cfg=None) -> list[str]:
    """[] or the refusal of an over-long local run (``cfg``: the config, for run.allow_long);
    warns on stderr above a minute per step. Estimate mode runs nothing: never refused here."""
    run = cfg.run if cfg is not None and not isinstance(cfg, dict) else (cfg or {}).get("run", {})
    allow_long = bool(getattr(run, "allow_long", None) if not isinstance(run, dict) else run.get("allow_long"))
    if spec.mode != "execute" or not spec.hardware.peak_tflops:
        return []  # nothing runs, or no peak to estimate with (local CUDA without hardware.peak_tflops)
    try:
        step = estimate(spec, assumptions_for(spec)).time_per_step_s
    except (TypeError, ValueError, ZeroDivisionError):  # a figure the cost model needs is unknown here
        return []
    total = step * spec.train.steps
    if step > WARN_STEP_S:
        print(f"xpar: warning: estimated {_human(step)} per step on this machine ({_human(total)} for "
              f"train.steps={spec.train.steps}; cost model, xpar.estimate.cost).", file=sys.stderr)
    if total > LONG_RUN_S and not allow_long:
        return [f"estimated {_human(total)} of training on this machine ({_human(step)} per step x "
                f"train.steps={spec.train.steps}), above the {_human(LONG_RUN_S)} that runs without asking; "
                f"pass run.allow_long=true to run it, or shorten it (train.steps, train.seq_len, model=tiny), "
                f"or estimate it: run.mode=estimate."]
    return []
