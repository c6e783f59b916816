"""Per-device memory of a layout: model states, activations, buffers. Units: bytes.

Model states (Rajbhandari et al. 2020, "ZeRO", Sec. 3.1 and 5, Fig. 1): mixed-precision
Adam keeps 2 (bf16 params) + 2 (bf16 grads) + K = 12 (fp32 master params, exp_avg,
exp_avg_sq) bytes per parameter; fp32 training keeps 4 + 4 + 8. ZeRO shards over the dp
ranks: stage 1 the optimizer states, stage 2 also the gradients, stage 3 also the params.
:func:`model_state_bytes` counts what xpar's torch wrappers actually hold per rank:

- DDP (stage 0): the whole local (tp-sharded) stage, params + grads, AdamW exp_avg and
  exp_avg_sq (the scalar ``step`` ignored);
- ZeRO-1 (torch ``ZeroRedundancyOptimizer``): optimizer states of the *whole* parameters
  assigned to this rank, greedily largest-first to the least-loaded rank (one param group;
  torch's ``_partition_parameters``). The paper's K*Psi/N_d is the ideal; we report the
  most loaded rank;
- ZeRO-2/3 (FSDP2 ``fully_shard``): every parameter is cut along dim 0 into dp chunks of
  ceil(d0/dp) rows, rank r holding rows [r c, min(d0, (r+1) c)) (the last ranks may hold
  fewer or none). ZeRO-2 (reshard_after_forward=False) holds the full parameters from
  forward to backward, so params count unsharded; grads and optimizer states are shards.
  ZeRO-3 shards all three. Gradients stay shards with m micro-batches because xpar
  reduce-scatters after every micro-batch's backward (xpar.parallel.factory.accumulate_step),
  as DeepSpeed and torchtitan do. Under pipeline parallelism torch's ``PipelineStage``
  instead turns FSDP2's gradient sync off for *every* backward and reduce-scatters once,
  after the stage's last one (``perform_reduce_grad``; torch 2.13, whatever m), so until
  then the rank holds its stages' whole dp-unsharded gradients: grads count unsharded
  there, as the measured accounting does (xpar.memory_accounting.model_state_bytes). Where a
  reduction is deferred under tp, the token embedding's gradient is held at the whole
  vocabulary (:func:`replicated_embedding_grad_numel`).

Tensor parallelism (Megatron, Shoeybi et al. 2019): q/k/v/w1/w3 split on dim 0, wo/w2 on
dim 1, token embedding and output projection on the vocabulary (dim 0); norms, row-parallel
biases and the learned position embedding replicated. Shapes come from the real model
built on the meta device, so the counts match ``sum(p.numel())`` exactly.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Table 2), per layer, 16-bit activations, 1-byte dropout masks:

    no parallelism        s b h (34 + 5 a s / h)
    tensor parallel t     s b h (10 + 24/t + 5 a s / (h t))
    t + sequence par.     s b h / t (34 + 5 a s / h)
    selective recompute   drops the 5 a s / h terms;  full recompute keeps 2 s b h (the input)

:func:`layer_activation_bytes` derives these term by term so the same count covers GQA
(K, V of width kv), SwiGLU (four f-wide tensors instead of two), no dropout and fused
(flash) attention; see its docstring. A stage holds the activations of every micro-batch in
flight (Korthikanti Sec. 4.2.3): GPipe m, 1F1B min(m, p - r) on rank r, interleaved 1F1B
p (1 + (p - 1)/(p v)) on the first rank.
"""
from __future__ import annotations

import math
from dataclasses import astuple, dataclass, field
from functools import lru_cache
from typing import Optional

from xpar.config import ModelConfig
from xpar.spec import RunSpec

BYTES = {"fp32": 4, "bf16": 2}
# bytes per parameter (params, grads, optimizer states): ZeRO paper's 2 + 2 + K, K = 12, for
# bf16 mixed precision; fp32 AdamW: 4 + 4 + 8 (exp_avg, exp_avg_sq).
STATE_BYTES = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}
STATE_TERMS = ("params", "grads", "optimizer")
MEMORY_TERMS = STATE_TERMS + ("activations", "comm_buffers", "framework_overhead")
"""The terms of a device's peak memory, named the same in estimates, reports and metrics."""


