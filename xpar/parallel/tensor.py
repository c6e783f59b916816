"""The tp axis: Megatron-style tensor parallelism with DTensor, and its communication count.

Plan (Shoeybi et al. 2019, "Megatron-LM"; sequence parallelism after Korthikanti et al.
2022), applied with ``torch.distributed.tensor.parallel.parallelize_module``:

Design notes (what each step does and why, with sources): docs/concepts/design-notes.md.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from xpar.parallel.ring import ring_factor
from xpar.parallel.torch_internals import (
    dispatch_mode_base,
    functional_collectives,
    in_backward,
    is_higher_order_op,
)


def block_plan(block: nn.Module, sequence_parallel: bool) -> dict:
    """The Megatron plan of one transformer block (keys are submodule names).

    A mixture of experts (``feed_forward`` without ``w1``) is left out of the plan: without
    sequence parallelism its input is the replicated residual stream, so every tp rank runs the
    router and its experts whole on the same tokens (identical gradients, like the norms'); the
    experts are not split over tp (Megatron-Core's expert tensor parallelism is estimated only)."""
    act = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    plan = {
        "attention": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),),
                                        use_local_output=False),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=act),
    }
    if getattr(block.feed_forward, "w1", None) is not None:
        plan.update({"feed_forward": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),),
                                                        use_local_output=False),
                     "feed_forward.w1": ColwiseParallel(),
                     "feed_forward.w2": RowwiseParallel(output_layouts=act)})
    if getattr(block.feed_forward, "w3", None) is not None:
        plan["feed_forward.w3"] = ColwiseParallel()
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool,
             keep_logits_sharded: bool = True) -> nn.Module:
    """Split ``model`` (a :class:`xpar.models.transformer.Transformer`, whole or one pipeline
    stage) over the 1-D ``tp_mesh`` in place; returns it.

    Args:
        sequence_parallel: shard norms and the residual stream along the sequence. A stage
            without the token embedding then expects its input as this rank's sequence shard
            ``[b, s/tp, h]`` and a stage without the output returns one.
        keep_logits_sharded: the output returns logits as a DTensor sharded on the vocabulary
            (for :func:`parallel_cross_entropy`); False all-gathers them into a plain
            ``[b, s, V]`` tensor (e.g. for a consumer that cannot take a DTensor).

    A tied output (``output.weight is tok_embeddings.weight``) stays tied: both splits shard
    the ``[V, h]`` matrix along the vocabulary, so the one DTensor parameter serves both.
    """
    act = Shard(1) if sequence_parallel else Replicate()
    tied = (model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(block, sequence_parallel))
    plan: dict = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
        if model.pos_embeddings is not None and sequence_parallel:
            # positions [s, h] computed in full (plain weight), each rank keeps its sequence rows
            plan["pos_embeddings"] = PrepareModuleOutput(output_layouts=Replicate(),
                                                         desired_output_layouts=Shard(0))
    if model.output is not None:
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        if keep_logits_sharded:
            plan["output"] = ColwiseParallel(input_layouts=act, output_layouts=Shard(-1),
                                             use_local_output=False)
        else:
            plan["output"] = ColwiseParallel(input_layouts=act, output_layouts=Replicate())
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if tied:
        model.output.weight = model.tok_embeddings.weight
    return model


