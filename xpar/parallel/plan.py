"""Layout constraints of tensor and pipeline parallelism, checked before any worker starts.

Called from :func:`xpar.validate.validate` (the one place of validation); kept here beside
the strategies whose constraints they are.
"""
from __future__ import annotations

from typing import Optional

from xpar.config import ModelConfig, ParallelConfig


def check_tp(m: ModelConfig, par: ParallelConfig, problems: list[str], seq_len: Optional[int] = None) -> None:
    """Megatron splits: heads and kv heads by tp (whole heads per rank), ffn by tp
    (column/row MLP), vocabulary by tp (vocabulary-parallel embedding and output); with
    sequence parallelism the training sequence by tp. ZeRO-1 (ZeroRedundancyOptimizer) is
    not composed with tp: it broadcasts parameters, which fails on DTensor parameters."""
    t = par.tp
    if t == 1:
        return
    dims = (("n_heads", m.n_heads), ("n_kv_heads", m.kv_heads), ("ffn_hidden", m.ffn_hidden),
            ("vocab_size", m.vocab_size))
    bad = [f"model.{name}={n}" for name, n in dims if n % t]
    if bad:
        ok = [d for d in range(1, 65) if all(n % d == 0 for _, n in dims)]
        problems.append(f"parallel.tp={t} must divide {', '.join(bad)} (Megatron split: whole heads, "
                        f"MLP columns and vocabulary rows per tp rank); tp values that divide "
                        f"n_heads={m.n_heads}, n_kv_heads={m.kv_heads}, ffn_hidden={m.ffn_hidden} and "
                        f"vocab_size={m.vocab_size}: {ok}.")
    if par.sequence_parallel and seq_len is not None and seq_len % t:
        ok = [s for s in range(t, min(seq_len, m.seq_len) + 1, t)][-3:]
        problems.append(f"parallel.sequence_parallel=true shards the sequence over tp: train.seq_len={seq_len} "
                        f"must be divisible by parallel.tp={t}; e.g. train.seq_len in {ok}, or "
                        f"sequence_parallel=false.")
    if par.zero_stage == 1:
        problems.append(f"parallel.zero_stage=1 (ZeroRedundancyOptimizer) is not composed with tp={t}: it broadcasts "
                        f"parameters, which fails on tensor-parallel (DTensor) parameters; use zero_stage 0 "
                        f"(replicate), 2 or 3 with tp>1, or tp=1.")


