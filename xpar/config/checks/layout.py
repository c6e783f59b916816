"""Checks of a resolved :class:`~xpar.config.layout.Layout` against the model and the mode.
Each returns violations and changes nothing."""
from __future__ import annotations

import math
from typing import Callable, Optional

from xpar.config.layout import (
    SCHEDULES,
    Layout,
    balanced_split,
    edge_split,
    even_split,
    cp_values,
    cp_world_rule,
    microbatch_ok,
    microbatch_problem,
)
from xpar.config.attention import kv_replicated
from xpar.config.checks import divisors, estimate_only
from xpar.config.checks.framework import frameworks_running
from xpar.config.remat import POLICIES, RECOMPUTE, SAC_POLICIES
from xpar.config.schema import ModelConfig
from xpar.config.vocab import tp_padding_hint


def check_tp(model: ModelConfig, layout: Layout, kv_rule: str = "split", mode: str = "estimate",
             world: Optional[int] = None) -> list[str]:
    """Megatron splits: heads and kv heads by tp (whole heads per rank; under ``kv_rule`` 'replicate',
    framework.kv_heads_over_tp, tp may instead be a multiple of the kv heads: xpar.config.attention.tp_kv_heads,
    estimated only), ffn by tp (column/row MLP), vocabulary by tp (vocabulary-parallel embedding and output;
    ``model`` with the vocabulary the framework pads, xpar.config.vocab); with
    sequence parallelism the training sequence by tp. ``world``: the fixed world size (None: a local run sized
    by its layout), whose tp values with parallel.dp=auto the refusal names where fewer work there."""
    t = layout.tp
    if t == 1:
        return []
    out, kv = _kv_problems(model, t, kv_rule, mode), model.kv_heads
    dims = (("n_heads", model.n_heads), ("ffn_hidden", model.ffn_hidden))
    kv_fits = lambda d: kv % d == 0 or (kv_rule == "replicate" and d % kv == 0)  # noqa: E731
    fails = {"n_heads": model.n_heads % t, "n_kv_heads": not kv_fits(t), "ffn_hidden": model.ffn_hidden % t}
    values = {"n_heads": model.n_heads, "n_kv_heads": kv, "ffn_hidden": model.ffn_hidden}  # the model's order
    bad = [f"model.{k}={values[k]}" for k in values if fails[k]]
    if bad:
        ok = [d for d in range(1, 65) if all(n % d == 0 for _, n in dims) and kv_fits(d)]
        kv_rule_text = "" if kv_rule == "split" else " (or a multiple of it: framework.kv_heads_over_tp=replicate)"
        here = [d for d in ok if world and world % (d * layout.pp * layout.cp) == 0]
        here_text = f" ({here} on the {world} devices, with parallel.dp=auto)" if world and here != ok else ""
        out.append(f"parallel.tp={t} must divide {', '.join(bad)} (Megatron split: whole heads and "
                   f"MLP columns per tp rank); tp values that divide "
                   f"n_heads={model.n_heads}, n_kv_heads={kv}{kv_rule_text} and ffn_hidden={model.ffn_hidden}: {ok}"
                   + here_text
                   + (_replicate_hint(model, t, kv_rule, bad) if mode == "estimate" else "") + ".")
    if model.vocab_size % t:
        out.append(f"parallel.tp={t} must divide model.vocab_size={model.vocab_size} (vocabulary-parallel embedding "
                   f"and output: whole rows per tp rank); {tp_padding_hint(model.vocab_size, t)}.")
    seq = layout.seq_len
    if layout.sequence_parallel and seq % t:
        ok = [s for s in range(t, min(seq, model.seq_len) + 1, t)]  # shorter: learned positions cover seq_len
        out.append(f"parallel.sequence_parallel=true shards the sequence over tp: train.seq_len={seq} "
                   f"must be divisible by parallel.tp={t}; e.g. " + (f"train.seq_len={ok[-1]}, or " if ok else "")
                   + "parallel.sequence_parallel=false.")  # was 'train.seq_len in [58, 60, 62]': no override
    return out


def _replicate_hint(model: ModelConfig, t: int, kv_rule: str, bad: list[str]) -> str:
    """The setting that prices ``t`` where the K/V heads alone refuse it and tp is a multiple of them (an estimate:
    execute mode runs xpar's engine, which splits K/V heads)."""
    if kv_rule != "split" or bad != [f"model.n_kv_heads={model.kv_heads}"] or t % model.kv_heads:
        return ""
    return (f"; or keep parallel.tp={t} with the K/V heads whole on every tp rank, as BigCode's Megatron-LM runs "
            f"multi-query attention: framework.kv_heads_over_tp=replicate (framework=megatron sets it)")


