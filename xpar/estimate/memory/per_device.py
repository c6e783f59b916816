"""Per-device memory of a layout: model states, activations, buffers. Units: bytes.

Every term is named (:data:`xpar.estimate.terms.MEMORY_TERMS`), each counted as the framework keeps
it; what a framework does differently is a :class:`MemoryOptions` field (framework profiles set them).

- Model states: the ZeRO paper's 2 + 2 + 12 bytes per parameter (Rajbhandari et al. 2020), or the
  framework's widths (:func:`state_widths`: xpar/torchtitan fp32 storage, Megatron/DeepSpeed bf16),
  held exactly as xpar's wrappers shard them (DDP, ZeroRedundancyOptimizer, FSDP2 dim-0 chunks).
- Activations: Korthikanti et al. 2022 Table 2 generalised term by term
  (:func:`layer_activation_bytes`); a rank's peak over the schedule's own action list.
- Recompute: none, full (Chen et al. 2016), selective by ``selective_recompute``.
- Besides (``count_buffers``): buffers (xpar.estimate.memory.buffers), recompute workspace, loss
  temporaries, ``hardware.framework_overhead_gb``. The peak: the planner's column model on a column of
  one layout (xpar.estimate.columns.layout_memory). Derivation: docs/concepts/cost-model-derivations.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from xpar.config.spec import RunSpec
from xpar.estimate.memory.activations import recompute_notes
from xpar.estimate.memory.buffers import state_buffer_terms
from xpar.estimate.columns.layout_memory import layout_memory
from xpar.estimate.columns.peak_memory import usable_bytes
from xpar.estimate.context_parallel import fold_cp
from xpar.estimate.comm.hsdp import shard_group_spec
from xpar.estimate.memory.model_states import (
    MemoryOptions,
    expert_state_bytes,
    held_state_terms,
    most_loaded_dp_rank,
    precision,
)


def state_terms(spec: RunSpec, pp_rank: int, dp_rank: int, o: MemoryOptions) -> dict[str, int]:
    """Model-state bytes by part: params_master (stored parameters), params_compute (bf16
    copies held: FSDP2 ZeRO-2's whole bf16 parameters, ZeRO-3's under pp when not
    resharded, autocast's weight copies per micro-batch in flight), grads, optimizer."""
    out = held_state_terms(spec, pp_rank, dp_rank, o)
    if precision(spec, o)["autocast"]:
        out["params_compute"] = layout_memory(spec, o, pp_rank)["copies"]
    return out


def model_state_bytes(spec: RunSpec, stage_index: Optional[int] = None, dp_rank: Optional[int] = None,
                      assume=None, **options) -> dict[str, int]:
    """Bytes per device of params, grads and optimizer states (dict with those keys) as the
    framework keeps them (:func:`state_terms`; params = master + compute copies).

    ``stage_index``: the pipeline rank; None takes the rank with the most bytes.
    ``dp_rank``: None takes the most loaded dp rank (:func:`most_loaded_dp_rank`).
    ``assume``/``options``: :class:`MemoryOptions`. Equals what
    xpar.parallel.memory_accounting.model_state_bytes measures on a real run (fp32 and bf16).
    """
    o = MemoryOptions.of(assume, **options)
    best = None
    for pr in (range(spec.pp) if stage_index is None else [stage_index]):
        t = state_terms(spec, pr, most_loaded_dp_rank(spec, pr, o.zero1) if dp_rank is None else dp_rank, o)
        d = {"params": t["params_master"] + t["params_compute"], "grads": t["grads"], "optimizer": t["optimizer"]}
        if best is None or sum(d.values()) > sum(best.values()):
            best = d
    return best


@dataclass
class MemoryEstimate:
    """Peak bytes on the most loaded device (pipeline rank ``pp_rank``, its most loaded dp
    rank). Every term is present, zero where it does not apply. Units: bytes."""

    params: float
    grads: float
    optimizer: float
    activations: float
    comm_buffers: float
    framework_overhead: float
    total: float
    device_memory: float
    """Memory of one device (hardware.device_memory_gb x 1e9)."""
    fits: bool
    """total <= usable (device memory less ``hardware.memory_headroom``)."""
    pp_rank: int
    detail: dict = field(default_factory=dict)
    """activations by term, comm buffers by term, model-state parts (params_master,
    params_compute), ``usable`` bytes and ``notes``."""

    @property
    def usable(self) -> float:
        """Bytes the fit check allows: device memory x (1 - hardware.memory_headroom)."""
        return self.detail.get("usable", self.device_memory)


def rank_memory(spec: RunSpec, o: MemoryOptions, pp_rank: Optional[int] = None) -> MemoryEstimate:
    """:class:`MemoryEstimate` of pipeline rank ``pp_rank`` (None: the most loaded) of ``spec``
    (cp-folded, shard group resolved) on its most loaded dp rank: the column model's one row
    (:func:`xpar.estimate.columns.layout_memory.layout_memory`), with its terms by part."""
    x = layout_memory(spec, o, pp_rank)
    r = x["pp_rank"]
    dp_rank = most_loaded_dp_rank(spec, r, o.zero1)
    st = held_state_terms(spec, r, dp_rank, o)
    if precision(spec, o)["autocast"]:
        st["params_compute"] = x["copies"]
    comm = dict(state_buffer_terms(spec, r, o), pp_p2p=x["p2p"])
    act = {"saved": x["kept"] + x["token_ids"], "transient": x["total_acts"] - x["kept"], "token_ids": x["token_ids"],
           "microbatches_in_flight": x["chunks"] / spec.layout.virtual_stages}
    hw, usable = spec.hardware, usable_bytes(spec.hardware)
    return MemoryEstimate(params=x["params"], grads=x["grads"], optimizer=x["optimizer"], activations=x["activations"],
                          comm_buffers=x["comm_buffers"], framework_overhead=(hw.framework_overhead_gb or 0) * 1e9,
                          total=x["total"], device_memory=(hw.device_memory_gb or 0) * 1e9, fits=x["total"] <= usable,
                          pp_rank=r,
                          detail={"activations": act, "comm_buffers": comm, "states": st, "usable": usable,
                                  "notes": recompute_notes(spec, o) + expert_notes(spec, r, dp_rank, o)})


def expert_notes(spec: RunSpec, pp_rank: int, dp_rank: int, o: MemoryOptions) -> list[str]:
    """The expert states of a MoE model's rank in words (xpar.estimate.memory.model_states.expert_state_bytes)."""
    ex = expert_state_bytes(spec, pp_rank, dp_rank, o)
    if not ex:
        return []
    cfg, lay = spec.model, spec.layout
    return [f"expert states: {cfg.n_experts // lay.ep} of {cfg.n_experts} routed experts per MoE layer on this rank "
            f"(ep={lay.ep}, etp={lay.expert_tp}): params {ex['params'] / 1e9:.1f} GB, grads {ex['grads'] / 1e9:.1f} GB, "
            f"optimizer {ex['optimizer'] / 1e9:.1f} GB (sharded over {ex['expert_dp']} expert-dp ranks), "
            f"included in the model states"]


def memory(spec: RunSpec, pp_rank: Optional[int] = None, assume=None, **options) -> MemoryEstimate:
    """Per-device peak memory of ``spec`` on pipeline rank ``pp_rank`` (None: the most
    loaded rank). ``assume`` (an Assumptions) and ``options`` give the
    :class:`MemoryOptions` (also the legacy ``flash``, ``dropout``, ``fused_rmsnorm``,
    ``sp_saves_gathered``). See the module docstring for the terms."""
    o = MemoryOptions.of(assume, **options)
    spec = fold_cp(spec)  # cp ranks hold s / cp tokens and shard over dp x cp (xpar.estimate.context_parallel)
    spec = shard_group_spec(spec)  # hierarchical ZeRO: states sharded over parallel.zero_shard_size (xpar.estimate.comm.hsdp)
    return rank_memory(spec, o, pp_rank)