def zero_model_state_bytes(psi: float, stage: int, n_d: int, p: int = 2, g: int = 2, k: int = 12) -> float:
    """Model-state bytes per device, ZeRO paper Sec. 5 / Fig. 1 / Table 1 (Psi parameters,
    P bytes per param, G per gradient, K of optimizer states; mixed-precision Adam
    2 + 2 + 12; dp degree n_d): stage 0 (P + G + K) Psi; 1: (P + G) Psi + K Psi / n_d;
    2: P Psi + (G + K) Psi / n_d; 3: (P + G + K) Psi / n_d."""
    return {0: (p + g + k) * psi, 1: (p + g) * psi + k * psi / n_d, 2: p * psi + (g + k) * psi / n_d,
            3: (p + g + k) * psi / n_d}[stage]


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
    import torch

    from xpar.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(ModelConfig(*cfg_key), layers=list(range(n_blocks)), first=first, last=last)
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters())


def _stage_shapes(cfg_key: tuple, layers: tuple[int, ...], first: bool, last: bool) -> list:
    """named_parameters() shapes of ``Transformer(cfg, layers, first, last)`` built on the
    meta device. Blocks are identical, so one block is built and its shapes repeated under
    each block's name (building 100 blocks, even on meta, takes seconds)."""
    outer = _meta_shapes(cfg_key, 0, first, last)
    block = [(n.split(".", 2)[2], sh) for n, sh in _meta_shapes(cfg_key, 1, False, False)]
    head = [x for x in outer if x[0].split(".")[0] in ("tok_embeddings", "pos_embeddings")]
    tail = [x for x in outer if x not in head]
    return head + [(f"layers.{i}.{n}", sh) for i in layers for n, sh in block] + tail


def param_shapes(spec: RunSpec, pp_rank: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, tp-local shape) of every parameter held by pipeline rank ``pp_rank``, in the
    order ``model.parameters()`` yields them (tied weights once), built on the meta device."""
    layout, out = spec.layout, []
    for s in layout.stages_of(pp_rank):
        shapes = _stage_shapes(astuple(spec.model), tuple(layout.stage_layers(s)), s == 0, s == layout.n_stages - 1)
        out += [(f"{s}:{name}", _tp_local(name, shape, spec.tp)) for name, shape in shapes]
    return out


def fsdp_shard_numel(shape: tuple[int, ...], dp: int, rank: int) -> int:
    """Elements of FSDP2's local shard on dp rank ``rank``: rows
    [rank c, min(d0, (rank+1) c)) with c = ceil(d0 / dp) (torch.chunk on dim 0)."""
    d0 = shape[0] if shape else 1
    rest = math.prod(shape[1:]) if len(shape) > 1 else 1
    c = math.ceil(d0 / dp)
    return max(0, min(d0, (rank + 1) * c) - rank * c) * rest


def zero1_partition(numels: list[int], dp: int) -> list[int]:
    """Elements per rank assigned by torch's ZeroRedundancyOptimizer: parameters sorted by
    size, largest first (stable), each to the rank with the fewest elements so far (lowest
    rank on ties)."""
    sizes = [0] * dp
    for n in sorted(numels, reverse=True):
        sizes[sizes.index(min(sizes))] += n
    return sizes


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
    Measured on the CPU build of torch 2.13 (tests/test_pipeline.py, 3D runs)."""
    if spec.tp == 1 or not grads_deferred(spec):
        return 0
    return sum(math.prod(sh) * (spec.tp - 1) for name, sh in param_shapes(spec, pp_rank)
               if name.split(":", 1)[1] == "tok_embeddings.weight")


def model_state_bytes_per_rank(spec: RunSpec, stage_index: int = 0) -> list[dict[str, int]]:
    """:func:`model_state_bytes` of every dp rank of pipeline rank ``stage_index``."""
    shapes = [shape for _, shape in param_shapes(spec, stage_index)]
    numels = [math.prod(s) for s in shapes]
    full, dp, z = sum(numels), spec.dp, spec.parallel.zero_stage
    bp, bg, bo = STATE_BYTES[spec.train.dtype]
    zero1 = zero1_partition(numels, dp) if z == 1 else None
    whole_grads = full + replicated_embedding_grad_numel(spec, stage_index)  # held while deferred
    out = []
    for r in range(dp):
        shard = sum(fsdp_shard_numel(s, dp, r) for s in shapes)
        grads = whole_grads if grads_deferred(spec) else (shard if z >= 2 else full)
        if z == 0:
            n = (full, grads, full)
        elif z == 1:
            n = (full, grads, zero1[r])
        elif z == 2:
            n = (full, grads, shard)
        else:
            n = (shard, grads, shard)
        out.append({"params": n[0] * bp, "grads": n[1] * bg, "optimizer": n[2] * bo})
    return out