def _kv_problems(model: ModelConfig, t: int, kv_rule: str, mode: str) -> list[str]:
    """Replicated K/V heads (tp above n_kv_heads under framework.kv_heads_over_tp=replicate) are estimated only."""
    if mode != "execute" or not kv_replicated(model.kv_heads, t, kv_rule) or t % model.kv_heads:
        return []
    ok = [d for d in divisors(model.kv_heads) if model.n_heads % d == 0 and model.ffn_hidden % d == 0]
    return [f"framework.kv_heads_over_tp=replicate with parallel.tp={t} > model.n_kv_heads={model.kv_heads} (each tp "
            f"rank keeping the K/V head its query heads need) is estimated, not executed, by xpar (its engine splits "
            f"K/V heads over tp with DTensor); estimate it with run.mode=estimate, or run parallel.tp in {ok}."]


def check_zero1(layout: Layout, mode: str) -> list[str]:
    """ZeRO-1 with tp or pp: estimated as Megatron's distributed optimizer (optimizer states
    sharded over dp, gradients reduce-scattered, parameters all-gathered after the step). In
    execute mode torch's ZeroRedundancyOptimizer fails on DTensor parameters and is not
    composed with pipeline stages: xpar runs ZeRO-2 instead and says so
    (:func:`xpar.config.resolve.layout_notes`), so nothing is refused here."""
    return []


def check_virtual_stages(schedule: str, pp: int, v: int) -> list[str]:
    """Stages per rank as the schedule places them: one, v >= 2, or exactly two (V shape)."""
    if pp == 1:
        return []
    rule = SCHEDULES[schedule].stages_per_rank
    if rule == "1" and v != 1:
        return [f"schedule {schedule} runs one stage per rank: parallel.virtual_stages must be 1, "
                f"got {v}; set parallel.virtual_stages=auto (or 1), or a schedule with v > 1 "
                f"(interleaved_1f1b, zero_bubble)."]
    if rule == "v" and v < 2:
        return [f"schedule {schedule} needs parallel.virtual_stages >= 2 (stages per rank), got {v}; "
                f"set parallel.virtual_stages=auto (2)."]
    if rule == "2" and v != 2:
        return [f"schedule {schedule} is V-shaped: parallel.virtual_stages must be 2, got {v}; "
                f"set parallel.virtual_stages=auto (2)."]
    return []


def check_recompute(layout: Layout, recompute_layers: Optional[int] = None, mode: str = "estimate") -> list[str]:
    """Selective (op-level) recompute (torch's selective activation checkpointing) allows one backward
    through each checkpointed region; the zero-bubble schedules split a block's backward into
    an input-gradient (I) and a weight-gradient (W) pass, which torch 2.13 refuses at run time
    ("Trying to backward an extra time ... selective activation checkpoint").
    ``recompute_layers`` (parallel.recompute_layers) 0..the blocks of the largest stage, with a
    policy; in execute mode the policy one xpar runs (xpar.config.remat.Policy.executes)."""
    out, rec = [], layout.recompute
    if rec in ("selective",) + SAC_POLICIES and layout.pp > 1 and SCHEDULES[layout.schedule].zero_bubble:
        out.append(f"parallel.recompute={rec} cannot run with schedule {layout.schedule}: its split "
                   f"backward (I then W) goes through each checkpointed block twice, which torch's selective "
                   f"checkpointing refuses; use parallel.recompute=full or none, or schedule interleaved_1f1b.")
    if mode == "execute" and rec in POLICIES and not POLICIES[rec].executes:
        runs = [p for p in RECOMPUTE if p == "selective" or POLICIES[p].executes]
        out.append(f"parallel.recompute={rec} ({POLICIES[rec].source}) is estimated, not executed: xpar runs "
                   f"{', '.join(runs)}; e.g. parallel.recompute=selective, or run.mode=estimate.")
    return out + _recompute_layers_problems(layout, recompute_layers)


