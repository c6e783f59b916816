"""Does a layout fit device memory? The check validation runs in estimate mode, and the
layouts on the same devices that would fit.

The peak is the cost model's (:func:`xpar.estimate.memory.memory`, every term named: params,
grads, optimizer, activations, comm_buffers, framework_overhead) on the most loaded pipeline
rank, under the :class:`~xpar.estimate.cost.Assumptions` of the hardware
(:func:`assumptions_for`). A layout that does not fit is refused before anything runs, with
the stage and ranks over the limit, by how much, and the alternatives that fit -- found by
changing the ZeRO stage, recomputation, sequence parallelism, the micro-batch size (global
batch kept) and the tp/pp degrees (world size kept), one change at a time and then
combined, each candidate checked by :func:`xpar.validate.validate` itself.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Optional

from xpar.estimate.cost import Assumptions, estimate
from xpar.estimate.memory import STATE_BYTES, MemoryEstimate, memory, model_state_bytes_per_rank
from xpar.spec import RunSpec

GB = 1e9
MAX_LISTED = 5


def assumptions_for(spec: RunSpec) -> Assumptions:
    """How torch behaves on the spec's hardware: measured CPU behaviour for a local CPU
    (:meth:`Assumptions.xpar_cpu`), xpar on CUDA otherwise."""
    return Assumptions.xpar_cpu() if spec.hardware.device == "cpu" else Assumptions()


def peak_memory(spec: RunSpec, pp_rank: Optional[int] = None) -> MemoryEstimate:
    """The cost model's peak per device (most loaded pipeline rank when ``pp_rank`` is None)."""
    a = assumptions_for(spec)
    return memory(spec, pp_rank, flash=a.flash_attention, dropout=a.dropout, fused_rmsnorm=a.fused_rmsnorm,
                  sp_saves_gathered=a.sp_saves_gathered)


def peak_ranks(spec: RunSpec, pp_rank: int) -> tuple[int, list[int]]:
    """(most loaded dp rank, its global ranks -- one per tp rank) on pipeline rank ``pp_rank``;
    ranks are laid out tp fastest, then dp, then pp (xpar.parallel.mesh)."""
    per_dp = model_state_bytes_per_rank(spec, pp_rank)
    dp_rank = max(range(len(per_dp)), key=lambda r: sum(per_dp[r].values()))
    first = pp_rank * spec.dp * spec.tp + dp_rank * spec.tp
    return dp_rank, list(range(first, first + spec.tp))


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def fit_problem(spec: RunSpec) -> Optional[str]:
    """None if the estimated peak fits device memory, else the refusal message: which
    pipeline rank and global ranks, by how much, the breakdown, and what would fit."""
    mem = peak_memory(spec)
    if mem.fits or not mem.device_memory:
        return None
    over = [r for r in range(spec.pp) if not peak_memory(spec, r).fits]
    dp_rank, ranks = peak_ranks(spec, mem.pp_rank)
    hw = spec.hardware
    where = (f"pipeline rank {mem.pp_rank} (stage{'s' if spec.pp * spec.parallel.virtual_stages > 1 else ''} "
             f"{_stages(spec, mem.pp_rank)}), on its most loaded dp rank {dp_rank} (global "
             f"rank{'s' if len(ranks) > 1 else ''} {ranks[0]}{'-' + str(ranks[-1]) if len(ranks) > 1 else ''}),")
    terms = ", ".join(f"{k} {_gb(getattr(mem, k))}" for k in
                      ("params", "grads", "optimizer", "activations", "comm_buffers", "framework_overhead"))
    lines = [f"layout does not fit device memory (cost-model estimate): {where} needs "
             f"{_gb(mem.total)} per device, {_gb(mem.total - mem.device_memory)} more than the "
             f"{_gb(mem.device_memory)} of {hw.gpu or hw.device} on hardware={hw.name}"
             + (f"; {len(over)} of {spec.pp} pipeline ranks are over" if spec.pp > 1 else "") + f". [{terms}]"]
    fits = alternatives(spec)
    if fits:
        lines.append(f"    Layouts on the same {spec.world_size} devices that fit (estimated peak per device, "
                     f"step time; global batch {spec.global_batch} kept):")
        lines += [f"      {label}: {_gb(m.total)}, {t:.3g} s/step" for label, m, t in fits]
    else:
        lines.append("    " + _no_layout_fits(spec))
    return "\n".join(lines)


def _stages(spec: RunSpec, pp_rank: int) -> str:
    from xpar.estimate.memory import rank_stages
    return ",".join(str(s) for s in rank_stages(spec, pp_rank))


