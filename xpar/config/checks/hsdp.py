"""Checks of hierarchical ZeRO (``parallel.zero_shard_size``: torch FSDP2's HSDP at ZeRO-2/3, shard-group ZeRO-1).
Returns violations."""
from __future__ import annotations

from xpar.config.layout import Layout


def check_zero_shard(size, layout: Layout, mode: str) -> list[str]:
    """zero_shard_size null, or a divisor of dp at ZeRO-1/2/3: ZeRO-2/3 shard inside the group and replicate
    across groups (FSDP2 HSDP); ZeRO-1 keeps its optimizer states 1/s per rank inside the group with the gradients
    reduced over all of dp (InternEvo's zero1 = s; Megatron-Core's distributed optimizer instances). Executed
    without pp, tp, cp and ep (estimated with them)."""
    if size is None:
        return []
    dp = layout.dp
    ok = [d for d in range(1, dp + 1) if dp % d == 0]
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or dp % size:
        return [f"parallel.zero_shard_size must divide dp={dp} (shard groups of consecutive dp ranks), got {size!r}; "
                f"values that work: {ok}, or null (shard over all of dp)."]
    if layout.zero_stage < 1:
        return [f"parallel.zero_shard_size={size} shards ZeRO's states inside groups, got parallel.zero_stage=0 "
                f"(nothing sharded); set parallel.zero_stage=1, 2 or 3, or parallel.zero_shard_size=null."]
    expert = _expert_shard_problem(size, layout)
    if expert:
        return [expert]
    others = {k: v for k, v in (("pp", layout.pp), ("tp", layout.tp), ("cp", layout.cp), ("ep", layout.ep)) if v > 1}
    if mode == "execute" and others:
        given = ", ".join(f"{k}={v}" for k, v in others.items())
        return [f"parallel.zero_shard_size={size} (hierarchical ZeRO) is executed over dp alone, got {given}; run it "
                f"with parallel.pp=1 parallel.tp=1 (cp, ep 1), or estimate it with run.mode=estimate."]
    return []


def _expert_shard_problem(size: int, layout: Layout) -> str:
    """'' or the line refusing shard groups that split no routed expert's states evenly: under ep (or an etp of its
    own) each group of s dp ranks holds s tp cp / (ep etp) ranks of one expert's expert-dp group, which must be a whole
    number (Megatron-Core: the expert data parallel group split into the distributed optimizer's instances,
    megatron/core/parallel_state.py ``initialize_model_parallel``; torchtitan: ep carved out of dp_shard x cp,
    torchtitan/distributed/parallel_dims.py)."""
    if layout.ep == 1 and layout.expert_tp == layout.tp:
        return ""
    ranks = size * layout.tp * layout.cp
    per_expert = layout.ep * layout.expert_tp
    if ranks % per_expert == 0:
        return ""
    ok = [d for d in range(1, layout.dp + 1) if layout.dp % d == 0 and (d * layout.tp * layout.cp) % per_expert == 0]
    return (f"parallel.zero_shard_size={size} splits the routed experts' states unevenly: a shard group's "
            f"{size} x tp {layout.tp} x cp {layout.cp} = {ranks} ranks must hold whole expert groups of ep {layout.ep} "
            f"x etp {layout.expert_tp} = {per_expert}; values that work: {ok or 'none at this dp'}, or null.")