def _recompute_layers_problems(layout: Layout, k: Optional[int]) -> list[str]:
    """parallel.recompute_layers null or 0..the blocks of the largest stage, with a policy."""
    if k is None:
        return []
    most = max(layout.layer_split)
    if layout.recompute == "none":
        return [f"parallel.recompute_layers={k} needs a recompute policy, got parallel.recompute=none; e.g. "
                f"parallel.recompute=full parallel.recompute_layers={k}, or parallel.recompute_layers=null."]
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= most:
        return [f"parallel.recompute_layers must be 0..{most} (blocks per stage, the largest stage holds {most}) "
                f"or null (every block), got {k!r}; e.g. parallel.recompute_layers={most // 2}."]
    return []


def check_pipeline(model: ModelConfig, layout: Layout, mode: str, derived: bool = False,
                   rule: str = "torch", global_batch: Optional[int] = None) -> list[str]:
    """Micro-batch count the schedule accepts; no tied embeddings split across stages.
    ``derived``: m came from micro_batches=auto (global batch / (b x dp)), said in the message.
    ``global_batch``: train.global_batch_size when given (None: auto); the counts offered keep it.
    ``rule``: the framework's micro-batch rule (framework.microbatch_rule) in estimate mode;
    execute mode runs torch's schedule classes and keeps torch's rule."""
    if layout.pp == 1:
        return []
    out = []
    rule_run = "torch" if mode == "execute" else rule
    works = None if derived or global_batch is None else _kept_batch_fixes(layout, rule_run, global_batch)
    problem = microbatch_problem(layout.schedule, layout.pp, layout.micro_batches, rule_run, works)
    if problem and mode == "execute" and rule != "torch" and microbatch_ok(
            layout.schedule, layout.pp, layout.micro_batches, rule):
        problem += (f" (xpar executes with torch's schedule classes; the framework's own rule, "
                    f"framework.microbatch_rule={rule}, accepts it in run.mode=estimate)")
    if problem and derived:
        b, dp = layout.micro_batch_size, layout.dp
        problem += (f" (parallel.micro_batches=auto gave m = train.global_batch_size / (micro_batch_size x dp) = "
                    f"{layout.global_batch} / ({b} x {dp}); for m = k set train.global_batch_size={b * dp}*k, "
                    f"or a smaller train.micro_batch_size)")
    if problem:
        out.append(problem)
    if mode == "execute" and not SCHEDULES[layout.schedule].executable:
        profiles = frameworks_running(layout.schedule)
        with_fw = f" framework={profiles[0]}" if profiles and "xpar" not in profiles else ""
        out.append(f"parallel.schedule={layout.schedule} is estimate-only: torch 2.13 has no schedule class for "
                   f"it (Qi et al. 2024's one-stage-per-rank zero-bubble schedules); run.mode=estimate{with_fw} "
                   f"estimates it{' (the profile that runs it)' if with_fw else ''}, or execute a zero-bubble "
                   f"schedule torch runs: parallel.schedule=zbv (V-shaped, 2 stages per rank) or zero_bubble with "
                   f"parallel.virtual_stages=2.")
    if mode == "execute" and model.tied_embeddings:
        out.append(f"model={model.name} ties its output to the embedding, which pp>1 would split across "
                   f"stages; set model.tied_embeddings=false or parallel.pp=1.")
    return out