def _no_layout_fits(spec: RunSpec) -> str:
    """Why nothing on these devices fits, and the hardware presets whose devices can hold
    the model states at all (ZeRO-3 over every device: states / world)."""
    from xpar.models.shapes import param_count
    from xpar.presets import presets

    psi = param_count(spec.model).total
    per_param = sum(STATE_BYTES[spec.train.dtype])
    states = per_param * psi
    dev = spec.hardware.device_memory_gb * GB
    msg = (f"No alternative tried fits (ZeRO stage, recompute, sequence parallelism, micro-batch size, "
           f"tp x pp over {spec.world_size} devices).")
    if states > spec.world_size * dev:
        msg = (f"No layout of model={spec.model.name} fits hardware={spec.hardware.name}: its model states "
               f"alone ({per_param} bytes/param in {spec.train.dtype} with AdamW x {psi / 1e9:.2f}e9 params = "
               f"{_gb(states)}) exceed the {spec.world_size} devices' {_gb(spec.world_size * dev)} in total.")
    bigger = []
    for name in presets("hardware"):
        if name == "local":
            continue
        hw = _hardware(name)
        world = int(hw.devices_per_node) * hw.nodes
        if world > spec.world_size and states / world < 0.5 * hw.device_memory_gb * GB:
            bigger.append((world, name))
    if bigger:
        named = []
        for _, name in sorted(bigger)[:3]:
            by = _presets_for(name, spec.model.name)
            named.append(name + (f" (parallel={by[0]})" if by else ""))
        msg += f" Hardware where the states take under half of device memory: {', '.join(named)}."
    return msg


def _hardware(name: str):
    from omegaconf import OmegaConf

    from xpar.config import HardwareConfig
    from xpar.presets import conf_dir
    node = OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(conf_dir() / "hardware" / f"{name}.yaml"))
    return OmegaConf.to_object(node)


def _presets_for(hardware: str, model: str) -> list[str]:
    """Parallel presets whose reference_hardware is ``hardware``, those named for ``model`` first."""
    from omegaconf import OmegaConf

    from xpar.presets import conf_dir, presets
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
    par, tr, m = spec.parallel, spec.train, spec.model
    zero = [z for z in range(par.zero_stage + 1, 4)]
    recompute = [r for r in ("selective", "full") if r != par.recompute and par.recompute != "full"]
    b = tr.micro_batch_size
    mbs = sorted({b // 2, 1} - {0, b}, reverse=True) if b > 1 else []
    dpn = int(spec.hardware.devices_per_node)
    degrees = []
    for t in (1, 2, 4, 8, 16):
        if t > dpn or spec.world_size % t:
            continue
        for p in range(1, m.n_layers + 1):
            if spec.world_size % (t * p) == 0 and (t, p) != (spec.tp, spec.pp) and p <= 64:
                degrees.append((t, p))
    options = [("zero_stage", zero), ("recompute", recompute),
               ("sequence_parallel", [True] if not par.sequence_parallel else []),
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


def _label(pchg: dict, tchg: dict) -> str:
    parts = [f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in pchg.items()]
    parts += [f"train.{k}={v}" for k, v in tchg.items()]
    return " ".join(parts)


def alternatives(spec: RunSpec, limit: int = MAX_LISTED, max_checked: int = 400) -> list[tuple[str, MemoryEstimate, float]]:
    """Layouts on the same hardware and global batch that fit: (overrides, peak memory, step
    time), the fewest changes first, then the fastest; at most ``limit``."""
    from xpar.config import RunConfig, XparConfig
    from xpar.validate import ConfigError, validate

    found = []
    fewest = None
    for k, pchg, tchg in _candidates(spec)[:max_checked]:
        if fewest is not None and k > fewest:
            break  # enough found with fewer changes
        par = replace(spec.parallel, dp="auto", micro_batches="auto", reference_hardware=None, **pchg)
        if "tp" in pchg or "pp" in pchg:
            par.layer_split = None
            if par.pp > 1 and spec.pp == 1:
                par.schedule, par.virtual_stages = "1f1b", "auto"
        if par.tp == 1:
            par.sequence_parallel = False
        tr = replace(spec.train, global_batch_size=spec.global_batch, **tchg)
        cfg = XparConfig(model=replace(spec.model), parallel=par, hardware=replace(spec.hardware), train=tr,
                         data=replace(spec.data), tracking=replace(spec.tracking),
                         run=RunConfig(mode="estimate", progress=False))
        try:
            cand = validate(cfg, check_memory=False)
        except ConfigError:
            continue
        mem = peak_memory(cand)
        if not mem.fits:
            continue
        fewest = k
        t = estimate(cand, assumptions_for(cand)).time_per_step_s
        found.append((k, t, _label(pchg, tchg), mem))
    found.sort(key=lambda x: (x[0], x[1]))
    return [(label, mem, t) for _, t, label, mem in found[:limit]]
