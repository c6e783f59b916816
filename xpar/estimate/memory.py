"""Per-device memory of a layout: model states, activations, buffers. Units: bytes.

Every term is named (:data:`MEMORY_TERMS`), each counted as the framework keeps it; what a
framework does differently is a :class:`MemoryOptions` field (the memory fields of
:class:`xpar.estimate.cost.Assumptions`, same names; framework profiles set them).

**Model states.** The ZeRO paper (Rajbhandari et al. 2020, Sec. 3.1, 5, Fig. 1) counts
mixed-precision Adam as 2 (bf16 params) + 2 (bf16 grads) + K = 12 (fp32 master, exp_avg,
exp_avg_sq) bytes per parameter (:data:`STATE_BYTES`, :func:`zero_model_state_bytes`).
Frameworks keep other splits (:func:`state_widths`):

- xpar and torchtitan (``param_storage='fp32'``): the stored parameters *are* the fp32
  master weights (4), AdamW keeps 8, gradients are fp32 (``grad_bytes`` = 4: FSDP2
  ``MixedPrecisionPolicy(reduce_dtype=fp32)`` reduces and accumulates in fp32; under
  autocast the gradients flow back into fp32 parameters). The bf16 compute copies: FSDP2
  ZeRO-2 holds the whole bf16 parameters from forward to backward (2 per element, counted
  in params); ZeRO-3 all-gathers them per unit (a buffer, :func:`comm_buffer_terms`), or
  keeps them whole under pp when ``fsdp_reshard_under_pp`` is False (torchtitan sets
  ``reshard_after_forward=False`` with pp); torch.autocast (ZeRO-0/1) caches one bf16 copy
  of each matmul weight per forward, saved for backward: per micro-batch in flight, from the
  schedule (measured here, tests/test_estimate_run.py).
- Megatron-LM and DeepSpeed (``param_storage='bf16'``): bf16 params (2), fp32 master +
  moments in the optimizer (12); Megatron's gradients live in an fp32 contiguous buffer
  (``grad_bytes`` = 4, no DDP bucket copy: ``ddp_bucket_copy`` False), so its distributed
  optimizer (ZeRO-1) keeps 6 + 12/d bytes per parameter (Megatron-Core docs, "Distributed
  Optimizer", table of bytes per parameter).
- ``cpu_offload_optimizer``: optimizer states (and, for bf16 params, the master copy inside
  them) live in host memory: 0 device bytes.

What each rank holds is exact for xpar's wrappers: DDP the whole local (tp-sharded) stage;
ZeRO-1 (torch ``ZeroRedundancyOptimizer``) the optimizer states of the whole parameters
assigned greedily, largest first, to the least-loaded rank; ZeRO-2/3 (FSDP2) dim-0 chunks
of ceil(d0/dp) rows (rank 0 holds the most). Gradients are shards under ZeRO-2/3, whole
where the reduction is deferred (:func:`grads_deferred`: torch's ``PipelineStage`` defers
it to the stage's last backward, whatever m). Tensor parallelism (Megatron, Shoeybi et al.
2019): q/k/v/w1/w3 and the vocabulary split on dim 0, wo/w2 on dim 1; shapes come from the
model's parameters (xpar.models.transformer, written out without torch: :func:`_meta_shapes`).

**Activations** (Korthikanti et al. 2022, Table 2, generalised term by term in
:func:`layer_activation_bytes`: GQA, SwiGLU, no dropout, flash attention, composite norms,
autocast's input casts). A pipeline rank's peak comes from the schedule's own action list
(torch's order, :func:`xpar.estimate.schedule.schedule_actions`): walking it, each forward
of stage s adds that stage's bytes for one micro-batch, its (weight) backward frees them, so
interleaved, zero-bubble and V-shaped schedules are right by construction, with stages of
unequal size (first: token ids; last: final norm, output input, fp32 log-probs).

**Recompute** (:func:`layer_activation_bytes`, :func:`recompute_extra_flops_per_token`):
``none``; ``full`` keeps each block's input (Chen et al. 2016); ``selective`` is, by
``selective_recompute``: 'op' (xpar, executed: keep every matmul and tp-collective output,
recompute attention core and element-wise ops), 'torchtitan_op' (torchtitan's op-level
SAC: keep SDPA outputs and every other matmul output), 'attention' (Megatron, Korthikanti
Sec. 4.2: recompute the attention core only -- worthless under flash attention, which keeps
no s x s scores; the estimate says so). ``recompute_layer_fraction`` applies the policy to
that fraction of blocks (torchtitan's selective_layer: full on every other block = 0.5).

**Besides** (``count_buffers``; xpar's CPU accounting counts none of them, so the CPU
profile turns them off): DDP gradient buckets, FSDP all-gather of the largest unit plus the
prefetched next and its reduce-scatter buffers, pipeline send/receive buffers, the
recompute workspace of one block during its backward, the fp32 logits/loss temporaries on
the last stage; and ``hardware.framework_overhead_gb`` (CUDA context, NCCL, allocator
fragmentation: a preset constant with its source).
"""
from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from typing import Optional

from xpar.config import ModelConfig
from xpar.spec import RunSpec

BYTES = {"fp32": 4, "bf16": 2}
STATE_BYTES = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}
"""Bytes per parameter (params, grads, optimizer states) in the ZeRO paper's accounting: 2 + 2
+ K, K = 12, for bf16 mixed precision; fp32 AdamW 4 + 4 + 8. Used for the paper's formula and
the dry run's element counts; what a framework keeps is :func:`state_widths`."""
STATE_TERMS = ("params", "grads", "optimizer")
MEMORY_TERMS = STATE_TERMS + ("activations", "comm_buffers", "framework_overhead")
"""The terms of a device's peak memory, named the same in estimates, reports and metrics."""
SELECTIVE_POLICIES = ("op", "torchtitan_op", "attention")


