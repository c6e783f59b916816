"""The one place that checks a composed config and resolves it into a :class:`RunSpec`.

Every violated constraint becomes one line naming the constraint, the values given and
values that would work. All lines are collected and raised together as
:class:`ConfigError` before any worker starts; the entry point prints them and exits 2.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from xpar.config import XparConfig
from xpar.spec import RunSpec

# Pipeline schedules by xpar name -> (torch class name, stages per rank rule).
# "v" means parallel.virtual_stages (>= 2), "2" means exactly two (V-shaped schedules).
SCHEDULES: dict[str, tuple[str, str]] = {
    "gpipe": ("ScheduleGPipe", "1"),
    "1f1b": ("Schedule1F1B", "1"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "v"),
    "looped_bfs": ("ScheduleLoopedBFS", "v"),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", "v"),
    "zbv": ("ScheduleZBVZeroBubble", "2"),
    "dualpipev": ("ScheduleDualPipeV", "2"),
}
# Schedules with a separate weight-gradient (W) action: measured here to give wrong
# gradients silently with FSDP2 reshard_after_forward=True (see FACTS / tests).
ZERO_BUBBLE_SCHEDULES = ("zero_bubble", "zbv", "dualpipev")
CHOICES = {
    "model.activation": ("swiglu", "gelu"),
    "model.norm": ("rmsnorm", "layernorm"),
    "model.position": ("rope", "learned"),
    "parallel.zero_stage": (0, 1, 2, 3),
    "parallel.schedule": tuple(SCHEDULES),
    "parallel.recompute": ("none", "selective", "full"),
    "train.dtype": ("fp32", "bf16"),
    "data.kind": ("synthetic", "text"),
    "run.mode": ("auto", "execute", "estimate"),
    "hardware.device": ("auto", "cpu", "cuda"),
}


class ConfigError(ValueError):
    """One or more violated constraints; ``problems`` holds one message per constraint."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(f"  - {p}" for p in problems))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def torchrun_world() -> Optional[dict[str, int]]:
    """Rank/world of a torchrun (torchelastic) launch, or None when xpar launches itself."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                               and "MASTER_ADDR" in os.environ):
        return {k: int(os.environ[k.upper()]) for k in ("rank", "world_size", "local_rank")
                if k.upper() in os.environ}
    return None


def to_schema(cfg: DictConfig | dict) -> XparConfig:
    """Typed config from a composed DictConfig (resolves interpolations)."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(cfg)
    merged = OmegaConf.merge(OmegaConf.structured(XparConfig), cfg)
    return OmegaConf.to_object(merged)


