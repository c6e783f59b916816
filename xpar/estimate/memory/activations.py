"""Saved activations per layer, stage and pipeline schedule (Korthikanti et al. 2022; the
schedule walk of torch's action lists): the second part of the memory estimate
(:mod:`xpar.estimate.memory.per_device` documents the accounting and its sources)."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Optional

import numpy as np

from xpar.config.attention import tp_model
from xpar.config.remat import MODULE_POLICIES, POLICIES, extra_forward_flops_per_layer, policy_name, stage_share
from xpar.config.remat import token_ffn as remat_token_ffn
from xpar.config.schema import ModelConfig
from xpar.config.spec import RunSpec
from xpar.estimate.memory.activation_offload import offload_layers, resident_blocks
from xpar.estimate.memory.mla import freed_bytes, latent_bytes, mla_widths
from xpar.estimate.memory.model_states import MemoryOptions, precision
from xpar.estimate.schedule import schedule_actions


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                           recompute: str = "none", *, kv: Optional[int] = None,
                           ffn: Optional[int] = None, swiglu: bool = False, dropout: bool = True,
                           flash: bool = False, elem: int = 2, norm_saves_output: bool = False,
                           sp_saves_gathered: bool = False, resid_elem: Optional[int] = None,
                           autocast_casts: bool = False, kv_matmul: Optional[int] = None,
                           selective: str = "attention", fused_swiglu: bool = False, q: Optional[int] = None,
                           block: str = "sequential", compiled: bool = False) -> float:
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

    Framework variants (measured on CPU with torch 2.13, tests/estimate/test_estimate_run.py):
    ``norm_saves_output``: torch's composite RMSNorm upcasts to fp32 and keeps its fp32 input
    and x * rstd (8 h per norm whatever the dtype; a fused norm keeps its input, er h);
    ``autocast_casts``: under torch.autocast each projection casts its fp32 input to bf16
    separately, so q, k, v (and w1, w3) each keep their own e h copy; ``sp_saves_gathered``
    (with ``sp``): the projections' inputs are kept all-gathered at full sequence length
    (torch DTensor; Megatron keeps the shard and gathers again in backward); ``fused_swiglu``: one
    SwiGLU kernel keeps its input (w1 and w3 outputs) and recomputes silu in backward, so the MLP
    keeps 3 e f, not 4 e f (Megatron-Core's bias_swiglu_impl, megatron/core/fusions/fused_bias_swiglu.py).

    ``recompute``: a policy of :mod:`xpar.config.remat` (``selective`` is ``selective``:
    the framework's). ``full`` keeps the layer input, er h (/t with sp); 'attention'
    (Megatron) drops the score terms; the op-level policies ('op', 'torchtitan_op',
    'save_dot_except_mlp', 'save_qkv_proj') keep the input and the outputs they name
    (:func:`_kept_bytes`). Not counted: RoPE's and norms' small side tensors (rstd,
    cos/sin). ``q``: the queries' and context's width, n_heads x head dim (None: h). ``block``: model.block
    (:func:`_replicated_bytes`). ``compiled`` (train.compile): :func:`compiled_drops`. Units: bytes.
    """
    q = h if q is None else q
    kv = q if kv is None else kv
    kvm = kv if kv_matmul is None else kv_matmul
    f = 4 * h if ffn is None else ffn
    er = elem if resid_elem is None else resid_elem
    mask = 1 if dropout else 0
    policy = policy_name(recompute, selective)
    if policy == "full":
        return s * b * er * h / (t if sp else 1)
    if policy not in ("none", "attention"):
        return s * b * _kept_bytes(h, a, t, sp, f, kvm, swiglu, elem, er, policy, q, compiled)
    rep, n_in = _replicated_bytes(h, elem, er, mask, swiglu, norm_saves_output, autocast_casts, block)
    split = 2 * elem * q + 2 * elem * kv + ((3 if fused_swiglu else 4) if swiglu else 2) * elem * f
    scores = 4 * a if flash else a * s * (elem + (mask + elem if dropout else 0))
    if policy == "attention":
        scores = 0
    gathered = n_in * elem * h if (sp and sp_saves_gathered) else 0  # kept at full sequence length
    per_token = (rep - gathered + split + scores) / t + gathered if sp else rep + (split + scores) / t
    return s * b * per_token