def _kept_batch_fixes(layout: Layout, rule: str, B: int) -> str:
    """What to change so that the schedule accepts the micro-batch count and B = b x m x dp holds:
    m = B / (b dp) where it is accepted, else a micro-batch size b whose count is, else gpipe
    (where the batch already holds) or a global batch of auto."""
    b, dp, pp, sched, m = layout.micro_batch_size, layout.dp, layout.pp, layout.schedule, layout.micro_batches
    ok = (lambda k: microbatch_ok(sched, pp, k, rule))
    head = f"with train.global_batch_size={B} = micro_batch_size x micro_batches x dp={dp}, "
    if B % (b * dp) == 0 and ok(B // (b * dp)):
        return head + f"micro_batches that work: [{B // (b * dp)}] (parallel.micro_batches={B // (b * dp)} or auto)."
    sizes = [x for x in divisors(B // dp) if x <= 64 and ok(B // dp // x)] if B % dp == 0 else []
    if sizes:
        return head + (f"micro_batch_size values that work: {sizes} (e.g. train.micro_batch_size={max(sizes)} "
                       f"parallel.micro_batches=auto).")
    if B == b * m * dp and sched != "gpipe":
        return head + "no micro_batch_size gives a count it accepts: parallel.schedule=gpipe."
    near = [k for k in range(pp, 4 * pp + 1) if ok(k)][:3]
    return head + f"none works; train.global_batch_size=auto with parallel.micro_batches in {near}."


def check_pipeline_runs(layout: Layout, k: Optional[int], mode: str) -> list[str]:
    """parallel.pipeline_micro_batches (k micro-batches per schedule run, m / k runs a step): null, or a divisor
    of m; estimated only unless k = m (xpar's engine runs one schedule a step). Source of the setting: NeMo
    AutoModel's benchmark loop calls ``schedule.step`` once per gradient-accumulation step, GA = global batch /
    (local batch x dp) of them, each over local batch / pp_microbatch_size micro-batches
    (nemo_automodel/recipes/llm/benchmark.py @037e04a6, the ``ga_steps`` loop): its DeepSeek-V3 run on 1024 H100
    ran 4 runs of 8. The memory model keeps m's in-flight count."""
    m = layout.micro_batches
    if k is None or k == m:
        return []
    if m % k:
        return [f"parallel.pipeline_micro_batches={k} must divide the step's {m} micro-batches (m / k schedule "
                f"runs a step); values that work: {divisors(m)}, or null (one run)."]
    if mode == "execute":
        return [estimate_only(f"parallel.pipeline_micro_batches={k} ({m // k} schedule runs a step)",
                              "its engine runs one schedule a step", "parallel.pipeline_micro_batches=null")]
    return []


def check_cp(model: ModelConfig, layout: Layout, mode: str, fits: Callable[[int], bool] = lambda c: True) -> list[str]:
    """cp >= 1; each sequence splits into 2 cp equal chunks (causal load balancing: rank i takes
    chunks i and 2 cp - 1 - i, as Megatron-Core and torchtitan do); estimated and executed
    (xpar.parallel.context). ``fits``: whether a cp keeps the world size (:func:`cp_world_rule`);
    the values named pass both."""
    cp, s, t = layout.cp, layout.seq_len, layout.tp
    if cp > 1 and s % (2 * cp):
        ok = cp_values(s, t, layout.sequence_parallel, fits)
        near = [x for x in (s - s % (2 * cp), s - s % (2 * cp) + 2 * cp) if x > 0 and fits(cp)
                and (not layout.sequence_parallel or (x // cp) % t == 0)]
        cps = f"cp values that work: {ok}" if ok else f"no cp > 1 on these devices splits seq_len={s}"
        lens = f"train.seq_len={near[0]}" + (f" (or {near[1]})" if len(near) > 1 else "") if near else ""
        return [f"parallel.cp={cp} splits each sequence into 2 x cp = {2 * cp} chunks (causal load balancing): "
                f"seq_len={s} is not divisible; {cps}" + (f"; or keep cp={cp} with {lens}" if lens else "") + "."]
    if cp > 1 and layout.sequence_parallel and (s // cp) % t:
        step = math.lcm(2 * cp, cp * t)
        return [f"parallel.cp={cp} with sequence_parallel=true shards each cp rank's seq_len / cp = {s // cp} "
                f"tokens over tp={t}: seq_len must be divisible by lcm(2 cp, cp tp) = {step}, got seq_len={s}; "
                f"e.g. train.seq_len={max(step, s - s % step)}, or parallel.sequence_parallel=false."]
    return []


def check_ep(model: ModelConfig, layout: Layout, mode: str) -> list[str]:
    """ep > 1 needs experts; ep divides the experts E, and ep x etp the tp x cp x dp ranks of a
    stage (ep inside dp x cp when etp = tp); etp divides tp. Executed (xpar.parallel.expert) with
    ZeRO 0-3, pp and tp, ep inside dp x cp; an explicit etp is estimated only."""
    ep, etp, n = layout.ep, layout.expert_tp, model.n_experts
    ranks = layout.tp * layout.cp * layout.dp
    if ep == 1 and etp == layout.tp:
        return []
    if not n:
        return [f"parallel.ep={ep} (etp={etp}) splits experts, but model={model.name} has none; use a MoE model "
                f"(e.g. model=moe_tiny) or parallel.ep=1 and parallel.etp=null."]
    if layout.tp % etp:
        return [f"parallel.etp={etp} must divide parallel.tp={layout.tp}; etp values that work: "
                f"{[k for k in range(1, layout.tp + 1) if layout.tp % k == 0]}."]
    ok = [k for k in range(1, ranks // etp + 1) if (ranks // etp) % k == 0 and n % k == 0]
    if n % ep or ranks % (ep * etp):
        return [f"parallel.ep={ep} must divide the experts (model.n_experts={n}), and ep x etp ({ep} x {etp}) the "
                f"ranks of a pipeline stage (tp={layout.tp} x cp={layout.cp} x dp={layout.dp} = {ranks}); "
                f"ep values that work: {ok}."]
    if mode == "execute" and layout.etp:
        return [f"parallel.etp={layout.etp} is estimated, not executed, by xpar (a run replicates each expert over "
                f"the tp ranks); run without it (parallel.etp=null) or estimate it with run.mode=estimate."]
    return []


def check_moe(model: ModelConfig, layout: Layout, mode: str) -> list[str]:
    """Experts are executed with dp / ZeRO, pp, ep and tp without sequence parallelism (the MoE
    left out of the tp plan, replicated over the tp ranks: xpar.parallel.tensor.block_plan);
    splitting them over tp, or sequence parallelism with experts, is estimated only (as
    Megatron-Core's expert tensor parallelism); a round-robin router (model.moe_routing) and multi-token
    prediction (model.mtp_layers) are estimated only."""
    if mode == "execute" and model.n_experts and layout.tp > 1 and layout.sequence_parallel:
        return [f"model={model.name} has experts, which xpar runs under tp only without sequence parallelism "
                f"(parallel.tp={layout.tp}, parallel.sequence_parallel=true); run parallel.sequence_parallel=false "
                f"(experts replicated over tp) or parallel.tp=1, or estimate it with run.mode=estimate."]
    if mode == "execute" and model.n_experts and model.capacity_factor is not None:
        return [f"model.capacity_factor={model.capacity_factor}: xpar runs experts dropless; set "
                f"model.capacity_factor=null to run it, or run.mode=estimate."]
    if mode == "execute" and model.mtp_layers:
        return [estimate_only(f"model.mtp_layers={model.mtp_layers} (multi-token prediction)",
                              "its model predicts the next token only", "model.mtp_layers=0")]
    if mode == "execute" and model.n_experts and model.moe_routing != "learned":
        return [estimate_only(f"model.moe_routing={model.moe_routing} (a synthetic balanced gate)",
                              "its router is learned top-k", "model.moe_routing=learned")]
    if mode == "execute" and model.kv_lora_rank is not None:
        return [f"model={model.name} has multi-head latent attention (model.kv_lora_rank={model.kv_lora_rank}), "
                f"which xpar estimates but does not run; set model.kv_lora_rank=null (MHA) to run it, or "
                f"run.mode=estimate."]
    return []


def check_positions(model: ModelConfig, mode: str) -> list[str]:
    """ALiBi (model.position=alibi) is estimated as attention without position parameters (the bias is added
    inside the fused attention kernels: flash-attn's alibi_slopes, Megatron-DeepSpeed's baddbmm into the
    scores); xpar's executed model has RoPE and learned positions only. A parallel block (model.block,
    xpar.config.block) and QK-norm (model.qk_norm) are estimated only: the executed model runs sequential blocks
    without q/k norms."""
    out = []
    if mode == "execute" and model.qk_norm:
        out.append(estimate_only("model.qk_norm=true (Qwen3's QK-norm)", "its attention has no q/k norms",
                                 "model.qk_norm=false"))
    if mode == "execute" and model.position == "alibi":
        out.append(estimate_only("model.position=alibi", "its model runs rope or learned positions",
                                 "model.position=rope"))
    if mode == "execute" and model.block != "sequential":
        out.append(estimate_only(f"model.block={model.block} (parallel attention and MLP)",
                                 "its model runs sequential blocks: the same matmuls", "model.block=sequential"))
    return out


def check_sinks(model: ModelConfig, sink_path, framework: str, mode: str) -> list[str]:
    """Learned attention sinks (model.attention_sinks): estimated only (xpar's executed model has none), and
    priced only by a framework with a sink path (framework.sink_attention: xpar.estimate.compute.kernel_block
    .sink_bytes)."""
    if not model.attention_sinks:
        return []
    if mode == "execute":
        return [estimate_only("model.attention_sinks=true", "its model has no sink logits",
                              "model.attention_sinks=false")]
    if sink_path is None:
        return [f"model.attention_sinks=true: framework={framework} prices no sink path; set "
                f"framework.sink_attention=fused (the sink inside the flash kernel: Transformer Engine >= 2.8 with "
                f"cuDNN >= 9.13.1, as framework=megatron_core) or framework.sink_attention=unfused (the s x s scores "
                f"in HBM), or model.attention_sinks=false."]
    return []


def check_layer_split(n_layers: int, given, pp: int, v: int) -> list[str]:
    """An explicit split assigns each layer once, in order, to the pp x v stages; without
    one, the stages must split the layers evenly."""
    n_stages = pp * v
    example = even_split(n_layers, n_stages) or balanced_split(n_layers, n_stages)
    if pp == 1:
        return ([f"parallel.layer_split={list(given)} given but pp=1; remove it."]
                if given not in (None, [], [n_layers]) else [])
    if n_layers < n_stages and not given:
        return [f"model.n_layers={n_layers} is fewer than the {n_stages} pipeline stages (pp={pp} x virtual_stages={v}); "
                f"every stage but the first and last needs >= 1 layer: e.g. model.n_layers={n_stages}, fewer stages, "
                f"or an explicit parallel.layer_split."]
    if not given:
        return [] if even_split(n_layers, n_stages) else [
            f"model.n_layers={n_layers} does not split evenly over {n_stages} stages "
            f"(pp={pp} x virtual_stages={v}); give an explicit parallel.layer_split, e.g. {example}."]
    split = list(given)
    if any(not isinstance(x, int) or isinstance(x, bool) for x in split):
        return [f"parallel.layer_split must list whole numbers of layers per stage, got {split}; e.g. {example}."]
    if len(split) != n_stages or any(x < 1 for x in split[1:-1]) or min(split) < 0 or sum(split) != n_layers:
        return [f"parallel.layer_split must assign each of the {n_layers} layers exactly once, in order, to "
                f"{n_stages} stages, each >= 1 but the first and last (>= 0: embedding or head alone) "
                f"(pp={pp} x virtual_stages={v}): got {split} (len {len(split)}, sum {sum(split)}); e.g. {example}."]
    return []


def check_edge_stages(n_layers: int, par, n_stages: int) -> list[str]:
    """``parallel.first_stage_layers`` / ``last_stage_layers`` (Megatron-LM's uneven pipeline):
    not with an explicit layer_split, >= 0, and leaving each middle stage a block."""
    first, last = par.first_stage_layers, par.last_stage_layers
    if first is None and last is None:
        return []
    given = " ".join(f"parallel.{k}={x}" for k, x in (("first_stage_layers", first), ("last_stage_layers", last))
                     if x is not None)
    if par.layer_split:
        return [f"{given} and parallel.layer_split={list(par.layer_split)} both set the stages' layers; give one "
                f"(e.g. drop parallel.layer_split)."]
    if n_stages < 2:
        return [f"{given} needs pipeline stages (parallel.pp >= 2), got {n_stages} stage; drop it or set parallel.pp=2."]
    if edge_split(n_layers, n_stages, first, last) is None:
        middle = n_stages - sum(x is not None for x in (first, last))
        most = max(0, n_layers - middle)
        if first is not None and last is not None:
            return [_edge_pair_problem(given, n_layers, n_stages, middle, first)]
        fix = " ".join(f"parallel.{k}={min(max(0, x), most)}"
                       for k, x in (("first_stage_layers", first), ("last_stage_layers", last)) if x is not None)
        return [f"{given} must be >= 0 and leave each of the {middle} other stages >= 1 of model.n_layers={n_layers} "
                f"blocks (pp x virtual_stages = {n_stages} stages); values that work: 0 .. {most}, e.g. {fix}."]
    return []


def _edge_pair_problem(given: str, n_layers: int, n_stages: int, middle: int, first: int) -> str:
    """Both ends given: first, last >= 0 with first + last = n_layers when no stage lies between (pp x v = 2),
    else first + last <= n_layers - the stages between; the fix keeps ``first`` where it can."""
    most = max(0, n_layers - middle)
    keep = min(max(0, first), most)
    last = n_layers - keep if middle == 0 else most - keep
    rule = (f"first + last = model.n_layers={n_layers} (no stage between them)" if middle == 0 else
            f"first + last <= {most}, leaving each of the {middle} stages between >= 1 of model.n_layers={n_layers} blocks")
    return (f"{given} must be >= 0 with {rule} (pp x virtual_stages = {n_stages} stages); e.g. "
            f"parallel.first_stage_layers={keep} parallel.last_stage_layers={last}.")