@dataclass(frozen=True)
class MemoryOptions:
    """How the framework keeps memory; :class:`xpar.estimate.cost.Assumptions` extends it
    with the time model's fields. Defaults: xpar on CUDA."""

    flash_attention: bool = True
    """SDPA/flash attention: no s x s scores in memory (xpar's model)."""
    dropout: bool = False
    """xpar's model has no dropout; Megatron's GPT has (1-byte masks)."""
    fused_rmsnorm: bool = True
    """RMSNorm keeps only its input for backward (a fused kernel). False: torch's composite
    RMSNorm, which also keeps x * rstd (one more e h per norm)."""
    sp_saves_gathered: bool = True
    """Sequence parallelism keeps the all-gathered (full-sequence) inputs of the column-parallel
    projections for backward (torch DTensor); False: the shard, gathered again (Megatron)."""
    count_buffers: bool = True
    """Count what the framework allocates besides model states and saved activations (DDP
    buckets, FSDP all-gather/reduce buffers, p2p buffers, recompute workspace, fp32 loss
    temporaries). xpar's CPU accounting counts none of them: False for hardware=local."""
    selective_recompute: str = "op"
    """What parallel.recompute=selective keeps: 'op' (xpar: every matmul and tp-collective
    output), 'torchtitan_op' (SDPA outputs + every other matmul output), 'attention'
    (Megatron: recompute only the attention core; worthless under flash attention)."""
    recompute_layer_fraction: float = 1.0
    """Fraction of blocks the recompute policy applies to (torchtitan selective_layer: full
    recompute on every other block = 0.5)."""
    param_storage: str = "fp32"
    """Mixed precision: 'fp32' (xpar, torchtitan: fp32 parameters are the master weights, bf16
    compute copies) or 'bf16' (Megatron, DeepSpeed: bf16 parameters, fp32 master in the optimizer)."""
    grad_bytes: int = 4
    """Bytes per held gradient element under mixed precision (4: fp32 reduce/accumulate, FSDP2
    reduce_dtype=fp32, Megatron main_grad; 2: bf16 gradients as in the ZeRO paper)."""
    fsdp_reshard_under_pp: bool = True
    """ZeRO-3 under pp reshards parameters after each forward (xpar); False keeps them unsharded
    between micro-batches (torchtitan: reshard_after_forward=False with pp)."""
    ddp_bucket_copy: bool = True
    """DDP copies gradients into communication buckets (torch default); False: gradients live in
    the buffer (Megatron's contiguous grad buffer, gradient_as_bucket_view=True)."""
    cpu_offload_optimizer: bool = False
    """Optimizer states (and a bf16-storage master copy) in host memory: 0 device bytes."""
    zero1: str = "zero_redundancy"
    """ZeRO-1: 'zero_redundancy' (torch ZeroRedundancyOptimizer: whole tensors, greedy; gradients
    all-reduced) or 'distributed_optimizer' (Megatron: even ranges of one flat buffer, ceil(n / dp);
    gradients reduce-scattered)."""
    loss_kernel: str = "fp32"
    """The cross entropy: 'fp32' (xpar, torchtitan: ``cross_entropy(logits.float())`` keeps fp32
    log-probs, 4 V/t bytes per token, and its backward holds two more dense fp32 gradients) or
    'fused' (an in-place fused kernel: flash-attn's CrossEntropyLoss, llm-foundry's default
    ``loss_fn='fused_crossentropy'``: keeps only the logits, the gradient written over them)."""
    replicated_embedding_grad: bool = True
    """A deferred gradient of the vocabulary-parallel token embedding is held whole (V x h) on
    every tp rank (:func:`replicated_embedding_grad_numel`): torch DTensor's behaviour (xpar,
    torchtitan). False: the gradient stays vocabulary-sharded as its parameter (Megatron's
    VocabParallelEmbedding, DeepSpeed with Megatron's tp)."""

    @classmethod
    def of(cls, assume=None, **overrides) -> "MemoryOptions":
        """Options from an object with these attribute names (an Assumptions), then
        ``overrides`` (also the legacy names flash, dropout, fused_rmsnorm, sp_saves_gathered)."""
        if "flash" in overrides:
            overrides["flash_attention"] = overrides.pop("flash")
        vals = {f.name: getattr(assume, f.name) for f in fields(cls) if hasattr(assume, f.name)}
        vals.update(overrides)
        if vals.get("selective_recompute", "op") not in SELECTIVE_POLICIES:
            raise ValueError(f"selective_recompute={vals['selective_recompute']!r}; expected one of {SELECTIVE_POLICIES}")
        return cls(**vals)


MEMORY_PROFILES = {
    "xpar": {},
    "torchtitan": dict(selective_recompute="torchtitan_op", fsdp_reshard_under_pp=False),
    "megatron": dict(selective_recompute="attention", param_storage="bf16", grad_bytes=4, ddp_bucket_copy=False,
                     zero1="distributed_optimizer", replicated_embedding_grad=False),
    "deepspeed": dict(param_storage="bf16", grad_bytes=2, zero1="distributed_optimizer",
                      replicated_embedding_grad=False),
}
MEMORY_PROFILES["megatron_core"] = MEMORY_PROFILES["megatron"]  # the same memory rules (conf/framework/megatron_core.yaml)
"""Memory fields of :class:`xpar.estimate.cost.Assumptions` per framework (the rest as xpar):
torchtitan -- op-level SAC (torchtitan/models/llama3/infra/parallelize.py: _save_list, every
other mm), FSDP2 reshard_after_forward=False under pp; Megatron-LM -- selective = attention
core (Korthikanti et al. 2022), bf16 params + fp32 main grads in a contiguous buffer,
distributed optimizer (Megatron-Core docs: 6 + 12/d bytes per parameter), vocabulary-sharded
embedding gradients (megatron/core/tensor_parallel/layers.py VocabParallelEmbedding); DeepSpeed --
bf16/fp16 params and gradients, fp32 master + moments in the (flat, evenly partitioned) optimizer,
Megatron's tp layers (sharded embedding gradients)."""


def zero_model_state_bytes(psi: float, stage: int, n_d: int, p: int = 2, g: int = 2, k: int = 12) -> float:
    """Model-state bytes per device, ZeRO paper Sec. 5 / Fig. 1 / Table 1 (Psi parameters,
    P bytes per param, G per gradient, K of optimizer states; mixed-precision Adam
    2 + 2 + 12; dp degree n_d): stage 0 (P + G + K) Psi; 1: (P + G) Psi + K Psi / n_d;
    2: P Psi + (G + K) Psi / n_d; 3: (P + G + K) Psi / n_d."""
    return {0: (p + g + k) * psi, 1: (p + g) * psi + k * psi / n_d, 2: p * psi + (g + k) * psi / n_d,
            3: (p + g + k) * psi / n_d}[stage]


def precision(spec: RunSpec, o: MemoryOptions) -> dict:
    """The precision recipe as memory sees it: ``e`` compute bytes, ``er`` residual-stream
    bytes, ``autocast`` (xpar's torch.autocast path: fp32 parameters without FSDP, so the
    residual stream stays fp32 and each matmul casts its input and weight to bf16;
    xpar.parallel.precision.mixed_precision_kind)."""
    if spec.train.dtype == "fp32":
        return {"e": 4, "er": 4, "autocast": False}
    autocast = o.param_storage == "fp32" and spec.parallel.zero_stage <= 1
    return {"e": 2, "er": 4 if autocast else 2, "autocast": autocast}


def state_widths(spec: RunSpec, o: MemoryOptions) -> tuple[int, int, int]:
    """Bytes per element of (stored params, grads, optimizer states) as the framework keeps
    them (module docstring): fp32 4/4/8; bf16 with fp32 storage 4/grad_bytes/8; bf16
    with bf16 storage 2/grad_bytes/12."""
    if spec.train.dtype == "fp32":
        return 4, 4, 8
    return (4, o.grad_bytes, 8) if o.param_storage == "fp32" else (2, o.grad_bytes, 12)


