"""Time and host memory of an offloaded optimizer step (``framework.cpu_offload_optimizer``),
ZeRO-Offload's schedule (Ren et al. 2021, Sec. 4; DeepSpeed ``offload_optimizer: cpu``):

    grad_to_host = copies x elements x grad_bytes / pcie              device -> host
    host_step    = devices_per_node x elements x (28 + param_bytes) / host_mem_bw
    param_to_dev = elements x param_bytes / pcie                     host -> device
    exposed      = copies x max(0, one copy - BACKWARD_SHARE x micro-batch compute)
                   + host_step + param_to_dev

``copies``: one per micro-batch under ZeRO-2/3 (reduced every micro-batch), else one per step.
Host memory per node: devices_per_node x elements x HOST_STATE_BYTES <= ``hardware.host_memory_gb``.
Hardware figures (``pcie_gb_per_s``, ``host_mem_gb_per_s``, ``host_memory_gb``) None where unknown:
then :func:`offload_problem` refuses offload. Not modelled: FSDP2's CPUOffloadPolicy, NVMe offload.
Units: seconds, bytes. Derivation: docs/concepts/cost-model-derivations.md.
"""
from __future__ import annotations

from typing import Any, Optional

from xpar.estimate.memory.model_states import held_numel, most_loaded_dp_rank, state_widths
from xpar.estimate.comm.overlap import vmax

HOST_STATE_BYTES = 16
"""Host bytes per offloaded element: fp32 master (4), exp_avg (4), exp_avg_sq (4) and the fp32
gradient accumulated on the host (4) (DeepSpeed: single_partition_of_fp32_groups and its
fp32 grad, DeepSpeedCPUAdam's states)."""
HOST_STEP_READ_WRITE_BYTES = 28
"""Bytes the host AdamW step moves per element besides the parameter copy: reads master,
gradient, exp_avg, exp_avg_sq (16), writes master, exp_avg, exp_avg_sq (12)."""
BACKWARD_SHARE = 2.0 / 3.0
"""Backward share of a micro-batch's compute: backward = 2 x forward FLOPs (Narayanan et al.
2021, the 3-passes convention of xpar.estimate.compute.flops)."""
OFFLOAD_TERMS = ("grad_to_host_s", "grad_to_host_exposed_s", "host_step_s", "param_to_device_s", "exposed_s")
"""Keys of :func:`offload_time` (seconds per step)."""


def offload_time(elements: Any, copies: Any, grad_bytes: float, param_bytes: float, microbatch_compute_s: Any,
                 pcie_gb_per_s: float, host_mem_gb_per_s: float, devices_per_node: int) -> dict[str, Any]:
    """Seconds per step of an offloaded optimizer on one device (module docstring), by part
    (:data:`OFFLOAD_TERMS`): ``grad_to_host_s`` (issued), ``grad_to_host_exposed_s``,
    ``host_step_s``, ``param_to_device_s`` and their exposed sum ``exposed_s``.

    ``elements``: the device's optimizer elements; ``copies``: gradient copies per step;
    ``grad_bytes`` / ``param_bytes``: bytes per element of the copied gradient and of the
    parameters copied back; ``microbatch_compute_s``: matmul + memory-bound seconds of one
    micro-batch on the device; bandwidths in GB/s (1e9 bytes/s), both > 0. Floats or numpy
    arrays over layouts (the same arithmetic)."""
    pcie, host = pcie_gb_per_s * 1e9, host_mem_gb_per_s * 1e9
    one = elements * grad_bytes / pcie
    grad_exposed = copies * vmax(one - BACKWARD_SHARE * microbatch_compute_s, 0.0)
    host_step = devices_per_node * elements * (HOST_STEP_READ_WRITE_BYTES + param_bytes) / host
    back = elements * param_bytes / pcie
    return {"grad_to_host_s": copies * one, "grad_to_host_exposed_s": grad_exposed, "host_step_s": host_step,
            "param_to_device_s": back, "exposed_s": grad_exposed + host_step + back}


def host_state_bytes(elements: Any, devices_per_node: int) -> Any:
    """Host memory a node needs for its devices' offloaded states, bytes (each device as the
    most loaded: ``elements`` x :data:`HOST_STATE_BYTES` x devices per node)."""
    return devices_per_node * elements * HOST_STATE_BYTES


def host_columns(hw, offload: Any, elements: Any) -> dict[str, Any]:
    """``optimizer_elements`` (``elements``: the optimizer's on the most loaded device), ``host_bytes``
    (per node: :func:`host_state_bytes` where ``offload`` is 1, else 0) and ``host_fits`` (host bytes
    <= hardware.host_memory_gb; True without offload) of layouts: numbers or numpy arrays
    (xpar.estimate.columns.peak_memory's candidate columns)."""
    host = offload * host_state_bytes(elements, devices_per_node(hw))
    return {"optimizer_elements": elements, "host_bytes": host,
            "host_fits": host <= (hw.host_memory_gb or 0) * 1e9}


def gradient_copies(zero_stage: Any, dp: Any, micro_batches: Any) -> Any:
    """Gradient copies to the host per step: m where gradients are reduced every micro-batch
    (ZeRO-2/3 at dp > 1), else 1 (floats or arrays)."""
    per_microbatch = (zero_stage >= 2) & (dp > 1)
    return per_microbatch * micro_batches + (1 - per_microbatch) * 1


