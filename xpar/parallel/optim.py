"""Optimizer-side pieces of a step: global gradient-norm clipping and the learning-rate
schedule. Both are layout-independent: a run gets the single-process model's numbers.

Clipping (``train.max_grad_norm``; null disables) follows ``torch.nn.utils.clip_grad_norm_``
(Pascanu et al. 2013): the L2 norm of the whole model's gradient, ``coef = max_norm /
(norm + 1e-6)`` clamped to 1, every gradient multiplied by ``coef``. With the model split
over a layout, :func:`global_grad_norm` assembles the norm from this rank's local parts:

Design notes (what each step does and why, with sources): docs/concepts/design-notes.md.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist

EPS = 1e-6
"""torch.nn.utils.clip_grad_norm_'s epsilon in the clip coefficient."""


def _local_part(g: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """(this rank's part of ``g``, the process groups its square sum is summed over)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(g, DTensor):
        return g, ()
    if any(pl.is_partial() for pl in g.placements):
        g = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
    # Shard or _StridedShard (FSDP2 over tp-sharded dim 0; its is_shard() is False in torch 2.13)
    groups = tuple(g.device_mesh.get_group(i) for i, pl in enumerate(g.placements) if not pl.is_replicate())
    return g.to_local(), groups


def _square_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Square sum of ``parts`` as a float64 scalar: each part's L2 norm reduced in its own
    kernel (fp32 accumulation, as torch's clip_grad_norm_), the norms squared and summed once in
    float64 -- no float64 copy of any gradient (that copy cost 3-8 % of a step in
    benchmarks/overhead.py), and no per-gradient float64 ops (2-6 % of a tp step there)."""
    norms = torch.stack([torch.linalg.vector_norm(t.detach()) for t in parts])
    return (norms.double() ** 2).sum()


def global_grad_norm(params: Iterable[torch.Tensor], pp_group=None) -> float:
    """L2 norm of the whole model's gradient (all ranks' parts, see module docstring);
    every rank returns the same value. Collective: all ranks of the groups involved call it."""
    parts: dict[tuple, list] = {}  # group names -> [groups, local parts]
    for p in params:
        if p.grad is None:
            continue
        local, groups = _local_part(p.grad)
        groups += getattr(p, "_xpar_norm_groups", ())  # expert parallelism: xpar.parallel.expert
        parts.setdefault(tuple(g.group_name for g in groups), [groups, []])[1].append(local)
    total = torch.zeros((), dtype=torch.float64)
    for groups, locals_ in parts.values():
        sq = _square_sum(locals_)
        for g in groups:
            dist.all_reduce(sq, group=g)
        total += sq
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    return math.sqrt(float(total))


@torch.no_grad()
def clip_grads_(params: list[torch.Tensor], max_norm: Optional[float], pp_group=None) -> float:
    """Scale the gradients so that their global norm is at most ``max_norm`` (no-op when
    None or when the norm is below it); return the pre-clip global norm."""
    norm = global_grad_norm(params, pp_group)
    if max_norm is None:
        return norm
    coef = max_norm / (norm + EPS)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def lr_factor(step: int, schedule: str, steps: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the base lr at optimizer step ``step`` (0-based): linear warm-up over
    ``warmup`` steps (both schedules), then 1 ('constant') or cosine decay to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, steps - warmup - 1)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, train) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` over :func:`lr_factor` for a :class:`xpar.config.schema.TrainConfig`; call
    ``.step()`` after each optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: lr_factor(
        k, train.lr_schedule, train.steps, train.lr_warmup_steps, train.min_lr_ratio))


def restore_lr_scheduler(scheduler: torch.optim.lr_scheduler.LambdaLR, optimizer: torch.optim.Optimizer,
                         train, step: int) -> float:
    """Put ``scheduler`` (:func:`build_lr_scheduler`) and the optimizer's lr where they are after
    ``step`` optimizer steps of ``train``'s schedule (a resumed run: the checkpoint's step, this
    run's lr and schedule, so a changed ``train.lr`` or ``train.steps`` takes effect). Returns the
    lr of the next step: ``train.lr * lr_factor(step)``, LambdaLR's own expression."""
    lr = train.lr * lr_factor(step, train.lr_schedule, train.steps, train.lr_warmup_steps, train.min_lr_ratio)
    state = scheduler.state_dict()
    state.update(last_epoch=step, _step_count=step + 1, _last_lr=[lr] * len(optimizer.param_groups))
    scheduler.load_state_dict(state)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


class NonFiniteStep(RuntimeError):
    """A step's loss or global gradient norm was NaN or inf under ``train.on_nonfinite=stop``."""


def first_nonfinite_rank(loss: Optional[float], norm: float) -> Optional[int]:
    """The lowest global rank whose step was not finite (its own loss, or the global norm,
    which every rank holds), or None when every rank's step was finite. One one-element
    all-reduce (MIN) over the default group: every rank gets the same answer, so every rank
    takes the same decision (stop, skip or step)."""
    bad = not math.isfinite(norm) or (loss is not None and not math.isfinite(loss))
    if not dist.is_initialized():
        return 0 if bad else None
    world = dist.get_world_size()
    first = torch.tensor([float(dist.get_rank() if bad else world)])
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    return None if int(first.item()) == world else int(first.item())


def nonfinite_message(step: int, rank: int, loss: Optional[float], norm: float, lr: float) -> str:
    """The one line a stopped run ends with (``loss``: this rank's, None where it sees none)."""
    seen = f"loss {loss} on rank {dist.get_rank() if dist.is_initialized() else 0}, " if loss is not None else ""
    return (f"non-finite step {step}: first on rank {rank}; {seen}global gradient norm {norm} "
            f"(train.on_nonfinite=stop); lower train.lr (now {lr:g}), or train.on_nonfinite=skip to skip "
            f"such steps.")
