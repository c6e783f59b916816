"""The preflight of activation offload (``parallel.activation_offload_layers``,
:mod:`xpar.estimate.memory.activation_offload`): its refusals (framework, Megatron-Core's rules,
execute mode, host link, host memory per node) and, in a memory refusal, the offload that fits
where the framework runs it. Units: bytes (GB = 1e9 bytes in messages), seconds.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from xpar.config.spec import RunSpec
from xpar.estimate.memory.activation_host import host_need
from xpar.estimate.memory.activation_offload import offload_layers, offload_problems
from xpar.estimate.memory.model_states import MemoryOptions
from xpar.estimate.memory.offload import devices_per_node, missing_host_fields, offload_step
from xpar.estimate.memory.per_device import memory
from xpar.estimate.step_parts import assumptions_for


def host_bytes_needed(spec: RunSpec) -> float:
    """Host bytes per node of ``spec``'s offloaded activations, plus its offloaded optimizer's states
    where it offloads those too (xpar.estimate.memory.offload). 0 without activation offload."""
    a = assumptions_for(spec)
    need = host_need(spec, MemoryOptions.of(a))
    if need is None:
        return 0.0
    total = need["host_bytes"]
    if getattr(a, "cpu_offload_optimizer", False) and not missing_host_fields(spec.hardware):
        total += offload_step(spec, a, memory(spec, assume=a).pp_rank, 0.0)["host_bytes"]
    return float(total)


def act_offload_problem(spec: RunSpec) -> Optional[str]:
    """Why ``spec``'s activation offload cannot run as asked (one line), or None: the rules of
    :func:`xpar.estimate.memory.activation_offload.offload_problems`, then the node's host memory
    (hardware.host_memory_gb, where given) holding the offloaded activations (pinned, one micro-batch)."""
    problems = offload_problems(spec)
    if problems:
        return problems[0]
    have = spec.hardware.host_memory_gb
    need = host_bytes_needed(spec)
    if have and need > have * 1e9:
        n = offload_layers(spec)
        per_block = host_need(spec, MemoryOptions.of(assumptions_for(spec)))["host_bytes"] / n
        most = int(max(have * 1e9 - (need - n * per_block), 0.0) // per_block)  # the blocks the host holds
        return (f"parallel.activation_offload_layers={n}: the offloaded activations need {need / 1e9:,.0f} GB of host "
                f"memory per node ({devices_per_node(spec.hardware)} devices x {n} blocks"
                f"{', with the offloaded optimizer states' if spec.framework.cpu_offload_optimizer else ''}), more than "
                f"hardware.host_memory_gb={have:g}; the host holds at most {most} blocks' "
                f"(parallel.activation_offload_layers={most}), or hardware.host_memory_gb={-(-need // 1e10) * 10:.0f}.")
    return None


def fitting_offload(spec: RunSpec, fits: Callable[[RunSpec], bool]) -> Optional[tuple[int, RunSpec]]:
    """The fewest blocks N to offload for ``spec`` (pp 1, no recompute, the framework runs it), more than
    it offloads now, with which ``fits`` (a checked candidate's test) holds, and that spec; None when none
    does. The peak falls with N (one block less per block offloaded), so the search halves."""
    if spec.pp > 1 or spec.layout.recompute != "none" or not getattr(spec.framework, "activation_offload", False):
        return None
    with_n = lambda n: replace(spec, parallel=replace(spec.parallel, activation_offload_layers=n))  # noqa: E731
    lo, hi = offload_layers(spec) + 1, spec.model.n_layers - 1
    if hi < lo or not fits(with_n(hi)):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(with_n(mid)) else (mid + 1, hi)
    return lo, with_n(lo)
