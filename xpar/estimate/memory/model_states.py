"""Model states per device (parameters, gradients, optimizer states) and the options that say how a
framework keeps them: the first part of the memory estimate (:mod:`xpar.estimate.memory.per_device` documents
the accounting and its sources)."""
from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import field, fields, make_dataclass, replace
from functools import lru_cache
from operator import attrgetter

from xpar.config.attention import tp_model
from xpar.config.layout import SCHEDULES
from xpar.config.profile import FrameworkConfig
from xpar.config.remat import SELECTIVE_POLICIES
from xpar.config.schema import ModelConfig
from xpar.config.spec import RunSpec
from xpar.estimate.frameworks.fp8_weights import block_linear_numel, fp8_weight_copy_bytes
from xpar.estimate.terms import MEMORY_TERMS, STATE_TERMS

BYTES = {"fp32": 4, "bf16": 2, "fp8": 2}
"""Bytes per element of the activations and compute copies by train.dtype: fp8 trains with bf16
storage and FP8 matmuls (torchtitan's float8 converter, Transformer Engine's fp8 recipes: the
activations and weights outside the matmuls stay bf16; FP8 casts are transient)."""
STATE_BYTES = {"bf16": (2, 2, 12), "fp32": (4, 4, 8), "fp8": (2, 2, 12)}
"""Bytes per parameter (params, grads, optimizer states) in the ZeRO paper's accounting: 2 + 2
+ K, K = 12, for bf16 mixed precision; fp32 AdamW 4 + 4 + 8. Used for the paper's formula and
the dry run's element counts; what a framework keeps is :func:`state_widths`."""


MEMORY_FIELDS = ("flash_attention", "dropout", "fused_rmsnorm", "sp_saves_gathered", "count_buffers",
                 "selective_recompute", "recompute_layer_fraction", "param_storage", "grad_bytes",
                 "optimizer_bytes", "fsdp_reshard_under_pp", "zero3_gather", "ddp_bucket_copy",
                 "cpu_offload_optimizer", "zero1", "loss_kernel", "interleaved_m_per_pp", "fused_swiglu",
                 "fp8_saves_inputs", "gqa_kv_expanded", "fp32_grad_partition",
                 "replicated_embedding_grad", "fp8_param_gather", "fp8_weight_copies",
                 "grad_reduce_cast_bytes", "grad_accum_cast_bytes", "grad_buckets", "bucket_mb", "fsdp_head_units",
                 "moe_recompute_graph_kept", "activation_offload_overlap", "moe_routed_copies_kept")
"""The :class:`xpar.config.profile.FrameworkConfig` fields that decide what a framework keeps in memory (each
documented there, with its default)."""


class _FromAssumptions:
    """The constructor of :data:`MemoryOptions` (a mixin: its fields come from FrameworkConfig)."""

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


MemoryOptions = make_dataclass(
    "MemoryOptions", [(f.name, f.type, field(default=f.default)) for f in fields(FrameworkConfig) if f.name in MEMORY_FIELDS],
    bases=(_FromAssumptions,), frozen=True, namespace={"__module__": __name__})
MemoryOptions.__doc__ = """How the framework keeps memory: the :data:`MEMORY_FIELDS` of FrameworkConfig with its defaults
(xpar on CUDA); frozen. :class:`xpar.estimate.step_parts.Assumptions` extends it with the time model's fields."""


