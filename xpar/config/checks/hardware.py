"""Checks of the hardware figures (``hardware.*``) before any worker starts or any layout is
planned: a figure that divides (FLOP/s, bytes/s), bounds (bytes) or adds (microseconds) must
be one the estimate can use.

What null means depends on the hardware. On ``hardware=local`` (and the ``xpar calibrate``
presets, whose name is ``local``) xpar measures the CPU's peak and detects device memory, so
null is an answer there. On any other hardware nothing is measured: a null peak made the
estimate's matmul time 0 (5.6x the tokens/s of a 70B on 64 A100s, 847 TFLOP/s on a 312 TFLOP/s
part), a null device memory let every layout "fit" with negative headroom (and crashed
``xpar plan``), and a null inter-node bandwidth on several nodes priced cross-node traffic at
the intra-node link's speed; each is refused here with the preset's own figure as the fix.
Negative latencies (a negative step time) and a zero or negative NIC count are refused too.
Each refusal names the constraint, the value given and a value that works
(:mod:`xpar.config.checks.environment` runs these first).
"""
from __future__ import annotations

import copy
import functools
import math
import os
from dataclasses import fields
from typing import Optional

from xpar.config.hardware import is_this_machine
from xpar.config.presets import conf_dir, load_preset, presets
from xpar.config.schema import HardwareConfig

POSITIVE_OR_NULL = ("peak_tflops", "peak_tflops_fp32", "hbm_tb_per_s", "intra_node_gb_per_s", "inter_node_gb_per_s",
                    "device_memory_gb", "pcie_gb_per_s", "host_mem_gb_per_s", "host_memory_gb", "deepep_nvl_gb_per_s")
"""Hardware fields that divide or bound (FLOP/s, bytes/s, bytes): 0 and negatives are refused; null
as :data:`NULL_MEANS` says (pcie_gb_per_s, host_mem_gb_per_s and host_memory_gb time and hold an offloaded optimizer,
xpar.estimate.memory.offload; deepep_nvl_gb_per_s: xpar.estimate.expert_parallel.ep_layer_times)."""

NULL_MEANS = {"peak_tflops": "null: measured, on hardware=local with a CPU only",
              "peak_tflops_fp32": "null: peak_tflops",
              "hbm_tb_per_s": "null: unknown, memory-bound time not estimated, with a note",
              "intra_node_gb_per_s": "null: unknown, communication not estimated, with a note",
              "inter_node_gb_per_s": "null: on one node only",
              "device_memory_gb": "null: detected, on hardware=local only",
              "pcie_gb_per_s": "null: unknown, no optimizer or activation offload",
              "host_mem_gb_per_s": "null: unknown, no optimizer offload",
              "host_memory_gb": "null: unknown, no optimizer offload",
              "deepep_nvl_gb_per_s": "null: DeepEP at intra_node_gb_per_s x link_efficiency"}
"""What a null figure means, said in the refusal of 0 (xpar.config.hardware.resolve_hardware measures and
detects; xpar.estimate.cost and xpar.estimate.memory.offload read the unknowns)."""

DATASHEET = {"peak_tflops": "the dense bf16 peak per device from the datasheet, TFLOP/s: A100 312, H100 SXM 989",
             "device_memory_gb": "the memory per device in GB (1e9 bytes) as the device reports it: 85.0 for an "
                                 "80 GB A100 or H100, 42.3 for a 40 GB A100",
             "inter_node_gb_per_s": "the bandwidth of one NIC in GB/s per direction: 25 for 200 Gb/s HDR InfiniBand, "
                                    "50 for 400 Gb/s NDR"}
"""Where a figure without a preset to copy from comes from (NVIDIA A100/H100 datasheets; the device
memory as torch.cuda reports it, see conf/hardware/a100_80gb_8gpu.yaml)."""

EXAMPLE = {"peak_tflops": 312.0, "device_memory_gb": 85.0, "inter_node_gb_per_s": 25.0}
"""A figure that works where the hardware is not a preset (an A100-SXM4-80GB node on HDR InfiniBand)."""



