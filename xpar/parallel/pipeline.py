"""The pp axis: pipeline stages and their schedule (torch.distributed.pipelining).

Each pipeline rank holds one stage, or v stages for the multi-stage schedules, placed as
:class:`xpar.config.layout.Layout` says (loop or V placement).

:func:`attach_schedule` wraps each already TP/DP-wrapped chunk in a ``PipelineStage`` on the
pp process group, builds the schedule by name and installs :func:`pipeline_step` as the
engine's step. Every compute action of every stage (F: forward, B: full backward, I:
backward for inputs, W: backward for weights) is timed with ``time.perf_counter``; the loss
of the last stage is counted in its F. ``engine.pipeline_stats()`` returns the per-step
action records that :mod:`xpar.track.bubble` turns into bubble ratios and a timeline.

Design notes (what each step does and why, with sources): docs/concepts/design-notes.md.
"""
from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules

from xpar.config.layout import SCHEDULES
from xpar.config.spec import RunSpec
from xpar.parallel.mesh import replica_mesh
from xpar.parallel.precision import activation_dtype, logits_dtype
from xpar.parallel.torch_internals import wrap_schedule_loss


def schedule_class(name: str) -> type:
    """The torch schedule class of an xpar schedule name (:data:`xpar.config.layout.SCHEDULES`)."""
    return schedules.get_schedule_class(SCHEDULES[name].torch_name)


class ActionRecorder:
    """Per-rank wall-clock record of the compute actions of one schedule step.

    ``actions`` holds ``[kind, stage, micro_batch, t0, t1]`` with times in seconds from the
    start of the step (after the pp barrier); kinds F, B, I, W as in torch's schedule IR.
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.actions: list[list] = []
        self.t_start = 0.0

    def begin(self) -> None:
        self.actions = []
        self.t_start = time.perf_counter()

    def end(self) -> None:
        span = time.perf_counter() - self.t_start
        self.steps.append({"span": span, "actions": self.actions})

    def _wrap(self, fn, kind_of, stage_index: int):
        def timed(chunk_id, *args, **kwargs):
            t0 = time.perf_counter()
            out = fn(chunk_id, *args, **kwargs)
            t1 = time.perf_counter()
            self.actions.append([kind_of(kwargs), stage_index, int(chunk_id),
                                 t0 - self.t_start, t1 - self.t_start])
            return out
        return timed

    def instrument(self, stage: PipelineStage) -> None:
        """Time this stage's forward_one_chunk, backward_one_chunk, backward_weight_one_chunk."""
        i = stage.stage_index
        stage.forward_one_chunk = self._wrap(stage.forward_one_chunk, lambda kw: "F", i)
        stage.backward_one_chunk = self._wrap(
            stage.backward_one_chunk, lambda kw: "B" if kw.get("full_backward", True) else "I", i)
        stage.backward_weight_one_chunk = self._wrap(stage.backward_weight_one_chunk, lambda kw: "W", i)

    def instrument_loss(self, schedule: Any) -> None:
        """Count the loss computation in the forward of the last stage (it follows directly)."""
        def wrap(fn):
            def timed(*args, **kwargs):
                out = fn(*args, **kwargs)
                if self.actions and self.actions[-1][0] == "F":
                    self.actions[-1][4] = time.perf_counter() - self.t_start
                return out
            return timed
        wrap_schedule_loss(schedule, wrap)


