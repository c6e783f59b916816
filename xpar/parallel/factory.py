"""The engine factory: one short function that composes the strategies in a fixed order: the model
on the meta device, its seeded init, cp, tp, recompute, activation offload, autocast, the dp wrapper (DDP or FSDP2),
experts, pipeline stages and their schedule, the optimizer and lr schedule.

Design notes (what each step does and why, with sources): docs/concepts/design-notes.md.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from xpar.config.spec import RunSpec
from xpar.models.transformer import Transformer
from xpar.parallel.context import apply_cp
from xpar.parallel.data_parallel import build_optimizer, wrap_dp
from xpar.parallel.expert import reduce_expert_grads, shard_experts, apply_ep, build_expert_groups
from xpar.parallel.memory_accounting import fsdp_params, grad_bytes_held
from xpar.parallel.mesh import replica_mesh, hsdp_mesh
from xpar.parallel.offload import apply_activation_offload
from xpar.parallel.optim import NonFiniteStep, clip_grads_, first_nonfinite_rank, nonfinite_message, build_lr_scheduler
from xpar.parallel.pipeline import attach_schedule
from xpar.parallel.precision import apply_autocast, mixed_precision_kind
from xpar.parallel.recompute import apply_recompute
from xpar.parallel.tensor import parallel_cross_entropy, loss_context, apply_tp


def cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over all B*S positions."""
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), targets_BS.flatten())