MEMORY_PROFILES = {
    "xpar": {},
    "torchtitan": dict(selective_recompute="torchtitan_op", fsdp_reshard_under_pp=False),
    "megatron": dict(selective_recompute="attention", param_storage="bf16", grad_bytes=4, ddp_bucket_copy=False,
                     zero1="distributed_optimizer", replicated_embedding_grad=False, gqa_kv_expanded=False,
                     interleaved_m_per_pp=True),
    "deepspeed": dict(param_storage="bf16", grad_bytes=2, zero1="distributed_optimizer",
                      replicated_embedding_grad=False, gqa_kv_expanded=False),
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
    autocast = o.param_storage == "fp32" and spec.layout.zero_stage <= 1
    return {"e": 2, "er": 4 if autocast else 2, "autocast": autocast}


def state_widths(spec: RunSpec, o: MemoryOptions) -> tuple[int, int, int]:
    """Bytes per element of (stored params, grads, optimizer states) as the framework keeps
    them (module docstring): fp32 4/4/8; bf16 with fp32 storage 4/grad_bytes/8; bf16
    with bf16 storage 2/grad_bytes/12; ``optimizer_bytes`` replaces the last under mixed precision."""
    if spec.train.dtype == "fp32":
        return 4, 4, 8
    p, k = (4, 8) if o.param_storage == "fp32" else (2, 12)
    return p, o.grad_bytes, o.optimizer_bytes or k


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
def _meta_shapes(cfg_key: tuple, n_blocks: int, first: bool, last: bool, moe: bool = False, ep: int = 1) -> tuple:
    """``named_parameters()`` (name, shape) of ``Transformer(cfg, range(n_blocks), first, last)``
    (xpar.models.transformer) written out without torch, in registration order: embeddings,
    blocks (norm, wq, wk, wv, wo, norm, w1, w2[, w3]; Linear weight then bias), final norm,
    output (omitted when tied to the embedding on one stage: named_parameters yields a shared
    tensor once). ``moe``: the blocks hold experts (router, each expert's MLP, the shared experts'
    MLP: :class:`xpar.models.transformer.MoE`); under expert parallelism ``ep`` a rank holds E / ep of
    the experts. Equal to the model built on the meta device for
    every preset (tests/plan/test_plan_memory.py, tests/parallel/test_moe.py); the dry run checks the counts
    against torch's."""
    cfg = ModelConfig(*cfg_key)
    h, kv, f, vocab = cfg.hidden, cfg.kv_heads * cfg.head_size, cfg.ffn_hidden, cfg.vocab_size

    def norm(name: str) -> list:
        return [(f"{name}.weight", (h,))] + ([(f"{name}.bias", (h,))] if cfg.norm != "rmsnorm" and cfg.bias else [])

    def linear(name: str, n_out: int, n_in: int) -> list:
        return [(f"{name}.weight", (n_out, n_in))] + ([(f"{name}.bias", (n_out,))] if cfg.bias else [])

    def mlp_shapes(name: str, width: int) -> list:
        return (linear(f"{name}.w1", width, h) + linear(f"{name}.w2", h, width)
                + (linear(f"{name}.w3", width, h) if cfg.activation == "swiglu" else []))

    out = [("tok_embeddings.weight", (vocab, h))] if first else []
    out += [("pos_embeddings.weight", (cfg.seq_len, h))] if first and cfg.position == "learned" else []
    for i in range(n_blocks):
        a, mlp = f"layers.{i}.attention", f"layers.{i}.feed_forward"
        out += norm(f"layers.{i}.attention_norm") + linear(f"{a}.wq", cfg.q_dim, h) + linear(f"{a}.wk", kv, h)
        out += linear(f"{a}.wv", kv, h) + linear(f"{a}.wo", h, cfg.q_dim) + norm(f"layers.{i}.ffn_norm")
        if not moe:
            out += mlp_shapes(mlp, f)
            continue
        out += [(f"{mlp}.router.weight", (cfg.n_experts, h))]
        out += [x for e in range(cfg.n_experts // ep) for x in mlp_shapes(f"{mlp}.experts.{e}", cfg.expert_ffn)]
        out += mlp_shapes(f"{mlp}.shared", cfg.expert_ffn * cfg.n_shared_experts) if cfg.n_shared_experts else []
    if last:
        out += norm("norm") + ([] if first and cfg.tied_embeddings else [("output.weight", (vocab, h))])
    return tuple(out)


def _stage_shapes(cfg_key: tuple, layers: tuple[int, ...], first: bool, last: bool) -> list:
    """named_parameters() shapes of ``Transformer(cfg, layers, first, last)``. Blocks are
    identical: one block's shapes are repeated under each block's name."""
    head, block, tail = _stage_parts(cfg_key, first, last)
    return head + [(f"layers.{i}.{n}", sh) for i in layers for n, sh in block] + tail


@lru_cache(maxsize=256)
def _stage_parts(cfg_key: tuple, first: bool, last: bool, tp: int = 1, moe: bool = False,
                 ep: int = 1, etp: int = 0) -> tuple[list, list, list]:
    """A stage's parameters in three parts: before the blocks (embeddings), one block (names
    after ``layers.<i>.``; a block with experts when ``moe``), after them (final norm, output);
    shapes tp-local (:func:`_tp_local`: experts split over tp as the dense MLP, Megatron-Core's
    expert tensor parallelism, at ``etp`` (0: tp)); E / ep experts under expert parallelism."""
    outer = _meta_shapes(cfg_key, 0, first, last)
    block = [(n.split(".", 2)[2], sh) for n, sh in _meta_shapes(cfg_key, 1, False, False, moe, ep)]
    head = [x for x in outer if x[0].split(".")[0] in ("tok_embeddings", "pos_embeddings")]
    tail = [x for x in outer if x not in head]
    return tuple([(n, _tp_local(n, sh, (etp or tp) if ".experts." in f".{n}" else tp)) for n, sh in part]
                 for part in (head, block, tail))


def param_shapes(spec: RunSpec, pp_rank: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, tp-local shape) of every parameter held by pipeline rank ``pp_rank``, in the
    order ``model.parameters()`` yields them (tied weights once), from :func:`_meta_shapes`
    (memoised per model, layout and tp degree)."""
    return list(_param_shapes(*shape_key(spec), pp_rank))


def param_numel(spec: RunSpec, pp_rank: int) -> int:
    """Parameter elements held by pipeline rank ``pp_rank`` (tp-local): :func:`param_shapes`' total."""
    return _stage_numels(*shape_key(spec), pp_rank)[0]


def unit_elements(spec: RunSpec, pp_rank: int) -> list[int]:
    """Parameter elements per FSDP unit of ``pp_rank`` in forward order: the root (embedding,
    final norm, output of the stages held; 0 on middle stages) first, then each block."""
    return list(_unit_elements(*shape_key(spec), pp_rank))


@lru_cache(maxsize=4096)
def _unit_elements(cfg_key: tuple, layout, tp: int, pp_rank: int) -> tuple:
    """:func:`unit_elements`, memoised and summed by part (:func:`_part_counts`: the stage ends, a
    dense block, a MoE block) rather than tensor by tensor: a MoE stage holds tens of thousands."""
    cfg = ModelConfig(*cfg_key)
    dense = _part_counts(cfg_key, False, False, tp)[1][0]
    moe = _part_counts(cfg_key, False, False, tp, True, layout.ep, layout.etp)[1][0] if cfg.n_experts else dense
    root, blocks = 0, []
    for s in layout.stages_of(pp_rank):
        head, _, tail, _ = _part_counts(cfg_key, s == 0, s == layout.n_stages - 1, tp)
        root += head[0] + tail[0]
        blocks += [moe if cfg.is_moe_layer(i) else dense for i in layout.stage_layers(s)]
    return (root,) + tuple(blocks)


def root_tail_elements(spec: RunSpec, pp_rank: int) -> int:
    """Elements of the root unit's tail on ``pp_rank`` (:func:`unit_elements`): the final norm and, untied, the output
    projection, of the last stage where the rank holds it; 0 elsewhere."""
    return _root_tail(*shape_key(spec), pp_rank)


@lru_cache(maxsize=1024)
def _root_tail(cfg_key: tuple, layout, tp: int, pp_rank: int) -> int:
    """:func:`root_tail_elements`, memoised."""
    return sum(_part_counts(cfg_key, s == 0, s == layout.n_stages - 1, tp)[2][0] for s in layout.stages_of(pp_rank))


def unit_expert_elements(spec: RunSpec, pp_rank: int) -> list[int]:
    """Routed-expert elements per FSDP unit of ``pp_rank``, as :func:`unit_elements` orders the units
    (the root 0; a MoE block its E / ep local experts, split over etp; a dense block 0): the part of each
    unit reduced and sharded over the expert-dp ranks (:func:`expert_dp_size`), not over dp."""
    return list(_unit_expert_elements(*shape_key(spec), pp_rank))


@lru_cache(maxsize=4096)
def _unit_expert_elements(cfg_key: tuple, layout, tp: int, pp_rank: int) -> tuple:
    """:func:`unit_expert_elements`, memoised (:func:`_part_counts`' routed experts of one MoE block)."""
    cfg = ModelConfig(*cfg_key)
    if not cfg.n_experts:
        return (0,) * (1 + layout.layers_of(pp_rank))
    experts = _part_counts(cfg_key, False, False, tp, True, layout.ep, layout.etp)[3][0]
    return (0,) + tuple(experts if cfg.is_moe_layer(i) else 0
                        for s in layout.stages_of(pp_rank) for i in layout.stage_layers(s))


def expert_numel(spec: RunSpec, pp_rank: int) -> int:
    """Routed-expert parameter elements held by pipeline rank ``pp_rank`` (tp-local, E / ep experts per
    MoE layer); 0 for a dense model."""
    return _rank_counts(*shape_key(spec), pp_rank, True)[0] if spec.model.n_experts else 0


def root_elements(spec: RunSpec, pp_rank: int) -> int:
    """Parameter elements of ``pp_rank``'s FSDP root unit (embeddings, final norm, output; 0 on
    middle stages): :func:`unit_elements`'s first."""
    return unit_elements(spec, pp_rank)[0]


def tensor_counts(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(parameter tensors of one block, of the model's ends: embeddings, final norm, output)."""
    return _tensor_counts(_model_key(cfg), tp)


@lru_cache(maxsize=256)
def _tensor_counts(cfg_key: tuple, tp: int) -> tuple[int, int]:
    head, block, tail = _stage_parts(cfg_key, True, True, tp)
    return len(block), len(head) + len(tail)


def block_shapes(cfg: ModelConfig, tp: int) -> tuple:
    """(name, tp-local shape) of one dense block's parameters, forward order (names after ``layers.<i>.``)."""
    return tuple(_stage_parts(_model_key(cfg), False, False, tp)[1])


_MODEL_FIELDS = attrgetter(*(f.name for f in fields(ModelConfig)))


def _model_key(cfg: ModelConfig) -> tuple:
    """The model's fields in order (``dataclasses.astuple`` without its deep copy: every field
    is a number, string or None): the key of the shape caches, ``ModelConfig(*key)`` rebuilds it."""
    return _MODEL_FIELDS(cfg)


def shape_key(spec: RunSpec) -> tuple:
    """(model key, layout key, tp) of the shape caches for ``spec``: the model as its tp ranks hold it
    (:func:`xpar.config.attention.tp_model`: K/V heads replicated over tp where the framework keeps them whole)."""
    return _model_key(tp_model(spec)), _shapes_layout(spec.layout), spec.tp


@lru_cache(maxsize=8192)
def _shapes_layout(layout):
    """The layout as parameter shapes see it (stages and their layers only): the key of the
    shape caches, shared by every layout with the same stages whatever its dp, batch, ZeRO stage."""
    placement = "zbv" if layout.schedule in SCHEDULES and SCHEDULES[layout.schedule].v_shaped else "gpipe"
    return replace(layout, dp=1, micro_batch_size=1, micro_batches=1, seq_len=1, zero_stage=0,
                   sequence_parallel=False, recompute="none", schedule=placement)  # stages placed alike


@lru_cache(maxsize=4096)
def _param_shapes(cfg_key: tuple, layout, tp: int, pp_rank: int) -> tuple:
    out, cfg = [], ModelConfig(*cfg_key)
    for s in layout.stages_of(pp_rank):
        head, block, tail = _stage_parts(cfg_key, s == 0, s == layout.n_stages - 1, tp)
        moe = _stage_parts(cfg_key, False, False, tp, True, layout.ep, layout.etp)[1] if cfg.n_experts else block
        out += [(f"{s}:{name}", shape) for name, shape in head]
        out += [(f"{s}:layers.{i}.{name}", shape) for i in layout.stage_layers(s)
                for name, shape in (moe if cfg.is_moe_layer(i) else block)]
        out += [(f"{s}:{name}", shape) for name, shape in tail]
    return tuple(out)


@lru_cache(maxsize=4096)
def _block_linear_numel(cfg_key: tuple, layout, tp: int, pp_rank: int) -> int:
    """:func:`xpar.estimate.frameworks.fp8_weights.block_linear_numel` of a pipeline rank (memoised by rank, not by
    its tens of thousands of shapes)."""
    return block_linear_numel(_param_shapes(cfg_key, layout, tp, pp_rank))


def fsdp_shard_numel(shape: tuple[int, ...], dp: int, rank: int) -> int:
    """Elements of FSDP2's local shard on dp rank ``rank``: rows
    [rank c, min(d0, (rank+1) c)) with c = ceil(d0 / dp) (torch.chunk on dim 0)."""
    d0 = shape[0] if shape else 1
    rest = math.prod(shape[1:]) if len(shape) > 1 else 1
    c = math.ceil(d0 / dp)
    return max(0, min(d0, (rank + 1) * c) - rank * c) * rest


@lru_cache(maxsize=8192)
def _stage_numels(cfg_key: tuple, layout, tp: int, pp_rank: int) -> tuple:
    """(whole elements, shape counts) of a pipeline rank: its parameters' shapes as a multiset,
    sorted ((tp-local shape, tensors of that shape) pairs; what every count below needs, since none
    depends on the tensors' order or names). Built from :func:`_stage_parts` per stage (a block's
    shapes times its blocks), never tensor by tensor: a MoE rank holds tens of thousands."""
    return _rank_counts(cfg_key, layout, tp, pp_rank, False)


@lru_cache(maxsize=8192)
def _rank_counts(cfg_key: tuple, layout, tp: int, pp_rank: int, experts_only: bool) -> tuple[int, tuple]:
    """(elements, (shape, count) pairs) of the parameters on pipeline rank ``pp_rank`` (the multiset
    of :func:`_param_shapes`' shapes); ``experts_only``: the routed experts' alone."""
    out, cfg = Counter(), ModelConfig(*cfg_key)
    moe = _part_counts(cfg_key, False, False, tp, *((True, layout.ep, layout.etp) if cfg.n_experts else ()))
    for s in layout.stages_of(pp_rank):
        head, block, tail, _ = _part_counts(cfg_key, s == 0, s == layout.n_stages - 1, tp)
        n_moe = sum(cfg.is_moe_layer(i) for i in layout.stage_layers(s))
        parts = ((moe[3], n_moe),) if experts_only else ((head, 1), (block, layout.layer_split[s] - n_moe),
                                                        (moe[1], n_moe), (tail, 1))
        for (_, pairs), k in parts:
            for shape, n in pairs:
                out[shape] += k * n
    return _counted(out)


@lru_cache(maxsize=256)
def _part_counts(cfg_key: tuple, first: bool, last: bool, tp: int, moe: bool = False, ep: int = 1,
                 etp: int = 0) -> tuple:
    """:func:`_stage_parts`' head, block and tail, then the block's routed experts alone, each as
    (elements, (shape, count) pairs)."""
    head, block, tail = _stage_parts(cfg_key, first, last, tp, moe, ep, etp)
    experts = [x for x in block if ".experts." in x[0]]
    return tuple(_counted(Counter(sh for _, sh in part)) for part in (head, block, tail, experts))


def _counted(counts: Counter) -> tuple[int, tuple]:
    """(elements, sorted (shape, count) pairs) of a shape multiset."""
    pairs = tuple(sorted((sh, n) for sh, n in counts.items() if n > 0))
    return sum(n * math.prod(sh) for sh, n in pairs), pairs


@lru_cache(maxsize=16384)
def _shard_total(counts: tuple, dp: int, rank: int) -> int:
    return sum(n * fsdp_shard_numel(sh, dp, rank) for sh, n in counts)


def _greedy_partition(numels, dp: int) -> tuple:
    """:func:`zero1_partition`; a heap of (size, rank): O(n log dp)."""
    sizes = [0] * dp
    heap = [(0, r) for r in range(dp)]
    for n in sorted(numels, reverse=True):
        size, r = heapq.heappop(heap)
        sizes[r] = size + n
        heapq.heappush(heap, (size + n, r))
    return tuple(sizes)


@lru_cache(maxsize=4096)
def _zero1_sizes(counts: tuple, dp: int) -> tuple:
    """:func:`zero1_partition` of the tensors of ``counts`` ((shape, count) pairs), memoised:
    the partition depends on the sizes alone, not on which tensor has which."""
    return _greedy_partition([math.prod(sh) for sh, n in counts for _ in range(n)], dp)


def zero1_partition(numels: list[int], dp: int) -> list[int]:
    """Elements per rank assigned by torch's ZeroRedundancyOptimizer: parameters sorted by
    size, largest first (stable), each to the rank with the fewest elements so far (lowest
    rank on ties)."""
    return list(_greedy_partition(numels, dp))


def grads_deferred(spec: RunSpec) -> bool:
    """Whether the dp reduction of gradients waits for the step's last backward, the rank
    holding its whole (dp-unsharded) gradients until then: always under pp (torch's
    PipelineStage defers DDP's and FSDP2's reduction, whatever m), and without pp for ZeRO-0/1
    with m > 1 (no_sync). ZeRO-2/3 without pp reduce-scatter every micro-batch."""
    return spec.pp > 1 or (spec.layout.zero_stage <= 1 and spec.micro_batches > 1)


def replicated_embedding_grad_numel(spec: RunSpec, pp_rank: int) -> int:
    """Gradient elements held beyond the tp-local token embedding while a reduction is
    deferred (:func:`grads_deferred`), on the rank holding stage 0 under tp.

    torch's DTensor backward of the vocabulary-parallel embedding (RowwiseParallel, weight
    Shard(0) on tp) returns a *Replicate* gradient: the whole V x h on every tp rank. FSDP2
    (and composable ``replicate``) redistribute it to the weight's Shard(0) only when they
    reduce it, so a deferred gradient is held whole: (V - ceil(V/t)) h more elements.
    Measured on the CPU build of torch 2.13 (tests/parallel/test_pipeline.py, 3D runs). ZeRO-0/1 at dp = 1
    have no wrapper: xpar places the gradient back after every backward
    (xpar.parallel.data_parallel.keep_grads_placed), nothing is held whole."""
    unwrapped = spec.layout.zero_stage <= 1 and spec.dp == 1
    if spec.tp == 1 or unwrapped or not grads_deferred(spec) or not spec.layout.has_first_stage(pp_rank):
        return 0
    return (spec.tp - 1) * _embedding_numel(*shape_key(spec), pp_rank)


@lru_cache(maxsize=1024)
def _embedding_numel(cfg_key: tuple, layout, tp: int, pp_rank: int) -> int:
    """tp-local token-embedding elements of a pipeline rank (the first stage's, where it holds it)."""
    return sum(math.prod(sh) for s in layout.stages_of(pp_rank) if s == 0
               for name, sh in _stage_parts(cfg_key, True, s == layout.n_stages - 1, tp)[0]
               if name == "tok_embeddings.weight")


def held_numel(spec: RunSpec, pp_rank: int, dp_rank: int, zero1: str = "zero_redundancy",
               replicated_embedding_grad: bool = True) -> dict[str, int]:
    """Elements dp rank ``dp_rank`` of pipeline rank ``pp_rank`` holds: ``storage`` (its
    parameter storage: the FSDP shard under ZeRO-2/3), ``whole`` (the dp-unsharded stage),
    ``grads`` (most held at once) and ``optimizer`` (elements with AdamW states). O(number
    of parameter tensors), memoised: no loop over the dp ranks. ``zero1``,
    ``replicated_embedding_grad``: see :class:`MemoryOptions`. Under expert parallelism the
    rank's E / ep experts (split over etp) are sharded and reduced over the expert-dp ranks
    (:attr:`xpar.config.layout.Layout.expert_dp`: tp dp / (ep etp) of a cp-folded layout), the rest over dp."""
    key = (*shape_key(spec), pp_rank)
    whole, counts = _stage_numels(*key)
    extra = replicated_embedding_grad_numel(spec, pp_rank) if replicated_embedding_grad else 0
    if spec.layout.ep == 1 and spec.layout.expert_tp == spec.tp:
        return _held(spec, whole, counts, spec.dp, dp_rank, zero1, extra)
    n_experts, experts = _rank_counts(*key, True)
    dense = _held(spec, whole - n_experts, _without(counts, experts), spec.dp, dp_rank, zero1, extra)
    expert_dp = expert_dp_size(spec)
    expert = _held(spec, n_experts, experts, expert_dp, dp_rank % expert_dp, zero1, 0)
    return {k: dense[k] + expert[k] for k in dense}


def expert_dp_size(spec: RunSpec) -> int:
    """Ranks the routed experts' states are reduced and sharded over: the layout's expert-dp under
    ep or an etp of its own (tp x cp x dp / (ep x etp): Megatron-Core's expert data parallel group,
    megatron/core/parallel_state.py ``get_expert_data_parallel_group``; DeepSpeed-MoE's expert data
    parallel group, deepspeed/utils/groups.py ``_get_expert_data_parallel_group``; xpar's engine,
    xpar.parallel.expert.group_ranks), else dp like every parameter."""
    lay = spec.layout
    return lay.expert_dp if lay.ep > 1 or lay.expert_tp != spec.tp else spec.dp


@lru_cache(maxsize=4096)
def _without(counts: tuple, removed: tuple) -> tuple:
    """(shape, count) pairs of ``counts`` less those of ``removed`` (a multiset difference)."""
    return _counted(Counter(dict(counts)) - Counter(dict(removed)))[1]


def _held(spec: RunSpec, whole: int, counts: tuple, dp: int, dp_rank: int, zero1: str, extra: int) -> dict[str, int]:
    """:func:`held_numel` of the parameters ``counts`` ((shape, count) pairs, ``whole`` elements) sharded over ``dp``
    ranks; ``extra``: replicated embedding gradient elements held while a reduction is deferred."""
    z = spec.layout.zero_stage
    shard = _shard_total(counts, dp, dp_rank) if z >= 2 else whole
    if grads_deferred(spec):
        grads = whole + extra
    else:
        grads = shard if z >= 2 else whole
    if z == 1 and zero1 == "distributed_optimizer":
        opt = -(-whole // dp)
    elif z == 1:
        opt = _zero1_sizes(counts, dp)[dp_rank]
    else:
        opt = shard
    return {"storage": shard, "whole": whole, "grads": grads, "optimizer": opt}


def expert_state_bytes(spec: RunSpec, pp_rank: int, dp_rank: int, o: MemoryOptions) -> dict[str, float]:
    """The routed experts' share of :func:`held_state_terms` on a rank (``params``, ``grads``,
    ``optimizer`` bytes; their E / ep experts per MoE layer, optimizer states over the expert-dp
    ranks), or {} for a dense model. Bytes."""
    if not spec.model.n_experts:
        return {}
    n_experts, experts = _rank_counts(*shape_key(spec), pp_rank, True)
    expert_dp = expert_dp_size(spec)
    n = _held(spec, n_experts, experts, expert_dp, dp_rank % expert_dp, o.zero1, 0)
    wp, wg, wo = state_widths(spec, o)
    return {"params": _master_numel(spec, n, o) * wp, "grads": n["grads"] * wg,
            "optimizer": 0 if o.cpu_offload_optimizer else n["optimizer"] * wo, "expert_dp": expert_dp}


def most_loaded_dp_rank(spec: RunSpec, pp_rank: int, zero1: str = "zero_redundancy") -> int:
    """dp rank holding the most model states: 0 under FSDP (ceil-sized chunks first) and
    DDP; ZeRO-1's rank with the largest greedy partition (lowest on ties)."""
    if spec.layout.zero_stage != 1 or zero1 == "distributed_optimizer":
        return 0
    _, counts = _stage_numels(*shape_key(spec), pp_rank)
    sizes = _zero1_sizes(counts, spec.dp)
    return sizes.index(max(sizes))


def model_state_bytes_per_rank(spec: RunSpec, stage_index: int = 0) -> list[dict[str, int]]:
    """Per dp rank of pipeline rank ``stage_index``: params (held during the step: whole
    under ZeRO-2), grads and optimizer bytes at the ZeRO paper's widths (:data:`STATE_BYTES`);
    the dry run (xpar.run.dryrun) checks these element counts against torch's."""
    bp, bg, bo = STATE_BYTES[spec.train.dtype]
    out = []
    for r in range(spec.dp):
        n = held_numel(spec, stage_index, r)
        params = n["whole"] if spec.layout.zero_stage == 2 else n["storage"]
        out.append({"params": params * bp, "grads": n["grads"] * bg, "optimizer": n["optimizer"] * bo})
    return out


def peak_ranks(spec: RunSpec, pp_rank: int) -> tuple[int, list[int]]:
    """(most loaded dp rank, its global ranks -- one per tp rank) on pipeline rank ``pp_rank``.
    Callers pass the cp-folded spec (xpar.estimate.context_parallel.fold_cp, whose rank order is the
    real one): the dp rank is then the index dp' = dp cp + c in the dp x cp replica group."""
    dp_rank = most_loaded_dp_rank(spec, pp_rank)
    first = spec.layout.rank(pp_rank, dp_rank, 0)
    return dp_rank, list(range(first, first + spec.tp))




def _master_numel(spec: RunSpec, n: dict, o: MemoryOptions) -> int:
    """Parameter elements stored on a rank of :func:`held_numel` counts ``n``: whole under ZeRO-2 (and
    ZeRO-0/1), the shard under ZeRO-3; bf16 storage (Megatron, DeepSpeed) whole through ZeRO-2."""
    z = spec.layout.zero_stage
    if spec.train.dtype == "fp32":
        return n["whole"] if z == 2 else n["storage"]  # ZeRO-2 holds the whole params
    if o.param_storage == "bf16":  # Megatron/DeepSpeed: bf16 params, fp32 master in the optimizer
        return n["whole"] if z <= 2 else n["storage"]
    return n["storage"]


def held_state_terms(spec: RunSpec, pp_rank: int, dp_rank: int, o: MemoryOptions) -> dict[str, int]:
    """:func:`state_terms` less autocast's weight copies (``params_compute`` 0 under autocast;
    those depend on the schedule, the rest on the rank's parameters, dp and the ZeRO stage only).
    Bytes."""
    n = held_numel(spec, pp_rank, dp_rank, o.zero1, o.replicated_embedding_grad)
    wp, wg, wo = state_widths(spec, o)
    z, rec = spec.layout.zero_stage, precision(spec, o)
    compute = 0
    master = _master_numel(spec, n, o) * wp
    fp32_master = spec.train.dtype != "fp32" and o.param_storage != "bf16"
    if fp32_master and not rec["autocast"] and (z == 2 or (z == 3 and spec.pp > 1 and not o.fsdp_reshard_under_pp)):
        compute = n["whole"] * rec["e"]
    optimizer = 0 if o.cpu_offload_optimizer else n["optimizer"] * wo
    if o.fp8_weight_copies and spec.train.dtype == "fp8":  # Transformer Engine's FP8 weights (xpar.estimate.frameworks.fp8_weights)
        linear = _block_linear_numel(*shape_key(spec), pp_rank)
        compute += fp8_weight_copy_bytes(spec.train.dtype, z, linear, o, spec.train.fp8_recipe,
                                         bool(getattr(spec.hardware, "mxfp8", False)))
    return {"params_master": master, "params_compute": compute, "grads": n["grads"] * wg, "optimizer": optimizer}
