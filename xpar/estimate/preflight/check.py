"""Does a layout fit memory? The checks after validation (:mod:`xpar.config.validate`) and before
any worker starts: device memory in estimate mode, host memory for local CPU runs, and the layouts
on the same devices that would fit.

The peak is the cost model's (:func:`xpar.estimate.memory.per_device.memory`) on the most loaded pipeline
rank. A layout that does not fit is refused with the stage and ranks over the limit, by how much,
and the alternatives that fit (ZeRO stage, recompute, sequence parallelism, micro-batch size, tp/pp
degrees; one change at a time, then combined, each validated).

:func:`check_run` is what the entry point, the sweep pre-flight and the tests call. Errors: every
refusal a :class:`~xpar.config.checks.ConfigError`. Units: bytes.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Optional

from xpar.config.checks import ConfigError
from xpar.config.checks.hardware import load_hardware_preset
from xpar.config.presets import conf_dir, presets
from xpar.config.schema import RunConfig, XparConfig
from xpar.config.spec import RunSpec
from xpar.config.validate import validate
from xpar.estimate.context_parallel import fold_cp
from xpar.estimate.cost import assumptions_for, estimate, peak_memory
from xpar.estimate.preflight.act_offload import act_offload_problem, fitting_offload
from xpar.estimate.preflight.duration import duration_problems
from xpar.estimate.memory.per_device import MemoryEstimate, memory
from xpar.estimate.memory.activation_host import host_need
from xpar.estimate.memory.model_states import MEMORY_TERMS, STATE_BYTES, MemoryOptions, peak_ranks, state_widths
from xpar.estimate.preflight.nearest_fit import partial_recompute, recompute_choices
from xpar.estimate.memory.offload import host_memory_line, missing_host_fields, offload_problem, offload_step
from xpar.models.shapes import param_count

GB = 1e9
MAX_LISTED = 5
MEMORY_TOLERANCE = 0.05
"""Fraction above the usable device memory within which estimate mode estimates a layout (labelled: a note and
``estimate/memory_fits`` 0) instead of refusing it: the memory model's own error where it runs high. On the
published peaks of benchmarks/memory_published.py the estimate is above the published figure in 10 of 23 runs,
by 0.4-10.1 % (median 5.2 %; two torch.compile + float8 H200 rows +47 %), so a published layout estimated up to
5 % over the device may have fit (Llama 3 405B on 16,384 H100, Dubey et al. 2024 Table 4, is estimated 0.4 %
over under Megatron-Core's interleaved warm-up). Beyond it the refusal names the settings that fit."""


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def fit_problem(spec: RunSpec) -> Optional[str]:
    """None if the estimated peak fits the usable device memory (device memory less
    ``hardware.memory_headroom``), else the refusal message: which pipeline rank and global
    ranks, by how much, the breakdown of that rank, and what would fit."""
    mem = peak_memory(spec)
    if mem.fits or not mem.device_memory:
        return None
    over = [r for r in range(spec.pp) if not peak_memory(spec, r).fits]
    dp_rank, ranks = peak_ranks(fold_cp(spec), mem.pp_rank)  # dp: the dp x cp replica index under cp
    hw = spec.hardware
    where = (f"pipeline rank {mem.pp_rank} (stage{'s' if spec.pp * spec.layout.virtual_stages > 1 else ''} "
             f"{_stages(spec, mem.pp_rank)}), on its most loaded dp rank {dp_rank} (global "
             f"rank{'s' if len(ranks) > 1 else ''} {ranks[0]}{'-' + str(ranks[-1]) if len(ranks) > 1 else ''}),")
    terms = ", ".join(f"{k} {_gb(getattr(mem, k))}" for k in MEMORY_TERMS)
    headroom = getattr(hw, "memory_headroom", 0.0) or 0.0
    limit = (f"{_gb(mem.usable)} usable ({_gb(mem.device_memory)} of {hw.gpu or hw.device} less "
             f"hardware.memory_headroom={headroom:g})" if headroom else f"{_gb(mem.device_memory)} of {hw.gpu or hw.device}")
    lines = [f"layout does not fit device memory (cost-model estimate): {where} needs "
             f"{_gb(mem.total)} per device, {_gb(mem.total - mem.usable)} more than the {limit} on hardware={hw.name}"
             + (f"; {len(over)} of {spec.pp} pipeline ranks are over" if spec.pp > 1 else "") + f". [{terms}]",
             "    " + breakdown(mem)]
    lines += [f"    Note: {n}" for n in mem.detail.get("notes", [])]
    lines += [f"    Note: {n}" for n in _flash_note(spec)]
    offload = _offload_line(spec, mem)
    if offload:
        lines.append("    " + offload[0])
    fits = alternatives(spec)
    if fits:
        lines[0] += f" Nearest settings that fit: {fits[0][0]} (estimated {_gb(fits[0][1].total)} per device)."
        lines.append(f"    Layouts on the same {spec.world_size} devices that fit (estimated peak per device, "
                     f"step time; global batch {spec.global_batch} kept):")
        lines += [f"      {label}: {_gb(mem.total)}, {t:.3g} s/step" for label, mem, t in fits]
    else:
        lines.append("    " + _no_layout_fits(spec, offload_fits=bool(offload and offload[1])))
    lines[0] += _act_offload_line(spec)
    return "\n".join(lines)


def _act_offload_line(spec: RunSpec) -> str:
    """Where the framework runs activation offload (framework.activation_offload) and ``spec`` (pp 1, no
    recompute) fits with it: the fewest blocks offloaded that fit, checked as a followed line would be
    (xpar.estimate.preflight.act_offload.fitting_offload); '' otherwise."""
    found = fitting_offload(spec, lambda c: peak_memory(c).fits and act_offload_problem(c) is None)
    if found is None or _passes(variant(spec, {"activation_offload_layers": found[0]}, {})) is None:
        return ""
    n, cand = found
    est = estimate(cand)
    how = ("Megatron-Core's --cpu-offloading-num-layers" if spec.framework.activation_offload_overlap else
           "torch's save_on_cpu, which xpar executes")
    return (f" Or, with activation offload as framework={spec.framework.name} runs it ({how}): "
            f"parallel.activation_offload_layers={n} (estimated "
            f"{_gb(peak_memory(cand).total)} per device, {est.time_per_step_s:.3g} s/step, "
            f"{est.time_breakdown.get('act_offload', 0.0):.3g} s of it exposed host-link copies).")


def breakdown(mem: MemoryEstimate) -> str:
    """One line: the refused rank's terms in detail (params = fp32/stored + compute copies;
    activations saved at the schedule's peak + transients, micro-batches in flight; buffers)."""
    st, act, comm = mem.detail.get("states", {}), mem.detail.get("activations", {}), mem.detail.get("comm_buffers", {})
    parts = [f"params {_gb(st.get('params_master', mem.params))} stored + {_gb(st.get('params_compute', 0))} "
             f"compute copies",
             f"activations {_gb(act.get('saved', mem.activations))} saved for backward at the schedule's peak "
             f"({act.get('microbatches_in_flight', 1):g} micro-batches in flight) + {_gb(act.get('transient', 0))} "
             f"transient"]
    parts += [f"{k} {_gb(v)}" for k, v in comm.items() if v]
    return "Breakdown: " + "; ".join(parts) + "."


def _flash_note(spec: RunSpec) -> list[str]:
    """Where the framework keeps each layer's s x s attention scores (framework.flash_attention false: Megatron-LM
    2021, DeepSpeed 2021), what FlashAttention would give the same layout: a run of that framework that used it
    (Falcon's, under framework=megatron) says framework.flash_attention=true."""
    if spec.framework.flash_attention or spec.hardware.device == "cpu":
        return []
    flash = replace(spec, framework=replace(spec.framework, flash_attention=True))
    need = max(peak_memory(flash, r).total for r in range(spec.pp))
    fits = all(peak_memory(flash, r).fits for r in range(spec.pp))
    return [f"framework={spec.framework.name} keeps each layer's s x s attention scores (framework.flash_attention"
            f"=false); with FlashAttention (framework.flash_attention=true) this layout needs {_gb(need)} per device"
            f" and {'fits' if fits else 'does not fit either'}."]


def _offload_line(spec: RunSpec, mem: MemoryEstimate) -> Optional[tuple[str, bool]]:
    """What xpar's optimizer offload (``framework.cpu_offload_optimizer=true``, estimate only)
    would give, said only where that line would be accepted: the framework runs offload
    (framework.offload), the hardware has the host figures, ZeRO stage >= 1 (set to 1 when
    at 0), and the host memory holds the states: (the line, whether it fits). None otherwise."""
    if spec.framework.cpu_offload_optimizer or not mem.optimizer or True not in list(spec.framework.offload):
        return None
    pchg = {} if spec.layout.zero_stage >= 1 else {"zero_stage": 1}
    cfg = variant(spec, pchg, {})
    cfg.framework = replace(cfg.framework, cpu_offload_optimizer=True)
    try:
        cand = validate(cfg)
    except ConfigError:
        return None
    a = assumptions_for(cand)
    if offload_problem(cand, a) or host_memory_need(cand, a):
        return None
    off = peak_memory(cand)
    line = ("parallel.zero_stage=1 " if pchg else "") + "framework.cpu_offload_optimizer=true"
    return (f"With the optimizer states offloaded to host memory ({line}: estimate only, ZeRO-Offload's schedule as "
            f"DeepSpeed's offload_optimizer runs it) it {'would fit' if off.fits else 'would still not fit'}: "
            f"{_gb(off.total)} per device.", off.fits)


def _stages(spec: RunSpec, pp_rank: int) -> str:
    return ",".join(str(s) for s in spec.layout.stages_of(pp_rank))


def _no_layout_fits(spec: RunSpec, offload_fits: bool = False) -> str:
    """Why nothing on these devices fits, and the hardware presets whose devices can hold
    the model states at all (ZeRO-3 over every device: states / world). ``offload_fits``: the
    offload line before it fits (:func:`_offload_line`): then this says that nothing fits with
    the optimizer states on the devices, and points to that line and to ``xpar plan``."""
    psi = param_count(spec.model).total
    offloaded = spec.framework.cpu_offload_optimizer  # the optimizer's states are on the host
    per_param = sum(state_widths(spec, assumptions_for(spec))[:2 if offloaded else 3])  # as the framework keeps them
    states = per_param * psi
    dev = spec.hardware.device_memory_gb * GB
    on_devices = " with the optimizer states on the devices" if offload_fits else ""
    msg = (f"No alternative tried fits{on_devices} (ZeRO stage, recompute, sequence parallelism, micro-batch size, "
           f"tp x pp over {spec.world_size} devices).")
    if states > spec.world_size * dev:
        msg = (f"No layout of model={spec.model.name} fits hardware={spec.hardware.name}{on_devices}: its model states "
               f"alone ({per_param} bytes/param in {spec.train.dtype} with AdamW under framework={spec.framework.name}"
               f"{' offloaded to host memory' if offloaded else ''} x {psi / 1e9:.2f}e9 params = "
               f"{_gb(states)}) exceed the {spec.world_size} devices' {_gb(spec.world_size * dev)} in total.")
    if offload_fits:
        msg += (f" With them offloaded this layout fits (the line above, estimate only), and xpar plan "
                f"model={spec.model.name} hardware={spec.hardware.name} ranks every layout that fits so.")
    bigger = _bigger_hardware(spec, states)
    if bigger:
        msg += f" Hardware where the states take under half of device memory: {', '.join(bigger)}."
    return msg


def _bigger_hardware(spec: RunSpec, states: float) -> list[str]:
    """Up to three hardware presets with more devices than ``spec`` whose devices hold the model
    states (``states`` bytes, ZeRO-3 over every device) in under half their memory, smallest
    first, each with a parallel preset written for it where there is one."""
    bigger = []
    for name in presets("hardware"):
        if name == "local" or name.startswith("calibrated_"):
            continue  # the machine at hand, as measured: not a bigger cluster to suggest
        hw = load_hardware_preset(name)
        if not str(hw.devices_per_node).isdigit() or not hw.device_memory_gb:
            continue  # detected at run time (a local machine): no fixed world size
        world = int(hw.devices_per_node) * hw.nodes
        if world > spec.world_size and states / world < 0.5 * hw.device_memory_gb * GB:
            bigger.append((world, name))
    named = []
    for _, name in sorted(bigger)[:3]:
        by = _presets_for(name, spec.model.name)
        named.append(name + (f" (parallel={by[0]})" if by else ""))
    return named


def _presets_for(hardware: str, model: str) -> list[str]:
    """Parallel presets whose reference_hardware is ``hardware``, those named for ``model`` first."""
    from omegaconf import OmegaConf

    out = []
    for name in presets("parallel"):
        node = OmegaConf.load(conf_dir() / "parallel" / f"{name}.yaml")
        if node.get("reference_hardware") == hardware:
            out.append(name)
    return sorted(out, key=lambda n: not n.startswith(model + "_"))


def _candidates(spec: RunSpec) -> list[tuple[int, dict, dict]]:
    """(number of changes, parallel changes, train changes) around ``spec``: ZeRO stage up,
    recompute selective/full, sequence parallelism on, micro-batch size down (to 1), and
    every tp (<= devices per node) x pp (dividing the layers) over the same world size."""
    lay, tr, model = spec.layout, spec.train, spec.model
    zero = [z for z in range(lay.zero_stage + 1, 4)]
    recompute = recompute_choices(spec)  # the policies the framework runs (xpar.estimate.preflight.nearest_fit)
    b = tr.micro_batch_size
    mbs = sorted({b // 2, 1} - {0, b}, reverse=True) if b > 1 else []
    dpn = int(spec.hardware.devices_per_node)
    degrees = []
    for t in (1, 2, 4, 8, 16):
        if t > dpn or spec.world_size % t:
            continue
        for p in range(1, model.n_layers + 1):
            if spec.world_size % (t * p) == 0 and (t, p) != (spec.tp, spec.pp) and p <= 64:
                degrees.append((t, p))
    options = [("zero_stage", zero), ("recompute", recompute),
               ("sequence_parallel", [True] if not lay.sequence_parallel else []),
               ("micro_batch_size", mbs), ("degrees", degrees)]
    out = []
    for k in (1, 2, 3):
        for combo in itertools.combinations([o for o in options if o[1]], k):
            for values in itertools.product(*[vals for _, vals in combo]):
                pchg, tchg = {}, {}
                for (key, _), v in zip(combo, values):
                    if key == "micro_batch_size":
                        tchg[key] = v
                    elif key == "degrees":
                        pchg.update({k: d for k, d, now in zip(("tp", "pp"), v, (spec.tp, spec.pp)) if d != now})
                    else:
                        pchg[key] = v
                out.append((k, pchg, tchg))
    return out


def _label(pchg: dict, tchg: dict, global_batch: int) -> str:
    """The overrides of a change, complete: a change of tp, pp or the micro-batch size also sets
    dp and the micro-batch count to auto and keeps the global batch (else a line with a fixed dp
    or micro-batch count would run another global batch, or be refused)."""
    parts = [f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in pchg.items()]
    parts += [f"train.{k}={v}" for k, v in tchg.items()]
    if "tp" in pchg or "pp" in pchg:
        parts.append("parallel.dp=auto")
    if "tp" in pchg or "pp" in pchg or tchg:
        parts += ["parallel.micro_batches=auto", f"train.global_batch_size={global_batch}"]
    return " ".join(parts)


def variant(spec: RunSpec, pchg: dict, tchg: dict, hwchg: Optional[dict] = None):
    """The estimate-mode XparConfig of ``spec`` with parallel (``pchg``), train (``tchg``) and
    hardware (``hwchg``) fields changed; dp and micro-batches auto, the global batch kept."""
    par = replace(spec.parallel_config(), dp="auto", micro_batches="auto", reference_hardware=None, **pchg)
    if "tp" in pchg or "pp" in pchg:
        par.layer_split = None
        if par.pp > 1 and spec.pp == 1:
            par.schedule, par.virtual_stages = "1f1b", "auto"
    if par.tp == 1:
        par.sequence_parallel = False
    tr = replace(spec.train, global_batch_size=spec.global_batch, **tchg)
    return XparConfig(model=replace(spec.model), parallel=par, hardware=replace(spec.hardware, **(hwchg or {})),
                      train=tr, data=replace(spec.data), tracking=replace(spec.tracking),
                      run=RunConfig(mode="estimate", progress=False), framework=replace(spec.framework))


def _passes(cfg) -> Optional[RunSpec]:
    """The spec of ``cfg`` when it validates, fits device memory and offloads (if it does) as
    asked into host memory that holds it; else None. No alternatives are searched."""
    try:
        cand = validate(cfg)
    except ConfigError:
        return None
    a = assumptions_for(cand)
    if (not peak_memory(cand).fits or offload_problem(cand, a) or host_memory_need(cand, a)
            or act_offload_problem(cand)):
        return None
    return cand


def alternatives(spec: RunSpec, limit: int = MAX_LISTED, max_checked: int = 400) -> list[tuple[str, MemoryEstimate, float]]:
    """Layouts on the same hardware and global batch that fit: (overrides, peak memory, step
    time), the fewest changes first, then the fastest; at most ``limit``."""
    found = []
    fewest = None
    partial = partial_recompute(spec, lambda pchg: _passes(variant(spec, pchg, {})))  # Megatron's --recompute-num-layers
    if partial is not None:
        fewest = 1
        found.append((1, estimate(partial[1]).time_per_step_s, _label(partial[0], {}, spec.global_batch),
                      peak_memory(partial[1])))
    for k, pchg, tchg in _candidates(spec)[:max_checked]:
        if fewest is not None and k > fewest:
            break  # enough found with fewer changes
        if pchg.get("sequence_parallel") and pchg.get("tp", spec.tp) == 1:
            continue  # refused at tp = 1 when followed (xpar.config.checks.environment.check_sequence_parallel)
        cand = _passes(variant(spec, pchg, tchg))
        if cand is None:
            continue
        mem = peak_memory(cand)
        fewest = k
        t = estimate(cand, assumptions_for(cand)).time_per_step_s
        found.append((k, t, _label(pchg, tchg, spec.global_batch), mem))
    found.sort(key=lambda x: (x[0], x[1]))
    return [(label, mem, t) for _, t, label, mem in found[:limit]]


HOST_MEMORY_USABLE = 0.8
"""Share of host memory a CPU run may plan for: the rest is left to the operating system and
other processes."""

WORKER_BASELINE_BYTES = 0.35e9
"""Resident memory of one local CPU worker beyond the cost model's figure: the Python interpreter,
torch's libraries and its allocator, bytes (benchmarks/worker_rss.py; benchmarks/README.md)."""


def host_memory_problem(spec: RunSpec) -> Optional[str]:
    """None if a CPU run of ``spec`` fits host memory, else why not and what to do.

    Every worker shares the host's memory, so the need is the world size times the cost model's
    peak per device for hardware=local (:func:`xpar.estimate.cost.peak_memory`) plus
    :data:`WORKER_BASELINE_BYTES`, the process itself.
    """
    mem, per_worker, usable = _host_need(spec)
    need, have = per_worker * spec.world_size, spec.hardware.device_memory_gb * 1e9
    if need <= usable:
        return None
    states = mem.params + mem.grads + mem.optimizer
    dtype = spec.train.dtype
    return (f"model={spec.model.name} does not fit this machine: {spec.world_size} workers need "
            f"~{need / 1e9:.1f} GB ({per_worker / 1e9:.2f} GB per worker: {WORKER_BASELINE_BYTES / 1e9:.2f} GB "
            f"for the process with torch, plus the cost-model estimate {mem.total / 1e9:.2f} GB, of which "
            f"model states {states / 1e9:.2f} GB at {sum(STATE_BYTES[dtype])} bytes/param for "
            f"{'fp32' if dtype == 'fp32' else dtype + ' mixed-precision'} AdamW), "
            f"{(need - usable) / 1e9:.1f} GB more than the {usable / 1e9:.1f} GB usable "
            f"({HOST_MEMORY_USABLE:.0%} of {have / 1e9:.1f} GB host memory). {_fewer_workers(spec, per_worker, usable)}"
            f", or {_estimate_advice(spec)}.")


def _host_need(spec: RunSpec) -> tuple[MemoryEstimate, float, float]:
    """(cost-model peak, bytes per worker with the process baseline and its offloaded activations, which on a CPU
    stay in the same memory, usable host bytes) of a CPU run."""
    mem = peak_memory(spec)
    need = host_need(spec, MemoryOptions.of(assumptions_for(spec)))  # xpar.estimate.memory.activation_host
    offloaded = need["block_bytes"] * (spec.parallel.activation_offload_layers or 0) if need else 0.0
    return mem, mem.total + WORKER_BASELINE_BYTES + offloaded, HOST_MEMORY_USABLE * spec.hardware.device_memory_gb * 1e9


def _fewer_workers(spec: RunSpec, per_worker: float, usable: float) -> str:
    """The largest dp (tp, pp and cp kept, the global batch auto) whose run fits host memory,
    checked as followed; else :func:`_smaller`."""
    others = spec.world_size // spec.dp
    dp = min(spec.dp - 1, int(usable // (per_worker * others)))
    while dp >= 1:
        cfg = XparConfig(model=replace(spec.model), parallel=replace(spec.parallel_config(), dp=dp),
                         hardware=replace(spec.hardware), train=replace(spec.train, global_batch_size="auto"),
                         data=replace(spec.data), tracking=replace(spec.tracking),
                         run=RunConfig(mode="execute", progress=False), framework=replace(spec.framework))
        try:
            cand = validate(cfg)
        except ConfigError:
            cand = None
        if cand is not None and _host_need(cand)[1] * cand.world_size <= usable:
            return f"Use at most {dp} workers: parallel.dp={dp} train.global_batch_size=auto"
        dp //= 2
    return _smaller(spec)


MODEL_PRESETS_BY_SIZE = ("tiny", "mini", "small", "7b", "13b", "70b", "175b", "405b")
"""conf/model presets, smallest first."""


def _smaller(spec: RunSpec) -> str:
    """What to run instead on this machine: smaller model presets, or for the smallest (or a
    custom model) fewer workers and a micro-batch of one."""
    name = spec.model.name
    smaller = MODEL_PRESETS_BY_SIZE[:MODEL_PRESETS_BY_SIZE.index(name)][:2] if name in MODEL_PRESETS_BY_SIZE else ()
    if smaller:
        return f"Use a smaller model ({' or '.join(f'model={m}' for m in smaller)})"
    return "Use fewer workers and smaller micro-batches (hardware.devices_per_node=1 train.micro_batch_size=1)"


def _estimate_advice(spec: RunSpec) -> str:
    """Where to estimate a run this machine cannot hold: ``estimate it: run.mode=estimate hardware=<preset>
    parallel.dp=auto`` on the smallest preset where that passes every check and fits (:func:`_cluster_for`),
    else the plan of the model on the smallest preset, which searches the layouts that fit: model=7b
    with the default train (fp32, micro-batch 4) fits no preset as it is (305 GB per device on B200 at
    ZeRO-0), and the estimate line sent there was refused again."""
    name, fits = _cluster_for(spec)
    if fits:
        return f"estimate it: run.mode=estimate hardware={name} parallel.dp=auto"
    return (f"find a layout of it that fits a cluster (it fits none as it is): xpar plan model={spec.model.name} "
            f"hardware={_cluster_holding(spec)}")


def _cluster_holding(spec: RunSpec) -> str:
    """The smallest cluster preset whose device memory, all devices together, holds the model states of
    mixed-precision AdamW (2 + 2 + 12 bytes per parameter: Rajbhandari et al. 2020, ZeRO, Section 3.1;
    :data:`STATE_BYTES`): ZeRO-3 shards them over every device, and the plan searches recompute and optimizer
    offload for the activations. model=70b went to a100_40gb_node (320 GB for 1.1 TB of states), whose plan
    fits no layout."""
    states = param_count(spec.model).total * sum(STATE_BYTES["bf16"])
    held = [name for world, name, hw in _cluster_presets() if world * (hw.device_memory_gb or 0) * 1e9 >= states]
    return held[0] if held else "a100_80gb_1024gpu"


def _cluster_presets() -> list:
    """(devices, name, HardwareConfig) of every cluster preset (not local, not calibrated_*), fewest devices first."""
    out = []
    for name in presets("hardware"):
        if name == "local" or name.startswith("calibrated_"):
            continue
        hw = load_hardware_preset(name)
        out.append((int(hw.devices_per_node) * hw.nodes, name, hw))
    return sorted(out, key=lambda x: (x[0], x[1]))


def _cluster_for(spec: RunSpec) -> tuple[str, bool]:
    """A hardware preset to estimate ``spec`` on, and whether it fits there: its parallel preset's reference
    cluster, else the smallest preset whose device count tp x pp divides (so that dp=auto resolves) and on
    which the estimate, followed as :func:`_estimate_advice` words it (dp and the global batch auto),
    passes every check and fits device memory (:func:`_passes`); the smallest that divides where none fits."""
    if spec.parallel.reference_hardware:
        return spec.parallel.reference_hardware, True
    sized = [name for world, name, _ in _cluster_presets() if world % (spec.tp * spec.pp) == 0]
    fits = ((name, True) for name in sized if _passes(_on_preset(spec, name)) is not None)
    return next(fits, (sized[0] if sized else "a100_80gb_1024gpu", False))


def _on_preset(spec: RunSpec, name: str) -> XparConfig:
    """The estimate-mode config of ``spec`` on hardware preset ``name`` with dp and the global batch auto."""
    cfg = variant(spec, {}, {})
    cfg.hardware, cfg.train = load_hardware_preset(name), replace(cfg.train, global_batch_size="auto")
    return cfg


def offload_host_problem(spec: RunSpec) -> Optional[str]:
    """None unless ``spec`` offloads its optimizer into host memory too small for it
    (:func:`host_memory_need`); then the refusal with the fixes that pass
    every check when followed (each checked here): more nodes (dp auto, the global batch kept),
    a larger host, or no offload."""
    step = host_memory_need(spec, assumptions_for(spec))
    if step is None:
        return None
    fixes = []
    for k in range(1, 7):
        nodes = spec.hardware.nodes * 2 ** k
        if _passes(variant(spec, {}, {}, {"nodes": nodes})):
            fixes.append(f"hardware.nodes={nodes} parallel.dp=auto parallel.micro_batches=auto "
                         f"train.global_batch_size={spec.global_batch}")
            break
    host_gb = math.ceil(step["host_bytes"] / GB / 10) * 10
    if _passes(variant(spec, {}, {}, {"host_memory_gb": float(host_gb)})):
        fixes.append(f"hardware.host_memory_gb={host_gb}")
    plain = variant(spec, {}, {})
    plain.framework = replace(plain.framework, cpu_offload_optimizer=False)
    if _passes(plain):
        fixes.append("framework.cpu_offload_optimizer=false")
    says = ("; values that work (each checked): " + ", or ".join(fixes)) if fixes else \
        "; no larger cluster (up to 64x the nodes), host, or run without offload passes: a smaller model"
    return host_memory_line(spec, step) + says + "."


def memory_problems(spec: RunSpec) -> list[str]:
    """The memory checks of a valid spec: host memory for a local CPU run, device memory
    (cost-model estimate) in estimate mode."""
    headroom = getattr(spec.hardware, "memory_headroom", 0.0) or 0.0
    if not 0.0 <= headroom < 1.0:
        return [f"hardware.memory_headroom={headroom:g} must be a fraction of device memory in [0, 1) "
                f"(0.05 keeps 5 % free); values that work: 0, 0.05, 0.1."]
    problem = (act_offload_problem(spec)  # xpar.estimate.preflight.act_offload
               or offload_problem(spec, assumptions_for(spec)) or offload_host_problem(spec))  # xpar.estimate.memory.offload
    if problem is None and spec.mode == "execute" and spec.hardware.device == "cpu":
        problem = host_memory_problem(spec)
    elif problem is None and spec.mode == "estimate":
        problem = None if within_tolerance(spec) else fit_problem(spec)
    return [problem] if problem else []


def within_tolerance(spec: RunSpec) -> bool:
    """Whether ``spec``'s estimated peak is over its usable device memory by at most :data:`MEMORY_TOLERANCE`;
    if so, a note on ``spec`` says so (estimated, labelled, not refused)."""
    mem = peak_memory(spec)
    if mem.fits or not mem.device_memory or mem.total > (1 + MEMORY_TOLERANCE) * mem.usable:
        return False
    spec.notes.append(f"estimated peak {_gb(mem.total)} per device (pipeline rank {mem.pp_rank}) is "
                      f"{100 * (mem.total / mem.usable - 1):.1f} % over the {_gb(mem.usable)} usable on "
                      f"hardware={spec.hardware.name}: within the memory model's error on published peaks "
                      f"({100 * MEMORY_TOLERANCE:g} %, xpar.estimate.preflight.check.MEMORY_TOLERANCE), so estimated "
                      "(estimate/memory_fits=0); it may not fit: recompute or a smaller micro-batch would leave room.")
    return True


def check_run(cfg, local_devices: Optional[int] = None) -> RunSpec:
    """Validate ``cfg`` (:func:`xpar.config.validate.validate`), then check that it fits memory.

    Raises:
        ConfigError: every violated constraint, or the memory refusal with its breakdown.
    """
    spec = validate(cfg, local_devices)
    problems = memory_problems(spec) or duration_problems(spec, cfg)
    if problems:
        raise ConfigError(problems)
    return spec


def host_memory_need(spec: RunSpec, assume) -> Optional[dict]:
    """The offloaded step of ``spec`` (:func:`xpar.estimate.memory.offload.offload_step`: ``host_bytes`` per
    node, ``elements``) when its states do not fit ``hardware.host_memory_gb``; None when they fit or
    nothing is offloaded."""
    if not getattr(assume, "cpu_offload_optimizer", False) or missing_host_fields(spec.hardware):
        return None
    step = offload_step(spec, assume, memory(spec, assume=assume).pp_rank, 0.0)
    have = (spec.hardware.host_memory_gb or 0) * 1e9
    return step if step is not None and step["host_bytes"] > have else None