def offload_figures_known(hw) -> bool:
    """Whether ``hw`` (a HardwareConfig or a hardware dict) gives PCIe, host-memory bandwidth
    and host-memory figures (all three > 0)."""
    return not missing_host_fields(hw)


def devices_per_node(hw) -> int:
    """The node's device count of a HardwareConfig ('auto': 1)."""
    n = hw.devices_per_node
    return int(n) if str(n).isdigit() else 1


def offload_elements(spec, options, pp_rank: int) -> int:
    """Optimizer elements of the most loaded dp rank of pipeline rank ``pp_rank`` (what it
    offloads; :func:`xpar.estimate.memory.per_device.held_numel`). ``options``: MemoryOptions/Assumptions."""
    return held_numel(spec, pp_rank, most_loaded_dp_rank(spec, pp_rank, options.zero1), options.zero1)["optimizer"]


def offload_step(spec, assume, pp_rank: int, microbatch_compute_s: float) -> Optional[dict[str, float]]:
    """:func:`offload_time` of ``spec`` (a RunSpec with ``cpu_offload_optimizer``) for the device
    of pipeline rank ``pp_rank`` (the memory peak's), plus ``elements`` and ``host_bytes`` (per
    node); None when the hardware lacks the figures (:func:`offload_figures_known`)."""
    hw = spec.hardware
    if not offload_figures_known(hw):
        return None
    n = offload_elements(spec, assume, pp_rank)
    param_bytes, grad_bytes, _ = state_widths(spec, assume)
    copies = gradient_copies(spec.layout.zero_stage, spec.dp, spec.micro_batches)
    out = offload_time(n, copies, grad_bytes, param_bytes, microbatch_compute_s, hw.pcie_gb_per_s,
                       hw.host_mem_gb_per_s, devices_per_node(hw))
    return dict(out, elements=float(n), host_bytes=float(host_state_bytes(n, devices_per_node(hw))))


HOST_FIELDS = ("pcie_gb_per_s", "host_mem_gb_per_s", "host_memory_gb")
"""The hardware fields an offloaded step is timed and held with (:func:`offload_figures_known`)."""


def missing_host_fields(hw) -> list[str]:
    """The :data:`HOST_FIELDS` of ``hw`` (HardwareConfig or dict) that are null or not > 0."""
    get = hw.get if isinstance(hw, dict) else (lambda k, d=None: getattr(hw, k, d))
    return [k for k in HOST_FIELDS if not (get(k) or 0) > 0]


def offload_problem(spec, assume) -> Optional[str]:
    """Why ``spec`` cannot offload its optimizer as asked (``framework.cpu_offload_optimizer``),
    or None: execute mode (xpar does not run it), hardware without the PCIe and host figures
    (the step would cost 0 s, :data:`HOST_FIELDS`), or ZeRO-0 (DeepSpeed's offload_optimizer is
    a ZeRO stage 1-3 option; at dp = 1 ZeRO-1 shards nothing and runs as ZeRO-0 does, so
    parallel.zero_stage=1 is the layout). Host memory: xpar.estimate.preflight.check.host_memory_need."""
    if not getattr(assume, "cpu_offload_optimizer", False):
        return None
    if spec.mode == "execute":
        return ("framework.cpu_offload_optimizer=true is estimated only: xpar does not execute optimizer offload "
                f"(run.mode={spec.mode} on hardware={spec.hardware.name}); e.g. framework.cpu_offload_optimizer=false, "
                "or run.mode=estimate with a cluster preset (hardware=a100_80gb_8gpu).")
    missing = missing_host_fields(spec.hardware)
    if missing:
        return (f"framework.cpu_offload_optimizer=true needs the host figures an offloaded step is timed with, and "
                f"hardware={spec.hardware.name} has no {', '.join('hardware.' + k for k in missing)} (null); give them, "
                f"e.g. {' '.join(f'hardware.{k}={EXAMPLE_HOST[k]:g}' for k in missing)} (a DGX A100 node, "
                "conf/hardware/a100_80gb_8gpu.yaml), or framework.cpu_offload_optimizer=false.")
    if spec.layout.zero_stage == 0:
        return (f"framework.cpu_offload_optimizer=true needs parallel.zero_stage >= 1 (got zero_stage=0, "
                f"dp={spec.dp}): offload moves each rank's optimizer partition (DeepSpeed offload_optimizer: ZeRO "
                "stages 1-3; at dp = 1 ZeRO-1 shards nothing, the same layout as ZeRO-0); values that work: "
                f"parallel.zero_stage=1, 2 or 3; e.g. parallel.zero_stage={1 if spec.dp == 1 else 3}.")
    return None


EXAMPLE_HOST = {"pcie_gb_per_s": 12.5, "host_mem_gb_per_s": 409.6, "host_memory_gb": 2000.0}
"""A DGX A100 node's host figures (conf/hardware/a100_80gb_8gpu.yaml, datasheet values): the example a
refusal gives for missing :data:`HOST_FIELDS`."""


def host_memory_line(spec, step: dict) -> str:
    """The refusal of xpar.estimate.preflight.check.host_memory_need, without a suggestion (the caller checks one)."""
    return (f"offloaded optimizer states need {step['host_bytes'] / 1e9:,.0f} GB of host memory per node "
            f"({devices_per_node(spec.hardware)} devices x {step['elements'] / 1e9:.2f}e9 elements x "
            f"{HOST_STATE_BYTES} bytes), more than hardware.host_memory_gb={spec.hardware.host_memory_gb:g}")