# --- parameters per pipeline rank -------------------------------------------------------

def _tp_local(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """Shape of one tp rank's piece (ceil for uneven splits: the largest piece)."""
    leaf = name.split(".")[-2] if "." in name else name
    split = None
    if leaf in ("wq", "wk", "wv", "w1", "w3", "tok_embeddings", "output"):
        split = 0
    elif leaf in ("wo", "w2") and name.endswith("weight"):
        split = 1
    if tp == 1 or split is None:
        return shape
    s = list(shape)
    s[split] = math.ceil(s[split] / tp)
    return tuple(s)


@lru_cache(maxsize=64)
def _meta_shapes(cfg_key: tuple, n_blocks: int, first: bool, last: bool) -> tuple:
    """``named_parameters()`` (name, shape) of ``Transformer(cfg, range(n_blocks), first, last)``
    (xpar.models.transformer) written out without torch, in registration order: embeddings,
    blocks (norm, wq, wk, wv, wo, norm, w1, w2[, w3]; Linear weight then bias), final norm,
    output (omitted when tied to the embedding on one stage: named_parameters yields a shared
    tensor once). Equal to the model built on the meta device for every preset
    (tests/test_plan_memory.py); the dry run checks the counts against torch's."""
    cfg = ModelConfig(*cfg_key)
    h, kv, f, vocab = cfg.hidden, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden, cfg.vocab_size

    def norm(name: str) -> list:
        return [(f"{name}.weight", (h,))] + ([(f"{name}.bias", (h,))] if cfg.norm != "rmsnorm" and cfg.bias else [])

    def linear(name: str, n_out: int, n_in: int) -> list:
        return [(f"{name}.weight", (n_out, n_in))] + ([(f"{name}.bias", (n_out,))] if cfg.bias else [])

    out = [("tok_embeddings.weight", (vocab, h))] if first else []
    out += [("pos_embeddings.weight", (cfg.seq_len, h))] if first and cfg.position == "learned" else []
    for i in range(n_blocks):
        a, mlp = f"layers.{i}.attention", f"layers.{i}.feed_forward"
        out += norm(f"layers.{i}.attention_norm") + linear(f"{a}.wq", h, h) + linear(f"{a}.wk", kv, h)
        out += linear(f"{a}.wv", kv, h) + linear(f"{a}.wo", h, h) + norm(f"layers.{i}.ffn_norm")
        out += linear(f"{mlp}.w1", f, h) + linear(f"{mlp}.w2", h, f)
        out += linear(f"{mlp}.w3", f, h) if cfg.activation == "swiglu" else []
    if last:
        out += norm("norm") + ([] if first and cfg.tied_embeddings else [("output.weight", (vocab, h))])
    return tuple(out)


def _stage_shapes(cfg_key: tuple, layers: tuple[int, ...], first: bool, last: bool) -> list:
    """named_parameters() shapes of ``Transformer(cfg, layers, first, last)``. Blocks are
    identical: one block's shapes are repeated under each block's name."""
    head, block, tail = _stage_parts(cfg_key, first, last)
    return head + [(f"layers.{i}.{n}", sh) for i in layers for n, sh in block] + tail


@lru_cache(maxsize=256)
def _stage_parts(cfg_key: tuple, first: bool, last: bool, tp: int = 1) -> tuple[list, list, list]:
    """A stage's parameters in three parts: before the blocks (embeddings), one block (names
    after ``layers.<i>.``), after them (final norm, output); shapes tp-local (:func:`_tp_local`)."""
    outer = _meta_shapes(cfg_key, 0, first, last)
    block = [(n.split(".", 2)[2], sh) for n, sh in _meta_shapes(cfg_key, 1, False, False)]
    head = [x for x in outer if x[0].split(".")[0] in ("tok_embeddings", "pos_embeddings")]
    tail = [x for x in outer if x not in head]
    return tuple([(n, _tp_local(n, sh, tp)) for n, sh in part] for part in (head, block, tail))


def param_shapes(spec: RunSpec, pp_rank: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, tp-local shape) of every parameter held by pipeline rank ``pp_rank``, in the
    order ``model.parameters()`` yields them (tied weights once), from :func:`_meta_shapes`
    (memoised per model, layout and tp degree)."""
    return list(_param_shapes(_model_key(spec.model), _shapes_layout(spec.layout), spec.tp, pp_rank))


def tensor_counts(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(parameter tensors of one block, of the model's ends: embeddings, final norm, output)."""
    return _tensor_counts(_model_key(cfg), tp)


@lru_cache(maxsize=256)
def _tensor_counts(cfg_key: tuple, tp: int) -> tuple[int, int]:
    head, block, tail = _stage_parts(cfg_key, True, True, tp)
    return len(block), len(head) + len(tail)


def _model_key(cfg: ModelConfig) -> tuple:
    """The model's fields in order (``dataclasses.astuple`` without its deep copy: every field
    is a number, string or None): the key of the shape caches, ``ModelConfig(*key)`` rebuilds it."""
    return tuple(getattr(cfg, f.name) for f in fields(cfg))


@lru_cache(maxsize=8192)
def _shapes_layout(layout):
    """The layout as parameter shapes see it (stages and their layers only): the key of the
    shape caches, shared by every layout with the same stages whatever its dp, batch, ZeRO stage."""
    return replace(layout, dp=1, micro_batch_size=1, micro_batches=1, seq_len=1, zero_stage=0,
                   sequence_parallel=False, recompute="none")


@lru_cache(maxsize=4096)
def _param_shapes(cfg_key: tuple, layout, tp: int, pp_rank: int) -> tuple:
    out = []
    for s in layout.stages_of(pp_rank):
        head, block, tail = _stage_parts(cfg_key, s == 0, s == layout.n_stages - 1, tp)
        out += [(f"{s}:{name}", shape) for name, shape in head]
        out += [(f"{s}:layers.{i}.{name}", shape) for i in layout.stage_layers(s) for name, shape in block]
        out += [(f"{s}:{name}", shape) for name, shape in tail]
    return tuple(out)


def fsdp_shard_numel(shape: tuple[int, ...], dp: int, rank: int) -> int:
    """Elements of FSDP2's local shard on dp rank ``rank``: rows
    [rank c, min(d0, (rank+1) c)) with c = ceil(d0 / dp) (torch.chunk on dim 0)."""
    d0 = shape[0] if shape else 1
    rest = math.prod(shape[1:]) if len(shape) > 1 else 1
    c = math.ceil(d0 / dp)
    return max(0, min(d0, (rank + 1) * c) - rank * c) * rest


@lru_cache(maxsize=8192)
def _stage_numels(cfg_key: tuple, layout, tp: int, pp_rank: int) -> tuple:
    """(whole elements, shapes) of a pipeline rank; memoised so that one estimate at any world
    size touches each parameter shape once per rank it asks about."""
    shapes = tuple(sh for _, sh in _param_shapes(cfg_key, layout, tp, pp_rank))
    return sum(math.prod(sh) for sh in shapes), shapes


@lru_cache(maxsize=8192)
def _numels(shapes: tuple) -> tuple:
    """Elements of each shape (memoised: the ZeRO-1 partition asks for them per dp degree)."""
    return tuple(math.prod(sh) for sh in shapes)


@lru_cache(maxsize=16384)
def _shard_total(shapes: tuple, dp: int, rank: int) -> int:
    return sum(n * fsdp_shard_numel(sh, dp, rank) for sh, n in Counter(shapes).items())


@lru_cache(maxsize=4096)
def _zero1_sizes(numels: tuple, dp: int) -> tuple:
    """:func:`zero1_partition`, memoised; a heap of (size, rank): O(n log dp)."""
    sizes = [0] * dp
    heap = [(0, r) for r in range(dp)]
    for n in sorted(numels, reverse=True):
        size, r = heapq.heappop(heap)
        sizes[r] = size + n
        heapq.heappush(heap, (size + n, r))
    return tuple(sizes)


def zero1_partition(numels: list[int], dp: int) -> list[int]:
    """Elements per rank assigned by torch's ZeroRedundancyOptimizer: parameters sorted by
    size, largest first (stable), each to the rank with the fewest elements so far (lowest
    rank on ties)."""
    return list(_zero1_sizes(tuple(numels), dp))


def grads_deferred(spec: RunSpec) -> bool:
    """Whether the dp reduction of gradients waits for the step's last backward, the rank
    holding its whole (dp-unsharded) gradients until then: always under pp (torch's
    PipelineStage defers DDP's and FSDP2's reduction, whatever m), and without pp for ZeRO-0/1
    with m > 1 (no_sync). ZeRO-2/3 without pp reduce-scatter every micro-batch."""
    return spec.pp > 1 or (spec.parallel.zero_stage <= 1 and spec.micro_batches > 1)


def replicated_embedding_grad_numel(spec: RunSpec, pp_rank: int) -> int:
    """Gradient elements held beyond the tp-local token embedding while a reduction is
    deferred (:func:`grads_deferred`), on the rank holding stage 0 under tp.

    torch's DTensor backward of the vocabulary-parallel embedding (RowwiseParallel, weight
    Shard(0) on tp) returns a *Replicate* gradient: the whole V x h on every tp rank. FSDP2
    (and composable ``replicate``) redistribute it to the weight's Shard(0) only when they
    reduce it, so a deferred gradient is held whole: (V - ceil(V/t)) h more elements.
    Measured on the CPU build of torch 2.13 (tests/test_pipeline.py, 3D runs). ZeRO-0/1 at dp = 1
    have no wrapper: xpar places the gradient back after every backward
    (xpar.parallel.data_parallel.keep_grads_placed), nothing is held whole."""
    unwrapped = spec.parallel.zero_stage <= 1 and spec.dp == 1
    if spec.tp == 1 or unwrapped or not grads_deferred(spec) or not spec.layout.has_first_stage(pp_rank):
        return 0
    return sum(math.prod(sh) * (spec.tp - 1) for name, sh in param_shapes(spec, pp_rank)
               if name.split(":", 1)[1] == "tok_embeddings.weight")


def held_numel(spec: RunSpec, pp_rank: int, dp_rank: int, zero1: str = "zero_redundancy",
               replicated_embedding_grad: bool = True) -> dict[str, int]:
    """Elements dp rank ``dp_rank`` of pipeline rank ``pp_rank`` holds: ``storage`` (its
    parameter storage: the FSDP shard under ZeRO-2/3), ``whole`` (the dp-unsharded stage),
    ``grads`` (most held at once) and ``optimizer`` (elements with AdamW states). O(number
    of parameter tensors), memoised: no loop over the dp ranks. ``zero1``,
    ``replicated_embedding_grad``: see :class:`MemoryOptions`."""
    whole, shapes = _stage_numels(_model_key(spec.model), _shapes_layout(spec.layout), spec.tp, pp_rank)
    z, dp = spec.parallel.zero_stage, spec.dp
    shard = _shard_total(shapes, dp, dp_rank) if z >= 2 else whole
    if grads_deferred(spec):
        grads = whole + (replicated_embedding_grad_numel(spec, pp_rank) if replicated_embedding_grad else 0)
    else:
        grads = shard if z >= 2 else whole
    if z == 1 and zero1 == "distributed_optimizer":
        opt = -(-whole // dp)
    elif z == 1:
        opt = _zero1_sizes(_numels(shapes), dp)[dp_rank]
    else:
        opt = shard
    return {"storage": shard, "whole": whole, "grads": grads, "optimizer": opt}


def most_loaded_dp_rank(spec: RunSpec, pp_rank: int, zero1: str = "zero_redundancy") -> int:
    """dp rank holding the most model states: 0 under FSDP (ceil-sized chunks first) and
    DDP; ZeRO-1's rank with the largest greedy partition (lowest on ties)."""
    if spec.parallel.zero_stage != 1 or zero1 == "distributed_optimizer":
        return 0
    _, shapes = _stage_numels(_model_key(spec.model), _shapes_layout(spec.layout), spec.tp, pp_rank)
    sizes = _zero1_sizes(_numels(shapes), spec.dp)
    return sizes.index(max(sizes))


def model_state_bytes_per_rank(spec: RunSpec, stage_index: int = 0) -> list[dict[str, int]]:
    """Per dp rank of pipeline rank ``stage_index``: params (held during the step: whole
    under ZeRO-2), grads and optimizer bytes at the ZeRO paper's widths (:data:`STATE_BYTES`);
    the dry run (xpar.dryrun) checks these element counts against torch's."""
    bp, bg, bo = STATE_BYTES[spec.train.dtype]
    out = []
    for r in range(spec.dp):
        n = held_numel(spec, stage_index, r)
        params = n["whole"] if spec.parallel.zero_stage == 2 else n["storage"]
        out.append({"params": params * bp, "grads": n["grads"] * bg, "optimizer": n["optimizer"] * bo})
    return out


def peak_ranks(spec: RunSpec, pp_rank: int) -> tuple[int, list[int]]:
    """(most loaded dp rank, its global ranks -- one per tp rank) on pipeline rank ``pp_rank``."""
    dp_rank = most_loaded_dp_rank(spec, pp_rank)
    first = spec.layout.rank(pp_rank, dp_rank, 0)
    return dp_rank, list(range(first, first + spec.tp))


def state_terms(spec: RunSpec, pp_rank: int, dp_rank: int, o: MemoryOptions) -> dict[str, int]:
    """Model-state bytes by part: params_master (stored parameters), params_compute (bf16
    copies held: FSDP2 ZeRO-2's whole bf16 parameters, ZeRO-3's under pp when not
    resharded, autocast's weight copies per micro-batch in flight), grads, optimizer."""
    out = held_state_terms(spec, pp_rank, dp_rank, o)
    if precision(spec, o)["autocast"]:
        out["params_compute"] = schedule_peak(spec, pp_rank, o)["weight_copies"]
    return out


def held_state_terms(spec: RunSpec, pp_rank: int, dp_rank: int, o: MemoryOptions) -> dict[str, int]:
    """:func:`state_terms` less autocast's weight copies (``params_compute`` 0 under autocast;
    those depend on the schedule, the rest on the rank's parameters, dp and the ZeRO stage only).
    Bytes."""
    n = held_numel(spec, pp_rank, dp_rank, o.zero1, o.replicated_embedding_grad)
    wp, wg, wo = state_widths(spec, o)
    z, rec = spec.parallel.zero_stage, precision(spec, o)
    compute = 0
    if spec.train.dtype == "fp32":
        master = (n["whole"] if z == 2 else n["storage"]) * wp  # ZeRO-2 holds the whole params
    elif o.param_storage == "bf16":  # Megatron/DeepSpeed: bf16 params, fp32 master in the optimizer
        master = (n["whole"] if z <= 2 else n["storage"]) * wp
    else:
        master = n["storage"] * wp
        if not rec["autocast"] and (z == 2 or (z == 3 and spec.pp > 1 and not o.fsdp_reshard_under_pp)):
            compute = n["whole"] * rec["e"]
    optimizer = 0 if o.cpu_offload_optimizer else n["optimizer"] * wo
    return {"params_master": master, "params_compute": compute, "grads": n["grads"] * wg, "optimizer": optimizer}


def model_state_bytes(spec: RunSpec, stage_index: Optional[int] = None, dp_rank: Optional[int] = None,
                      assume=None, **options) -> dict[str, int]:
    """Bytes per device of params, grads and optimizer states (dict with those keys) as the
    framework keeps them (:func:`state_terms`; params = master + compute copies).

    ``stage_index``: the pipeline rank; None takes the rank with the most bytes.
    ``dp_rank``: None takes the most loaded dp rank (:func:`most_loaded_dp_rank`).
    ``assume``/``options``: :class:`MemoryOptions`. Equals what
    xpar.memory_accounting.model_state_bytes measures on a real run (fp32 and bf16).
    """
    o = MemoryOptions.of(assume, **options)
    best = None
    for pr in (range(spec.pp) if stage_index is None else [stage_index]):
        t = state_terms(spec, pr, most_loaded_dp_rank(spec, pr, o.zero1) if dp_rank is None else dp_rank, o)
        d = {"params": t["params_master"] + t["params_compute"], "grads": t["grads"], "optimizer": t["optimizer"]}
        if best is None or sum(d.values()) > sum(best.values()):
            best = d
    return best


# --- activations -----------------------------------------------------------------------

def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                           recompute: str = "none", *, kv: Optional[int] = None,
                           ffn: Optional[int] = None, swiglu: bool = False, dropout: bool = True,
                           flash: bool = False, elem: int = 2, norm_saves_output: bool = False,
                           sp_saves_gathered: bool = False, resid_elem: Optional[int] = None,
                           autocast_casts: bool = False, kv_matmul: Optional[int] = None,
                           selective: str = "attention") -> float:
    """Bytes one transformer layer keeps for backward, for one micro-batch (b sequences of s).

    Korthikanti et al. 2022, Sec. 4.1, term by term (e = ``elem`` compute bytes, er =
    ``resid_elem`` residual-stream bytes, default e; mask = 1 byte/element with ``dropout``),
    per token:

    - replicated across tp unless ``sp``: two norm inputs 2 er h, the q/k/v input and the
      MLP input e h each, two dropout masks h each  -> 10 h for GPT (e = er = 2);
    - split by tp: Q e h, K and V e kv each, the wo input e h, MLP inner tensors
      2 e f (GELU) or 4 e f (SwiGLU: w1 and w3 outputs, silu output, w2 input)
                                                    -> 24 h for GPT (kv = h, f = 4h);
    - attention scores, split by tp: softmax output e a s, its dropout mask a s and output
      e a s (no dropout: e a s only)                -> 5 a s for GPT; with ``flash`` only
      the fp32 log-sum-exp, 4 a bytes per token.

    Framework variants (measured on CPU with torch 2.13, tests/test_estimate_run.py):
    ``norm_saves_output``: torch's composite RMSNorm upcasts to fp32 and keeps its fp32 input
    and x * rstd (8 h per norm whatever the dtype; a fused norm keeps its input, er h);
    ``autocast_casts``: under torch.autocast each projection casts its fp32 input to bf16
    separately, so q, k, v (and w1, w3) each keep their own e h copy; ``sp_saves_gathered``
    (with ``sp``): the projections' inputs are kept all-gathered at full sequence length
    (torch DTensor; Megatron keeps the shard and gathers again in backward).

    ``recompute``: ``full`` keeps the layer input, er h (/t with sp). ``selective`` by
    ``selective``: 'attention' (Megatron) drops the score terms; 'op' (xpar) keeps the input
    and every matmul output -- q (h), k, v (``kv_matmul`` each, the un-expanded GQA width),
    w1 and w3 (f), all /t, and the wo and w2 outputs (h, partial sums under tp) -- plus the tp
    collectives' outputs (2 all-reduced h; with sp 2 gathered h and 2 reduce-scattered h/t);
    'torchtitan_op' keeps the input, SDPA's output and log-sum-exp, and every other matmul
    output (wq, wv, w1, w2). Not counted: RoPE's and norms' small side tensors (rstd,
    cos/sin). Units: bytes.
    """
    kv = h if kv is None else kv
    kvm = kv if kv_matmul is None else kv_matmul
    f = 4 * h if ffn is None else ffn
    er = elem if resid_elem is None else resid_elem
    mask = 1 if dropout else 0
    if recompute == "full":
        return s * b * er * h / (t if sp else 1)
    if recompute == "selective" and selective != "attention":
        return s * b * _selective_op_bytes(h, a, t, sp, f, kvm, swiglu, elem, er, selective)
    n_in = (3 + (2 if swiglu else 1)) if autocast_casts else 2
    norm_in = 4 if norm_saves_output else er
    rep = 2 * norm_in * h + n_in * elem * h + 2 * mask * h + (2 * 4 * h if norm_saves_output else 0)
    split = 2 * elem * h + 2 * elem * kv + (4 if swiglu else 2) * elem * f
    scores = 4 * a if flash else a * s * (elem + (mask + elem if dropout else 0))
    if recompute == "selective":
        scores = 0
    gathered = n_in * elem * h if (sp and sp_saves_gathered) else 0  # kept at full sequence length
    per_token = (rep - gathered + split + scores) / t + gathered if sp else rep + (split + scores) / t
    return s * b * per_token


def _selective_op_bytes(h: int, a: int, t: int, sp: bool, f: int, kv: int, swiglu: bool, e: int, er: int,
                        policy: str) -> float:
    """Per-token bytes kept by op-level selective recompute (see :func:`layer_activation_bytes`)."""
    n_f = 2 if swiglu else 1
    block_in = er * h / (t if sp else 1)
    if policy == "op":
        kept = e * (h + 2 * kv + n_f * f) / t + 2 * e * h
    else:  # torchtitan_op: SDPA output + lse, every other matmul (wq, wv, w1, and w2 with SwiGLU)
        kept = e * (h + h + kv + f) / t + 4 * a / t + (e * h if swiglu else 0)
    coll = 0.0  # tp collectives' outputs: 'op' keeps all; torchtitan only its reduce-scatters
    if t > 1 and sp:
        coll = 2 * e * h / t + (2 * e * h if policy == "op" else 0)
    elif t > 1 and policy == "op":
        coll = 2 * e * h
    return block_in + kept + coll


def korthikanti_table2(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                       recompute: str = "none") -> float:
    """Korthikanti et al. 2022 Table 2 closed forms (GPT, 16-bit, dropout). Units: bytes."""
    att = 0 if recompute == "selective" else 5 * a * s / h
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    if sp:
        return s * b * h / t * (34 + att)
    return s * b * h * (10 + 24 / t + att / t)


def recompute_extra_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: str, policy: str = "op",
                                    fraction: float = 1.0) -> float:
    """Forward FLOPs per token run again in backward (Narayanan et al. 2021 convention,
    :mod:`xpar.estimate.flops`): full -- every block's forward; selective 'attention' and
    'op' -- the attention core (scores and context; xpar's 'op' also reruns the element-wise
    ops, which this convention does not count); 'torchtitan_op' -- the matmuls it does not
    keep (wk, wo, and w3 with SwiGLU; the attention core is kept). Times ``fraction`` of
    the blocks. Units: FLOP per token (the whole model's layers)."""
    from xpar.estimate.flops import forward_flops_per_token

    fwd = forward_flops_per_token(cfg, seq_len)
    h, f, kv = cfg.hidden, cfg.ffn_hidden, cfg.kv_heads * cfg.head_dim
    if recompute == "none":
        return 0.0
    if recompute == "full":
        extra = fwd["matmul"] + fwd["attention"]
    elif policy == "torchtitan_op":
        extra = cfg.n_layers * 2 * (h * kv + h * h + (h * f if cfg.activation == "swiglu" else 0))
    else:
        extra = fwd["attention"]
    return fraction * extra