UNCALIBRATED_LOCAL = ("hardware=local is UNCALIBRATED: its estimates count the matmuls at the measured peak and "
                      "leave out what they have no figure for (links, HBM, host time per operator), so they read "
                      "faster than a run here: `xpar calibrate hardware=local --name here`, then "
                      "hardware=calibrated_here")
"""The note of an estimate or a plan on ``hardware=local`` (no calibrated figures: xpar.calibrate)."""

def load_hardware_preset(name: str):
    """conf/hardware/<name>.yaml over the node preset it inherits (xpar.config.presets.load_preset),
    through the HardwareConfig schema (defaults filled in): a copy of the one read while no file of
    conf/hardware/ changed (a refusal reads every preset: ~20 ms each through OmegaConf).

    Raises:
        FileNotFoundError: ``name`` is not a hardware preset."""
    files = sorted((conf_dir() / "hardware").glob("*.yaml"))
    stamp = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files)
    return copy.deepcopy(_hardware_preset(name, stamp))


@functools.lru_cache(maxsize=256)
def _hardware_preset(name: str, stamp: tuple):
    """:func:`load_hardware_preset` read once per ``stamp`` (the folder's files, times and sizes)."""
    from omegaconf import OmegaConf

    node = OmegaConf.merge(OmegaConf.structured(HardwareConfig), load_preset("hardware", name))
    return OmegaConf.to_object(node)


def _preset(name: str):
    """The hardware preset ``name``, or None (hardware=local: figures measured; or not a preset)."""
    return None if name == "local" or name not in presets("hardware") else load_hardware_preset(name)


