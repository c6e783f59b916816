"""The plan's context-parallel, expert-parallel and dtype axes: ``plan.cp``, ``plan.ep`` and
``plan.dtype`` resolved to the values searched, with their defaults, and each bad value one line.

Defaults:

- ``plan.cp``: [1] below :data:`CP_MIN_SEQ` tokens per sequence; from there 1, 2, 4 and 8
  (:data:`CP_DEFAULT`) -- the Llama 3 paper trains its 128k-token stage at cp 16 over 8-GPU nodes,
  NeMo's long-context recipes use cp 2-8 at 16k-128k tokens: below 16k a sequence's attention is
  too small a share of the step to pay for the K/V all-gathers. The space keeps only cp values
  that split seq_len into 2 cp equal chunks (xpar.plan.space rule ``cp_seq``).
- ``plan.ep``: for a MoE model every divisor of model.n_experts (the space keeps those dividing
  dp x cp: rule ``ep``; expert tensor parallelism at tp, Megatron-Core's default); [1] for a dense one.
- ``plan.dtype``: [train.dtype]; ``plan.dtype=[bf16,fp8]`` searches both where the hardware has an
  FP8 peak (hardware.peak_tflops_fp8; else fp8 is dropped by rule ``fp8_hw``).
"""
from __future__ import annotations

from typing import Any, Optional

CP_MIN_SEQ = 16384
"""Tokens per sequence from which plan.cp searches :data:`CP_DEFAULT` by default."""
CP_DEFAULT = (1, 2, 4, 8)
DTYPES = ("fp32", "bf16", "fp8")


def default_cp(seq_len: int) -> tuple[int, ...]:
    """plan.cp's default at ``seq_len`` tokens (module docstring)."""
    return CP_DEFAULT if seq_len >= CP_MIN_SEQ else (1,)


def default_ep(model: dict) -> tuple[int, ...]:
    """plan.ep's default: the divisors of a MoE model's experts, (1,) for a dense model."""
    n = int(model.get("n_experts") or 0)
    return tuple(d for d in range(1, n + 1) if n % d == 0) if n else (1,)


def _degrees(value: Any, key: str, eg: str) -> tuple[Optional[tuple[int, ...]], list[str]]:
    vals = list(value) if isinstance(value, (list, tuple)) else [value]
    if not vals or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in vals):
        return None, [f"plan.{key}={value} must be a list of whole numbers >= 1; e.g. plan.{key}={eg}."]
    return tuple(sorted(set(vals))), []


def resolve_axes(p, model: dict, seq_len: int, dtype: str) -> tuple[dict, list[str]]:
    """(``cp``, ``ep``, ``dtypes`` for :class:`xpar.plan.space.Constraints`, problem lines) of the
    plan config ``p`` (plan.cp, plan.ep, plan.dtype; null: the defaults). ``dtypes`` is () when
    plan.dtype is null (the train dtype, no dtype column)."""
    out: dict = {"cp": default_cp(seq_len), "ep": default_ep(model), "dtypes": ()}
    problems: list[str] = []
    for key, eg in (("cp", "[1,2,4]"), ("ep", "[1,8]")):
        given = getattr(p, key, None)
        if given is not None:
            vals, bad = _degrees(_plain(given), key, eg)
            problems += bad
            out[key] = vals or out[key]
    given = getattr(p, "dtype", None)
    if given is not None:
        vals = [str(v) for v in (_plain(given) if isinstance(_plain(given), (list, tuple)) else [given])]
        bad = [v for v in vals if v not in DTYPES]
        if bad or not vals:
            problems.append(f"plan.dtype={vals}: {bad or 'empty'} not a training dtype; values that work: "
                            f"{list(DTYPES)}, e.g. plan.dtype=[bf16,fp8].")
        else:
            out["dtypes"] = tuple(dict.fromkeys(vals))
    if not problems and out["dtypes"] == (dtype,):
        out["dtypes"] = ()
    return out, problems


def _plain(value):
    from omegaconf import OmegaConf
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
