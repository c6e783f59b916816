"""One transformer block's forward or backward on one rank, kernel by kernel (issue 42).

Prices every kernel of a block (Megatron-Core / torchtitan order: norm, qkv or MLA projections,
RoPE, attention core, output projection, residual add, norm, MLP or router + experts + combine)
with xpar.estimate.compute.kernels, for a micro-batch b of s tokens under tp (with sequence parallelism),
cp (load-balanced causal chunks) and ep (experts not split by tp: Megatron's ETP = 1). Backward:
each GEMM's dgrad and wgrad, the attention backward, elementwise passes at twice their traffic.
Every argument broadcasts (numpy columns); the result is a :class:`BlockTerms` of arrays, seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import numpy as np

from xpar.config.attention import tp_kv_heads
from xpar.estimate.compute.fp8_recipes import DEFAULT as DEFAULT_RECIPE, Fp8Recipe, gemm_dtype, quantiser
from xpar.estimate.compute.kernels import (DTYPE_BYTES, HBM_FRACTION, Device, attention_time, expert_gemm_rate,
                                           gemm_time, kernel_overhead, memory_time)
from xpar.estimate.moe_dispatch import DISPATCHERS, atomic_scatter_seconds, sync_seconds

BF16 = DTYPE_BYTES["bf16"]


@dataclass(frozen=True)
class BlockShape:
    """A block's shape. MLA (DeepSeek-V2/V3) where ``kv_lora_rank`` > 0: queries through a
    ``q_lora_rank`` bottleneck (0: a direct projection), keys/values through ``kv_lora_rank``, heads
    of ``qk_nope_dim + qk_rope_dim`` (q, k) and ``v_head_dim`` (v). Otherwise ``head_dim`` (which
    may differ from hidden / heads) for q, k and v."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    gated: bool = True
    experts: int = 0
    top_k: int = 1
    expert_ffn: int = 0
    shared_experts: int = 0
    capacity_factor: Optional[float] = None
    imbalance: float = 1.0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    rope: bool = True
    """Rotary embeddings on q and k (False: learned or no positions, GPT-3)."""
    window: int = 0
    """Sliding-window attention: the keys each query sees (model.sliding_window, a local block); 0: causal."""
    expert_bias: bool = False
    """The routed experts' GEMMs carry biases (model.bias on a MoE model: gpt-oss)."""

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim if self.mla else self.head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim if self.mla else self.head_dim


def shape_of(model, moe: bool = True, local: bool = False) -> BlockShape:
    """The :class:`BlockShape` of an xpar ModelConfig (a MoE layer where ``moe`` and the model has experts;
    MLA where the model sets ``kv_lora_rank``; a local layer's window where ``local``)."""
    experts = model.n_experts if moe else 0
    mla = {k: getattr(model, k, None) or 0 for k in ("q_lora_rank", "kv_lora_rank")}
    if mla["kv_lora_rank"]:
        mla.update(qk_nope_dim=model.qk_nope_head_dim, qk_rope_dim=model.qk_rope_head_dim, v_head_dim=model.v_head_dim)
    return BlockShape(hidden=model.hidden, heads=model.n_heads, kv_heads=model.kv_heads,
                      head_dim=getattr(model, "head_dim", None) or model.hidden // model.n_heads,
                      ffn=model.ffn_hidden, gated=model.activation == "swiglu", experts=experts,
                      top_k=model.moe_top_k, expert_ffn=model.expert_ffn_hidden or model.ffn_hidden,
                      shared_experts=model.n_shared_experts, capacity_factor=model.capacity_factor,
                      imbalance=model.moe_imbalance, rope=model.position == "rope",
                      window=model.sliding_window if local else 0, expert_bias=bool(experts and model.bias), **mla)