def _replicated_bytes(h: int, elem: int, er: int, mask: int, swiglu: bool, norm_saves_output: bool,
                      autocast_casts: bool, block: str) -> tuple[float, int]:
    """(bytes per token of :func:`layer_activation_bytes`'s replicated terms, projection inputs kept): the norm
    inputs, the q/k/v and MLP inputs and the two dropout masks (its docstring). In a parallel ``block``
    (model.block, xpar.config.block) both branches read the block input x, so its norm input is kept once (a fused
    norm's; torch's composite one keeps its fp32 copy per norm), and with one norm the q/k/v and MLP inputs are
    one tensor (not under ``autocast_casts``: each projection casts its own)."""
    n_norms = 1 if block == "parallel" else 2
    n_in = (3 + (2 if swiglu else 1)) if autocast_casts else n_norms
    norm_in = 4 if norm_saves_output else er
    norm_inputs = n_norms if (norm_saves_output or block == "sequential") else 1
    rep = norm_inputs * norm_in * h + n_in * elem * h + 2 * mask * h + (n_norms * 4 * h if norm_saves_output else 0)
    return rep, n_in


def kept_terms(policy: str, swiglu: bool, compiled: bool = False) -> tuple:
    """The projections whose outputs a block keeps under an op-level ``policy``
    (:data:`xpar.config.remat.POLICIES`); torchtitan keeps every other matmul output, so w2
    (the 7th matmul with SwiGLU, the 6th with GELU) only with SwiGLU; ``compiled``: less
    :func:`compiled_drops`."""
    keeps = POLICIES[policy].keeps
    drop = compiled_drops(policy, compiled)
    return tuple(k for k in keeps if (k != "w2" or swiglu or policy != "torchtitan_op") and k not in drop)


def compiled_drops(policy: str, compiled: bool) -> tuple:
    """The kept outputs a compiled block does not keep under ``policy``: ('w2',) for torchtitan's op-level SAC under
    train.compile, else (). Eager selective checkpointing caches the output of every op its policy marks MUST_SAVE,
    read by the backward or not (torch/utils/checkpoint.py ``_CachingTorchDispatchMode``: ``storage[key][idx] = out``
    for MUST_SAVE/PREFER_SAVE; ``CheckpointPolicy``'s note: such a policy "would save additional tensors not limited
    to ones that are actually needed for gradient computation"). Under torch.compile the policy only tags the traced
    nodes, and AOTAutograd's partitioner keeps the saved values the backward graph reads
    (torch/_functorch/partitioners.py ``_extract_fwd_bwd_modules``: "filter out saved values that don't actually end
    up being used by the backwards pass"). w2's output (torchtitan's 7th matmul) only feeds the residual add, whose
    backward reads nothing, so a compiled block drops it, and with sequence parallelism its reduce-scatter's output
    (:func:`_kept_bytes`); the other kept outputs are read (the SDPA, SwiGLU and wo backwards; q, v and h rebuilt from
    them). Checked on torch (tests/estimate/test_compile.py)."""
    return ("w2",) if compiled and policy == "torchtitan_op" else ()


def _kept_bytes(h: int, a: int, t: int, sp: bool, f: int, kv: int, swiglu: bool, e: int, er: int,
                policy: str, q: Optional[int] = None, compiled: bool = False) -> float:
    """Per-token bytes kept by an op-level policy (see :func:`layer_activation_bytes`): the block
    input, then each kept output -- q e h/t, k and v e kv/t (the un-expanded GQA width), w1 and w3
    e f/t, wo and w2 e h (partial sums under tp), SDPA's output e h/t with its fp32 log-sum-exp
    4 a/t ('context') -- and the tp collectives' outputs the policy keeps ('op': all of them, 2
    all-reduced e h, with sp 2 gathered e h and 2 reduce-scattered e h/t; torchtitan: its
    reduce-scatters, compiled only wo's: :func:`compiled_drops`; the MaxText policies none); q: the queries' width
    (None: h). Units: bytes per token."""
    q = h if q is None else q
    width = {"wq": q / t, "wk": kv / t, "wv": kv / t, "wo": h, "w1": f / t, "w3": f / t if swiglu else 0,
             "w2": h, "context": q / t}
    lse = 4 * a / t if "context" in POLICIES[policy].keeps else 0  # SDPA's fp32 log-sum-exp
    kept = e * sum(width[k] for k in kept_terms(policy, swiglu, compiled)) + lse
    block_in = er * h / (t if sp else 1)
    coll = 0.0
    if t > 1 and sp and policy in ("op", "torchtitan_op"):
        scatters = 1 if "w2" in compiled_drops(policy, compiled) else 2
        coll = scatters * e * h / t + (2 * e * h if policy == "op" else 0)
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
    """Forward FLOPs per token run again in backward, the whole model's blocks times
    ``fraction`` of them (:func:`xpar.config.remat.extra_forward_flops_per_layer`: full --
    every block's forward; 'attention' and 'op' -- the attention core; 'torchtitan_op' -- wk,
    wo, and w3 with SwiGLU; save_dot_except_mlp -- the attention core, w1 and w3; ``policy``:
    what ``selective`` means). Units: FLOP per token."""
    return fraction * cfg.n_layers * extra_forward_flops_per_layer(cfg, seq_len, recompute, policy)