def recompute_notes(spec: RunSpec, o: MemoryOptions) -> list[str]:
    """What the estimate should say about the recompute policy: Megatron's selective recompute
    under flash attention saves ~nothing; an op-level policy that keeps more than no
    recompute (with sequence parallelism at large t, the wo/w2 outputs before their
    reduce-scatter and the all-gathered inputs are kept at full sequence length)."""
    if spec.parallel.recompute != "selective":
        return []
    if o.selective_recompute == "attention" and o.flash_attention:
        return ["selective recompute of the attention core (Megatron) saves almost nothing under flash "
                "attention: the s x s scores are never kept (only a 4 a bytes/token log-sum-exp)"]
    lb = layer_bytes(spec, o)
    if lb["kept"] > lb["none"]:
        return [f"selective recompute ({o.selective_recompute}) keeps {lb['kept'] / lb['none']:.2f}x the activations "
                f"of no recompute per block here (it keeps matmul and collective outputs that plain autograd "
                f"does not need); recompute=none or full is better for memory"]
    return []


def _layer_kwargs(spec: RunSpec, o: MemoryOptions) -> dict:
    """:func:`layer_activation_bytes` keywords for the spec's model, precision and framework."""
    cfg, rec = spec.model, precision(spec, o)
    return dict(kv=cfg.hidden, kv_matmul=cfg.kv_heads * cfg.head_dim, ffn=cfg.ffn_hidden,
                swiglu=cfg.activation == "swiglu", dropout=o.dropout, flash=o.flash_attention, elem=rec["e"],
                resid_elem=rec["er"], norm_saves_output=not o.fused_rmsnorm and cfg.norm == "rmsnorm",
                sp_saves_gathered=o.sp_saves_gathered, autocast_casts=rec["autocast"],
                selective=o.selective_recompute)


