"""Step time, throughput, MFU and memory of one layout: the cost model for ``run.mode=estimate``.

    T_mb(r) = matmul (F_r / (peak eta(h/t))) + memory-bound (passes A_r / HBM)
            + exposed tp, pp and dp communication + host time         per micro-batch, rank r
    step    = m max_r T_mb(r) + beta/(1 - beta) m mean_{r != slowest} T_mb(r)   pipeline and bubble
            + dp communication left at the end + optimizer and gradient passes + host step time

eta(x) = hardware.matmul_efficiency x / (x + GEMM_HALF_DIM). Parts: FLOPs (xpar.estimate.compute.flops,
Narayanan et al. 2021), activations (Korthikanti et al. 2022), collectives (NCCL's alpha-beta),
dp timeline (xpar.estimate.comm.dp, overlap), bubble (xpar.estimate.schedule), host, offload, cp and
ep. The step is the planner's orchestration on a column of one layout
(xpar.estimate.columns.one_layout); its parts: xpar.estimate.step_parts (re-exported here).
Units: seconds, FLOP/s, bytes. One fitted constant per GPU family (hardware.matmul_efficiency):
docs/accuracy/published.md, docs/accuracy/fit_history.md. Pure: no devices, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from xpar.config.spec import RunSpec
from xpar.estimate.frameworks import deepspeed_zero3
from xpar.estimate.columns.cp_ep import cp_columns
from xpar.estimate.columns.one_layout import layout_columns, layout_step
from xpar.estimate.columns.step_time import Step
from xpar.estimate.comm.volume import comm_bytes_rank
from xpar.estimate.context_parallel import cp_comm_of, fold_cp
from xpar.estimate.comm.dp import grad_bytes
from xpar.estimate.expert_parallel import ep_note, ep_replay
from xpar.estimate.memory.per_device import MemoryEstimate, memory
from xpar.estimate.memory.activation_host import host_need
from xpar.estimate.memory.activation_offload import offload_layers, resident_blocks
from xpar.estimate.memory.model_states import MemoryOptions
from xpar.estimate.memory.offload import devices_per_node, host_state_bytes, offload_elements, offload_figures_known
from xpar.estimate.step_parts import (  # noqa: F401 (re-exported: their home before issue 41)
    GEMM_HALF_DIM,
    Assumptions,
    assumptions_for,
    compute_peak,
    ep_a2a_overlap_of,
    fill_time,
    gradient_time,
    layer_costs,
    matmul_efficiency,
    optimizer_time,
    pp_overlap_of,
    pp_send_latency,
    rank_compute,
    rates,
    reduced_grad_bytes,
    sink_assumptions,
    step_rates,
    step_time,
    tp_times,
    waits_unstretched,
    with_hardware,
)
from xpar.estimate.terms import TIME_TERMS  # noqa: F401 (re-exported: the breakdown's keys)


SHOWN_MEMORY_NOTES = ("expert states", "torchtitan's DeepEP branch", "framework.moe_recompute_graph_kept")
"""The memory notes an estimate prints (the others explain a refusal: xpar.estimate.preflight.check)."""


@dataclass
class Estimate:
    """Estimated figures of one layout (mode 'estimate'); same names as measured runs."""

    memory: MemoryEstimate
    model_flops_per_step: float
    """Model FLOPs of a whole step, all devices (no recompute)."""
    hardware_flops_per_step: float
    """FLOPs executed per step, all devices (recompute included)."""
    time_per_step_s: float
    time_breakdown: dict[str, float]
    """Seconds on the slowest rank by term (:data:`TIME_TERMS`; they sum to time_per_step_s)."""
    tokens_per_s: float
    tokens_per_s_per_device: float
    tflops_per_device: float
    """Model TFLOP/s per device (1e12 FLOP/s)."""
    hw_tflops_per_device: float
    """Hardware TFLOP/s per device (recompute counted, as Narayanan et al. 2021 Table 1)."""
    mfu: float
    hfu: float
    bubble_ratio: float
    comm_bytes: dict[str, float]
    """Bytes per device per step by collective, slowest rank (xpar.estimate.comm.volume)."""
    notes: list[str] = field(default_factory=list)
    comm_time: dict[str, float] = field(default_factory=dict)
    """Seconds of communication issued per step on the slowest rank, hidden or not (tp, pp,
    dp), beside the exposed shares in ``time_breakdown``."""
    framework: str = "xpar"
    offload: dict = field(default_factory=dict)
    """An offloaded optimizer's seconds per step by part (xpar.estimate.memory.offload.OFFLOAD_TERMS; its
    ``exposed_s`` is in ``time_breakdown['optimizer']``), ``elements`` and host ``host_bytes`` per
    node; empty without offload."""


def _memory(spec: RunSpec, a: Assumptions, pp_rank: Optional[int] = None) -> MemoryEstimate:
    return memory(spec, pp_rank, assume=a)


def peak_memory(spec: RunSpec, pp_rank: Optional[int] = None) -> MemoryEstimate:
    """The cost model's peak per device (most loaded pipeline rank when ``pp_rank`` is None),
    under :func:`assumptions_for` the spec."""
    return _memory(spec, assumptions_for(spec), pp_rank)


def estimate(spec: RunSpec, assume: Optional[Assumptions] = None) -> Estimate:
    """Estimate step time, throughput, MFU/HFU, bubble, communication and memory of ``spec``
    under ``assume`` (default: the spec's framework, :func:`assumptions_for`).

    Pure function of the spec (no devices, no process groups). See the module docstring
    for the formulas and the calibration.
    """
    assume = assumptions_for(spec) if assume is None else sink_assumptions(spec.model, assume)
    if spec.layout.cp > 1:
        return _with_cp_comm(spec, estimate(fold_cp(spec), assume), assume)
    spec = waits_unstretched(spec, spec.world_size)
    notes = missing_figure_notes(spec.hardware)
    mem = _memory(spec, assume)
    notes += [n for n in mem.detail.get("notes", []) if n.startswith(SHOWN_MEMORY_NOTES)]
    elements = offload_elements(spec, assume, mem.pp_rank) if assume.cpu_offload_optimizer else 0
    step = layout_step(spec, assume, mem.optimizer, elements, mem.grads)
    slow, x = int(step.slot[0]), {k: float(v[0]) for k, v in step.slowest.items()}
    comm = deepspeed_zero3.comm_bytes(spec, assume, slow, comm_bytes_rank(spec, slow, assume.scatter_gather,
                                                                           assume.zero1, grad_bytes(spec, assume)))
    est = _result(spec, mem, float(step.time[0]), {k: float(v[0]) for k, v in step.breakdown.items()},
                  float(step.beta[0]), comm, notes)
    m = spec.micro_batches
    est.comm_time = {"tp": m * x["tp_issued"] + x["tp_step"], "pp": m * x["pp_issued"], "dp": x["dp_issued"]}
    est.framework, est.offload = assume.name, _offload(spec, assume, step, elements, notes)
    notes += act_offload_notes(spec, est.time_breakdown.get("act_offload", 0.0), assume)
    return _with_ep_comm(spec, est, assume, m * x["ep_issued"]) if spec.layout.ep > 1 else est


def act_offload_notes(spec: RunSpec, exposed_s: float, assume: Assumptions) -> list[str]:
    """The activation offload of ``spec`` in words (xpar.estimate.memory.activation_offload): blocks offloaded and
    held under ``assume``'s copies (TE's side stream, or torch's save_on_cpu), the exposed copies per step
    (``exposed_s``) and the host memory per node; [] without it."""
    n = offload_layers(spec)
    if not n:
        return []
    need = host_need(spec, MemoryOptions.of(assume))
    blocks, link, overlap = spec.model.n_layers, spec.hardware.pcie_gb_per_s, assume.activation_offload_overlap
    how = ("Megatron-Core's --cpu-offloading, Transformer Engine's cpu_offload" if overlap else
           "torch.autograd.graph.save_on_cpu, copies on the compute stream")
    over = f"over the host link at {link:g} GB/s" if link else "(no host link figure: the copies cost 0 s)"
    return [f"activations of {n} of {blocks} blocks offloaded to host memory ({how}): "
            f"{resident_blocks(blocks, n, overlap)} blocks' activations held on the device, "
            f"{need['block_bytes'] / 1e9:.2f} GB a block copied {over}, +{exposed_s:.3g} s exposed per step; "
            f"{need['host_bytes'] / 1e9:,.0f} GB of host memory per node"]


def missing_figure_notes(hw) -> list[str]:
    """Notes on the figures ``hw`` (a HardwareConfig) lacks, whose terms the estimate then leaves at 0."""
    notes = []
    if not hw.hbm_tb_per_s:
        notes.append("no HBM bandwidth for this hardware: memory-bound time not estimated")
    if hw.intra_node_gb_per_s is None:
        notes.append("no link bandwidth for this hardware: communication time not estimated")
    return notes


def _with_ep_comm(spec: RunSpec, est: Estimate, assume: Assumptions, issued: float) -> Estimate:
    """The estimate of an ep layout, its all-to-alls and router imbalance already in the slowest rank's step
    (xpar.estimate.columns.ep_slots): plus their note and the slowest rank's ``issued`` all-to-all seconds per
    step as ``ep`` in comm_time."""
    note = ep_note(spec, ep_a2a_overlap_of(assume, spec.layout.schedule, spec.pp), ep_replay(spec, assume),
                   assume.ep_shared_expert_overlap and spec.model.n_shared_experts > 0)
    est.notes = list(est.notes) + [note]
    est.comm_time = dict(est.comm_time, ep=issued)
    return est


def _with_cp_comm(spec: RunSpec, est: Estimate, assume: Assumptions) -> Estimate:
    """The estimate of a cp layout from its folded one (xpar.estimate.context_parallel): plus the
    exposed part of the K/V exchange of the fullest rank's layers as ``assume.cp_comm`` runs it, m per step
    (xpar.estimate.columns.cp_ep.cp_columns on the layout's column; ``cp_comm`` in the breakdown, the
    issued seconds as ``cp`` in comm_time), and what the attention core's ring steps add (``cp_attention``:
    xpar.estimate.cp_attention)."""
    exposed, issued, ring = (float(x[0]) for x in cp_columns(spec, layout_columns(spec), spec.layout.cp, assume))
    breakdown = dict(est.time_breakdown, cp_comm=exposed, cp_attention=ring)
    out = _result(fold_cp(spec), est.memory, est.time_per_step_s + exposed + ring, breakdown, est.bubble_ratio,
                  est.comm_bytes, list(est.notes) + [f"context parallelism cp={spec.layout.cp}: priced as dp x cp ranks at "
                                                     f"s / cp tokens each, K/V {CP_NOTES[cp_comm_of(spec, assume)]}"])
    out.comm_time, out.framework, out.offload = dict(est.comm_time, cp=issued), est.framework, est.offload
    return out


CP_NOTES = {"all_gather": "all-gathers exposed", "p2p": "ring (p2p) sends hidden behind each chunk's attention",
            "a2a": "and Q/output all-to-alls (Ulysses) exposed"}
"""How an estimate's note names the cp exchange of each framework.cp_comm (xpar.estimate.cp_exchange)."""