def _deepep_branch_note(spec: RunSpec, o: MemoryOptions) -> list[str]:
    """The note for torchtitan + DeepEP under full recompute without the kept graphs: the branch whose README
    publishes torchtitan's DeepEP scaling runs (pytorch/torchtitan @022f885f, torchtitan/distributed/deepep/) keeps
    them (docs/accuracy/fit_history.md, session 13); upstream's DeepEP path does not, hence the default."""
    on = replace(o, moe_recompute_graph_kept=True)
    graph = max(moe_kept_graph_bytes(spec, on, st, stage_recompute_share(spec, st, on))
                for st in range(spec.layout.n_stages))
    return [f"torchtitan's DeepEP branch (022f885f, whose README publishes its DeepEP runs) keeps each recomputed MoE "
            f"block's graph after its backward ({graph / 1e9:.1f} GB on the largest stage here, not counted); describe "
            f"such a run with framework.moe_recompute_graph_kept=true"] if graph else []


def recompute_notes(spec: RunSpec, o: MemoryOptions) -> list[str]:
    """What the estimate should say about the recompute policy: Megatron's selective recompute
    under flash attention saves ~nothing; an op-level policy that keeps more than no
    recompute (with sequence parallelism at large t, the wo/w2 outputs before their
    reduce-scatter and the all-gathered inputs are kept at full sequence length); the MoE graphs
    kept after the backward (:func:`moe_kept_graph_bytes`)."""
    name = policy_name(spec.layout.recompute, o.selective_recompute)
    graph = max(moe_kept_graph_bytes(spec, o, st, stage_recompute_share(spec, st, o)) for st in range(spec.layout.n_stages))
    if graph:
        return [f"framework.moe_recompute_graph_kept: after its backward each recomputed MoE block keeps its recomputed "
                f"attention and router graph until its next forward ({graph / 1e9:.1f} GB on the largest stage)"]
    if name == "full" and spec.framework.name == "torchtitan" and spec.framework.ep_dispatcher == "deepep":
        return _deepep_branch_note(spec, o)
    if name in ("none", "full"):
        return []
    if name == "attention" and o.flash_attention:
        return ["selective recompute of the attention core (Megatron) saves almost nothing under flash "
                "attention: the s x s scores are never kept (only a 4 a bytes/token log-sum-exp)"]
    lb = layer_bytes(spec, o, 1.0)
    if lb["kept"] > lb["none"]:
        return [f"recompute={spec.layout.recompute} ({name}) keeps {lb['kept'] / lb['none']:.2f}x the activations "
                f"of no recompute per block here (it keeps matmul and collective outputs that plain autograd "
                f"does not need); recompute=none or full is better for memory"]
    return []


def _layer_kwargs(spec: RunSpec, o: MemoryOptions) -> dict:
    """:func:`layer_activation_bytes` keywords for the spec's model, precision and framework. A compiled block
    (train.compile) keeps what fused kernels keep: AOTAutograd's partitioner (torch/_functorch/partitioners.py,
    min_cut_rematerialization_partition) recomputes pointwise ops in the backward, so RMSNorm keeps its bf16 input
    (no fp32 copies) and SwiGLU its two inputs and product (SiLU recomputed: 3 e f, ``fused_swiglu``); under an op-level
    torch policy it keeps only the saved outputs its backward reads (``compiled``: :func:`compiled_drops`)."""
    cfg, rec, compiled = spec.model, precision(spec, o), spec.train.compile
    kv_width = tp_model(spec).kv_heads * cfg.head_size  # K/V heads replicated over tp kept on every rank (tp_model)
    kw = dict(q=cfg.q_dim, kv=cfg.q_dim if o.gqa_kv_expanded else kv_width, kv_matmul=kv_width, ffn=token_ffn(cfg, routed_load(spec)),
              swiglu=cfg.activation == "swiglu", dropout=o.dropout, flash=o.flash_attention, elem=rec["e"],
              resid_elem=rec["er"], norm_saves_output=not (o.fused_rmsnorm or compiled) and cfg.norm == "rmsnorm",
              sp_saves_gathered=o.sp_saves_gathered, autocast_casts=rec["autocast"],
              selective=o.selective_recompute, fused_swiglu=o.fused_swiglu or compiled, block=cfg.block,
              compiled=compiled)
    return {**kw, **mla_widths(cfg)}  # MLA: its own q/k/v and context widths (xpar.estimate.memory.mla)


def token_ffn(cfg, load: float = 1.0) -> float:
    """The MLP inner width one token goes through, the mean over the blocks
    (:func:`xpar.config.remat.token_ffn`: what a token's MLP activations scale with), its routed experts' k x expert
    width times ``load`` (:func:`routed_load`: the busiest rank's routed copies over the even share). Not counted
    here: the router's E logits (small) and each routed copy of the token's input (k h per token, as large as the
    experts' inner activations for fine-grained experts: :func:`routed_copy_bytes`, per framework)."""
    base = remat_token_ffn(cfg)
    if load == 1.0 or not cfg.n_experts:
        return base
    return base + cfg.moe_layers * cfg.moe_top_k * cfg.expert_ffn * (load - 1.0) / cfg.n_layers


