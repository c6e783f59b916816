"""Checks of hierarchical ZeRO (``parallel.zero_shard_size``: torch FSDP2's HSDP). Returns violations."""
from __future__ import annotations

from xpar.config.layout import Layout


def check_zero_shard(size, layout: Layout, mode: str) -> list[str]:
    """zero_shard_size null, or a divisor of dp at ZeRO-2/3 (FSDP2 shards inside the group and
    replicates across groups); executed without pp, tp, cp and ep (estimated with them)."""
    if size is None:
        return []
    dp = layout.dp
    ok = [d for d in range(1, dp + 1) if dp % d == 0]
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or dp % size:
        return [f"parallel.zero_shard_size must divide dp={dp} (shard groups of consecutive dp ranks), got {size!r}; "
                f"values that work: {ok}, or null (shard over all of dp)."]
    if layout.zero_stage < 2:
        return [f"parallel.zero_shard_size={size} shards ZeRO-2/3's states inside groups (FSDP2 HSDP), got "
                f"parallel.zero_stage={layout.zero_stage}; set parallel.zero_stage=2 or 3, or parallel.zero_shard_size=null."]
    others = {k: v for k, v in (("pp", layout.pp), ("tp", layout.tp), ("cp", layout.cp), ("ep", layout.ep)) if v > 1}
    if mode == "execute" and others:
        given = ", ".join(f"{k}={v}" for k, v in others.items())
        return [f"parallel.zero_shard_size={size} (HSDP) is executed over dp alone, got {given}; run it with "
                f"parallel.pp=1 parallel.tp=1 (cp, ep 1), or estimate it with run.mode=estimate."]
    return []
