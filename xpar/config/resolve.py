"""Resolution of a composed config into a :class:`~xpar.config.layout.Layout` and its target:
every 'auto' becomes a number here, once. Each function returns its result and the
violations it met (the config is never changed)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from omegaconf import OmegaConf

from xpar.config.checks import divisors
from xpar.config.checks.hardware import part_memory_notes
from xpar.config.layout import (
    SCHEDULES,
    Layout,
    balanced_split,
    cp_values,
    cp_world_rule,
    even_split,
    requested_split,
    zero_stage_run,
)
from xpar.config.hardware import is_this_machine, resolve_hardware
from xpar.config.schema import HardwareConfig, XparConfig
from xpar.config.torchrun import under_torchrun
from xpar.config.presets import load_preset, presets


@dataclass(frozen=True)
class Target:
    """Where the layout runs: mode 'execute' or 'estimate', the hardware (detected for
    'local'), the world size when it is fixed (None: a local run fills this machine), and
    how it is launched ('local' or 'torchrun')."""

    mode: str
    hardware: HardwareConfig
    world: Optional[int]
    source: str
    """Where the world size comes from, for messages."""
    launcher: str
    notes: tuple[str, ...] = ()
    sized_here: bool = False
    """An estimate sized by the local device count (hardware=local, devices_per_node auto, one node): a
    layout of another size is estimated with hardware.devices_per_node set (as execute mode sizes its workers)."""


def torchrun_world() -> Optional[dict[str, int]]:
    """Rank/world of a torchrun (torchelastic) launch, or None when xpar launches itself."""
    if under_torchrun():
        return {k: int(os.environ[k.upper()]) for k in ("rank", "world_size", "local_rank")
                if k.upper() in os.environ}
    return None


def reference_hardware(c: XparConfig) -> tuple[HardwareConfig, list[str], list[str]]:
    """(hardware, notes, problems): hardware=local with a parallel preset written for a
    cluster (``reference_hardware``) assumes that preset's cluster (conf/hardware/<name>.yaml,
    through the same schema), so that mode auto estimates it, and says so in a note."""
    name, hw = c.parallel.reference_hardware, c.hardware
    if not (is_this_machine(hw) and name and c.run.mode != "execute" and not torchrun_world()):
        return hw, [], []
    if name not in presets("hardware"):
        return hw, [], [f"parallel.reference_hardware={name!r} is not a hardware preset; available: "
                        f"{', '.join(presets('hardware'))}."]
    node = OmegaConf.merge(OmegaConf.structured(HardwareConfig), load_preset("hardware", name))
    note = (f"hardware={name} assumed: the preset's reference cluster (parallel={c.parallel.name} names "
            f"reference_hardware={name}); pass hardware=<preset> for another cluster.")
    return OmegaConf.to_object(node), [note], []


def resolve_target(c: XparConfig, local_devices: Optional[int] = None) -> tuple[Target, list[str]]:
    """Mode, hardware and world size of the run."""
    hardware, notes, problems = reference_hardware(c)
    trun = torchrun_world()
    local = is_this_machine(hardware)
    mode = c.run.mode if c.run.mode != "auto" else ("execute" if (local or trun) else "estimate")
    if mode == "execute" and not local and not trun:
        problems.append(
            f"run.mode=execute needs the devices of hardware={hardware.name} "
            f"({hardware.devices_per_node} x {hardware.nodes} nodes); this machine is 'local'. "
            f"Use run.mode=estimate (or auto), hardware=local, or start under torchrun on that cluster.")
    hw = resolve_hardware(hardware, local_devices if not trun else None, threads=c.train.threads_per_worker or 1)
    if trun:
        world, source = trun["world_size"], (
            f"the SLURM job's {os.environ['XPAR_SUBMITIT_TASKS']} tasks (hydra.launcher.nodes x tasks_per_node)"
            if os.environ.get("XPAR_SUBMITIT_TASKS") else f"torchrun WORLD_SIZE={trun['world_size']}")
    elif mode == "estimate" or problems and not local:  # refused execute: check the layout on the named cluster
        world = int(hw.devices_per_node) * hw.nodes
        source = f"hardware={hw.name} ({hw.devices_per_node} devices x {hw.nodes} nodes = {world})"
    else:
        world, source = None, f"local devices={hw.devices_per_node}"
    notes += part_memory_notes(hw)
    sized_here = mode == "estimate" and local and not trun and hardware.devices_per_node == "auto" and hw.nodes == 1
    return Target(mode, hw, world, source, "torchrun" if trun else "local", tuple(notes), sized_here), problems


def resolve_dp(dp, tp: int, pp: int, target: Target, cp: int = 1, seq_len: Optional[int] = None,
               sequence_parallel: bool = False) -> tuple[int, list[str]]:
    """dp from 'auto' (world / (tp cp pp); a local run fills this machine's devices), checked
    against the world size. With cp > 1 the products are named tp*cp*pp and the cp values offered
    also split ``seq_len`` (:func:`xpar.config.checks.layout.cp_values`)."""
    world, source, ranks = target.world, target.source, tp * pp * cp
    name = "tp*cp*pp" if cp > 1 else "tp*pp"
    if dp == "auto":
        if world is None:
            return max(1, int(target.hardware.devices_per_node) // ranks), []
        if world % ranks:
            return 1, [f"dp=auto needs world size divisible by {name}: {source}, {name}={ranks}; "
                       + _cp_fix(world, tp, pp, cp, seq_len, sequence_parallel, name)]
        return world // ranks, []
    dp = int(dp)
    if world is not None and dp * ranks != world:
        fix = f" or parallel.dp={world // ranks}." if world % ranks == 0 else (
            ", with " + _cp_fix(world, tp, pp, cp, seq_len, sequence_parallel, name))
        degrees = f"tp={tp}, cp={cp}" if cp > 1 else f"tp={tp}"
        here = (f" Or estimate {dp * ranks} devices of this machine's kind: hardware.devices_per_node={dp * ranks}."
                if target.sized_here else "")
        return dp, [f"dp*{name} must equal the world size: dp={dp} x {degrees} x pp={pp} = {dp * ranks}, "
                    f"but {source}. Use parallel.dp=auto" + fix + here]
    return dp, []


def _cp_fix(world: int, tp: int, pp: int, cp: int, seq_len: Optional[int], sp: bool, name: str) -> str:
    """The {name} values that divide ``world``; with cp > 1 the cp values that do (and split seq_len)."""
    if cp == 1 or seq_len is None:
        return f"{name} values that divide {world}: {divisors(world)}."
    ok = cp_values(seq_len, tp, sp, cp_world_rule("auto", tp, pp, world))
    return f"cp values that work with tp={tp} x pp={pp} on {world} devices and seq_len={seq_len}: {ok}" + (
        f" (e.g. parallel.cp={min(ok, key=lambda c: (abs(c - cp), -c))} parallel.dp=auto)." if ok else ".")


def resolve_batch(b: int, m, global_batch, dp: int) -> tuple[int, int, list[str]]:
    """(micro-batches m, global batch B) with B = b m dp; either may be 'auto'."""
    if global_batch == "auto":
        m = 1 if m == "auto" else int(m)
        return m, b * m * dp, []
    B = int(global_batch)
    if m == "auto":
        if B % (b * dp):
            return 1, B, [f"train.global_batch_size={B} must be divisible by micro-batch size x dp "
                          f"= {b} x {dp} = {b * dp}; " + _batch_fix(B, b, dp) + "."]
        return B // (b * dp), B, []
    m = int(m)
    if B != b * m * dp:
        other = (", or parallel.micro_batches=auto" if B % (b * dp) == 0 else
                 f" ({B} sequences cannot be split evenly over dp={dp})" if B % dp else
                 f", or {_batch_fix(B, b, dp)}")
        return m, B, [f"train.global_batch_size must equal micro-batch size x micro-batches x dp: "
                      f"{B} != {b} x {m} x {dp} = {b * m * dp}. Set train.global_batch_size={b * m * dp} "
                      f"(or auto){other}."]
    return m, B, []


def _batch_fix(B: int, b: int, dp: int) -> str:
    """What makes B split into micro-batches over dp: a micro-batch size dividing B / dp, else
    (B not a multiple of dp) the global batches that are."""
    sizes = [x for x in divisors(B // dp) if x <= 64] if B % dp == 0 else []
    if sizes:
        return (f"micro_batch_size values that work: {sizes} (e.g. train.micro_batch_size={max(sizes)} "
                f"parallel.micro_batches=auto)")
    near = [x for x in (B - B % (b * dp), B - B % (b * dp) + b * dp) if x > 0]
    return (f"{B} sequences cannot be split evenly over dp={dp}; train.global_batch_size values that work "
            f"with micro_batch_size={b}: {near} (e.g. train.global_batch_size={near[-1]} parallel.micro_batches=auto)")


def resolve_virtual_stages(schedule: str, pp: int, v) -> int:
    """Stages per pipeline rank: 'auto' is 1 for one-stage schedules (gpipe, 1f1b), 2 for the
    others; always 1 without pipelining."""
    if pp == 1:
        return 1
    return SCHEDULES[schedule].default_virtual_stages() if v == "auto" else int(v)


def resolve_layer_split(n_layers: int, given, n_stages: int) -> list[int]:
    """The given split, or an even one (balanced where none is even: a placeholder while
    :func:`xpar.config.checks.layout.check_layer_split` reports the problem)."""
    if n_stages == 1:
        return [n_layers]
    if given and all(isinstance(x, int) and not isinstance(x, bool) for x in given) and len(given) == n_stages:
        return [int(x) for x in given]
    return even_split(n_layers, n_stages) or balanced_split(n_layers, n_stages)


def uneven_split_ok(c: XparConfig) -> bool:
    """Whether ``c`` takes the lighter-ends split where the stages do not divide the layers: an estimate
    (run.mode=estimate) under a framework that splits unevenly (framework.even_layer_split false). A run
    executes the split it names."""
    return c.run.mode == "estimate" and not c.framework.even_layer_split


def build_layout(c: XparConfig, target: Target) -> tuple[Layout, list[str]]:
    """The resolved layout of ``c`` on ``target``, and the violations met resolving it."""
    par, tr, model = c.parallel, c.train, c.model
    seq = tr.seq_len if tr.seq_len is not None else model.seq_len
    dp, problems = resolve_dp(par.dp, par.tp, par.pp, target, par.cp, seq, bool(par.sequence_parallel))
    b = max(1, tr.micro_batch_size)
    m, B, batch_problems = resolve_batch(b, par.micro_batches, tr.global_batch_size, max(dp, 1))
    v = resolve_virtual_stages(par.schedule, par.pp, par.virtual_stages)
    split = resolve_layer_split(model.n_layers, requested_split(model.n_layers, par, par.pp * v, uneven_split_ok(c)),
                                par.pp * v)
    seq = tr.seq_len if tr.seq_len is not None else model.seq_len
    layout = Layout(dp=max(dp, 1), tp=par.tp, pp=par.pp, micro_batch_size=b, micro_batches=max(m, 1),
                    seq_len=seq, layer_split=tuple(split), schedule=par.schedule,
                    zero_stage=_zero_stage(c, target),
                    sequence_parallel=par.sequence_parallel, recompute=par.recompute, cp=par.cp,
                    ep=par.ep, etp=par.etp or 0)
    return layout, problems + batch_problems


def _zero_stage(c: XparConfig, target: Target) -> int:
    """The ZeRO stage that runs (:func:`xpar.config.layout.zero_stage_run`); in execute mode ZeRO-1
    with tp or pp runs as ZeRO-2: torch's ZeroRedundancyOptimizer broadcasts whole parameters
    (fails on DTensor) and is not composed with pipeline stages. Estimates keep ZeRO-1 (the
    distributed optimizer, xpar.estimate.comm.dp)."""
    par = c.parallel
    z = zero_stage_run(par.schedule, par.pp, par.zero_stage)
    return 2 if (z == 1 and target.mode == "execute" and (par.tp > 1 or par.pp > 1)) else z


def layout_notes(requested_zero_stage: int, layout: Layout) -> list[str]:
    """What was changed for correctness, said to the user (console, tag ``xpar.notes``)."""
    if requested_zero_stage == 1 and layout.zero_stage == 2:
        return [f"parallel.zero_stage=1 ran as zero_stage=2 (FSDP2 reshard_after_forward=False: gradients "
                f"sharded too): torch's ZeroRedundancyOptimizer is not composed with tp={layout.tp}/pp={layout.pp} "
                f"(it broadcasts whole parameters, which fails on DTensor). Estimates model ZeRO-1 as Megatron's "
                f"distributed optimizer (run.mode=estimate)."]
    if layout.zero_stage != requested_zero_stage:
        return [f"parallel.zero_stage={requested_zero_stage} ran as zero_stage={layout.zero_stage} "
                f"(FSDP2 reshard_after_forward=False): schedule {layout.schedule} with "
                f"reshard_after_forward=True gives wrong gradients silently in torch 2.13."]
    if layout.pp > 1 and SCHEDULES[layout.schedule].zero_bubble and layout.zero_stage == 0 \
            and layout.dp * layout.cp > 1 and layout.tp == 1:
        over = "dp" if layout.cp == 1 else "dp x cp"
        return [f"schedule {layout.schedule} under DDP: xpar all-reduces each stage's gradients over {over} after its "
                f"last weight-gradient pass (torch's split backward calls autograd.grad, so DDP's hooks never fire: "
                f"pytorch#144530)."]
    return []
