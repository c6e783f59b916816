"""Checks of the step loop's fields (clipping, learning-rate schedule, threads); the
enumerated ones (dtype, recompute) are in :data:`xpar.config.checks.config.CHOICES`. Each ``check_<name>(c)`` takes the composed config and returns problem
lines: the constraint, the values given, values that work (empty when valid)."""
from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "cosine")


def check_runtime(c) -> list[str]:
    """Every check of this module."""
    return check_max_grad_norm(c) + check_lr_schedule(c)


def check_max_grad_norm(c) -> list[str]:
    """train.max_grad_norm: a positive number, or null (no clipping)."""
    v = c.train.max_grad_norm
    if v is not None and not (v > 0 and math.isfinite(v)):
        return [f"train.max_grad_norm must be > 0 or null (no clipping; finite), got {v}; e.g. 1.0."]
    return []


def check_lr_schedule(c) -> list[str]:
    """train.lr_schedule in constant|cosine; 0 <= lr_warmup_steps <= steps (checked when steps >= 1);
    0 <= min_lr_ratio <= 1."""
    t, out = c.train, []
    if t.lr_schedule not in LR_SCHEDULES:
        out.append(f"train.lr_schedule={t.lr_schedule!r} is unknown; values that work: {list(LR_SCHEDULES)}.")
    if t.steps > 0 and not 0 <= t.lr_warmup_steps <= t.steps:  # steps < 1: its own line (checks.config)
        out.append(f"train.lr_warmup_steps must satisfy 0 <= lr_warmup_steps <= steps, got "
                   f"lr_warmup_steps={t.lr_warmup_steps}, steps={t.steps}; e.g. train.lr_warmup_steps={t.steps // 10}.")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        out.append(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}; e.g. 0.1.")
    return out


def check_threads(c) -> list[str]:
    """train.threads_per_worker: null (1) or >= 1. Checked before the target is resolved
    (:func:`xpar.config.validate.validate`'s early checks): resolving hardware=local measures the peak
    with these threads (torch.set_num_threads(-1) raised there)."""
    v = c.train.threads_per_worker
    if v is not None and int(v) < 1:
        return [f"train.threads_per_worker must be >= 1 or null (= 1), got {v}; e.g. 1."]
    return []