def layer_bytes(spec: RunSpec, o: MemoryOptions) -> dict[str, float]:
    """One block, one micro-batch: ``kept`` (under the recompute policy, mixed over
    ``recompute_layer_fraction`` of the blocks), ``none`` (no recompute) and ``workspace``
    (rebuilt during the block's backward: none - policy, 0 without recompute). xpar's model
    expands GQA K/V to all heads before SDPA, so K and V are kept at width h. Bytes."""
    cfg, par = spec.model, spec.parallel
    args = (spec.seq_len, spec.train.micro_batch_size, cfg.hidden, cfg.n_heads, spec.tp, par.sequence_parallel)
    kw = _layer_kwargs(spec, o)
    none = layer_activation_bytes(*args, "none", **kw)
    policy = layer_activation_bytes(*args, par.recompute, **kw)
    phi = o.recompute_layer_fraction if par.recompute != "none" else 0.0
    return {"kept": phi * policy + (1 - phi) * none, "none": none, "workspace": none - policy if phi else 0.0}


def stage_bytes(spec: RunSpec, stage: int, o: MemoryOptions) -> dict[str, float]:
    """Activation bytes one micro-batch keeps on ``stage`` until its backward: ``layers``,
    ``logits`` (last stage: the final norm's saved input(s), the output projection's input,
    the fp32 log-probs of the cross entropy, 4 V / t per token, Korthikanti Sec. 4.3) and
    ``embedding_mask`` (first stage, with dropout); and the transients of that stage:
    ``workspace`` (one block rebuilt in its backward) and ``loss_transient`` (last stage: while
    the loss runs backward the dense fp32 gradient of nll_loss and of log_softmax live beside
    the kept log-probs, 2 x 4 V / t per token; xpar's cross_entropy takes ``logits.float()``; a
    fused loss kernel, ``loss_kernel='fused'``, keeps the logits only and no transient).
    ``weight_copies``: autocast's bf16 weight copies kept for backward (blocks not recomputed,
    and the output projection). Bytes."""
    cfg, lay, par = spec.model, spec.layout, spec.parallel
    rec = precision(spec, o)
    s, b, h, t, sp = spec.seq_len, spec.train.micro_batch_size, cfg.hidden, spec.tp, par.sequence_parallel
    lb = layer_bytes(spec, o)
    n = lay.layer_split[stage]
    out = {"layers": n * lb["kept"], "workspace": lb["workspace"] if n else 0.0, "logits": 0.0,
           "loss_transient": 0.0, "embedding_mask": 0.0, "weight_copies": 0.0}
    if rec["autocast"]:
        kv = cfg.kv_heads * cfg.head_dim
        block = (2 * h * h + 2 * h * kv + (3 if cfg.activation == "swiglu" else 2) * h * cfg.ffn_hidden) / t
        kept_blocks = n * (1 - (o.recompute_layer_fraction if par.recompute != "none" else 0.0))
        out["weight_copies"] = rec["e"] * (kept_blocks * block + (cfg.vocab_size * h / t if stage == lay.n_stages - 1 else 0))
    if stage == 0 and o.dropout:
        out["embedding_mask"] = s * b * h / (t if sp else 1)
    if stage > 0 and n and not o.count_buffers:
        out["layers"] -= _uncounted_stage_input(spec, o, rec)
    if stage == lay.n_stages - 1:
        sh = s * b * h / (t if sp else 1)
        composite = not o.fused_rmsnorm and cfg.norm == "rmsnorm"
        norm = 8 * sh if composite else rec["er"] * sh
        lin_in = rec["e"] * (s * b * h if sp and o.sp_saves_gathered else sh)
        fused = o.loss_kernel == "fused"
        out["logits"] = norm + lin_in + (rec["e"] if fused else 4) * s * b * cfg.vocab_size / t
        out["loss_transient"] = 0.0 if fused else 8 * s * b * cfg.vocab_size / t
    return out


