"""Validation: a composed config in, a resolved :class:`~xpar.config.spec.RunSpec` out.

Runs every named check (:mod:`xpar.config.checks.config` on the config, :mod:`xpar.config.checks.layout`
on the resolved :class:`~xpar.config.layout.Layout`), collects every violation and raises them
together as :class:`ConfigError` before any worker starts; the entry point prints them and
exits 2. Nothing here changes the config it is given. Whether the layout fits memory is
checked after validation by :mod:`xpar.estimate.preflight.check`, which calls the cost model.
"""
from __future__ import annotations

import re
from dataclasses import replace
from functools import lru_cache
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from xpar.config.attention import kv_replicated
from xpar.config.checks import ConfigError, divisors, estimate_only  # noqa: F401  (divisors re-exported)
from xpar.config.checks import config as config_checks
from xpar.config.checks import layout as layout_checks
from xpar.config.checks.environment import check_environment
from xpar.config.checks.framework import check_framework, check_framework_layout
from xpar.config.checks.hsdp import check_zero_shard
from xpar.config.checks.hardware import estimate_peak_problem
from xpar.config.checks.ranges import range_problems
from xpar.config.checks.runtime import check_runtime, check_threads
from xpar.config.hardware import is_this_machine
from xpar.config.layout import Layout, requested_split
from xpar.config.resolve import (  # noqa: F401
    Target,
    build_layout,
    layout_notes,
    resolve_target,
    torchrun_world,
    uneven_split_ok,
)
from xpar.config.schema import XparConfig
from xpar.config.spec import RunSpec, settings_of
from xpar.config.vocab import padded_model, padding_notes


def to_schema(cfg: DictConfig | dict) -> XparConfig:
    """Typed config from a composed DictConfig (resolves interpolations)."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(cfg)
    merged = OmegaConf.merge(_structured_schema(), cfg)  # merge copies it: the cached schema is never changed
    return OmegaConf.to_object(merged)


@lru_cache(maxsize=1)
def _structured_schema() -> DictConfig:
    """``OmegaConf.structured(XparConfig)``, built once (tens of milliseconds each time)."""
    return OmegaConf.structured(XparConfig)


def _raise_if(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems)


def layout_problems(c: XparConfig, layout: Layout, mode: str, world: Optional[int] = None) -> list[str]:
    """Every check of the resolved layout (``world``: the fixed world size, None on a local run)."""
    par, v = c.parallel, layout.virtual_stages
    return (layout_checks.check_tp(padded_model(c.model, c.framework, layout.tp), layout,
                                  c.framework.kv_heads_over_tp, mode, world) + layout_checks.check_zero1(layout, mode)
            + layout_checks.check_virtual_stages(par.schedule, par.pp, v)
            + layout_checks.check_pipeline(c.model, layout, mode, derived=par.micro_batches == "auto",
                                           rule=c.framework.microbatch_rule,
                                           global_batch=None if c.train.global_batch_size == "auto"
                                           else int(c.train.global_batch_size))
            + layout_checks.check_moe(c.model, layout, mode) + layout_checks.check_positions(c.model, mode)
            + layout_checks.check_sinks(c.model, c.framework.sink_attention, c.framework.name, mode)
            + layout_checks.check_cp(
                c.model, layout, mode, layout_checks.cp_world_rule(par.dp, par.tp, par.pp, world))
            + layout_checks.check_ep(c.model, layout, mode) + check_zero_shard(par.zero_shard_size, layout, mode)
            + layout_checks.check_recompute(layout, par.recompute_layers, mode)
            + layout_checks.check_pipeline_runs(layout, par.pipeline_micro_batches, mode)
            + layout_checks.check_edge_stages(c.model.n_layers, par, par.pp * v)
            + layout_checks.check_layer_split(c.model.n_layers, given_split(c, par.pp * v), par.pp, v))


def local_cuda_problems(target, layout: Layout) -> list[str]:
    """A local CUDA run with more ranks than devices: on hardware=local, this machine's count; on a
    cluster preset (hardware.device=cuda), the preset's devices_per_node, and what this machine has."""
    hw = target.hardware
    if not (target.mode == "execute" and target.launcher == "local" and hw.device == "cuda"
            and layout.world_size > int(hw.devices_per_node)):
        return []
    ranks = f"{'dp*tp*cp*pp' if layout.cp > 1 else 'dp*tp*pp'}={layout.world_size}"
    if is_this_machine(hw):
        return [f"{ranks} exceeds the {hw.devices_per_node} local CUDA devices; reduce the degrees or use "
                f"run.mode=estimate."]
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    here = f"has {have} CUDA device{'s' if have != 1 else ''}" if have else "has no CUDA device"
    return [f"{ranks} ranks exceed hardware={hw.name}'s devices_per_node={hw.devices_per_node} (the preset's "
            f"GPUs per node; xpar starts local workers on one node), and this machine {here}; estimate the "
            f"cluster instead: run.mode=estimate, or run locally: hardware=local with degrees that fit it."]