@dataclass(frozen=True)
class BlockTerms:
    """Seconds of one block's pass on one rank, by kind of kernel (arrays of one shape)."""

    gemm: np.ndarray
    """Dense GEMMs: qkv or MLA projections, attention output, MLP or shared experts, router."""
    projections: np.ndarray
    """The attention's projections alone (part of ``gemm``): what a recompute policy's wq..wo rerun."""
    experts: np.ndarray
    """Routed experts' GEMMs (grouped, or one per local expert)."""
    attention: np.ndarray
    """The attention core (FlashAttention, BF16)."""
    memory: np.ndarray
    """Memory-bound kernels: norms, residual adds, RoPE, activation, FP8 casts, MoE routing traffic."""
    overhead: np.ndarray
    """Launch gaps, or host issue time beyond the kernels' own (xpar.estimate.compute.kernels.kernel_overhead)."""
    kernels: np.ndarray
    """Kernels launched."""
    atomics: np.ndarray
    """aten kernels a MoE layer runs as they are, compiled or not (not scaled by framework.elementwise_passes):
    atomic scatters of its copies back into their tokens (framework.moe_scatter 'atomic':
    xpar.estimate.moe_dispatch.atomic_scatter_seconds), backward the sum of torch._grouped_mm's split gate and up
    input gradients (:func:`split_up_grad_bytes`), and eager per-expert bias adds (:func:`split_bias_bytes`); 0
    elsewhere."""

    @property
    def busy(self) -> np.ndarray:
        return self.gemm + self.experts + self.attention + self.memory + self.atomics

    @property
    def total(self) -> np.ndarray:
        return self.busy + self.overhead

    def __add__(self, other: "BlockTerms") -> "BlockTerms":
        return BlockTerms(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def priced_cast_bytes(quant: Fp8Recipe) -> float:
    """A recipe's bytes an element quantised (``quant.cast_bytes()``) as the block's memory-bound passes price bytes,
    at kernels.HBM_FRACTION of HBM: the bytes they would move in the time the recipe's kernels take at their own
    ``quant.hbm_fraction`` (xpar.estimate.compute.fp8_recipes.CAST_HBM_FRACTION; None: the same share)."""
    return quant.cast_bytes() * HBM_FRACTION / (quant.hbm_fraction or HBM_FRACTION)


def _linear(m, n, k, device, dtype, backward, groups=1, quant: Optional[Fp8Recipe] = None):
    """(seconds, kernels, cast bytes) of a linear layer y = x W (x: m x k, W: k x n): forward, or dgrad +
    wgrad. Under an FP8 recipe ``quant`` (xpar.estimate.compute.fp8_recipes) its quantisation of the GEMM's
    activation input: ``quant.kernels`` kernels moving ``quant.cast_bytes()`` an element (delayed scaling:
    one kernel, read BF16, write FP8, 3 bytes) at the recipe's share of HBM (:func:`priced_cast_bytes`); its
    forward bytes are returned either way (the caller doubles a backward's memory traffic: the output gradient's
    quantisation). None: no cast (BF16 GEMMs)."""
    casts = 0 if quant is None else quant.kernels
    moved = 0.0 if quant is None else priced_cast_bytes(quant) * groups * m * k
    if not backward:
        return gemm_time(m, n, k, device, dtype, groups), 1 + casts, moved
    dgrad = gemm_time(m, k, n, device, dtype, groups)  # dx = dy W^T: (m x n) @ (n x k)
    wgrad = gemm_time(k, n, m, device, dtype, groups)  # dW = x^T dy: (k x m) @ (m x n), reduced over tokens
    return dgrad + wgrad, 2 + casts, moved


def _attention_linears(sh: BlockShape, t, tp, device, dtype, backward, kv_heads=None, quant=None):
    """(seconds, kernels, cast bytes) of the attention's projections on t tokens per rank; ``kv_heads``: the K/V
    heads the tp group projects over all its tokens (:func:`xpar.config.attention.tp_kv_heads`; None: the model's)."""
    parts = []
    if sh.mla:
        q_in = sh.hidden
        if sh.q_lora_rank:
            parts.append((sh.q_lora_rank, sh.hidden, None))  # q down-projection (replicated over tp)
            q_in = sh.q_lora_rank
        parts.append((sh.heads * sh.qk_dim, q_in, "n"))  # q (up-)projection, column-parallel
        parts.append((sh.kv_lora_rank + sh.qk_rope_dim, sh.hidden, None))  # kv down-projection + shared rope key
        parts.append((sh.heads * (sh.qk_nope_dim + sh.v_dim), sh.kv_lora_rank, "n"))  # kv up-projection
    else:
        kv = sh.kv_heads if kv_heads is None else kv_heads
        parts.append(((sh.heads + 2 * kv) * sh.head_dim, sh.hidden, "n"))  # fused qkv, column-parallel
    parts.append((sh.hidden, sh.heads * sh.v_dim, "k"))  # output projection, row-parallel (K split)
    out = (0.0, 0, 0.0)
    tp = np.asarray(tp, dtype=float)
    for n, k, split in parts:  # split: the dimension tp divides (None: replicated on every tp rank)
        n_r, k_r = (n / tp if split == "n" else n), (k / tp if split == "k" else k)
        out = _sum(out, _linear(t, n_r, k_r, device, dtype, backward, quant=quant))
    return out


def _sum(a, b):
    return tuple(x + y for x, y in zip(a, b))


def _mlp(t, width, hidden, gated, tp, device, dtype, backward, quant=None):
    """(seconds of GEMMs, kernels, bytes of activation and casts) of a dense MLP of ``width`` on t tokens."""
    up = _linear(t, width * (2 if gated else 1) / tp, hidden, device, dtype, backward, quant=quant)
    down = _linear(t, hidden, width / tp, device, dtype, backward, quant=quant)
    act = t * width / tp * BF16 * (3 if gated else 2)  # SwiGLU reads gate and up, writes one; GeLU one in, one out
    return _sum(_sum(up, down), (0.0, 1, act))


def expert_tokens(sh: BlockShape, tokens_per_rank, ep):
    """Tokens each local expert computes on the busiest rank: the even share ``k T ep / E`` (T tokens
    per rank entering the MoE) times the router imbalance, dropless; with a capacity factor c every
    expert's buffer is c times the even share (overflow dropped, the rest padded: Fedus et al. 2022)."""
    even = np.asarray(tokens_per_rank, dtype=float) * sh.top_k * ep / max(sh.experts, 1)
    if sh.capacity_factor is not None:
        return np.ceil(sh.capacity_factor * even)
    return np.ceil(even * sh.imbalance)


def _moe(sh: BlockShape, t, tp, ep, device, dtype, backward, grouped, sorts: bool = False, quant=None,
         scatter: str = "fused", expert_kernel: str = "dense", bias_add: str = "fused"):
    """(dense gemm s, expert gemm s, kernels, bytes, aten kernel s: BlockTerms.atomics) of router + routed and shared
    experts, t tokens per rank; ``sorts``: the dispatcher reorders the received copies by local expert and back (ep > 1,
    several local experts: xpar.estimate.moe_dispatch); ``scatter`` 'atomic': the copies are summed back into
    their tokens by an aten atomic scatter (forward the combine, backward the gather's gradient:
    xpar.estimate.moe_dispatch.SCATTERS), priced by :func:`~xpar.estimate.moe_dispatch.atomic_scatter_seconds`
    instead of as a streaming unpermute (its target and the sum with the shared experts' output:
    :func:`scatter_target_bytes`); ``expert_kernel``: framework.expert_gemm_kernel, the routed experts' GEMMs at
    :func:`~xpar.estimate.compute.kernels.expert_gemm_rate` of the dense rate, 'torch_grouped_mm' with torchtitan's
    split gate and up GEMMs (:func:`split_up_grad_bytes`, backward); ``bias_add`` 'split': the experts' biases added
    eagerly per local expert (:func:`split_bias_bytes`, forward and backward alike)."""
    t_sp = t / tp  # with sequence parallelism each tp rank routes its own tokens (ETP = 1)
    router = _linear(t_sp, sh.experts, sh.hidden, device, "bf16", backward)
    m = expert_tokens(sh, t_sp, ep)
    local = sh.experts // np.asarray(ep)
    groups, launches = (local, 1) if grouped else (1, local)
    up = _linear(m, sh.expert_ffn * (2 if sh.gated else 1), sh.hidden, device, dtype, backward, groups, quant)
    down = _linear(m, sh.hidden, sh.expert_ffn, device, dtype, backward, groups, quant)
    experts = tuple(x * launches for x in _sum(up, down))
    experts = (experts[0] / expert_gemm_rate(expert_kernel, device, dtype)[1 if backward else 0],) + experts[1:]
    moved = (2 * t_sp * sh.top_k * sh.hidden * BF16  # permute: gather the token copies into expert order
             + t_sp * (sh.top_k + 1) * sh.hidden * BF16  # unpermute + weighted combine
             + 2 * t_sp * sh.experts * 4  # router softmax and top-k over fp32 logits
             + m * local * sh.expert_ffn * BF16 * (3 if sh.gated else 2))  # experts' activation
    kernels = router[1] + experts[1] + 8  # softmax, top-k, permute x2, unpermute x2, aux loss, activation
    resort = sorts * (np.asarray(ep) > 1) * (local > 1)
    moved = moved + resort * 2 * 2 * m * local * sh.hidden * BF16  # sort by local expert, unsort: read + write
    kernels = kernels + 2 * resort
    gemm, moved = router[0], moved + router[2] + experts[2]
    if sh.shared_experts:
        s_gemm, s_k, s_bytes = _mlp(t, sh.shared_experts * sh.expert_ffn, sh.hidden, sh.gated, tp, device, dtype,
                                    backward, quant)
        gemm, kernels, moved = gemm + s_gemm, kernels + s_k, moved + s_bytes
    atomic = np.zeros_like(np.asarray(t_sp, dtype=float))
    if scatter == "atomic":  # the streaming unpermute's bytes become one atomic scatter of the copies
        moved = moved - t_sp * (sh.top_k + 1) * sh.hidden * BF16 + scatter_target_bytes(t_sp, sh.hidden)
        atomic = atomic_scatter_seconds(t_sp * sh.top_k, t_sp, sh.hidden, device.hbm_bytes_per_s)
    if backward and expert_kernel == "torch_grouped_mm":
        atomic = atomic + memory_time(split_up_grad_bytes(m * local, sh.hidden), device)
    if sh.expert_bias and bias_add == "split":
        atomic = atomic + memory_time(split_bias_bytes(m * local, sh.expert_ffn * (2 if sh.gated else 1), sh.hidden),
                                      device)
    return gemm, experts[0], kernels, moved, atomic


def scatter_target_bytes(tokens, hidden: int):
    """Bytes a MoE forward moves around an atomic scatter (framework.moe_scatter 'atomic') beside the scatter itself,
    ``tokens`` x ``hidden`` bf16: the zero-filled buffer it adds into, written once, and that buffer's sum with the
    shared experts' output or a zeroed one (two read, one written): 4 x tokens x hidden x 2. Source: torchtitan
    @022f885f torchtitan/distributed/deepep/utils.py ``unpermute`` (``torch.zeros(restore_shape)`` then
    ``scatter_add_``) and torchtitan/models/moe/moe.py ``MoE.forward`` (DeepEP branch: ``torch.zeros_like(x)`` without
    shared experts, then ``routed_output + out``; all-to-all branch: ``out.scatter_add``, out of place, a copy of
    ``out``). The backward's traffic is twice the forward's, as every element-wise pass of the block
    (aten's ``index_select_backward`` zero-fills its ``index_add_`` target too)."""
    return 4.0 * np.asarray(tokens, dtype=float) * hidden * BF16


def split_bias_bytes(copies, up_width, hidden: int):
    """Bytes NeMo AutoModel's eager expert-bias adds move in one pass of a MoE layer (framework.expert_bias_add
    'split'), ``copies`` routed rows: after the gate/up GEMM (``up_width`` wide, bf16) each local expert's slice plus
    its bias (read 2, write 2 bytes an element) and their torch.cat (read 2, write 2): 8 bytes an element; after the
    down GEMM (``hidden`` wide) the bias times the fp32 probabilities (write 4), its sum with the slice (read 2 + 4,
    write 4: fp32 by type promotion), the fp32 torch.cat (read 4, write 4) and the cast back (read 4, write 2): 28 bytes
    an element. Source: nemo_automodel/components/moe/layers.py @037e04a6 ``GroupedExpertsDeepEP._apply_bias`` (split
    by ``tokens_per_expert``, ``t + b`` / ``t + b * p``, ``torch.cat``, ``.to(value.dtype)``) and the flex dispatcher's
    fp32 probabilities (megatron/token_dispatcher.py: "DeepEP only supports float32 probs"). The backward (the cast's
    and the split's gradients, the scaled bias's two reductions) is counted at the forward's bytes."""
    return np.asarray(copies, dtype=float) * (8.0 * up_width + 28.0 * hidden)


def split_up_grad_bytes(copies, hidden: int):
    """Bytes of the add that sums the two input gradients of a MoE layer's routed copies where its gate (w1) and up
    (w3) projections are two grouped GEMMs on one input: read both (copies x hidden, bf16), write one. Source:
    torchtitan torchtitan/models/moe/moe.py ``_run_experts_grouped_mm`` (@022f885f; @0691f514 under
    torchtitan/models/common/moe): ``torch._grouped_mm(x, w1)`` and ``torch._grouped_mm(x, w3)`` apart, so autograd
    accumulates x's two dgrads in one add kernel, compiled or eager (a GEMM's output fuses with nothing). xpar prices
    the up projection as one GEMM of twice the width (one dgrad, one output), as Megatron-Core's fused fc1 and NeMo
    AutoModel's ``gate_and_up_projs`` run it."""
    return 3.0 * np.asarray(copies, dtype=float) * hidden * BF16


def _ffn(sh: BlockShape, t, tp, ep, device, dtype, backward, grouped, quant, sorts, scatter, expert_kernel,
         bias_add: str = "fused"):
    """(dense gemm s, expert gemm s, kernels, bytes, aten kernel s) of the block's MLP: :func:`_moe` where the block
    has experts, else :func:`_mlp` (no experts, no aten kernels of a MoE layer)."""
    if sh.experts:
        return _moe(sh, t, tp, ep, device, dtype, backward, grouped, sorts, quant, scatter, expert_kernel, bias_add)
    g, kernels, moved = _mlp(t, sh.ffn, sh.hidden, sh.gated, tp, device, dtype, backward, quant)
    return g, np.zeros_like(t), kernels, moved, np.zeros_like(t)


def _unfused_attention(b, s_q, s_kv, heads, sh: BlockShape, device, backward):
    """(GEMM seconds, kernels, bytes) of an attention core without FlashAttention (Megatron-LM 2021):
    batched GEMMs Q K^T (s_q x d @ d x s_kv) and P V (s_q x s_kv @ s_kv x d) per head, the scaled,
    masked softmax reading and writing the s_q x s_kv scores (fp16/bf16)."""
    g = np.asarray(b, dtype=float) * heads
    scores, kernels, _ = _linear(s_q, s_kv, sh.qk_dim, device, "bf16", backward, groups=g)
    context, k2, _ = _linear(s_q, sh.v_dim, s_kv, device, "bf16", backward, groups=g)
    return scores + context, kernels + k2 + 1, 2 * g * s_q * s_kv * BF16


def _attention_core(sh: BlockShape, micro_batch, seq_len, cp, tp, device, backward, flash, window_kernel=True,
                    sinks: Optional[str] = None):
    """(seconds on tensor cores, kernels, bytes moved besides) of one rank's attention core. A local block
    (``sh.window``) computes its window's blocks where ``window_kernel``, else every block of the square (the
    band as a dense mask); the unfused path computes the whole square either way. Learned sinks (``sinks``: their
    path, None: none) add :func:`sink_bytes` at the HBM rate to the core's seconds (rerun where the core is)."""
    heads = sh.heads / np.asarray(tp, dtype=float)
    s_q = np.asarray(seq_len, dtype=float) / cp
    sunk, k_sink = sink_bytes(sinks, micro_batch, s_q, np.asarray(seq_len, dtype=float), heads, backward)
    if not flash:
        core, kernels, moved = _unfused_attention(micro_batch, s_q, np.asarray(seq_len, dtype=float), heads, sh,
                                                  device, backward)
        return core + memory_time(sunk, device), kernels + k_sink, moved
    kv_heads = heads if sh.mla else np.maximum(1.0, sh.kv_heads / np.asarray(tp, dtype=float))  # MLA: MHA
    dense_band = sh.window > 0 and not window_kernel
    attn = attention_time(micro_batch, s_q, seq_len, heads, sh.qk_dim, sh.v_dim, device, causal=not dense_band,
                          kv_heads=kv_heads, backward=backward, window=sh.window if window_kernel else 0)
    kernels = (3 if backward else 1) + k_sink  # FlashAttention backward: preprocess, main, dq conversion
    return attn + memory_time(sunk, device), kernels, 0.0


def sink_bytes(path: Optional[str], micro_batch, s_q, s_kv, heads, backward: bool):
    """(bytes, kernels) one rank's attention core moves for learned sinks (model.attention_sinks) beyond its own
    pass, by the framework's path (framework.sink_attention), ``heads`` per rank:

    - 'fused' (cuDNN through Transformer Engine >= 2.8, cuDNN >= 9.13.1): forward nothing (the sink is one more term
      of the kernel's running softmax sum: cudnn-frontend scaled_dot_product_flash_attention.h, Softmax
      ``set_sink``); backward the dsink reduction, exp(sink - stats) x D summed over batch and queries per head
      (the same file, ``sub_sink``/``exp_sink``/``reduce_per_token_grad``): the fp32 stats and the fp32 rowsum D
      read once, 8 bytes a query row and head, no kernel of its own counted (one cuDNN graph);
    - 'unfused' (Transformer Engine's UnfusedDotProductAttention, transformer_engine/pytorch/attention/
      dot_product_attention/backends.py: ``torch.cat`` of the sink column to the scores, then ``[..., :-1]``):
      the bf16 s_q x s_kv scores read and written once more forward (the concatenation) and backward (the slice's
      gradient padded back), one kernel each;
    - None: no sinks, nothing."""
    rows = np.asarray(micro_batch, dtype=float) * heads * s_q
    if path == "fused":
        return (8.0 * rows if backward else 0.0 * rows), 0
    if path == "unfused":
        return 2.0 * BF16 * rows * s_kv, 1
    return 0.0 * rows, 0


def block_times(sh: BlockShape, micro_batch, seq_len, device: Device, tp=1, cp=1, ep=1, dtype: str = "bf16",
                backward: bool = False, grouped_gemm: bool = True, host_us_per_kernel: float = 0.0,
                sequence_parallel: bool = True, flash: bool = True, dropout: bool = False, dispatcher: str = "alltoall",
                expert_call_us: float = 0.0, kv_over_tp: str = "split", fp8_recipe: str = DEFAULT_RECIPE,
                window_kernel: bool = True, sinks: Optional[str] = None, moe_scatter: str = "fused",
                expert_gemm_kernel: str = "dense", fp8_casts: str = "te", expert_bias_add: str = "fused") -> BlockTerms:
    """:class:`BlockTerms` of one block's forward (or, with ``backward``, backward) on one rank.

    ``micro_batch`` sequences of ``seq_len`` tokens, split over cp ranks (each rank's queries against
    the whole sequence, the causal half); tp splits heads and MLP widths (``sequence_parallel``: norms,
    residual adds and routing on 1/tp of the tokens); ep ranks hold ``experts / ep`` experts each.
    ``dtype`` is the GEMMs' (fp8: the attention core stays BF16; each GEMM input is quantised as ``fp8_recipe`` does,
    its GEMMs at that recipe's rate: xpar.estimate.compute.fp8_recipes). ``flash``: FlashAttention, else batched score
    GEMMs and a softmax over the scores in HBM; ``dropout``: masks on the attention output and MLP output (and the
    scores when not ``flash``). ``host_us_per_kernel``: the framework's host time to issue one kernel (0: the gap only).
    ``dispatcher``: the MoE token dispatcher (xpar.estimate.moe_dispatch.DISPATCHERS): its host
    synchronisation idles the GPU once per MoE forward (in ``overhead``), its sorting by local expert
    moves bytes (in ``memory``). ``expert_call_us``: host microseconds per local expert and GEMM call
    where the grouped GEMM loops over the experts (framework.expert_gemm_call_us; 2 calls a forward, 4 a backward).
    ``kv_over_tp``: framework.kv_heads_over_tp; 'replicate' with tp above the K/V heads projects each rank's K/V head
    over all its tokens, or over its sequence shard with ``sequence_parallel`` (BigCode's Megatron-LM: the split's
    FLOPs, its output all-gathered: xpar.estimate.step_parts.kv_replica_times). ``window_kernel``, ``sinks`` (learned
    attention sinks' path, framework.sink_attention; None: none): :func:`_attention_core`. ``moe_scatter``,
    ``expert_gemm_kernel``, ``expert_bias_add``: the framework's MoE combine, expert GEMMs and expert biases (:func:`_moe`). ``fp8_casts``: who quantises
    (framework.fp8_cast_kernels: fp8_recipes.quantiser).

    Raises:
        ValueError: ``dtype`` has no tensor-core peak here, or ``fp8_recipe`` needs MXFP8 tensor cores (gemm_dtype)."""
    t = np.asarray(micro_batch, dtype=float) * np.asarray(seq_len, dtype=float) / cp  # tokens per rank
    t_sp = np.where(sequence_parallel, t / tp, t)
    kv = np.where(sequence_parallel, sh.kv_heads, tp_kv_heads(sh.kv_heads, np.asarray(tp), kv_over_tp))
    quant = quantiser(fp8_recipe, fp8_casts) if dtype == "fp8" else None
    dtype = gemm_dtype(fp8_recipe, device.mx_native) if dtype == "fp8" else dtype
    projections, kernels, moved = _attention_linears(sh, t, tp, device, dtype, backward, kv, quant)
    attn, k_attn, b_attn = _attention_core(sh, micro_batch, seq_len, cp, tp, device, backward, flash, window_kernel,
                                           sinks)
    heads = sh.heads / np.asarray(tp, dtype=float)
    rope_k = 1 if sh.mla else np.maximum(1.0, sh.kv_heads / np.asarray(tp, dtype=float))  # MLA: one rope key for all
    moved = moved + b_attn * (1 + 0.5 * dropout) + (
        2 * 2 * t_sp * sh.hidden * BF16  # two norms: read x, write y
        + 2 * 3 * t_sp * sh.hidden * BF16  # two residual adds: read two, write one
        + sh.rope * 2 * t * (heads + rope_k) * (sh.qk_rope_dim or sh.head_dim) * BF16  # RoPE on q, k
        + dropout * 2 * 2.5 * t_sp * sh.hidden * BF16)  # two dropouts: read x, write y and a byte mask
    kernels = kernels + k_attn + 4 + 2 * sh.rope + 2 * dropout  # two norms, two adds, RoPE on q and k
    g, experts, k_ffn, b_ffn, atomics = _ffn(sh, t, tp, ep, device, dtype, backward, grouped_gemm, quant,
                                             DISPATCHERS[dispatcher].sorts_by_local_expert, moe_scatter, expert_gemm_kernel,
                                             expert_bias_add)
    gemm, kernels, moved = projections + g, kernels + k_ffn, moved + b_ffn
    moved = moved * (DTYPE_BYTES["fp32"] / BF16 if dtype == "fp32" else 1.0)  # fp32 training: 4-byte activations
    memory = memory_time(moved * (2 if backward else 1), device)  # backward: grads in and out, saved inputs
    busy = gemm + experts + attn + memory + atomics
    over = kernel_overhead(kernels, busy, device, host_us_per_kernel * 1e-6)
    if sh.experts:
        over = over + expert_loop_gap(sh.experts // np.asarray(ep), experts, backward, expert_call_us)
    if sh.experts and not backward:  # the backward reuses the forward's split sizes: no synchronisation
        over = over + sync_seconds(dispatcher, host_us_per_kernel, sh.capacity_factor is not None)
    shape = np.broadcast(t, busy).shape
    return BlockTerms(*(np.broadcast_to(np.asarray(x, dtype=float), shape)
                        for x in (gemm, projections, experts, attn, memory, over, kernels, atomics)))


def expert_loop_gap(local, expert_s, backward: bool, call_us: float):
    """Seconds the GPU waits on the host in a grouped expert GEMM that loops over ``local`` experts, one GEMM
    call each at ``call_us`` host microseconds (fc1 and fc2: 2 calls an expert forward, their dgrad and wgrad
    4 backward) beyond the experts' own GEMM seconds ``expert_s``: the loop follows the MoE layer's host
    synchronisation (the dispatcher's split sizes), so no earlier work hides it. 0 where ``call_us`` is 0."""
    calls = (4 if backward else 2) * np.asarray(local, dtype=float)
    return np.maximum(0.0, calls * call_us * 1e-6 - expert_s)


def block_step_times(sh: BlockShape, micro_batch, seq_len, device: Device, **kw) -> BlockTerms:
    """Forward + backward :class:`BlockTerms` of one block (keywords as :func:`block_times`)."""
    return block_times(sh, micro_batch, seq_len, device, **kw) + block_times(sh, micro_batch, seq_len, device,
                                                                          backward=True, **kw)


LOSS_BYTES = {"fp32": (8.0, 8.0), "fused": (2.0, 4.0)}
"""(forward, backward) bytes a logit the cross-entropy after the output projection moves through HBM, by
framework.loss_kernel (memory: xpar.estimate.memory.activations.loss_bytes):

- 'fp32' (eager ``cross_entropy(logits.float())``: xpar, torchtitan, Megatron's default): fp32 logits read and
  probabilities written forward, the gradient read and written backward, 8 + 8 (the count the fitted constants were
  fitted with; a compiled loss, train.compile_loss, is priced so too);
- 'fused' (one kernel a pass over the logits in their own dtype, bf16): forward one read of each row (max, log-sum-exp
  and the loss in one kernel), backward one read and one write of the gradient, 2 + 4. flash-attn's
  ``CrossEntropyLoss`` (flash_attn/ops/triton/cross_entropy.py: ``cross_entropy_fwd_kernel`` loads a row's logits
  and stores its loss and lse, ``cross_entropy_bwd_kernel`` loads them again and stores dlogits), llm-foundry's
  ``fused_crossentropy`` (that class) and TinyLlama's ``FusedCrossEntropyLoss`` (jzhang38/TinyLlama
  lit_gpt/fused_cross_entropy.py @bf122247: flash-attn's ``xentropy_cuda_lib``, forward losses and lse, backward the
  gradient). llm.c's ``fused_classifier_kernel5`` (karpathy/llm.c train_gpt2.cu @a0d5dbbd, llmc/fused_classifier.cuh
  @c6efd90a) does both in the forward: it reads each bf16 row (a second read "hopefully still in cache", the rows
  taken in reverse order for the output GEMM's cache hits) and overwrites it with its gradient, 4 bytes, and runs no
  loss kernel backward: within the 6 priced here."""


def logits_times(tokens, hidden, vocab, device: Device, tp=1, dtype: str = "bf16", backward: bool = False,
                 loss: str = "fp32"):
    """(GEMM seconds, memory seconds) of the output projection over ``tokens`` tokens on one rank (vocabulary
    split by tp) and its cross-entropy's passes over the logits by ``loss`` (framework.loss_kernel:
    :data:`LOSS_BYTES`).

    Raises:
        ValueError: ``loss`` is not a key of :data:`LOSS_BYTES`."""
    if loss not in LOSS_BYTES:
        raise ValueError(f"framework.loss_kernel={loss!r} is not one of {', '.join(LOSS_BYTES)}")
    shard = vocab / np.asarray(tp, dtype=float)
    gemm, _, _ = _linear(np.asarray(tokens, dtype=float), shard, hidden, device, dtype, backward)
    per_logit = LOSS_BYTES[loss][1 if backward else 0]
    return gemm, memory_time(per_logit * np.asarray(tokens, dtype=float) * shard, device)