def routed_load(spec: RunSpec) -> float:
    """Routed copies the busiest rank's experts hold activations for, over the even share k T (T tokens per rank
    entering the MoE): ``model.capacity_factor`` c where set (every expert's buffer c x its even share, padded, at any
    ep: GShard, Lepikhin et al. 2021; Fedus et al. 2022; Megatron-Core ``--moe-pad-expert-input-to-capacity``), else,
    dropless, ``model.moe_imbalance`` where ep > 1 (the busiest ep rank's tokens over the mean: its experts receive that
    many copies and keep their SwiGLU inputs and outputs for backward) and 1 at ep 1, where a rank computes all k T
    copies whatever their spread over its experts. The busiest rank the step time prices
    (xpar.estimate.expert_parallel.busiest_rank_load) is the device whose memory is the peak. 1 without experts."""
    cfg = spec.model
    if not cfg.n_experts:
        return 1.0
    if cfg.capacity_factor is not None:
        return float(cfg.capacity_factor)
    return float(cfg.moe_imbalance) if spec.layout.ep > 1 else 1.0


def layer_bytes(spec: RunSpec, o: MemoryOptions, share: float) -> dict[str, float]:
    """One block, one micro-batch: ``kept`` (under the recompute policy on ``share`` of the
    blocks, the rest none: :func:`xpar.config.remat.stage_share`), ``none`` (no recompute)
    and ``workspace`` (rebuilt during a recomputed block's backward: none - policy; 0 when no
    block is recomputed). xpar's model expands GQA K/V to all heads before SDPA, so K and V are
    kept at width h; a framework whose kernel takes them un-expanded (``gqa_kv_expanded`` False)
    keeps kv_heads x head_dim. Bytes."""
    cfg, lay = spec.model, spec.layout
    args = (spec.seq_len, spec.train.micro_batch_size, cfg.hidden, cfg.n_heads, spec.tp, lay.sequence_parallel)
    kw = _layer_kwargs(spec, o)
    none = layer_activation_bytes(*args, "none", **kw) - fp8_input_saving(spec, o, "none") + mla_extra(spec, o, "none")
    name = policy_name(lay.recompute, o.selective_recompute)
    policy = (layer_activation_bytes(*args, "none" if name in MODULE_POLICIES else lay.recompute, **kw)
              - fp8_input_saving(spec, o, lay.recompute) + mla_extra(spec, o, name))
    none += routed_copy_bytes(spec, o, "none")
    policy += routed_copy_bytes(spec, o, name)
    return {"kept": share * policy + (1 - share) * none, "none": none, "workspace": none - policy if share else 0.0}


def routed_copy_bytes(spec: RunSpec, o: MemoryOptions, policy: str) -> float:
    """Bytes one block and micro-batch keeps of its tokens' routed copies (the mean over the blocks, as
    :func:`token_ffn`): ``framework.moe_routed_copies_kept`` copies of h per routed token (k per token), of which the
    experts' first GEMM's input is held on each of the etp ranks of its expert group (the tokens are gathered over
    etp, at the busiest rank's :func:`routed_load`) and the others on the token's own rank. Megatron-Core keeps one in every version: the grouped fc1 GEMM's
    input for its weight gradient (megatron/core/transformer/moe/experts.py ``TEGroupedMLP.forward`` -> Transformer
    Engine's ``GroupedLinear``, which saves its inputs for wgrad). A second, the experts' outputs where the combine
    multiplies them by the routing probabilities (megatron/core/transformer/moe/moe_utils.py ``unpermute``:
    ``permuted_tokens * permuted_probs`` keeps ``permuted_tokens`` for the probabilities' gradient), is not kept
    where the probabilities are applied in the experts' activation (``weighted_bias_swiglu_impl``), and its version
    split is not read here: profiles set 1. None under full recompute or
    ``moe`` (the MoE layer rerun whole, megatron/core/transformer/moe/moe_layer.py ``moe_layer_recompute``); 0 for a
    dense model or a profile with 0. Units: bytes."""
    cfg, lay = spec.model, spec.layout
    n = o.moe_routed_copies_kept
    if not (cfg.n_experts and n) or policy in ("full", "moe"):
        return 0.0
    local = spec.seq_len * spec.train.micro_batch_size / (spec.tp if lay.sequence_parallel else 1)
    # fc1's input: gathered over etp, on the busiest rank at its load (routed_load); the others on the token's rank
    copies = (lay.expert_tp if lay.sequence_parallel else 1) * routed_load(spec) + (n - 1)
    share = cfg.moe_layers / cfg.n_layers
    e = 1 if _fp8_inputs(spec, o) else precision(spec, o)["e"]  # Transformer Engine keeps FP8-cast GEMM inputs
    return e * cfg.moe_top_k * cfg.hidden * local * copies * share