LATE_RANGES = ("run.fail_rank", "run.hang_rank")
"""Keys whose range refusal waits for the layout: :func:`fail_rank_problems` names the ranks that work."""


def unnamed(ranged: dict[str, str], others: list[str]) -> list[str]:
    """The range refusals ``ranged`` (key -> line, :func:`xpar.config.checks.ranges.range_problems`) of keys
    no line of ``others`` names already (their own checks say more: the preset's figure, the divisors)."""
    return [line for key, line in ranged.items()
            if not any(re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", o) for o in others)]


def split_notes(c: XparConfig, layout: Layout) -> list[str]:
    """The lighter-ends split an estimate took where none was given (:func:`xpar.config.layout.requested_split`)."""
    par, n = c.parallel, len(layout.layer_split)
    if n < 2 or par.layer_split or par.first_stage_layers is not None or par.last_stage_layers is not None \
            or c.model.n_layers % n == 0:
        return []
    return [f"model.n_layers={c.model.n_layers} over {n} pipeline stages: estimated with the split "
            f"{list(layout.layer_split)} (lighter first and last stages, as xpar plan prices it); set "
            f"parallel.layer_split (or first_stage_layers / last_stage_layers) to price the run's own."]


def unused_setting_notes(c: XparConfig, layout: Layout, mode: str) -> list[str]:
    """An estimate's notes on settings it takes but prices nothing for here: framework.moe_recompute_graph_kept outside
    full recompute of a MoE model (xpar.estimate.memory.activations.moe_kept_graph_bytes), and model.qk_norm, whose
    time is priced (kernel_block.qk_norm_bytes) but whose q/k norm inputs only such a kept graph counts in memory
    (activations.eager_attention_extra_bytes)."""
    kept = c.framework.moe_recompute_graph_kept
    priced = bool(c.model.n_experts) and layout.recompute == "full"
    if mode != "estimate":
        return []
    out = [] if not kept or priced else [
        f"framework.moe_recompute_graph_kept=true prices nothing here: it keeps MoE blocks' recomputed graphs under "
        f"parallel.recompute=full (got recompute={layout.recompute}, model.n_experts={c.model.n_experts})"]
    if c.model.qk_norm and not (kept and priced):
        out.append("model.qk_norm=true: the q/k norms' time is priced, their saved inputs are not in the memory estimate "
                   "(counted only in a kept recomputed MoE graph: framework.moe_recompute_graph_kept=true, "
                   "parallel.recompute=full)")
    return out


def kv_replica_notes(c: XparConfig, layout: Layout, mode: str) -> list[str]:
    """What an estimate with K/V heads replicated over tp prices (framework.kv_heads_over_tp=replicate, tp above
    model.n_kv_heads: xpar.config.attention.tp_model), and that the dry run, whose engine splits them, is left out."""
    kv, t = c.model.kv_heads, layout.tp
    if mode != "estimate" or c.model.kv_lora_rank is not None or not kv_replicated(kv, t, c.framework.kv_heads_over_tp):
        return []
    return [f"framework.kv_heads_over_tp=replicate: each of the parallel.tp={t} ranks keeps the K/V head its query "
            f"heads need whole ({t // kv} copies of each of the model.n_kv_heads={kv}: their projection's parameters, "
            f"gradients, optimizer states and saved K/V on every such rank, the gradients reduced over tp); no dry run "
            f"(run.dry_run): xpar's engine splits K/V heads over tp"]


def given_split(c: XparConfig, n_stages: int):
    """The layer split ``c`` asks for (:func:`xpar.config.layout.requested_split`), or None."""
    return requested_split(c.model.n_layers, c.parallel, n_stages, uneven_split_ok(c))


def validate(cfg: DictConfig | dict | XparConfig, local_devices: Optional[int] = None) -> RunSpec:
    """Check every constraint and resolve the run.

    Args:
        cfg: the composed config (not changed).
        local_devices: devices on this machine (CPU workers or GPUs); None detects.

    Returns:
        The resolved :class:`RunSpec` (no 'auto' left).

    Raises:
        ConfigError: listing every violated constraint.
    """
    c = cfg if isinstance(cfg, XparConfig) else to_schema(cfg)
    early = (config_checks.check_choices(c) + config_checks.check_degrees(c) + check_environment(c)
             + check_threads(c))
    problems = (config_checks.check_model(c) + config_checks.check_train(c) + check_runtime(c)
                + config_checks.check_data(c) + check_framework(c.framework) + config_checks.check_sweep(c))
    ranged = range_problems(c)
    late = {k: ranged.pop(k) for k in LATE_RANGES if k in ranged}  # their own check, after the layout, says more
    early = unnamed(ranged, early + problems) + early
    _raise_if(early and early + problems)  # resolution assumes valid choices and degrees; say everything
    target, target_problems = resolve_target(c, local_devices)
    layout, layout_resolution = build_layout(c, target)
    problems += target_problems + layout_resolution + layout_problems(c, layout, target.mode, target.world)
    problems += check_framework_layout(c.framework, c.parallel.zero_stage, layout.pp, c.parallel.schedule,
                                       layout.micro_batches, bool(c.parallel.sequence_parallel), layout.tp,
                                       layout.cp, layout.ep, layout.layer_split if layout.pp > 1 else (), layout.dp,
                                       bool(c.model.n_experts))
    problems += estimate_peak_problem(target.hardware, target.mode) + fail_rank_problems(c, layout, target.mode)
    problems += fp8_problems(c.train.dtype, target.hardware, target.mode)
    problems += fp8_recipe_problems(c.train.dtype, c.train.fp8_recipe, target.hardware)
    problems += compile_problems(c.train, target.mode)
    problems += unnamed(late, problems)
    _raise_if(problems + local_cuda_problems(target, layout))
    return build_spec(c, target, layout)


def fp8_problems(dtype: str, hw, mode: str) -> list[str]:
    """train.dtype=fp8 needs FP8 matmuls (hardware.peak_tflops_fp8) and is estimated only: xpar
    executes bf16 and fp32 (FP8 runs need torchao float8 on an H100-class GPU)."""
    if dtype != "fp8":
        return []
    if mode == "execute":
        return [f"train.dtype=fp8 is estimated, not executed, by xpar (FP8 matmuls need an H100-class GPU and "
                f"torchao float8; this run's device is {hw.device}); estimate it with run.mode=estimate "
                f"hardware=h100_80gb_64gpu, or run train.dtype=bf16."]
    if not hw.peak_tflops_fp8:
        return [f"train.dtype=fp8 needs FP8 matmuls; hardware={hw.name} has none (hardware.peak_tflops_fp8 unset); "
                f"use an H100/H200 preset (hardware=h100_80gb_64gpu) or train.dtype=bf16."]
    return []


def compile_problems(train, mode: str) -> list[str]:
    """train.compile=true and train.compile_loss=true are estimated only: xpar's engine runs eagerly, so an
    executed run would time eager kernels under a compiled label."""
    if mode != "execute":
        return []
    return [estimate_only(f"train.{k}=true", "its engine runs eager PyTorch", f"train.{k}=false")
            for k in ("compile", "compile_loss") if getattr(train, k)]


def fp8_recipe_problems(dtype: str, recipe: str, hw) -> list[str]:
    """train.fp8_recipe=mxfp8 under train.dtype=fp8 needs MXFP8 tensor cores (hardware.mxfp8: Blackwell);
    the values that work on ``hw`` are named."""
    if dtype != "fp8" or recipe != "mxfp8" or getattr(hw, "mxfp8", False):
        return []
    return [f"train.fp8_recipe=mxfp8 needs MXFP8 tensor cores (Blackwell); hardware={hw.name} has none "
            f"(hardware.mxfp8=false); use train.fp8_recipe=delayed, current or blockwise, or a Blackwell preset "
            f"(hardware=b200_180gb_64gpu, gb200_nvl72_576gpu)."]


def fail_rank_problems(c: XparConfig, layout: Layout, mode: str) -> list[str]:
    """``run.fail_rank`` and ``run.hang_rank`` (fault injection) name a rank of this executed run; a
    rank outside it or an estimate would inject nothing, silently."""
    out, world = [], layout.world_size
    for key, rank in (("run.fail_rank", c.run.fail_rank), ("run.hang_rank", c.run.hang_rank)):
        if rank is None:
            continue
        if mode != "execute":
            out.append(f"{key}={rank} injects a worker fault, but run.mode={mode} starts no worker; "
                       f"drop it ({key}=null).")
        elif not 0 <= rank < world:
            out.append(f"{key} must be a rank of this run, 0..{world - 1}, or null, got {rank}; "
                       f"e.g. {key}={world - 1}.")
    return out


def build_spec(c: XparConfig, target: Target, layout: Layout) -> RunSpec:
    """The RunSpec of a valid config: ``layout``, the parallel settings it does not own, resolved copies
    of the other groups."""
    train = replace(c.train, global_batch_size=layout.global_batch, seq_len=layout.seq_len,
                    threads_per_worker=c.train.threads_per_worker or 1)
    replicas = kv_replica_notes(c, layout, target.mode)  # K/V heads replicated over tp: estimated, no dry run
    notes = (list(target.notes) + layout_notes(c.parallel.zero_stage, layout) + padding_notes(c.model, c.framework, layout.tp)
             + split_notes(c, layout) + replicas + unused_setting_notes(c, layout, target.mode))
    if target.mode == "execute" and c.framework.name != "xpar":
        notes.append(f"framework={c.framework.name} shapes this run's estimate (fidelity/*) only: the run itself is "
                     "xpar's engine (torch DDP, FSDP2, DTensor, pipelining)")
    model = replace(padded_model(c.model, c.framework, layout.tp), head_dim=c.model.head_size)  # resolved for every reader
    return RunSpec(model=model, parallel=settings_of(c.parallel), hardware=target.hardware, train=train,
                   data=replace(c.data), tracking=replace(c.tracking), mode=target.mode, layout=layout,
                   device=target.hardware.device if target.mode == "execute" else "cuda",
                   launcher=target.launcher, progress=c.run.progress, fail_rank=c.run.fail_rank, hang_rank=c.run.hang_rank,
                   collective_timeout_s=c.run.collective_timeout_s, heartbeat_timeout_s=c.run.heartbeat_timeout_s,
                   dry_run=c.run.dry_run and not replicas, notes=notes, framework=replace(c.framework, terms=list(c.framework.terms)),
                   vocab_unpadded=c.model.vocab_size if c.framework.make_vocab_size_divisible_by else None)