def stage_io(spec: RunSpec, stage: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta tensors of one micro-batch's input and output of ``stage``: tokens ``[b, S]``
    into the first stage, hidden states ``[b, S, H]`` between stages, logits ``[b, S, V]``
    out of the last, with S the tokens a rank holds of each sequence: seq_len / cp under
    context parallelism (xpar.parallel.context).

    Given to PipelineStage, they spare torch's runtime shape inference, which runs an extra
    forward and backward through the wrapped chunk on the first step; through DDP that extra
    pass breaks the reducer's bucket rebuild under ScheduleGPipe (torch 2.13: "rebuilt
    parameter indices size is not same as original model parameters size" on step 2).
    """
    b, S, H, V = spec.train.micro_batch_size, spec.seq_len // spec.cp, spec.model.hidden, spec.model.vocab_size
    # Between tensor-parallel stages the activation is a plain tensor: the whole sequence,
    # or this tp rank's sequence shard under sequence parallelism (xpar.parallel.tensor).
    # The last stage's logits (a vocabulary-sharded DTensor under tp) go only to the loss,
    # and torch does not check them against this shape.
    S_between = S // spec.tp if spec.layout.sequence_parallel else S
    # bf16: hidden states are bf16 under FSDP2's policy, fp32 under autocast; logits bf16.
    dtype = activation_dtype(spec.train.dtype, spec.layout.zero_stage)
    last = spec.layout.n_stages - 1
    act = dict(device="meta", dtype=dtype, requires_grad=True)  # gradients flow back through these
    x = torch.empty(b, S, dtype=torch.int64, device="meta") if stage == 0 else torch.empty(b, S_between, H, **act)
    y = (torch.empty(b, S, V, device="meta", dtype=logits_dtype(spec.train.dtype), requires_grad=True)
         if stage == last else torch.empty(b, S_between, H, **act))
    return x, y


def attach_schedule(engine, stage_ids: list[int]) -> None:
    """Build this rank's PipelineStages and the schedule; install the pipelined step.

    ``engine.chunks`` are this rank's stages (already wrapped for tp and dp), in the order
    of ``stage_ids``. Sets ``engine.stages``, ``engine.schedule``, ``engine.step_fn`` and
    ``engine.pipeline_stats`` (a callable returning this rank's timing record).
    """
    spec = engine.spec
    pp_mesh = engine.mesh["pp"]
    group = pp_mesh.get_group()
    n_stages = spec.layout.n_stages
    device = torch.device(spec.device, torch.cuda.current_device()) if spec.device == "cuda" \
        else torch.device(spec.device)
    recorder = ActionRecorder()
    stages = []
    for chunk, s in zip(engine.chunks, stage_ids):
        inputs, outputs = stage_io(spec, s)
        stage = PipelineStage(chunk, stage_index=s, num_stages=n_stages, device=device, group=group,
                              input_args=inputs, output_args=outputs)
        recorder.instrument(stage)
        _probe_before_reduce(stage, engine)
        if split_backward_needs_reduce(spec, chunk):
            _average_grads_after_reduce(stage, replica_mesh(engine.mesh).get_group(), spec.dp * spec.cp)
        stages.append(stage)
    cls = schedule_class(spec.layout.schedule)
    target = stages[0] if issubclass(cls, schedules.PipelineScheduleSingle) else stages
    schedule = cls(target, n_microbatches=spec.micro_batches, loss_fn=engine.loss_fn)
    recorder.instrument_loss(schedule)
    engine.stages, engine.schedule = stages, schedule
    engine.step_fn = pipeline_step
    engine.recorder = recorder
    pp_rank = pp_mesh.get_local_rank()

    def pipeline_stats() -> dict:
        return {"pp_rank": pp_rank, "stages": list(stage_ids), "schedule": spec.layout.schedule,
                "steps": recorder.steps}
    engine.pipeline_stats = pipeline_stats


def _probe_before_reduce(stage: PipelineStage, engine) -> None:
    """Probe the rank's held gradients (``engine.probe_grads``) just before ``stage`` reduces
    its gradients over dp, where FSDP2's deferred unsharded gradients peak (see the module
    docstring)."""
    reduce = stage.perform_reduce_grad

    def probed(*args, **kwargs):
        engine.probe_grads()
        return reduce(*args, **kwargs)
    stage.perform_reduce_grad = probed


def split_backward_needs_reduce(spec: RunSpec, chunk: torch.nn.Module) -> bool:
    """Whether xpar must average ``chunk``'s gradients over dp (x cp) itself: a zero-bubble schedule
    (zero_bubble, zbv, dualpipev) with a DDP-wrapped stage. Their split backward
    (``stage_backward_input`` / ``stage_backward_weight``) calls ``torch.autograd.grad``, so
    DDP's reducer hooks never fire and each dp replica steps on its own gradients
    (pytorch/pytorch#144530, open in torch 2.13: the two replicas' gradient norms differ from
    step 0 on, benchmarks/README.md). FSDP2 and composable ``replicate`` are reduced by torch's
    REDUCE_GRAD action and need nothing."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    return spec.dp * spec.cp > 1 and SCHEDULES[spec.layout.schedule].zero_bubble and isinstance(chunk, DDP)


def _average_grads_after_reduce(stage: PipelineStage, dp_group, dp: int) -> None:
    """After ``stage``'s REDUCE_GRAD action (its last backward of the step, gradients already
    scaled by 1/m), all-reduce its gradients over the replica group (dp, or dp x cp) in one flat
    fp32 buffer and divide by its size ``dp``.
    Averaging is idempotent, so a gradient DDP did reduce is left as it was. Parameters DDP was told
    to ignore (ep's experts, reduced over expert-dp by xpar.parallel.expert) are left alone."""
    reduce = stage.perform_reduce_grad
    ignored = set(getattr(stage.submod, "parameters_to_ignore", ()))
    params = [p for n, p in stage.submod.module.named_parameters() if n not in ignored]

    def averaged(*args, **kwargs):
        out = reduce(*args, **kwargs)
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=dp_group)
            flat /= dp
            for g, avg in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(avg.view_as(g))
        return out
    stage.perform_reduce_grad = averaged


def pipeline_step(engine, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> Optional[float]:
    """One optimizer step through the pipeline.

    The rank's m micro-batches of b rows are concatenated into the ``[m*b, S]`` batch that
    ``schedule.step`` splits back into m. The first stage gets the inputs and the last
    stage the targets; gradients are scaled by 1/m by the schedule (mean loss). Returns the
    mean loss over the micro-batches on the rank holding the last stage, else None.
    """
    first = any(st.is_first for st in engine.stages)
    last = any(st.is_last for st in engine.stages)
    args = (torch.cat(inputs),) if first else ()
    target = torch.cat(targets) if last else None
    losses: list[torch.Tensor] = []
    dist.barrier(group=engine.mesh["pp"].get_group())  # a common start: timestamps comparable
    engine.recorder.begin()
    with engine.loss_context():  # loss_parallel around the loss and its backward when tp > 1
        engine.schedule.step(*args, target=target, losses=losses, return_outputs=False)
    engine.recorder.end()
    loss = sum(float(l.detach()) for l in losses) / len(losses) if last else None
    engine.finish_step(loss)  # clip the global norm (all-reduced over pp), check it, optimizer and lr steps
    return loss