def _offload(spec: RunSpec, assume: Assumptions, step: Step, elements: int, notes: list[str]) -> dict:
    """The offloaded optimizer step of the memory peak's device (xpar.estimate.memory.offload; ``elements``: the
    optimizer elements it holds) as ``step`` priced it: seconds by part, ``elements`` and the host
    ``host_bytes`` per node; {} without offload, or with a note when the hardware has no host figures."""
    if not assume.cpu_offload_optimizer:
        return {}
    if not offload_figures_known(spec.hardware):
        notes.append("no PCIe or host-memory figures for this hardware: the offloaded optimizer step is not estimated")
        return {}
    out = {k: float(v[0]) for k, v in step.offload.items()}
    out.update(elements=float(elements),
               host_bytes=float(host_state_bytes(elements, devices_per_node(spec.hardware))))
    notes.append(f"optimizer offloaded to host memory (ZeRO-Offload's schedule): +{out['host_step_s']:.3g} s host "
                 f"AdamW, +{out['grad_to_host_exposed_s'] + out['param_to_device_s']:.3g} s PCIe exposed per "
                 f"step; {out['host_bytes'] / 1e9:,.0f} GB of host memory per node")
    return out


def _result(spec: RunSpec, mem: MemoryEstimate, time: float, breakdown: dict, beta: float, comm: dict,
            notes: list[str]) -> Estimate:
    """The Estimate of a step of ``time`` seconds: throughput, model/hardware FLOP/s, MFU/HFU (:func:`step_rates`)."""
    return Estimate(memory=mem, time_per_step_s=time, time_breakdown=breakdown, bubble_ratio=beta, comm_bytes=dict(comm),
                    notes=notes, **step_rates(spec, time))


