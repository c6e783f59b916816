"""Checks of the framework profile (conf/framework/): choices and ranges. Returns violations."""
from __future__ import annotations

from xpar.config import FrameworkConfig

CHOICES = {
    "zero1": ("zero_redundancy", "distributed_optimizer"),
    "dp_collective": ("nccl", "ring", "tree", "hierarchical"),  # xpar.estimate.collectives.ALGORITHMS
    "selective_recompute": ("op", "torchtitan_op", "attention"),  # xpar.estimate.memory.SELECTIVE_POLICIES
    "param_storage": ("fp32", "bf16"),
}
FRACTIONS = ("tp_overlap", "pp_overlap", "overlap_slowdown", "recompute_layer_fraction")


def check_framework(fw: FrameworkConfig) -> list[str]:
    """Each choice among its values, each share in [0, 1], gradient bytes 2 or 4."""
    out = [f"framework.{k}={getattr(fw, k)!r} is not one of {', '.join(v)}." for k, v in CHOICES.items()
           if getattr(fw, k) not in v]
    out += [f"framework.{k}={getattr(fw, k)} must be between 0 and 1." for k in FRACTIONS
            if not 0.0 <= getattr(fw, k) <= 1.0]
    out += [f"framework.{k}={getattr(fw, k)} must be 2 or 4 (bytes per gradient element)."
            for k in ("grad_reduce_bytes", "grad_bytes") if getattr(fw, k) not in (2, 4)]
    return out