def validate(cfg: DictConfig | dict | XparConfig, local_devices: Optional[int] = None,
             check_memory: bool = True) -> RunSpec:
    """Check every constraint and resolve the run.

    Args:
        cfg: the composed config.
        local_devices: devices on this machine (CPU workers or GPUs); None detects.
        check_memory: in estimate mode, refuse a layout whose estimated peak exceeds device
            memory (:func:`xpar.estimate.fit.fit_problem`); False for its own what-ifs.

    Returns:
        The resolved :class:`RunSpec`.

    Raises:
        ConfigError: listing every violated constraint.
    """
    from xpar.hardware import resolve_hardware

    c = cfg if isinstance(cfg, XparConfig) else to_schema(cfg)
    problems: list[str] = []
    _check_choices(c, problems)
    if problems:  # later checks assume valid choices
        raise ConfigError(problems)

    m, par, tr = c.model, c.parallel, c.train
    _check_model(m, problems)

    # --- mode and world size -------------------------------------------------------
    trun = torchrun_world()
    notes: list[str] = []
    if c.hardware.name == "local" and not trun and c.run.mode != "execute" and par.reference_hardware:
        _assume_reference_hardware(c, problems, notes)  # a cluster preset beyond this machine
    local = c.hardware.name == "local"
    mode = c.run.mode
    if mode == "auto":
        mode = "execute" if (local or trun) else "estimate"
    if mode == "execute" and not local and not trun:
        problems.append(
            f"run.mode=execute needs the devices of hardware={c.hardware.name} "
            f"({c.hardware.devices_per_node} x {c.hardware.nodes} nodes); this machine is 'local'. "
            f"Use run.mode=estimate (or auto), hardware=local, or start under torchrun on that cluster.")
    hw = resolve_hardware(c.hardware, local_devices if not trun else None)
    from xpar.parallel.plan import resolve_virtual_stages
    resolve_virtual_stages(par, problems)
    degree_problems = [f"parallel.{name} must be >= 1, got {getattr(par, name)}."
                       for name in ("tp", "pp", "virtual_stages") if getattr(par, name) < 1]
    if degree_problems:  # the rest divides by these
        raise ConfigError(problems + degree_problems)
    tp_pp = par.tp * par.pp
    if trun:
        world = trun["world_size"]
        source = f"torchrun WORLD_SIZE={world}"
    elif mode == "estimate":
        world = int(hw.devices_per_node) * hw.nodes
        source = f"hardware={hw.name} ({hw.devices_per_node} devices x {hw.nodes} nodes = {world})"
    else:
        world = None
        source = f"local devices={hw.devices_per_node}"
    dp = par.dp
    if dp == "auto":
        if world is None:  # local run: fill this machine's devices (at least one replica)
            dp = max(1, int(hw.devices_per_node) // tp_pp)
        elif world % tp_pp:
            ok = [d for d in divisors(world)]
            problems.append(f"dp=auto needs world size divisible by tp*pp: {source}, tp*pp={tp_pp}; "
                            f"tp*pp values that divide {world}: {ok}.")
            dp = 1
        else:
            dp = world // tp_pp
    else:
        try:
            dp = int(dp)
        except (TypeError, ValueError):
            raise ConfigError([f"parallel.dp must be an integer >= 1 or 'auto', got {dp!r}."])
        if dp < 1:
            problems.append(f"parallel.dp must be >= 1 or 'auto', got {dp}.")
            dp = 1
    if world is not None and dp * tp_pp != world:
        problems.append(f"dp*tp*pp must equal the world size: dp={dp} x tp={par.tp} x pp={par.pp} = "
                        f"{dp * tp_pp}, but {source}. Use parallel.dp=auto"
                        + (f" or dp={world // tp_pp}." if world % tp_pp == 0 else f", with tp*pp dividing {world}."))
    world = dp * tp_pp
    if mode == "execute" and not trun and hw.device == "cuda" and world > int(hw.devices_per_node):
        problems.append(f"dp*tp*pp={world} exceeds the {hw.devices_per_node} local CUDA devices; "
                        f"reduce the degrees or use run.mode=estimate.")

    # --- batch ---------------------------------------------------------------------------
    seq = tr.seq_len if tr.seq_len is not None else m.seq_len
    if seq < 1 or (m.position == "learned" and seq > m.seq_len):
        problems.append(f"train.seq_len must be in [1, {m.seq_len}] for model={m.name} "
                        f"(learned positions cover {m.seq_len}), got {seq}.")
    b = tr.micro_batch_size
    if b < 1:
        problems.append(f"train.micro_batch_size must be >= 1, got {b}.")
        b = 1
    mb, B = par.micro_batches, tr.global_batch_size
    if mb != "auto":
        mb = int(mb)
        if mb < 1:
            problems.append(f"parallel.micro_batches must be >= 1 or 'auto', got {mb}.")
            mb = 1
    if B == "auto" and mb == "auto":
        mb = 1
    if B == "auto":
        B = b * mb * dp
    else:
        B = int(B)
        if mb == "auto":
            if B % (b * dp):
                ok = [x for x in divisors(B) if x <= 64 and (B // x) % dp == 0]
                problems.append(f"train.global_batch_size={B} must be divisible by micro-batch size x dp "
                                f"= {b} x {dp} = {b * dp}; micro_batch_size values that work: {ok}.")
                mb = 1
            else:
                mb = B // (b * dp)
        elif B != b * mb * dp:
            problems.append(
                f"train.global_batch_size must equal micro-batch size x micro-batches x dp: "
                f"{B} != {b} x {mb} x {dp} = {b * mb * dp}. Set train.global_batch_size={b * mb * dp} "
                f"(or auto), or parallel.micro_batches=auto.")

    # --- steps and data ---------------------------------------------------------------------
    if not tr.lr > 0:
        problems.append(f"train.lr must be > 0, got {tr.lr}; e.g. train.lr=3e-4.")
    if tr.weight_decay < 0:
        problems.append(f"train.weight_decay must be >= 0, got {tr.weight_decay}.")
    if tr.steps <= 0:
        problems.append(f"train.steps must be > 0, got {tr.steps}.")
    if tr.steps > 0 and not 0 <= tr.warmup_steps < tr.steps:
        problems.append(f"train.warmup_steps must satisfy 0 <= warmup_steps < steps, got warmup_steps="
                        f"{tr.warmup_steps}, steps={tr.steps}; e.g. warmup_steps={min(2, tr.steps - 1)}.")
    if c.data.kind == "text":
        if not c.data.path or not Path(c.data.path).expanduser().is_file():
            problems.append(f"data.path must be an existing text file for data=text, got {c.data.path!r}.")
        elif Path(c.data.path).expanduser().stat().st_size < seq + 1:
            problems.append(f"data.path={c.data.path} holds fewer than seq_len+1={seq + 1} bytes.")
        if m.vocab_size < 256:
            problems.append(f"data=text uses byte tokens (0..255): model.vocab_size must be >= 256, "
                            f"got {m.vocab_size}.")
    if tr.dtype == "bf16" and mode == "execute" and par.zero_stage == 1:
        problems.append("train.dtype=bf16 with zero_stage=1 is not supported; use fp32 or zero_stage 0/2/3.")

    from xpar.parallel.plan import check_layout, resolve_pp  # TP/PP constraints live with the strategies
    par.micro_batches = mb  # resolved from 'auto' above: the pipeline schedules check it
    layer_split = check_layout(m, par, mode, problems, seq_len=seq)

    if problems:
        raise ConfigError(problems)
    par.dp, par.micro_batches = dp, mb
    tr.global_batch_size, tr.seq_len = B, seq
    tr.threads_per_worker = tr.threads_per_worker or 1
    spec = RunSpec(model=m, parallel=par, hardware=hw, train=tr, data=c.data, tracking=c.tracking,
                   mode=mode, world_size=world, device=hw.device if mode == "execute" else "cuda",
                   layer_split=layer_split, launcher="torchrun" if trun else "local",
                   progress=c.run.progress, fail_rank=c.run.fail_rank, dry_run=c.run.dry_run)
    spec.notes = notes + spec.notes + resolve_pp(par)
    if mode == "execute" and hw.device == "cpu":
        problem = host_memory_problem(spec)
        if problem:
            raise ConfigError([problem])
    if mode == "estimate" and check_memory:
        from xpar.estimate.fit import fit_problem
        problem = fit_problem(spec)
        if problem:
            raise ConfigError([problem])
    return spec


def _assume_reference_hardware(c: XparConfig, problems: list[str], notes: list[str]) -> None:
    """hardware=local with a parallel preset written for a cluster (``reference_hardware``):
    take that hardware preset (conf/hardware/<name>.yaml, through the same schema), so that
    mode auto estimates it, and say so in a note."""
    from xpar.config import HardwareConfig
    from xpar.presets import conf_dir, presets

    name = c.parallel.reference_hardware
    if name not in presets("hardware"):
        problems.append(f"parallel.reference_hardware={name!r} is not a hardware preset; available: "
                        f"{', '.join(presets('hardware'))}.")
        return
    node = OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(conf_dir() / "hardware" / f"{name}.yaml"))
    c.hardware = OmegaConf.to_object(node)
    notes.append(f"hardware={name} assumed: the preset's reference cluster (parallel={c.parallel.name} names "
                 f"reference_hardware={name}); pass hardware=<preset> for another cluster.")


def _check_choices(c: XparConfig, problems: list[str]) -> None:
    for key, allowed in CHOICES.items():
        group, name = key.split(".")
        value = getattr(getattr(c, group), name)
        if value not in allowed:
            problems.append(f"{key} must be one of {list(allowed)}, got {value!r}.")


def _check_model(m: Any, problems: list[str]) -> None:
    for name in ("n_layers", "hidden", "n_heads", "ffn_hidden", "vocab_size", "seq_len"):
        if getattr(m, name) < 1:
            problems.append(f"model.{name} must be >= 1, got {getattr(m, name)}.")
    if m.n_heads >= 1 and m.hidden % m.n_heads:
        ok = [d for d in divisors(m.hidden) if d <= 256]
        problems.append(f"model.hidden must be divisible by model.n_heads: {m.hidden} % {m.n_heads} != 0; "
                        f"n_heads values that divide {m.hidden}: {ok}.")
    if m.kv_heads < 1 or (m.n_heads % m.kv_heads):
        problems.append(f"model.n_heads must be divisible by model.n_kv_heads (grouped-query attention): "
                        f"n_heads={m.n_heads}, n_kv_heads={m.kv_heads}; n_kv_heads values that work: "
                        f"{divisors(max(m.n_heads, 1))}.")
    elif m.position == "rope" and m.hidden % m.n_heads == 0 and m.head_dim % 2:
        problems.append(f"rope needs an even head dim: hidden/n_heads = {m.head_dim}.")


HOST_MEMORY_USABLE = 0.8
"""Share of host memory a CPU run may plan for: the rest is left to the Python interpreters,
torch's libraries and the allocator, which the cost model does not count."""


def host_memory_problem(spec: RunSpec) -> Optional[str]:
    """None if a CPU run of ``spec`` fits host memory, else why not and what to do.

    Every worker shares the host's memory, so the need is the cost model's peak per device
    for hardware=local (:func:`xpar.estimate.fit.peak_memory`: params, grads, optimizer states,
    activations, communication buffers, on the most loaded rank) times the world size.
    """
    from xpar.estimate.fit import peak_memory
    from xpar.estimate.memory import STATE_BYTES

    mem = peak_memory(spec)
    need = mem.total * spec.world_size
    have = spec.hardware.device_memory_gb * 1e9
    usable = HOST_MEMORY_USABLE * have
    if need <= usable:
        return None
    states = mem.params + mem.grads + mem.optimizer
    dtype = spec.train.dtype
    return (f"model={spec.model.name} does not fit this machine: {spec.world_size} workers need "
            f"~{need / 1e9:.1f} GB (cost-model estimate per worker {mem.total / 1e9:.1f} GB, of which model states "
            f"{states / 1e9:.1f} GB at {sum(STATE_BYTES[dtype])} bytes/param for "
            f"{'fp32' if dtype == 'fp32' else dtype + ' mixed-precision'} AdamW), "
            f"{(need - usable) / 1e9:.1f} GB more than the {usable / 1e9:.1f} GB usable "
            f"({HOST_MEMORY_USABLE:.0%} of {have / 1e9:.1f} GB host memory). Use a smaller model "
            f"(model=tiny or small), or estimate it: run.mode=estimate hardware=a100_80gb_8gpu.")
