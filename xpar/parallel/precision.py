"""Mixed precision: bf16 compute, fp32 master weights, fp32 optimizer states, fp32 loss.

``train.dtype=bf16`` is mixed precision as practitioners run it (Micikevicius et al. 2018;
torchtitan's ``mixed_precision_param=bfloat16``). Parameters are *stored* in fp32 on every
strategy -- they are the master weights that AdamW updates, with fp32 ``exp_avg`` and
``exp_avg_sq`` -- and only the compute runs in bf16. How the bf16 compute is obtained
depends on the dp wrapper, as in torchtitan (``maybe_enable_amp``):

Design notes (what each step does and why, with sources): docs/concepts/design-notes.md.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Compute dtype of each ``train.dtype``; parameters are fp32 in both."""


def compute_dtype(dtype: str) -> torch.dtype:
    """The dtype matmuls run in for ``train.dtype``."""
    return DTYPES[dtype]


def uses_fsdp(zero_stage: int) -> bool:
    """ZeRO-2/3 run on FSDP2 (``xpar.parallel.data_parallel.wrap_dp``)."""
    return zero_stage >= 2


def mixed_precision_kind(dtype: str, zero_stage: int) -> str:
    """'fp32', 'fsdp' (FSDP2 MixedPrecisionPolicy) or 'autocast' (torch.autocast)."""
    if dtype == "fp32":
        return "fp32"
    return "fsdp" if uses_fsdp(zero_stage) else "autocast"


def fsdp_policy(dtype: str):
    """FSDP2's policy for ``train.dtype``: bf16 unsharded parameters, fp32 gradient
    reduce-scatter (``reduce_dtype``); the default (no casts) for fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype(dtype), reduce_dtype=torch.float32)


def apply_autocast(chunk: nn.Module, dtype: str, device: str) -> nn.Module:
    """Run ``chunk``'s forward under ``torch.autocast(device, dtype)`` (in place; the
    parameter names do not change). Applied to the innermost model before DDP wraps it, so
    DDP's forward (and a pipeline stage's) enters autocast around the model only; the loss
    and the backward run outside it, as torch's AMP recipe asks."""
    if dtype == "fp32":
        return chunk
    forward = chunk.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type="cpu" if device == "meta" else device, dtype=compute_dtype(dtype)):
            return forward(*args, **kwargs)
    chunk.forward = autocast_forward
    return chunk


def activation_dtype(dtype: str, zero_stage: int) -> torch.dtype:
    """dtype of the hidden states a pipeline stage sends to the next: bf16 under FSDP2's
    policy (the residual stream is bf16), fp32 under autocast (the residual adds promote
    bf16 matmul outputs to fp32) and in fp32 runs."""
    return torch.bfloat16 if mixed_precision_kind(dtype, zero_stage) == "fsdp" else torch.float32


def logits_dtype(dtype: str) -> torch.dtype:
    """dtype of the last stage's logits: bf16 on both mixed-precision paths (the output
    projection is a matmul), fp32 otherwise."""
    return compute_dtype(dtype)


def is_param_cast(t: torch.Tensor) -> Optional[bool]:
    """True when ``t`` is a dtype cast of a leaf parameter (autocast's cached bf16 weight
    copy): its grad_fn is ``ToCopyBackward0`` straight into an ``AccumulateGrad``."""
    fn = t.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    nxt = fn.next_functions
    return bool(nxt) and nxt[0][0] is not None and type(nxt[0][0]).__name__ == "AccumulateGrad"