@dataclass
class Engine:
    """This rank's part of the model, wrapped, with its optimizer and step function.

    ``chunks``: the model chunks held by this rank (one, or v pipeline stages).
    ``step(inputs, targets)``: one optimizer step over this rank's micro-batches (lists of
    ``[b, S]`` int64 tensors); returns the mean loss over them, or None on pipeline ranks
    that do not hold the last stage.
    """

    spec: RunSpec
    mesh: DeviceMesh
    chunks: list[nn.Module]
    optimizer: Optional[torch.optim.Optimizer]
    step_fn: Callable[["Engine", list, list], Optional[float]]
    stages: list[Any] = field(default_factory=list)
    schedule: Any = None
    grads_peak: int = 0
    """Most gradient bytes held at once on this rank so far (:meth:`probe_grads`)."""
    accounting: bool = True
    """Probe memory in this step. The loop accounts on the first step only (every step has
    the same shapes), so the timed steps carry no accounting overhead."""
    scheduler: Any = None
    """The lr schedule (xpar.parallel.optim.build_lr_scheduler), stepped after each optimizer step."""
    grad_norms: list = field(default_factory=list)
    """Pre-clip global gradient norm of each step so far (xpar.parallel.optim.global_grad_norm)."""
    current_step: int = 0
    """The optimizer step being taken (set by the step loop), for the non-finite message."""
    nonfinite_steps: list = field(default_factory=list)
    """Steps whose loss or global gradient norm was NaN or inf (``train.on_nonfinite``)."""
    skipped_steps: list = field(default_factory=list)
    """Of those, the steps whose optimizer step was skipped (``on_nonfinite=skip``)."""
    expert_groups: Any = None
    """Expert parallelism's process groups (xpar.parallel.expert.ExpertGroups), None without ep."""
    _fsdp_params: Optional[list] = field(default=None, init=False, repr=False)

    def step(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> Optional[float]:
        return self.step_fn(self, inputs, targets)

    def finish_step(self, loss: Optional[float] = None) -> None:
        """After the last backward of a step: clip the global gradient norm to
        ``train.max_grad_norm`` (recording the pre-clip norm in ``grad_norms``), check that
        this rank's ``loss`` (None where it sees none) and the norm are finite on every rank
        (``train.on_nonfinite``), take the optimizer step, advance the lr schedule.

        Raises:
            NonFiniteStep: a non-finite step under ``on_nonfinite=stop`` (on every rank).
        """
        if self.expert_groups is not None:  # experts: summed over expert-dp, / dp x cp
            reduce_expert_grads(self.chunks, self.expert_groups)
        params = [p for c in self.chunks for p in c.parameters()]
        pp_group = self.mesh["pp"].get_group() if self.spec.pp > 1 else None
        norm = clip_grads_(params, self.spec.train.max_grad_norm, pp_group)
        self.grad_norms.append(norm)
        bad_rank = first_nonfinite_rank(loss, norm)
        if bad_rank is not None:
            self.nonfinite_steps.append(self.current_step)
            policy = self.spec.train.on_nonfinite
            if policy == "stop":
                raise NonFiniteStep(nonfinite_message(self.current_step, bad_rank, loss, norm, self.spec.train.lr))
            if policy == "skip":
                self.skipped_steps.append(self.current_step)
                return
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def probe_grads(self) -> None:
        """Update ``grads_peak`` with the gradient bytes held now: local ``.grad`` plus
        FSDP2's unsharded gradients awaiting a deferred reduction
        (:func:`xpar.parallel.memory_accounting.grad_bytes_held`). Called where the held gradients peak: after
        each micro-batch's backward, and before each pipeline stage's gradient reduction."""
        if not self.accounting:
            return
        if self._fsdp_params is None:
            self._fsdp_params = fsdp_params(self.chunks)
        self.grads_peak = max(self.grads_peak, grad_bytes_held(self.chunks, self._fsdp_params))

    @property
    def loss_fn(self) -> Callable:
        if self.spec.tp > 1:
            return parallel_cross_entropy
        return cross_entropy

    def loss_context(self):
        """Context for the loss and its backward: ``loss_parallel`` when tp > 1."""
        if self.spec.tp > 1:
            return loss_context(self.spec.tp)
        return nullcontext()


def build_model(spec: RunSpec, stage_ids: Optional[list[int]] = None) -> list[Transformer]:
    """Step 1: the model (or the given pipeline stages of it) on the meta device."""
    if stage_ids is None:
        with torch.device("meta"):
            return [Transformer(spec.model)]
    layout = spec.layout
    with torch.device("meta"):
        return [Transformer(spec.model, layers=layout.stage_layers(s), first=(s == 0), last=(s == layout.n_stages - 1))
                for s in stage_ids]


def materialize(chunk: nn.Module, device: str, seed: int) -> nn.Module:
    """Step 2: allocate on ``device`` and run the seeded init. Parameters are fp32 in every
    run: with ``train.dtype=bf16`` they are the master weights (xpar.parallel.precision)."""
    chunk.to_empty(device=device)
    if chunk.cfg.tied_embeddings and chunk.tok_embeddings is not None and chunk.output is not None:
        chunk.output.weight = chunk.tok_embeddings.weight  # to_empty unties shared parameters
    chunk.init_weights(seed)
    return chunk


def wrap_chunk(chunk: nn.Module, spec: RunSpec, mesh: DeviceMesh, device: str, experts=None) -> nn.Module:
    """Steps 3-4 on one chunk: TP -> activation recompute -> activation offload -> mixed precision -> dp wrapper
    (the torchtitan order: checkpointing wraps the tp-split blocks, FSDP2 wraps the
    checkpointed blocks, so all-gathers stay outside the recomputed region)."""
    lay, shard, dtype = spec.layout, spec.parallel.zero_shard_size, spec.train.dtype
    if spec.cp > 1:
        chunk = apply_cp(chunk, mesh["cp"])                                             # 3a
    if spec.tp > 1:
        chunk = apply_tp(chunk, mesh["tp"], lay.sequence_parallel)                     # 3
    chunk = apply_recompute(chunk, lay.recompute, spec.parallel.recompute_layers)       # 3b
    chunk = apply_activation_offload(chunk, spec.parallel.activation_offload_layers, device)  # 3b': pp 1
    if mixed_precision_kind(dtype, lay.zero_stage) == "autocast":
        chunk = apply_autocast(chunk, dtype, spec.device)                               # 3c
    if experts is not None and (lay.zero_stage >= 2 or spec.tp > 1):  # ep: experts over expert-dp first
        shard_experts(chunk, experts, lay.zero_stage == 3 if lay.zero_stage >= 2 else None, dtype)
    dp_mesh = replica_mesh(mesh)
    if shard and lay.zero_stage >= 2 and shard < dp_mesh.size():  # HSDP: 2-D dp mesh
        dp_mesh = hsdp_mesh(dp_mesh, shard)
    return wrap_dp(chunk, dp_mesh, lay.zero_stage, device, dtype, pipelined=spec.pp > 1)  # 4


def optimizer_mesh(spec: RunSpec, mesh: DeviceMesh) -> DeviceMesh:
    """The dp ranks the optimizer shards its states over: all of dp, or under ZeRO-1 with
    ``parallel.zero_shard_size`` = s < dp the s consecutive ranks of this rank's shard group (DDP still
    all-reduces the gradients over all of dp; ZeroRedundancyOptimizer updates 1/s of the parameters and
    broadcasts them inside the group: InternEvo's zero1 = s, internlm/solver/optimizer/hybrid_zero_optim.py,
    ParallelMode.ZERO1 as the broadcast group; Megatron-Core's num_distributed_optimizer_instances)."""
    dp_mesh, shard = replica_mesh(mesh), spec.parallel.zero_shard_size
    if spec.layout.zero_stage == 1 and shard and shard < dp_mesh.size():
        return hsdp_mesh(dp_mesh, shard)["dp_shard"]
    return dp_mesh


def build_engine(spec: RunSpec, mesh: DeviceMesh, materialize_model: bool = True) -> Engine:
    """Compose the layout of ``spec`` on ``mesh`` (axes pp, dp, cp, tp) for this rank.

    Raises:
        RuntimeError: from torch if the plan is impossible (validation should prevent it).
    """
    device = spec.device if materialize_model else "meta"
    stage_ids = None
    if spec.pp > 1:
        stage_ids = spec.layout.stages_of(mesh["pp"].get_local_rank())
    chunks = build_model(spec, stage_ids)                                          # 1
    experts = None
    if spec.layout.ep > 1:                                                         # 1b: this rank's experts
        experts = build_expert_groups(spec.layout)
        chunks = [apply_ep(c, experts) for c in chunks]
    if materialize_model:
        chunks = [materialize(c, device, spec.train.seed) for c in chunks]         # 2
    chunks = [wrap_chunk(c, spec, mesh, device, experts) for c in chunks]          # 3, 4
    params = [p for c in chunks for p in c.parameters()]
    engine = Engine(spec=spec, mesh=mesh, chunks=chunks, optimizer=None, step_fn=accumulate_step,
                    expert_groups=experts)
    if materialize_model:                                                          # 6
        engine.optimizer = build_optimizer(params, spec.layout.zero_stage, optimizer_mesh(spec, mesh), spec.train.lr,
                                           spec.train.weight_decay, chunks, experts)
        engine.scheduler = build_lr_scheduler(engine.optimizer, spec.train)
    if spec.pp > 1:
        attach_schedule(engine, stage_ids)                                           # 5
    return engine


def accumulate_step(engine: Engine, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    """Gradient accumulation over m micro-batches, one optimizer step. Returns the mean loss
    over this rank's micro-batches.

    When gradients are synchronised over dp:

    - ZeRO-0/1 (DDP, or composable ``replicate`` under tp): only on the last micro-batch
      (``no_sync`` / ``set_requires_gradient_sync(False)`` before it), saving m - 1
      all-reduces. The gradients are whole on every rank anyway (under tp the token
      embedding's is then held at the whole vocabulary until the sync:
      xpar.estimate.memory.per_device.replicated_embedding_grad_numel).
    - ZeRO-2/3 (FSDP2): on every micro-batch, as DeepSpeed ZeRO-2/3 and torchtitan do. Each
      backward reduce-scatters and accumulates into the sharded ``p.grad``, so a rank never
      holds more than one FSDP unit's unsharded gradients. Deferring the sync would save
      m - 1 reduce-scatters but make FSDP2 accumulate the *whole unsharded* gradients across
      micro-batches: ZeRO-2/3's gradient saving gone whenever m > 1.

    ``engine.probe_grads()`` after each backward records the gradient bytes held (the
    measured ``grads`` term, xpar.parallel.memory_accounting.model_state_bytes).
    """
    model, m = engine.chunks[0], len(inputs)
    loss_fn = engine.loss_fn
    sync_every = engine.spec.layout.zero_stage >= 2
    total = 0.0
    for i, (x, y) in enumerate(zip(inputs, targets)):
        sync = sync_every or i == m - 1
        _set_grad_sync(model, sync)
        ctx = model.no_sync() if (hasattr(model, "no_sync") and not sync) else nullcontext()
        with ctx, engine.loss_context():
            loss = loss_fn(model(x), y) / m
            loss.backward()
        engine.probe_grads()  # held gradients peak at a micro-batch boundary
        total += float(loss.detach())
    engine.finish_step(total)  # gradients are zeroed by the loop at the start of the next step
    return total


def _set_grad_sync(model: nn.Module, sync: bool) -> None:
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 (fully_shard, replicate)
        model.set_requires_gradient_sync(sync)