def peak_ranks(spec: RunSpec, pp_rank: int) -> tuple[int, list[int]]:
    """(most loaded dp rank, its global ranks -- one per tp rank) on pipeline rank ``pp_rank``."""
    per_dp = model_state_bytes_per_rank(spec, pp_rank)
    dp_rank = max(range(len(per_dp)), key=lambda r: sum(per_dp[r].values()))
    first = spec.layout.rank(pp_rank, dp_rank, 0)
    return dp_rank, list(range(first, first + spec.tp))


def model_state_bytes(spec: RunSpec, stage_index: Optional[int] = None,
                      dp_rank: Optional[int] = None) -> dict[str, int]:
    """Bytes per device of params, grads and optimizer states (dict with those keys).

    ``stage_index``: the pipeline rank (holding stages stage_index, stage_index + pp, ... for
    interleaved schedules); None takes the rank with the most bytes. ``dp_rank``: None
    takes the dp rank with the most bytes (rank 0 under FSDP; ZeRO-1's most loaded rank).
    For fp32 this equals what xpar.memory_accounting.model_state_bytes measures on a real run.
    """
    ranks = range(spec.pp) if stage_index is None else [stage_index]
    best = None
    for pr in ranks:
        per_dp = model_state_bytes_per_rank(spec, pr)
        cands = per_dp if dp_rank is None else [per_dp[dp_rank]]
        for d in cands:
            if best is None or sum(d.values()) > sum(best.values()):
                best = d
    return best


# --- activations -----------------------------------------------------------------------

def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                           recompute: str = "none", *, kv: Optional[int] = None,
                           ffn: Optional[int] = None, swiglu: bool = False, dropout: bool = True,
                           flash: bool = False, elem: int = 2, norm_saves_output: bool = False,
                           sp_saves_gathered: bool = False) -> float:
    """Bytes one transformer layer keeps for backward, for one micro-batch (b sequences of s).

    Korthikanti et al. 2022, Sec. 4.1, term by term (e = elem bytes, mask = 1 byte/element
    when ``dropout``), per token:

    - replicated across tp unless ``sp``: two norm inputs 2 e h, the q/k/v input and the
      MLP input e h each, two dropout masks h each  -> 10 h for GPT (e = 2);
    - split by tp: Q e h, K and V e kv each, the wo input e h, MLP inner tensors
      2 e f (GELU: its input and the w2 input) or 4 e f (SwiGLU: w1 and w3 outputs, silu
      output, w2 input)                            -> 24 h for GPT (kv = h, f = 4h);
    - attention scores, split by tp: softmax output e a s, its dropout mask a s and output
      e a s (no dropout: e a s only)               -> 5 a s for GPT; with ``flash`` (fused
      attention) only the fp32 log-sum-exp, 4 a bytes per token.

    ``selective`` recompute drops the score terms; ``full`` keeps only the layer input
    e h (divided by t with ``sp``). ``norm_saves_output``: each of the two norms also keeps
    its normalised input x * rstd for the weight gradient (+2 e h, replicated): torch's
    composite RMSNorm, measured on the CPU build of torch 2.13 (a fused norm kernel keeps
    only its input). ``sp_saves_gathered`` (with ``sp``): the q/k/v input and the MLP input
    are kept as the all-gathered full sequence, 2 e h not divided by t -- torch's DTensor
    sequence parallelism (the linear's weight gradient reads its gathered input; Megatron
    keeps the shard and all-gathers again in backward, as Korthikanti et al. count).
    Measured on CPU with torch 2.13 (tests/test_estimate_run.py). Not counted: RoPE's and
    norms' small side tensors (rstd, cos/sin). Units: bytes.
    """
    kv = h if kv is None else kv
    f = 4 * h if ffn is None else ffn
    mask = 1 if dropout else 0
    if recompute == "full":
        return s * b * elem * h / (t if sp else 1)
    rep = 2 * elem * h + 2 * elem * h + 2 * mask * h + (2 * elem * h if norm_saves_output else 0)
    split = 2 * elem * h + 2 * elem * kv + (4 if swiglu else 2) * elem * f
    scores = 4 * a if flash else a * s * (elem + (mask + elem if dropout else 0))
    if recompute == "selective":
        scores = 0
    gathered = 2 * elem * h if (sp and sp_saves_gathered) else 0  # kept at full sequence length
    per_token = (rep - gathered + split + scores) / t + gathered if sp else rep + (split + scores) / t
    return s * b * per_token