def _uncounted_stage_input(spec: RunSpec, o: MemoryOptions, rec: dict) -> float:
    """Bytes of a received stage input that xpar's CPU accounting does not see
    (``count_buffers`` False): torch's PipelineStage hands each stage its input as a leaf
    that requires grad, which the saved-tensor tracker skips like a parameter
    (xpar.memory_accounting.ActivationTracker). It is saved as itself by the first block's
    checkpoint (recompute) or by a composite norm that needs no upcast (fp32 residual)."""
    sh = spec.seq_len * spec.train.micro_batch_size * spec.model.hidden / (spec.tp if spec.parallel.sequence_parallel else 1)
    if spec.parallel.recompute != "none" or (rec["er"] == 4 and not o.fused_rmsnorm):
        return rec["er"] * sh
    return 0.0


@lru_cache(maxsize=512)
def _walk(schedule: str, pp: int, m: int, v: int, rank: int, per_stage: tuple, transient: tuple) -> tuple:
    """Peak of one rank over its action list: (peak kept bytes, peak kept + transient bytes,
    peak micro-batch chunks in flight). ``per_stage``: (stage, kept bytes per micro-batch);
    ``transient``: (stage, bytes during that stage's forward of the last stage's loss,
    bytes during its backward) -- both tuples so the walk is memoised."""
    from xpar.estimate.schedule import schedule_actions

    acts = schedule_actions(schedule, pp, m, v)[rank]
    kept = dict(per_stage)
    during = {st: (f, bw) for st, f, bw in transient}
    live = peak = peak_all = chunks = peak_chunks = 0
    for a in acts:
        if a.kind == "F":
            live += kept[a.stage]
            chunks += 1
            peak, peak_chunks = max(peak, live), max(peak_chunks, chunks)
            peak_all = max(peak_all, live + during[a.stage][0])
        elif a.kind in "BI":
            peak_all = max(peak_all, live + during[a.stage][1])
        if a.kind in "BW":
            live -= kept[a.stage]
            chunks -= 1
    return peak, max(peak, peak_all), peak_chunks