def mla_extra(spec: RunSpec, o: MemoryOptions, policy: str) -> float:
    """Bytes one MLA block and micro-batch keeps beside :func:`layer_activation_bytes` at MLA's widths: its latents
    (:func:`xpar.estimate.memory.mla.latent_bytes`, not under full recompute) less what a module policy
    discards (:func:`xpar.estimate.memory.mla.freed_bytes`). 0 for a model without MLA and any other policy."""
    cfg, t, sp = spec.model, spec.tp, spec.layout.sequence_parallel
    fp8 = _fp8_inputs(spec, o)
    per_token = -freed_bytes(cfg, policy, precision(spec, o)["e"], t, sp, fp8, cfg.block == "parallel")
    if policy != "full":
        composite = not (o.fused_rmsnorm or spec.train.compile) and cfg.norm == "rmsnorm"
        e = precision(spec, o)["e"]
        per_token += latent_bytes(cfg, e, 1 if fp8 else e, composite) / (t if sp else 1)
    return spec.seq_len * spec.train.micro_batch_size * per_token


def fp8_input_saving(spec: RunSpec, o: MemoryOptions, recompute: str) -> float:
    """Bytes one block and micro-batch keeps less when its linear layers save FP8 inputs
    (``fp8_saves_inputs`` under train.dtype=fp8): 1 byte per element of the inputs of the q/k/v and
    MLP-in projections (h each, / t with sequence parallelism), of wo (h / t) and of w2 (ffn / t),
    under the policies that keep them (none, Megatron's attention); 0 otherwise."""
    if not _fp8_inputs(spec, o):
        return 0.0
    if policy_name(recompute, o.selective_recompute) not in ("none", "attention", *MODULE_POLICIES):
        return 0.0
    cfg, t, sp = spec.model, spec.tp, spec.layout.sequence_parallel
    inputs = 1 if cfg.block == "parallel" else 2  # one norm: the q/k/v and MLP-in inputs are one tensor
    per_token = inputs * cfg.hidden / (t if sp else 1) + (cfg.hidden + token_ffn(cfg, routed_load(spec))) / t
    return spec.seq_len * spec.train.micro_batch_size * per_token


def _fp8_inputs(spec: RunSpec, o: MemoryOptions) -> bool:
    """Whether the linear layers keep FP8 inputs (train.dtype=fp8 and ``fp8_saves_inputs``)."""
    return spec.train.dtype == "fp8" and o.fp8_saves_inputs