def parallel_cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over all B*S positions, on vocabulary-sharded logits.

    ``logits_BSV`` is the DTensor from the output of :func:`apply_tp` (sharded on V on the
    1-D tp mesh); the softmax is computed without gathering the logits (``loss_parallel``:
    all-reduces of ``[B, S]`` max, sum-exp and target logit). Returns a replicated scalar
    DTensor (``float(loss)`` works). Call it AND its ``backward()`` inside
    :func:`loss_context` (torch's rule for ``loss_parallel``: the backward fails outside it).
    Plain-tensor logits fall back to the ordinary cross entropy.
    """
    if not isinstance(logits_BSV, DTensor):
        return F.cross_entropy(logits_BSV.flatten(0, 1).float(), targets_BS.flatten())
    with loss_context(2):
        return F.cross_entropy(logits_BSV.flatten(0, 1).float(), targets_BS.flatten())


_loss_depth = 0


@contextmanager
def loss_context(tp: int) -> Iterator[None]:
    """Context for the loss *and* its backward: ``loss_parallel()`` when tp > 1, else a no-op.

    Re-entrant, unlike ``loss_parallel()`` itself (whose exit switches the parallel loss off
    even inside an outer ``loss_parallel()``), and switched off again on an exception.
    """
    global _loss_depth
    if tp <= 1 or _loss_depth:
        yield
        return
    _loss_depth += 1
    try:
        with loss_parallel():
            yield
    finally:
        _loss_depth -= 1


# --- communication count ---------------------------------------------------------------

_FUNCOL = functional_collectives()
_KINDS = {
    _FUNCOL.all_reduce: "allreduce",
    _FUNCOL.all_reduce_coalesced: "allreduce",
    _FUNCOL.all_gather_into_tensor: "allgather",
    _FUNCOL.all_gather_into_tensor_coalesced: "allgather",
    _FUNCOL.reduce_scatter_tensor: "reduce_scatter",
    _FUNCOL.reduce_scatter_tensor_coalesced: "reduce_scatter",
    _FUNCOL.all_to_all_single: "all_to_all",
    _FUNCOL.broadcast: "broadcast",
}
COMM_KINDS = ("allreduce", "allgather", "reduce_scatter")


def _group_name(g) -> str:
    return g if isinstance(g, str) else getattr(g, "group_name", str(g))


def _tensors(x) -> list[torch.Tensor]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


class TPCommCounter(dispatch_mode_base()):
    """Counts the collectives that DTensor issues on the tp group, with their sizes.

    A ``TorchDispatchMode`` that lets DTensor desugar each op first (returning
    ``NotImplemented`` for DTensor arguments, as ``CommDebugMode`` does) and then sees the
    functional collectives (``torch.ops._c10d_functional.*``) on local tensors. Only
    collectives whose group is the tp group are counted (FSDP/DDP traffic on the dp axis
    is not). Forward and backward are told apart by whether autograd is running a node.

    Bytes are PAYLOAD bytes: the size of the whole tensor the collective is about -- the
    all-reduced tensor, the gathered (output) tensor of an all-gather, the input tensor of
    a reduce-scatter. The bytes a ring algorithm sends per device are payload x
    :func:`xpar.parallel.ring.ring_factor` (:meth:`ring_bytes`).
    """

    def __init__(self, tp_mesh: DeviceMesh):
        super().__init__()
        self.group = tp_mesh.get_group().group_name
        self.n = tp_mesh.size()
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_higher_order_op(func):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        kind = _KINDS.get(func._overloadpacket)
        if kind is not None:
            group = kwargs.get("group_name", args[-1])
            if _group_name(group) == self.group:
                src = out if kind == "allgather" else args[0]
                phase = "backward" if in_backward() else "forward"
                self.bytes[(kind, phase)] += sum(t.numel() * t.element_size() for t in _tensors(src))
                self.calls[(kind, phase)] += 1
        return out

    def payload_bytes(self, phase: Optional[str] = None) -> dict[str, int]:
        """Payload bytes per collective kind (all kinds in COMM_KINDS present), for one
        phase ('forward'/'backward') or both."""
        out = {k: 0 for k in COMM_KINDS}
        for (kind, ph), b in self.bytes.items():
            if phase is None or ph == phase:
                out[kind] = out.get(kind, 0) + b
        return out

    def ring_bytes(self) -> float:
        """Bytes a ring implementation sends per device for the counted collectives."""
        return sum(b * ring_factor(kind, self.n) for (kind, _), b in self.bytes.items())

    def metrics(self, steps: int = 1) -> dict[str, float]:
        """``comm/tp_{allreduce,allgather,reduce_scatter}_bytes``: payload bytes per step per
        device (counted over ``steps`` steps), and ``comm/tp_ring_bytes``: the bytes a ring
        sends per device per step for them."""
        out = {f"comm/tp_{k}_bytes": v / steps for k, v in self.payload_bytes().items()}
        out["comm/tp_ring_bytes"] = self.ring_bytes() / steps
        return out


@contextmanager
def count_tp_comm(tp_mesh: Optional[DeviceMesh]) -> Iterator[Optional[TPCommCounter]]:
    """``with count_tp_comm(mesh['tp']) as c: ...`` then ``c.metrics()``; yields None when
    there is no tp axis (size 1), so the caller can skip it."""
    if tp_mesh is None or tp_mesh.size() == 1:
        yield None
        return
    counter = TPCommCounter(tp_mesh)
    with counter:
        yield counter


def tp_layer_comm_bytes_formula(b: int, s: int, h: int, element_size: int, sequence_parallel: bool = False
                                ) -> dict[str, int]:
    """Payload bytes of ONE transformer block per micro-batch (forward + backward).

    Without sequence parallelism: 2 all-reduces of b*s*h elements in forward (after ``wo``
    and ``w2``) and 2 in backward (the inputs of attention and MLP). With it, each of those
    becomes an all-gather plus a reduce-scatter of the same payload: 2 + 2 in forward and
    2 + 2 in backward (Korthikanti et al. 2022, Sec. 4.2.2) -- the same ring traffic. Not
    included: embedding, output and loss collectives and, with sequence parallelism, the
    all-reduce of the norm parameters' gradients (h elements per norm parameter; they are
    left Partial by backward and reduced once by the dp wrapper -- FSDP2 / replicate)."""
    x = b * s * h * element_size
    if sequence_parallel:
        return {"allreduce": 0, "allgather": 4 * x, "reduce_scatter": 4 * x}
    return {"allreduce": 4 * x, "allgather": 0, "reduce_scatter": 0}
