"""The plan's cp, ep, etp, v and dtype axes: ``plan.cp``, ``plan.ep``, ``plan.etp``, ``plan.virtual_stages``
and ``plan.dtype`` resolved to the values searched, with their defaults; each bad value one line.

- ``plan.cp``: the powers of two leaving each cp rank >= :data:`CP_MIN_TOKENS` tokens, at every sequence
  length: NeMo's Llama 3 70B recipe runs cp 2 at 8k tokens, its long-context recipes cp 2-8 at 16k-128k and
  cp 32 at 1M (NeMo performance_long_sequence.md), Llama 3 cp 16 at 128k (8k per rank). The space keeps cp
  values that split seq_len into 2 cp equal chunks (xpar.plan.space rule ``cp_seq``) and divide the devices.
- ``plan.ep``: a MoE model's divisors of model.n_experts (kept where ep x etp divides tp x cp x dp: rule
  ``ep``); [1] for a dense one. ``plan.etp``: the profile's ``framework.etp_degrees`` (megatron_core: [0, 1],
  etp = tp and MoE parallel folding, etp 1, the Megatron-Bridge MoE recipes'), else [0] (etp = tp).
- ``plan.virtual_stages``: the v of looped schedules; null: xpar.plan.space.schedule_pairs's.
- ``plan.dtype``: [train.dtype]; ``plan.dtype=[bf16,fp8]`` searches both where the hardware has an
  FP8 peak (hardware.peak_tflops_fp8; else fp8 is dropped by rule ``fp8_hw``).
"""
from __future__ import annotations

from typing import Any, Optional

CP_MIN_TOKENS = 4096
"""Fewest tokens of a sequence per cp rank that plan.cp's default searches (module docstring)."""
DTYPES = ("fp32", "bf16", "fp8")


def default_cp(seq_len: int) -> tuple[int, ...]:
    """plan.cp's default at ``seq_len`` tokens: 1 and each power of two with seq_len / cp >=
    :data:`CP_MIN_TOKENS` (module docstring): 1-16 at 64k, 1-256 at 1M."""
    out, c = [1], 2
    while seq_len // c >= CP_MIN_TOKENS:
        out.append(c)
        c *= 2
    return tuple(out)


def default_ep(model: dict) -> tuple[int, ...]:
    """plan.ep's default: the divisors of a MoE model's experts, (1,) for a dense model."""
    n = int(model.get("n_experts") or 0)
    return tuple(d for d in range(1, n + 1) if n % d == 0) if n else (1,)


def default_etp(model: dict, framework: Optional[dict] = None) -> tuple[int, ...]:
    """plan.etp's default: a MoE model's ``framework.etp_degrees`` (megatron_core: etp = tp and etp 1, what its
    MoE recipes run), else (0,), etp = tp; (0,) for a dense model."""
    listed = (framework or {}).get("etp_degrees") if model.get("n_experts") else None
    return tuple(sorted({int(x) for x in listed})) if listed else (0,)


def _degrees(value: Any, key: str, eg: str) -> tuple[Optional[tuple[int, ...]], list[str]]:
    vals = list(value) if isinstance(value, (list, tuple)) else [value]
    lo, what = (0, ">= 0 (0: etp = tp)") if key == "etp" else (1, ">= 1")
    if not vals or not all(isinstance(v, int) and not isinstance(v, bool) and v >= lo for v in vals):
        return None, [f"plan.{key}={value} must be a list of whole numbers {what}; e.g. plan.{key}={eg}."]
    return tuple(sorted(set(vals))), []


def resolve_axes(p, model: dict, seq_len: int, dtype: str, framework: Optional[dict] = None) -> tuple[dict, list[str]]:
    """(``cp``, ``ep``, ``etp``, ``v``, ``dtypes`` for :class:`xpar.plan.space.Constraints`, problem
    lines) of the plan config ``p`` (plan.cp, plan.ep, plan.etp, plan.virtual_stages, plan.dtype; null:
    the defaults; ``v`` None: :func:`xpar.plan.space.schedule_pairs`'s). ``dtypes`` is () when
    plan.dtype is null (the train dtype, no dtype column)."""
    out: dict = {"cp": default_cp(seq_len), "ep": default_ep(model), "dtypes": (), "etp": default_etp(model, framework),
                 "v": None}
    problems: list[str] = []
    for key, eg in (("cp", "[1,2,4]"), ("ep", "[1,8]"), ("etp", "[0,1]"), ("virtual_stages", "[2,4,8]")):
        given = getattr(p, key, None)
        if given is not None:
            vals, bad = _degrees(_plain(given), key, eg)
            problems += bad
            out[{"virtual_stages": "v"}.get(key, key)] = vals or out[{"virtual_stages": "v"}.get(key, key)]
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