def schedule_peak(spec: RunSpec, pp_rank: int, o: MemoryOptions) -> dict[str, float]:
    """Activation bytes of pipeline rank ``pp_rank`` at its peak, walking the schedule's
    action list (torch's order; one micro-batch at a time without pp): ``kept`` (saved
    for backward), ``total`` (with the transients when ``count_buffers``),
    ``weight_copies`` (autocast's bf16 weights kept, same walk) and
    ``microbatches_in_flight`` (peak chunks in flight / v). Bytes."""
    lay, par = spec.layout, spec.parallel
    stages = lay.stages_of(pp_rank)
    sb = {st: stage_bytes(spec, st, o) for st in stages}
    kept = tuple((st, sb[st]["layers"] + sb[st]["logits"] + sb[st]["embedding_mask"]) for st in stages)
    copies = tuple((st, sb[st]["weight_copies"]) for st in stages)
    cb = o.count_buffers
    trans = tuple((st, sb[st]["loss_transient"] * cb, (sb[st]["workspace"] + sb[st]["loss_transient"]) * cb)
                  for st in stages)
    zero = tuple((st, 0.0, 0.0) for st in stages)
    if spec.pp == 1:
        k, c = kept[0][1], copies[0][1]
        out = {"kept": k, "total": k + max(trans[0][1], trans[0][2]), "weight_copies": c, "chunks": 1}
    else:
        args = (par.schedule, spec.pp, spec.micro_batches, lay.virtual_stages, pp_rank)
        k, total, chunks = _walk(*args, kept, trans)
        out = {"kept": k, "total": total, "weight_copies": _walk(*args, copies, zero)[0], "chunks": chunks}
    out["microbatches_in_flight"] = out.pop("chunks") / lay.virtual_stages
    out["token_ids"] = _token_id_bytes(spec, pp_rank)
    return out


def _token_id_bytes(spec: RunSpec, pp_rank: int) -> float:
    """int64 token ids the embedding keeps for backward: one micro-batch without pp; under pp
    torch splits the whole local batch into micro-batch views of one tensor, kept while any
    view is (8 s b m bytes)."""
    if not spec.layout.has_first_stage(pp_rank):
        return 0.0
    return token_id_bytes(spec.seq_len, spec.train.micro_batch_size, spec.micro_batches, spec.pp)


def token_id_bytes(seq_len, b, m, pp):
    """int64 token ids kept by the rank holding the first stage: 8 s b, times m under pp
    (:func:`_token_id_bytes`). Bytes; numbers or numpy arrays alike."""
    return 8.0 * (seq_len * b) * ((m - 1) * (pp > 1) + 1)