def korthikanti_table2(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                       recompute: str = "none") -> float:
    """Korthikanti et al. 2022 Table 2 closed forms (GPT, 16-bit, dropout). Units: bytes."""
    att = 0 if recompute == "selective" else 5 * a * s / h
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    if sp:
        return s * b * h / t * (34 + att)
    return s * b * h * (10 + 24 / t + att / t)


def microbatches_in_flight(schedule: str, pp: int, m: int, v: int = 1, rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at its peak, in units of
    the rank's whole layer set (Korthikanti et al. 2022, Sec. 4.2.3):

    gpipe m; 1f1b min(m, p - r); interleaved_1f1b min(v m, 2 (p - r - 1) + (v - 1) p + 1)
    chunks of 1/v each, i.e. p (1 + (p - 1)/(p v)) on rank 0 (Megatron's warm-up, as in
    torch's Interleaved1F1B); other schedules: the peak of torch's action order
    (:func:`xpar.estimate.schedule.peak_in_flight`) / v.
    """
    if pp == 1:
        return 1.0  # gradient accumulation: one micro-batch at a time
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - rank))
    if schedule == "interleaved_1f1b":
        return min(v * m, 2 * (pp - rank - 1) + (v - 1) * pp + 1) / v
    from xpar.estimate.schedule import peak_in_flight, torch_actions
    return peak_in_flight(torch_actions(schedule, pp, m, v)[rank]) / v


def activation_terms(spec: RunSpec, pp_rank: int, flash: bool = True, dropout: bool = False,
                     fused_rmsnorm: bool = True, sp_saves_gathered: bool = True) -> dict:
    """Activation bytes of pipeline rank ``pp_rank`` at its peak, by term.

    layers: per-layer bytes x the rank's layers x micro-batches in flight; recompute_layer:
    with full recompute, one layer's full activations rebuilt during its backward;
    embedding (first stage): the int64 token ids (8 bytes each) per micro-batch in flight
    and, with ``dropout``, the embedding dropout mask; logits (last stage): the final norm
    input and output-projection input (e h each, /t with sp) and the fp32 log-softmax
    saved by the cross entropy, 4 V / t per token (Korthikanti Sec. 4.3), for one
    micro-batch (the last stage runs each backward right after its forward), m with GPipe.

    ``flash``: xpar's model calls scaled_dot_product_attention (fused; no s x s scores
    kept); it expands GQA K/V to all heads before that call, so K and V are counted at
    full width h. xpar's model has no dropout. ``fused_rmsnorm=False`` (torch's composite
    RMSNorm, e.g. on CPU): every RMSNorm also keeps x * rstd, one more e h per norm
    (``norm_saves_output`` of :func:`layer_activation_bytes`; the final norm in logits).
    ``sp_saves_gathered``: torch's sequence parallelism keeps the all-gathered inputs of the
    q/k/v, MLP and output projections at full sequence length (see
    :func:`layer_activation_bytes`).
    """
    cfg, par = spec.model, spec.parallel
    s, b, h, t, sp = spec.seq_len, spec.train.micro_batch_size, cfg.hidden, spec.tp, par.sequence_parallel
    e = BYTES[spec.train.dtype]
    extra_norm = not fused_rmsnorm and cfg.norm == "rmsnorm"
    kw = dict(kv=h, ffn=cfg.ffn_hidden, swiglu=cfg.activation == "swiglu", dropout=dropout,
              flash=flash, elem=e, norm_saves_output=extra_norm, sp_saves_gathered=sp_saves_gathered)
    per_layer = layer_activation_bytes(s, b, h, cfg.n_heads, t, sp, par.recompute, **kw)
    full_layer = layer_activation_bytes(s, b, h, cfg.n_heads, t, sp, "none", **kw)
    split, stages = spec.layer_split, spec.layout.stages_of(pp_rank)
    n_layers, v = spec.layout.layers_of(pp_rank), spec.layout.virtual_stages
    inflight = microbatches_in_flight(par.schedule, spec.pp, spec.micro_batches, v, pp_rank)
    last_inflight = spec.micro_batches if (par.schedule == "gpipe" and spec.pp > 1) else 1
    sh = s * b * h / (t if sp else 1)
    return {
        "layers": per_layer * n_layers * inflight,
        "recompute_layer": full_layer if par.recompute == "full" and n_layers else 0.0,
        "embedding": (8 * s * b + (s * b * h / t if dropout else 0)) * inflight if 0 in stages else 0.0,
        "logits": (((1 + extra_norm) * e * sh + e * (s * b * h if sp and sp_saves_gathered else sh)
                    + 4 * s * b * cfg.vocab_size / t) * last_inflight
                   if len(split) - 1 in stages else 0.0),
        "microbatches_in_flight": inflight,
    }


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
    pp_rank: int
    detail: dict = field(default_factory=dict)
    """activations by term (layers, recompute_layer, embedding, logits), micro-batches in
    flight, comm buffers by term."""


def comm_buffer_terms(spec: RunSpec, pp_rank: int) -> dict[str, float]:
    """Communication and sharding buffers, bytes.

    ddp_buckets (ZeRO 0/1): torch DDP copies gradients into flat buckets
    (gradient_as_bucket_view=False, the default): one more gradient-sized buffer.
    fsdp_unsharded (ZeRO 2/3): FSDP2 all-gathers one unit (a block, or the root: embedding,
    norm, output) ahead of use: two units of params in flight for ZeRO-3, plus one unit of
    unsharded gradients before its reduce-scatter. Under pipeline parallelism the unsharded
    gradients are already counted in ``grads`` (torch defers FSDP2's reduction to the
    stage's last backward, see :func:`model_state_bytes_per_rank`), so only the params.
    With m micro-batches there is no further gradient buffer: xpar reduce-scatters every
    micro-batch (pp = 1), and under pp the deferred gradients are the ``grads`` term.
    pp_p2p: one send and one receive buffer of b s h elements per stage held (/t with sp).
    """
    z, e = spec.parallel.zero_stage, BYTES[spec.train.dtype]
    shapes = param_shapes(spec, pp_rank)
    full = sum(math.prod(sh) for _, sh in shapes)
    units: dict[str, int] = {}
    for name, sh in shapes:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0].endswith("layers") else parts[0].split(":")[0] + ":root"
        units[key] = units.get(key, 0) + math.prod(sh)
    unit = max(units.values()) if units else 0
    out = {"ddp_buckets": 0.0, "fsdp_unsharded": 0.0, "pp_p2p": 0.0}
    if z <= 1 and spec.dp > 1:
        out["ddp_buckets"] = full * STATE_BYTES[spec.train.dtype][1]
    if z >= 2:
        param_units = 2 if z == 3 else 0
        grad_units = 1 if spec.pp == 1 else 0
        out["fsdp_unsharded"] = unit * e * (param_units + grad_units)
    if spec.pp > 1:
        sh = spec.seq_len * spec.train.micro_batch_size * spec.model.hidden
        out["pp_p2p"] = 2 * len(spec.layout.stages_of(pp_rank)) * sh * e / (spec.tp if spec.parallel.sequence_parallel else 1)
    return out


def memory(spec: RunSpec, pp_rank: Optional[int] = None, flash: bool = True,
           dropout: bool = False, fused_rmsnorm: bool = True, sp_saves_gathered: bool = True) -> MemoryEstimate:
    """Per-device peak memory of ``spec`` on pipeline rank ``pp_rank`` (None: the most
    loaded rank). See the module docstring for the formulas; ``flash``, ``dropout``,
    ``fused_rmsnorm``, ``sp_saves_gathered`` as in
    :func:`activation_terms`."""
    ranks = range(spec.pp) if pp_rank is None else [pp_rank]
    best = None
    for r in ranks:
        states = model_state_bytes(spec, r)
        act = activation_terms(spec, r, flash=flash, dropout=dropout, fused_rmsnorm=fused_rmsnorm,
                               sp_saves_gathered=sp_saves_gathered)
        comm = comm_buffer_terms(spec, r)
        acts = sum(v for k, v in act.items() if k != "microbatches_in_flight")
        overhead = spec.hardware.framework_overhead_gb * 1e9
        total = sum(states.values()) + acts + sum(comm.values()) + overhead
        dev = (spec.hardware.device_memory_gb or 0) * 1e9
        est = MemoryEstimate(params=states["params"], grads=states["grads"], optimizer=states["optimizer"],
                             activations=acts, comm_buffers=sum(comm.values()), framework_overhead=overhead,
                             total=total, device_memory=dev, fits=total <= dev, pp_rank=r,
                             detail={"activations": act, "comm_buffers": comm})
        if best is None or est.total > best.total:
            best = est
    return best