def stage_recompute_share(spec: RunSpec, stage: int, o: MemoryOptions) -> float:
    """Share of ``stage``'s blocks recomputed (:func:`xpar.config.remat.stage_share`:
    ``parallel.recompute_layers`` of them, else ``recompute_layer_fraction``)."""
    return stage_share(spec.layout.recompute, spec.layout.layer_split[stage], spec.parallel.recompute_layers,
                       o.recompute_layer_fraction)


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
    and the output projection); ``moe_graph``: :func:`moe_kept_graph_bytes`; ``moe_graph_backward``:
    :func:`moe_graph_backward_bytes`. ``layers`` counts the blocks a stage holds with activation offload
    (parallel.activation_offload_layers: :func:`xpar.estimate.memory.activation_offload.resident_blocks`). Bytes."""
    cfg, lay = spec.model, spec.layout
    rec = precision(spec, o)
    s, b, h, t, sp = spec.seq_len, spec.train.micro_batch_size, cfg.hidden, spec.tp, lay.sequence_parallel
    share = stage_recompute_share(spec, stage, o)
    lb = layer_bytes(spec, o, share)
    n = lay.layer_split[stage]
    kept_n = resident_blocks(n, offload_layers(spec), o.activation_offload_overlap)  # activation offload: pp 1 (xpar.estimate.memory.activation_offload)
    out = {"layers": kept_n * lb["kept"], "workspace": lb["workspace"] if n else 0.0, "logits": 0.0, "moe_graph": 0.0,
           "loss_transient": 0.0, "embedding_mask": 0.0, "weight_copies": 0.0}
    if rec["autocast"]:
        kv = tp_model(spec).kv_heads * cfg.head_size
        block = (2 * h * cfg.q_dim + 2 * h * kv + (3 if cfg.activation == "swiglu" else 2) * h * cfg.ffn_hidden) / t
        kept_blocks = n * (1 - share)
        out["weight_copies"] = rec["e"] * (kept_blocks * block + (cfg.vocab_size * h / t if stage == lay.n_stages - 1 else 0))
    if stage == 0 and o.dropout:
        out["embedding_mask"] = s * b * h / (t if sp else 1)
    if stage > 0 and n and not o.count_buffers:
        out["layers"] -= _uncounted_stage_input(spec, o, rec, share)
    out["moe_graph"] = moe_kept_graph_bytes(spec, o, stage, share)
    out["moe_graph_backward"] = moe_graph_backward_bytes(spec, o, stage, share)
    if stage == lay.n_stages - 1:
        sh = s * b * h / (t if sp else 1)
        composite = not o.fused_rmsnorm and cfg.norm == "rmsnorm"
        norm = 8 * sh if composite else rec["er"] * sh
        lin_in = rec["e"] * (s * b * h if sp and o.sp_saves_gathered else sh)
        kept, transient = loss_bytes(o.loss_kernel, spec.train.compile_loss, rec["e"])
        out["logits"] = norm + lin_in + kept * s * b * cfg.vocab_size / t
        out["loss_transient"] = transient * s * b * cfg.vocab_size / t
    return out


def moe_kept_graph_bytes(spec: RunSpec, o: MemoryOptions, stage: int, share: float) -> float:
    """Bytes the recomputed MoE blocks of ``stage`` keep after their backward with ``moe_recompute_graph_kept``
    (xpar.config.profile.FrameworkConfig): per recomputed MoE block, the recompute's graph of the attention sublayer and
    the router with its saved tensors, one micro-batch's (the last one each block recomputed): a block's
    no-recompute bytes (:func:`layer_activation_bytes`) without the expert MLP's inner tensors (the experts run after
    the router; their nodes are not reached from the kept probabilities). 0 without the option, experts or full
    recompute. Held from the block's backward to its next forward, so beside what the stage still keeps then, not
    beside its own micro-batch (:func:`stage_chunk_bytes`). Bytes."""
    cfg, lay = spec.model, spec.layout
    if not (o.moe_recompute_graph_kept and cfg.n_experts and share) or policy_name(lay.recompute) != "full":
        return 0.0
    moe = sum(cfg.is_moe_layer(i) for i in lay.stage_layers(stage))
    args = (spec.seq_len, spec.train.micro_batch_size, cfg.hidden, cfg.n_heads, spec.tp, lay.sequence_parallel)
    block = layer_activation_bytes(*args, "none", **dict(eager_layer_kwargs(spec, o), ffn=0))
    extra = spec.seq_len * spec.train.micro_batch_size * eager_attention_extra_bytes(spec, o)
    return share * moe * (block + extra)


def eager_layer_kwargs(spec: RunSpec, o: MemoryOptions) -> dict:
    """:func:`_layer_kwargs` for a block that runs eagerly under ``train.compile``: the deepep branch's fully recomputed
    MoE blocks. torchtitan @022f885f wraps each block in its checkpoint and compiles it with fullgraph=False
    (torchtitan/models/llama4/infra/parallelize.py apply_compile); dynamo traces torch.utils.checkpoint as one
    higher-order op, which refuses a body that mutates state outside it (``PrimusTurboDeepepManager.setup_metadata``'s
    ``self.token_probs``, ``MoE.tokens_per_expert.add_``) and then runs the whole checkpointed block eagerly, forward
    and recompute (the branch's own note @2a642d02, apply_compile: "prevent AC from falling back the whole graph to
    eager", "TODO: Fix Compile(AC(graph break))"; checked on torch, tests/estimate/test_moe_recompute_graph.py). So its
    SwiGLU keeps w1's and w3's outputs, silu's output and the product (4 e f, ``fused_swiglu`` only where the profile
    fuses it) and its norms are the profile's (``fused_rmsnorm``), not the compiled block's."""
    cfg = spec.model
    return dict(_layer_kwargs(spec, o), fused_swiglu=o.fused_swiglu, compiled=False,
                norm_saves_output=not o.fused_rmsnorm and cfg.norm == "rmsnorm")


def moe_graph_backward_bytes(spec: RunSpec, o: MemoryOptions, stage: int, share: float) -> float:
    """Bytes live while the last recomputed MoE block of ``stage`` runs its backward with ``moe_recompute_graph_kept``:
    the graphs the stage's other recomputed MoE blocks keep (:func:`moe_kept_graph_bytes`, one block's each) and that
    block's rebuilt activations, its no-recompute bytes (:func:`layer_activation_bytes`) with the eager extras
    (:func:`eager_attention_extra_bytes`; eager, :func:`eager_layer_kwargs`: SwiGLU keeps 4 e f) and the routed copies
    the expert GEMMs keep, e k h / t per token (the
    permuted input, torchtitan/distributed/deepep/utils.py ``permute``: ``tokens.index_select(0, sorted_indices)``, k
    rows a token, which the w1 and w3 ``torch._grouped_mm`` calls keep for their weight gradients:
    torchtitan/models/moe/moe.py _run_experts_grouped_mm; :func:`token_ffn` leaves it out). The backward runs the blocks last to first, so when the stage's first block
    is recomputed every other block already holds its graph again (torch's non-reentrant checkpoint recomputes one
    block at a time, in its backward: torch/utils/checkpoint.py). 0 where :func:`moe_kept_graph_bytes` is 0 or fewer
    than one MoE block is recomputed. One micro-batch. Bytes."""
    graph = moe_kept_graph_bytes(spec, o, stage, share)
    cfg, lay = spec.model, spec.layout
    n = share * sum(cfg.is_moe_layer(i) for i in lay.stage_layers(stage))
    if not graph or n < 1:
        return 0.0
    args = (spec.seq_len, spec.train.micro_batch_size, cfg.hidden, cfg.n_heads, spec.tp, lay.sequence_parallel)
    rebuilt = layer_activation_bytes(*args, "none", **eager_layer_kwargs(spec, o))
    routed = precision(spec, o)["e"] * cfg.moe_top_k * routed_load(spec) * cfg.hidden / spec.tp
    extra = eager_attention_extra_bytes(spec, o) + routed
    return graph * (n - 1) / n + rebuilt + spec.seq_len * spec.train.micro_batch_size * extra


def eager_attention_extra_bytes(spec: RunSpec, o: MemoryOptions) -> float:
    """Bytes per token an eager torchtitan attention sublayer and router keep for backward beyond
    :func:`layer_activation_bytes`'s terms, for the recomputed MoE graph of :func:`moe_kept_graph_bytes`. The MoE blocks
    of the deepep branch are compiled with fullgraph=False (torchtitan/models/llama4/infra/parallelize.py
    apply_compile @022f885f) and break the graph at DeepEP's autograd Functions
    (torchtitan/distributed/deepep/fused_a2a.py FusedDispatch), so the recompute is priced as eager code:

    - with ``model.qk_norm`` (Qwen3), the q_norm and k_norm inputs, (q + kv) / t elements (K before repeat_kv:
      kv_heads x head_dim), e bytes each under a fused RMSNorm (its input and rstd), 8 under torch's composite one
      (fp32 input and x * rstd, as :func:`_replicated_bytes`);
    - the router's fp32 softmax output over the E experts, 4 E, and its top-k int64 indices, 8 k
      (torchtitan/models/moe/moe.py TokenChoiceTopKRouter.forward: ``F.softmax(scores.to(torch.float32))`` keeps its
      output; ``scores.gather(dim=1, index=...)`` its index), replicated over tp.

    Not counted: SDPA's output beside wo's input (torchtitan's ``output.transpose(1, 2).contiguous()``): the flash
    kernels return a transposed view of a (b, s, heads, d) buffer, so the copy is a no-op and the two are one storage
    (checked on torch's CPU flash kernel, tests/estimate/test_moe_recompute_graph.py). 0 without experts. Units: bytes
    per token."""
    cfg = spec.model
    if not cfg.n_experts:
        return 0.0
    e, t = precision(spec, o)["e"], spec.tp
    kv = tp_model(spec).kv_heads * cfg.head_size
    norm = (e if o.fused_rmsnorm else 8) * (cfg.q_dim + kv) / t if cfg.qk_norm else 0.0
    return norm + 4 * cfg.n_experts + 8 * cfg.moe_top_k


def loss_bytes(loss_kernel: str, compiled: bool, elem: int) -> tuple[float, float]:
    """(kept, transient) bytes per logit of the cross-entropy on the last stage (:func:`stage_bytes`), ``elem`` the
    compute dtype's bytes. Eager ``cross_entropy(logits.float())`` (loss_kernel 'fp32'): the fp32 log-probs kept
    (4; Korthikanti et al. 2022 Sec. 4.3) and, while the loss runs backward, the dense fp32 gradients of nll_loss and
    log_softmax (8). A fused loss kernel ('fused', llm-foundry's in-place one): the logits kept, no transient.
    ``compiled`` (train.compile_loss): AOTAutograd's partitioner (torch/_functorch/partitioners.py,
    min_cut_rematerialization_partition) saves the graph's bf16 input and a per-token max and log-sum-exp (not
    counted), recomputing the upcast and the softmax in the backward, which writes one gradient in the logits'
    dtype beside them: elem kept, elem transient. Units: bytes per element of s b V / t."""
    if loss_kernel == "fused":
        return float(elem), 0.0
    if compiled:
        return float(elem), float(elem)
    return 4.0, 8.0


def _uncounted_stage_input(spec: RunSpec, o: MemoryOptions, rec: dict, share: float) -> float:
    """Bytes of a received stage input that xpar's CPU accounting does not see
    (``count_buffers`` False): torch's PipelineStage hands each stage its input as a leaf
    that requires grad, which the saved-tensor tracker skips like a parameter
    (xpar.parallel.memory_accounting.ActivationTracker). It is saved as itself by the first block's
    checkpoint (recompute: ``share`` of the stage's blocks > 0, the first block among them) or by
    a composite norm that needs no upcast (fp32 residual)."""
    sh = spec.seq_len * spec.train.micro_batch_size * spec.model.hidden / (spec.tp if spec.layout.sequence_parallel else 1)
    if share > 0 or (rec["er"] == 4 and not o.fused_rmsnorm):
        return rec["er"] * sh
    return 0.0


def memory_schedule(schedule: str, pp: int, m: int, megatron_interleaved: bool) -> str:
    """The schedule whose action order holds the activation peak of ``schedule``: itself, except
    Megatron-LM's interleaved 1F1B at m == pp (``megatron_interleaved``, the profile's
    ``interleaved_m_per_pp``), which runs every forward first on every rank
    (megatron/core/pipeline_parallel/schedules.py ``get_num_warmup_microbatches``:
    ``all_warmup_microbatches`` when num_microbatches == pipeline_parallel_size): looped BFS's
    order, which keeps every chunk too."""
    if megatron_interleaved and schedule == "interleaved_1f1b" and m == pp:
        return "looped_bfs"
    return schedule


@lru_cache(maxsize=512)
def stage_events(schedule: str, pp: int, m: int, v: int, rank: int) -> tuple:
    """The events of pipeline rank ``rank``'s action list (torch's order) where a memory peak can
    fall: after each forward and before each backward's release (B or I; B and W release a chunk).
    Returns (stages: the stage indices acting, increasing; rows [n, len(stages)]: live micro-batch
    chunks per stage at each event; kind [n]: 0 forward, 1 backward; acting [n]: the column of the
    acting stage). The one schedule walk: bytes per chunk times these rows give a rank's peak
    (xpar.estimate.columns.layout_memory); xpar.estimate.columns.peak_memory sums the rows by stage class."""
    acts = schedule_actions(schedule, pp, m, v)[rank]
    kinds = np.array([a.kind for a in acts])
    stages, col = np.unique(np.array([a.stage for a in acts], dtype=np.int64), return_inverse=True)
    col = col.ravel()
    inc, back = kinds == "F", (kinds == "B") | (kinds == "I")
    delta = inc.astype(np.int64) - ((kinds == "B") | (kinds == "W"))
    per = np.zeros((len(acts), len(stages)), dtype=np.int64)
    per[np.arange(len(acts)), col] = delta
    after = np.cumsum(per, axis=0)
    rows = np.concatenate([after[inc], (after - per)[back]])
    kind = np.repeat([0, 1], [int(inc.sum()), int(back.sum())])
    return tuple(stages.tolist()), rows, kind, np.concatenate([col[inc], col[back]])


def stage_chunk_bytes(spec: RunSpec, stage: int, o: MemoryOptions) -> tuple[float, float, float, float]:
    """Bytes of one micro-batch chunk of ``stage`` (:func:`stage_bytes`): (kept until its backward,
    transient during its forward, transient during its backward, autocast's weight copies); the
    transients (loss temporaries; recompute workspace in the backward) only when ``count_buffers``. The recomputed MoE
    graph a stage keeps after a backward (``moe_graph``) replaces the chunk it released, so its backward transient is
    at least moe_graph - kept, and with ``count_buffers`` at least moe_graph_backward - kept (the last recomputed block
    rebuilt beside the others' graphs): the peak at that event is the other live chunks plus max(kept + transient,
    moe_graph, moe_graph_backward)."""
    sb, cb = stage_bytes(spec, stage, o), o.count_buffers
    kept = sb["layers"] + sb["logits"] + sb["embedding_mask"]
    back = max((sb["workspace"] + sb["loss_transient"]) * cb, sb["moe_graph"] - kept, (sb["moe_graph_backward"] - kept) * cb)
    return kept, sb["loss_transient"] * cb, back, sb["weight_copies"]


def token_id_bytes(seq_len, b, m, pp):
    """int64 token ids kept by the rank holding the first stage: 8 s b, times m under pp
    (xpar.estimate.columns.layout_memory). Bytes; numbers or numpy arrays alike."""
    return 8.0 * (seq_len * b) * ((m - 1) * (pp > 1) + 1)


def microbatches_in_flight(schedule: str, pp: int, m: int, v: int = 1, rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at its peak, in units of
    the rank's whole layer set: the most live chunks after a forward (:func:`stage_events`, torch's
    order) / v. Matches Korthikanti et al. 2022 Sec. 4.2.3: GPipe m, 1F1B min(m, p - r),
    interleaved p (1 + (p - 1)/(p v)) on rank 0."""
    if pp == 1:
        return 1.0  # gradient accumulation: one micro-batch at a time
    _, rows, kind, _ = stage_events(schedule, pp, m, v, rank)
    return int(rows[kind == 0].sum(1).max()) / v
