"""The single-process reference a layout is checked against: the whole model, the whole
global batch per step, one process, the same precision recipe, clipping and lr schedule.

Precision (``xpar.parallel.precision``): ``fp32``; ``autocast`` (fp32 parameters, forward
under ``torch.autocast(cpu, bf16)``, as DDP / ZeRO-1 / tp / pp without FSDP run it); ``fsdp``
(fp32 master weights; each step's forward and backward run on a bf16 copy of the model and
the bf16 gradients are cast to fp32 before the update, as FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` does on every shard).
"""
from __future__ import annotations

import copy
from typing import Optional

import torch

from xpar.config.spec import RunSpec
from xpar.models.transformer import Transformer
from xpar.parallel.factory import cross_entropy
from xpar.parallel.optim import build_lr_scheduler, clip_grads_
from xpar.parallel.precision import mixed_precision_kind
from xpar.run.data import TokenSource


def _bf16_step(model, rows) -> torch.Tensor:
    """FSDP2-style: forward/backward on a bf16 copy, fp32 gradients into ``model``."""
    work = copy.deepcopy(model).to(torch.bfloat16)
    loss = cross_entropy(work(rows[:, :-1]), rows[:, 1:])
    loss.backward()
    for p, w in zip(model.parameters(), work.parameters()):
        p.grad = w.grad.float()
    return loss


def reference_run(spec: RunSpec, steps: Optional[int] = None, precision: Optional[str] = None) -> dict:
    """Train the single-process model; return ``losses`` and ``grad_norms`` (pre-clip) per
    step, the last step's pre-clip gradients by parameter name (``last_grads``) and the
    trained ``model``. ``precision`` defaults to the recipe ``spec`` runs."""
    precision = precision or mixed_precision_kind(spec.train.dtype, spec.layout.zero_stage)
    model = Transformer(spec.model)
    model.init_weights(spec.train.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, weight_decay=spec.train.weight_decay,
                            foreach=False)
    sched = build_lr_scheduler(opt, spec.train)
    data = TokenSource(spec)
    out: dict = {"losses": [], "grad_norms": [], "model": model}
    for step in range(steps or spec.train.steps):
        rows = data.global_batch(step)
        opt.zero_grad(set_to_none=True)
        if precision == "fsdp":
            loss = _bf16_step(model, rows)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
                logits = model(rows[:, :-1])
            loss = cross_entropy(logits, rows[:, 1:])
            loss.backward()
        out["last_grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["grad_norms"].append(clip_grads_(list(model.parameters()), spec.train.max_grad_norm))
        opt.step()
        sched.step()
        out["losses"].append(float(loss.detach()))
    return out