def microbatches_in_flight(schedule: str, pp: int, m: int, v: int = 1, rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at its peak, in units of
    the rank's whole layer set: the peak of the schedule's action list (torch's order;
    :func:`xpar.estimate.schedule.peak_in_flight`) / v. Matches Korthikanti et al. 2022
    Sec. 4.2.3: GPipe m, 1F1B min(m, p - r), interleaved p (1 + (p - 1)/(p v)) on rank 0."""
    if pp == 1:
        return 1.0  # gradient accumulation: one micro-batch at a time
    from xpar.estimate.schedule import peak_in_flight, schedule_actions
    return peak_in_flight(schedule_actions(schedule, pp, m, v)[rank]) / v


def activation_terms(spec: RunSpec, pp_rank: int, assume=None, **options) -> dict:
    """Activation bytes of pipeline rank ``pp_rank`` at its peak, by term: ``saved`` (kept
    for backward at the schedule's peak, token ids included), ``transient`` (recompute
    workspace and loss temporaries on top, when ``count_buffers``), ``token_ids``,
    ``microbatches_in_flight`` (chunks at the peak / v). ``assume``/``options``:
    :class:`MemoryOptions`."""
    o = MemoryOptions.of(assume, **options)
    p = schedule_peak(spec, pp_rank, o)
    return {"saved": p["kept"] + p["token_ids"], "transient": p["total"] - p["kept"], "token_ids": p["token_ids"],
            "microbatches_in_flight": p["microbatches_in_flight"]}


# --- the whole device ------------------------------------------------------------------

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


@lru_cache(maxsize=8192)
def _fsdp_units(cfg_key: tuple, layout, tp: int, pp_rank: int) -> tuple[int, int]:
    """Elements of the largest FSDP root unit (a stage's embeddings, final norm, output) and
    of the largest block unit on a pipeline rank, as xpar and torchtitan wrap them."""
    roots, blocks = [0], [0]
    for s in layout.stages_of(pp_rank):
        head, block, tail = _stage_parts(cfg_key, s == 0, s == layout.n_stages - 1, tp)
        roots.append(sum(math.prod(sh) for _, sh in head + tail))
        blocks.append(sum(math.prod(sh) for _, sh in block) if layout.layer_split[s] else 0)
    return max(roots), max(blocks)


def comm_buffer_terms(spec: RunSpec, pp_rank: int, assume=None, **options) -> dict[str, float]:
    """Communication and sharding buffers, bytes (0 unless ``count_buffers``).

    ddp_buckets (ZeRO 0/1, dp > 1): torch DDP copies gradients into flat buckets
    (gradient_as_bucket_view=False, the default): one more gradient-sized buffer (Megatron's
    gradients live in its buffer: ``ddp_bucket_copy`` False). fsdp_allgather (ZeRO-3,
    resharded): in the compute dtype, the root's unsharded parameters (gathered at the start of
    the forward and held through it -- through the backward too without pp,
    xpar.parallel.data_parallel.apply_fsdp), the running block's and the prefetched next
    block's (FSDP2's implicit prefetch): root + 2 blocks. fsdp_reduce (ZeRO-2/3 without
    pp): one unit of unsharded gradients in the compute dtype, plus its fp32 copy when the
    reduction runs in fp32 (MixedPrecisionPolicy reduce_dtype); under pp the deferred whole
    gradients are the ``grads`` term. pp_p2p: one send and one receive buffer of b s h
    elements per stage held (/t with sp).
    """
    o = MemoryOptions.of(assume, **options)
    out = state_buffer_terms(spec, pp_rank, o)
    out["pp_p2p"] = 0.0
    if o.count_buffers and spec.pp > 1:
        out["pp_p2p"] = p2p_buffer_bytes(spec.seq_len, spec.train.micro_batch_size, spec.model.hidden,
                                         len(spec.layout.stages_of(pp_rank)), precision(spec, o)["er"], spec.tp,
                                         spec.parallel.sequence_parallel)
    return out


def state_buffer_terms(spec: RunSpec, pp_rank: int, o: MemoryOptions) -> dict[str, float]:
    """The buffers of :func:`comm_buffer_terms` sized by the model states (ddp_buckets,
    fsdp_allgather, fsdp_reduce): they depend on the rank's parameters, dp, pp and the ZeRO
    stage only. Bytes."""
    out = {"ddp_buckets": 0.0, "fsdp_allgather": 0.0, "fsdp_reduce": 0.0}
    if not o.count_buffers:
        return out
    z, e = spec.parallel.zero_stage, precision(spec, o)["e"]
    whole, _ = _stage_numels(_model_key(spec.model), _shapes_layout(spec.layout), spec.tp, pp_rank)
    root, block = _fsdp_units(_model_key(spec.model), _shapes_layout(spec.layout), spec.tp, pp_rank)
    unit = max(root, block)
    if z <= 1 and spec.dp > 1 and o.ddp_bucket_copy:
        out["ddp_buckets"] = whole * state_widths(spec, o)[1]
    if z == 3 and (spec.pp == 1 or o.fsdp_reshard_under_pp):
        out["fsdp_allgather"] = (root + 2 * block) * e
    if z >= 2 and spec.pp == 1:
        out["fsdp_reduce"] = unit * (e + (o.grad_bytes if e != o.grad_bytes else 0))
    return out


def p2p_buffer_bytes(seq_len, b, hidden, stages_held, resid_elem, tp, sp):
    """Pipeline send and receive buffers of one pipeline rank: 2 per stage held, b s h
    elements of ``resid_elem`` bytes each (/tp with sequence parallelism ``sp``). Bytes.
    Works on numbers or numpy arrays alike (the planner, :mod:`xpar.plan.vmemory`)."""
    return 2 * stages_held * (seq_len * b * hidden) * resid_elem / (tp * sp + 1 - sp)


def rank_memory(spec: RunSpec, pp_rank: int, o: MemoryOptions) -> MemoryEstimate:
    """:class:`MemoryEstimate` of pipeline rank ``pp_rank`` on its most loaded dp rank."""
    st = state_terms(spec, pp_rank, most_loaded_dp_rank(spec, pp_rank, o.zero1), o)
    act = activation_terms(spec, pp_rank, o)
    comm = comm_buffer_terms(spec, pp_rank, o)
    acts = act["saved"] + act["transient"]
    overhead = (spec.hardware.framework_overhead_gb or 0) * 1e9
    params = st["params_master"] + st["params_compute"]
    total = params + st["grads"] + st["optimizer"] + acts + sum(comm.values()) + overhead
    dev = (spec.hardware.device_memory_gb or 0) * 1e9
    usable = dev * (1 - (getattr(spec.hardware, "memory_headroom", 0.0) or 0.0))
    return MemoryEstimate(params=params, grads=st["grads"], optimizer=st["optimizer"], activations=acts,
                          comm_buffers=sum(comm.values()), framework_overhead=overhead, total=total,
                          device_memory=dev, fits=total <= usable, pp_rank=pp_rank,
                          detail={"activations": act, "comm_buffers": comm, "states": st, "usable": usable,
                                  "notes": recompute_notes(spec, o)})


def memory(spec: RunSpec, pp_rank: Optional[int] = None, assume=None, **options) -> MemoryEstimate:
    """Per-device peak memory of ``spec`` on pipeline rank ``pp_rank`` (None: the most
    loaded rank). ``assume`` (an Assumptions) and ``options`` give the
    :class:`MemoryOptions` (also the legacy ``flash``, ``dropout``, ``fused_rmsnorm``,
    ``sp_saves_gathered``). See the module docstring for the terms."""
    o = MemoryOptions.of(assume, **options)
    best = None
    for r in (range(spec.pp) if pp_rank is None else [pp_rank]):
        est = rank_memory(spec, r, o)
        if best is None or est.total > best.total:
            best = est
    return best