def _text(v) -> str:
    """A value as an override writes it: null, true/false, 312 (not 312.0), 8.4."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    return f"{v:g}" if isinstance(v, float) else str(v)


def _needs_figure(hw, name: str) -> bool:
    """Null is refused for ``name`` on this hardware: peak and device memory off hardware=local
    (nothing measures them), the inter-node bandwidth on several nodes with an intra-node one."""
    if name in ("peak_tflops", "device_memory_gb"):
        return not is_this_machine(hw)
    if name == "inter_node_gb_per_s":
        return hw.nodes > 1 and hw.intra_node_gb_per_s is not None
    return False


def _working_value(hw, name: str, preset) -> Optional[str]:
    """A value of ``name`` that the checks accept on ``hw``: the preset's own figure where it has
    one, else the dataclass default or null where null is accepted, else :data:`EXAMPLE`."""
    own = getattr(preset, name) if preset is not None else None
    if own is not None:
        return _text(own)
    if _needs_figure(hw, name):
        return _text(EXAMPLE[name])
    return _text(next(f.default for f in fields(HardwareConfig) if f.name == name))


def _positive_problem(hw, name: str, preset) -> Optional[str]:
    """0 or negative refused; null refused where :func:`_needs_figure`."""
    v, fix = getattr(hw, name), _working_value(hw, name, preset)
    if v is not None and v > 0:
        return None
    needed = _needs_figure(hw, name)
    where = f"on hardware={hw.name}" + (f" with hardware.nodes={hw.nodes}" if name == "inter_node_gb_per_s" else "")
    if v is not None:
        given = f"{v} {where} ({DATASHEET[name]})" if needed else f"{v}"
        return f"hardware.{name} must be > 0 or null ({NULL_MEANS[name]}), got {given}; e.g. hardware.{name}={fix}."
    if not needed:
        return None
    why = {"peak_tflops": "xpar measures a peak only on hardware=local with a CPU, so the estimate's matmul "
                          "time would be 0",
           "device_memory_gb": "xpar detects device memory only on hardware=local, so no layout could be "
                               "checked against it",
           "inter_node_gb_per_s": f"cross-node traffic would be priced at the intra-node link's "
                                  f"{_text(hw.intra_node_gb_per_s)} GB/s"}[name]
    own = " (the preset's figure)" if preset is not None and getattr(preset, name) is not None else ""
    alt = ", or hardware.nodes=1" if name == "inter_node_gb_per_s" else ""
    return f"hardware.{name}=null {where}: {why}; give {DATASHEET[name]}; e.g. hardware.{name}={fix}{own}{alt}."



def latency_fields() -> tuple[str, ...]:
    """The HardwareConfig fields in microseconds (``*_us``): latencies and host overheads."""
    return tuple(f.name for f in fields(HardwareConfig) if f.name.endswith("_us"))


def _other_problems(hw, preset) -> dict[str, str]:
    """Latencies and overheads >= 0 (null where the schema allows it); NIC count >= 1 or null;
    nodes >= 1; devices_per_node >= 1 or auto; efficiencies in (0, 1]; overheads and headroom."""
    out = {}
    for name in latency_fields():
        v = getattr(hw, name)
        if v is not None and not 0 <= v < math.inf:  # NaN and inf too
            out[name] = (f"hardware.{name} must be >= 0 microseconds and finite (a latency or a host overhead adds to "
                         f"the step), "
                         f"got {v}; e.g. hardware.{name}={_working_value(hw, name, preset)}.")
    n = hw.nics_per_node
    if n is not None and not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        out["nics_per_node"] = (f"hardware.nics_per_node must be an integer >= 1 or null (one per device), got {n!r}; "
                                f"e.g. hardware.nics_per_node={_working_value(hw, 'nics_per_node', preset)}.")
    if hw.nodes < 1:
        out["nodes"] = f"hardware.nodes must be >= 1, got {hw.nodes}; e.g. hardware.nodes=1."
    n = hw.devices_per_node
    if n != "auto" and not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        out["devices_per_node"] = (f"hardware.devices_per_node must be an integer >= 1 or 'auto', got {n!r}; e.g. "
                                   f"hardware.devices_per_node=auto.")
    cores = hw.cpu_cores
    if cores is not None and not (isinstance(cores, int) and not isinstance(cores, bool) and cores >= 1):
        out["cpu_cores"] = (f"hardware.cpu_cores must be an integer >= 1 or null (not a CPU: no stretch for "
                            f"workers outnumbering cores), got {cores!r}; e.g. hardware.cpu_cores={os.cpu_count() or 1}.")
    for name in ("matmul_efficiency", "link_efficiency"):
        if not 0 < getattr(hw, name) <= 1:
            out[name] = f"hardware.{name} must be in (0, 1], got {getattr(hw, name)}; e.g. hardware.{name}=0.7."
    ns = hw.optimizer_ns_per_element
    if ns is not None and not 0 < ns < math.inf:
        out["optimizer_ns_per_element"] = (f"hardware.optimizer_ns_per_element must be > 0 nanoseconds and finite, or "
                                           f"null (bytes over memory bandwidth), got {ns}; "
                                           f"e.g. hardware.optimizer_ns_per_element=null.")
    if hw.framework_overhead_gb < 0:
        out["framework_overhead_gb"] = (f"hardware.framework_overhead_gb must be >= 0, got {hw.framework_overhead_gb}; "
                                        f"e.g. 2.0.")
    return out


def _kernel_model_problems(hw) -> dict[str, str]:
    """The kernel model's figures: SM count an integer >= 1 or null, tiles multiples of 16 in
    [16, 512], fractions of peak in (0, 1] or null (xpar.estimate.compute.kernels)."""
    out = {}
    n = hw.sm_count
    if n is not None and not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        out["sm_count"] = (f"hardware.sm_count must be an integer >= 1 or null (no kernel-level pricing), got {n!r}; "
                           f"e.g. hardware.sm_count=132 (H100 SXM).")
    for name in ("gemm_tile_m", "gemm_tile_n"):
        v = getattr(hw, name)
        if not (isinstance(v, int) and not isinstance(v, bool) and 16 <= v <= 512 and v % 16 == 0):
            out[name] = (f"hardware.{name} must be a multiple of 16 in [16, 512] (a tensor-core GEMM tile), got {v!r}; "
                         f"e.g. hardware.{name}={128 if name.endswith('m') else 256}.")
    for name in ("gemm_efficiency", "gemm_efficiency_fp8", "attention_efficiency", "attention_bwd_efficiency",
                 "attention_efficiency_fa2", "attention_bwd_efficiency_fa2", "attention_efficiency_cudnn_2024",
                 "attention_bwd_efficiency_cudnn_2024"):
        v = getattr(hw, name)
        if v is not None and not 0 < v <= 1:
            out[name] = (f"hardware.{name} must be in (0, 1] (a fraction of peak) or null, got {v}; "
                         f"e.g. hardware.{name}=0.7.")
    return out


def hardware_value_problems(hw) -> dict[str, str]:
    """Every refused figure of the HardwareConfig ``hw``: field name -> one refusal line (the
    constraint, the value given, a value that works: the preset's own figure where it has one).

    Raises nothing; an empty dict when every figure is usable."""
    preset = _preset(hw.name)
    out = {}
    for name in POSITIVE_OR_NULL:
        line = _positive_problem(hw, name, preset)
        if line:
            out[name] = line
    return {**out, **_other_problems(hw, preset), **_kernel_model_problems(hw)}


def check_hardware_values(c) -> list[str]:
    """:func:`hardware_value_problems` of ``c.hardware``, as problem lines."""
    return list(hardware_value_problems(c.hardware).values())


def estimate_peak_problem(hw, mode: str) -> list[str]:
    """An estimate of resolved hardware without a peak (hardware=local on a CUDA device: xpar
    measures only a CPU's peak, :func:`xpar.config.hardware.resolve_hardware`): its matmul time would be
    0. ``mode``: the resolved run.mode. One line, or none where the estimate has a peak or the run
    executes (MFU is then reported as 0, "no peak known")."""
    if mode != "estimate" or hw.peak_tflops is not None:
        return []
    return [f"hardware.peak_tflops=null on hardware={hw.name} with device {hw.device}: xpar measures a peak only on "
            f"a CPU, so the estimate's matmul time would be 0; give {DATASHEET['peak_tflops']}; e.g. "
            f"hardware.peak_tflops={_text(EXAMPLE['peak_tflops'])}, or run.mode=execute."]


def part_memory_notes(hw) -> list[str]:
    """A note where ``hardware.device_memory_gb`` was changed on a preset by more than 10 % while its
    ``hbm_tb_per_s`` stayed the preset's (its ``gpu`` too, or renamed alone) (``hardware.device_memory_gb=40`` on an 80 GB A100 preset prices the
    80 GB part's 2.039 TB/s HBM with 40 GB): the figures kept, and the presets of a part with that memory
    and the same peak (the A100-SXM4-40GB's, 1.555 TB/s). None where the hardware is no preset."""
    base = _preset(hw.name)
    if base is None or not hw.device_memory_gb or not base.device_memory_gb or hw.hbm_tb_per_s != base.hbm_tb_per_s \
            or abs(hw.device_memory_gb / base.device_memory_gb - 1) <= 0.1:
        return []
    parts = [n for n in presets("hardware") if n.endswith("_node") and (p := _preset(n)).gpu != base.gpu
             and p.peak_tflops == base.peak_tflops and p.device_memory_gb
             and abs(p.device_memory_gb / hw.device_memory_gb - 1) <= 0.1]
    named = hw.gpu != base.gpu  # hardware.gpu given, the bandwidth not: still the preset part's
    other = (f"; hardware={' or hardware='.join(parts)} (with hardware.nodes) is that part" if parts else
             f"; set {'' if named else 'hardware.gpu and '}hardware.hbm_tb_per_s for the part you mean")
    kept = (f"hbm_tb_per_s={_text(base.hbm_tb_per_s)} of its gpu={base.gpu} ({_text(base.device_memory_gb)} GB), "
            f"though hardware.gpu={hw.gpu}" if named else f"gpu={base.gpu} ({_text(base.device_memory_gb)} GB) and "
            f"hbm_tb_per_s={_text(base.hbm_tb_per_s)}")
    return [f"hardware.device_memory_gb={_text(hw.device_memory_gb)} on hardware={hw.name} keeps the preset's "
            f"{kept}: memory-bound time is priced at that part's bandwidth{other}."]