def even_split(n_layers: int, n_stages: int) -> Optional[list[int]]:
    return [n_layers // n_stages] * n_stages if n_layers % n_stages == 0 else None


def check_pp(m: ModelConfig, par: ParallelConfig, mode: str, problems: list[str]) -> list[int]:
    """Schedule, stages per rank, micro-batch rules and the layer split. Returns the split."""
    from xpar.validate import SCHEDULES

    if par.pp == 1:
        if par.layer_split not in (None, [], [m.n_layers]):
            problems.append(f"parallel.layer_split={list(par.layer_split)} given but pp=1; remove it.")
        return [m.n_layers]
    rule = SCHEDULES[par.schedule][1]
    v = par.virtual_stages
    if rule == "1" and v != 1:
        problems.append(f"schedule {par.schedule} runs one stage per rank: parallel.virtual_stages must be 1, "
                        f"got {v}; use schedule interleaved_1f1b/zero_bubble for v > 1.")
    if rule == "v" and v < 2:
        problems.append(f"schedule {par.schedule} needs parallel.virtual_stages >= 2 (stages per rank), got {v}.")
    if rule == "2" and v != 2:
        problems.append(f"schedule {par.schedule} is V-shaped: parallel.virtual_stages must be 2, got {v}.")
    mb = par.micro_batches
    if mb != "auto":
        rule = microbatch_problem(par.schedule, par.pp, int(mb))
        if rule:
            problems.append(rule)
    if par.zero_stage == 1:
        problems.append("parallel.zero_stage=1 (ZeroRedundancyOptimizer over DDP) is not composed with pp>1; "
                        "use zero_stage 0, 2 or 3 on the dp axis.")
    if mode == "execute" and m.tied_embeddings:
        problems.append(f"model={m.name} ties its output to the embedding, which pp>1 would split across "
                        f"stages; set model.tied_embeddings=false or pp=1.")
    n_stages = par.pp * v
    if par.layer_split:
        given = list(par.layer_split)
        if any(not isinstance(x, int) or isinstance(x, bool) for x in given):
            problems.append(f"parallel.layer_split must list whole numbers of layers per stage, got {given}; "
                            f"e.g. {even_split(m.n_layers, n_stages) or _uneven(m.n_layers, n_stages)}.")
            return []
        split = [int(x) for x in given]
        if len(split) != n_stages or any(x < 0 for x in split) or sum(split) != m.n_layers:
            problems.append(
                f"parallel.layer_split must assign each of the {m.n_layers} layers exactly once, in order, to "
                f"{n_stages} stages (pp={par.pp} x virtual_stages={v}): got {split} (len {len(split)}, "
                f"sum {sum(split)}); e.g. {even_split(m.n_layers, n_stages) or _uneven(m.n_layers, n_stages)}.")
        return split
    split = even_split(m.n_layers, n_stages)
    if split is None:
        problems.append(f"model.n_layers={m.n_layers} does not split evenly over {n_stages} stages "
                        f"(pp={par.pp} x virtual_stages={v}); give an explicit "
                        f"parallel.layer_split, e.g. {_uneven(m.n_layers, n_stages)}.")
        return []
    return split


def microbatch_ok(schedule: str, pp: int, m: int) -> bool:
    """Micro-batch counts torch 2.13 accepts, per schedule (measured: tests/test_pipeline.py).

    gpipe, looped_bfs, zbv: any m >= 1. 1f1b: m >= pp (Schedule1F1B: m >= stages).
    dualpipev: m >= 2*pp (its stage count). interleaved_1f1b, zero_bubble: m must be a
    multiple of the number of rounds max(1, m // pp) -- so any m < 2*pp, and above that
    e.g. multiples of pp; m < pp runs.
    """
    if m < 1:
        return False
    if schedule == "1f1b":
        return m >= pp
    if schedule == "dualpipev":
        return m >= 2 * pp
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        return m % max(1, m // pp) == 0
    return True


def microbatch_problem(schedule: str, pp: int, m: int) -> Optional[str]:
    """The message for a micro-batch count the schedule refuses, or None."""
    if microbatch_ok(schedule, pp, m):
        return None
    near = [k for k in range(max(1, m - 2 * pp), m + 2 * pp + 1) if microbatch_ok(schedule, pp, k)]
    near = sorted(near, key=lambda k: (abs(k - m), k))[:3]
    if schedule == "1f1b":
        why = f"needs micro-batches >= pp = {pp} (Schedule1F1B: at least one per stage)"
    elif schedule == "dualpipev":
        why = f"needs micro-batches >= 2*pp = {2 * pp} (ScheduleDualPipeV: at least one per stage, 2 stages per rank)"
    else:
        rounds = max(1, m // pp)
        why = (f"needs micro-batches divisible by its number of rounds max(1, m // pp) = {rounds} "
               f"(pp={pp}; any m < {2 * pp} works)")
    return (f"schedule {schedule} {why}, got parallel.micro_batches={m}; "
            f"micro_batches that work: {sorted(near)}" + (" or schedule=gpipe." if schedule != "gpipe" else "."))


def resolve_virtual_stages(par: ParallelConfig, problems: list[str]) -> None:
    """Turn ``parallel.virtual_stages`` into an int: 'auto' is 1 for the one-stage-per-rank
    schedules (gpipe, 1f1b) and 2 for the others."""
    from xpar.validate import SCHEDULES

    v = par.virtual_stages
    if v == "auto":
        par.virtual_stages = 1 if SCHEDULES.get(par.schedule, ("", "1"))[1] == "1" else 2
        return
    try:
        par.virtual_stages = int(v)
    except (TypeError, ValueError):
        problems.append(f"parallel.virtual_stages must be an integer >= 1 or 'auto', got {v!r}.")
        par.virtual_stages = 1


def resolve_pp(par: ParallelConfig) -> list[str]:
    """Settings changed for correctness under pipelining; returns the notes explaining them.

    Zero-bubble schedules (zero_bubble, zbv, dualpipev) with FSDP2 reshard_after_forward=True
    (zero_stage=3) give wrong gradients without any error in torch 2.13 (measured: some
    stages' gradients off by 30-100 %, tests/test_pipeline.py). They run correctly with
    reshard_after_forward=False, which is xpar's zero_stage=2, so zero_stage 3 becomes 2.
    """
    from xpar.validate import ZERO_BUBBLE_SCHEDULES

    if par.pp > 1 and par.schedule in ZERO_BUBBLE_SCHEDULES and par.zero_stage == 3:
        par.zero_stage = 2
        return [f"parallel.zero_stage=3 ran as zero_stage=2 (FSDP2 reshard_after_forward=False): "
                f"schedule {par.schedule} with reshard_after_forward=True gives wrong gradients "
                f"silently in torch 2.13."]
    return []


def _uneven(n: int, k: int) -> list[int]:
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def check_layout(m: ModelConfig, par: ParallelConfig, mode: str, problems: list[str],
                 seq_len: Optional[int] = None) -> list[int]:
    """All TP and PP constraints; returns the layer split (blocks per stage). ``seq_len``:
    the training sequence length (checked against sequence parallelism when given)."""
    check_tp(m, par, problems, seq_len)
    return check_pp(m, par, mode, problems)
