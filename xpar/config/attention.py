"""FLOPs of a block's attention by its shape: multi-head or grouped-query attention (MHA/GQA), and
DeepSeek's multi-head latent attention (MLA: DeepSeek-AI 2024, "DeepSeek-V2", Sec. 2.1; "DeepSeek-V3",
Sec. 2.1.1), where queries and keys/values are projected through low-rank latents
(``model.q_lora_rank``, ``model.kv_lora_rank``), each head's query and key are a no-position part
(``qk_nope_head_dim``) and a rotary part (``qk_rope_head_dim``, one rotary key shared by the heads),
and values are ``v_head_dim`` wide. Training runs MLA's projections as written (not absorbed).
Pure (no torch), in the config layer so that xpar.estimate.compute.flops and xpar.config.remat read the same
counts. Units: FLOP per token, 2 per multiply-add. Also the K/V heads a tp group holds where tp exceeds them
(``framework.kv_heads_over_tp``: :func:`tp_kv_heads`, :func:`tp_model`).
"""
from __future__ import annotations

from dataclasses import replace

KV_OVER_TP = ("split", "replicate")
"""``framework.kv_heads_over_tp`` values (xpar.config.profile.FrameworkConfig)."""


def is_mla(cfg) -> bool:
    """Whether the model's attention is MLA (``kv_lora_rank`` set)."""
    return getattr(cfg, "kv_lora_rank", None) is not None


def attention_projection_flops(cfg) -> dict[str, float]:
    """Forward FLOPs per token of the attention's projections, as wq, wk, wv, wo. MHA/GQA: wq and wo
    h x q (q = n_heads x head dim), wk and wv h x kv. MLA (n heads, h wide): wq = h x q_lora_rank +
    q_lora_rank x n (nope + rope) (h x n (nope + rope) without a q_lora_rank); wk = h x (kv_lora_rank +
    rope) (the shared latent and rotary key) + kv_lora_rank x n nope; wv = kv_lora_rank x n v_head_dim;
    wo = n v_head_dim x h."""
    h, n = cfg.hidden, cfg.n_heads
    if not is_mla(cfg):
        q, kv = cfg.q_dim, cfg.kv_heads * cfg.head_size
        return {"wq": 2 * h * q, "wk": 2 * h * kv, "wv": 2 * h * kv, "wo": 2 * h * q}
    qk, r, c = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
    wq = 2 * n * qk * h if r is None else 2 * (h * r + r * n * qk)
    return {"wq": wq, "wk": 2 * (h * (c + cfg.qk_rope_head_dim) + c * n * cfg.qk_nope_head_dim),
            "wv": 2 * c * n * cfg.v_head_dim, "wo": 2 * n * cfg.v_head_dim * h}


def mla_up_projection_flops(cfg) -> float:
    """Forward FLOPs per token of MLA's up-projections, what Megatron-Core's ``--recompute-modules mla_up_proj``
    reruns (megatron/core/transformer/multi_latent_attention.py ``qkv_up_proj_and_rope_apply``: linear_q_up_proj,
    or linear_q_proj without a q_lora_rank, and linear_kv_up_proj): 2 (q_lora_rank x n (nope + rope) + kv_lora_rank
    x n (nope + v_head_dim)), h in place of q_lora_rank without one. Part of :func:`attention_projection_flops`'
    wq, wk and wv. 0 for a model without MLA. Units: FLOP per token."""
    if not is_mla(cfg):
        return 0.0
    n, qk = cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q_in = cfg.hidden if cfg.q_lora_rank is None else cfg.q_lora_rank
    return 2.0 * (q_in * n * qk + cfg.kv_lora_rank * n * (cfg.qk_nope_head_dim + cfg.v_head_dim))


def attention_core_flops(cfg, seq_len: int, causal: bool = False, window: bool = False) -> float:
    """Forward FLOPs per token of one block's attention core, scores Q K^T and context P V over s keys
    (the whole square; half when ``causal``): 2 s n (d_qk + d_v); 4 s q for MHA/GQA (d_qk = d_v = head
    dim), 2 s n (nope + rope + v_head_dim) for MLA. A sliding window (model.sliding_window) is not counted
    (every layer's whole square, as Narayanan et al. 2021 count the matmuls as written, and as Megatron-Bridge's
    published gpt-oss figures of 25.11 and 26.04.01 count it) unless ``window``: then the mean over the model's
    blocks, each local block at :func:`attended_keys` (with ``causal``) or min(w, s) keys."""
    if is_mla(cfg):
        widths = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    else:
        widths = 2 * cfg.q_dim
    full = seq_len * (0.5 if causal else 1.0)
    local = cfg.local_layers / cfg.n_layers if window else 0.0
    return 2 * widths * ((1 - local) * full + local * attended_keys(seq_len, cfg.sliding_window, causal))


def attended_keys(seq_len: int, window: int, causal: bool = True) -> float:
    """Mean keys a query of a sliding-window layer attends to (``window`` w keys, itself included) over a
    sequence of s tokens: causal, w - w (w - 1) / (2 s) for w < s, else s / 2 (the 1 .. w keys of the first w
    queries, w after: Megatron-Bridge src/megatron/bridge/training/utils/flop_utils.py @0494433b,
    ``swa_context``; an earlier version counted min(w, s) / 2); not ``causal``: min(w, s)."""
    if not causal:
        return float(min(window, seq_len))
    return window - window * (window - 1) / (2 * seq_len) if window < seq_len else seq_len / 2


def kv_replicated(kv_heads: int, tp: int, rule: str) -> bool:
    """Whether a tp group of ``tp`` ranks keeps copies of K/V heads: ``rule`` 'replicate' (framework.kv_heads_over_tp)
    and tp > ``kv_heads`` (tp a multiple of them: xpar.config.checks.layout.check_tp)."""
    return rule == "replicate" and tp > kv_heads


def tp_kv_heads(kv_heads, tp, rule: str = "split"):
    """K/V heads a tp group holds, summed over its ranks (one rank: this / tp): ``kv_heads`` where tp splits them,
    max(kv_heads, tp) under ``rule`` 'replicate' (each rank keeps kv_heads / min(tp, kv_heads) = the one K/V head its
    query heads need, whole; BigCode's Megatron-LM MQA, vLLM's QKVParallelLinear). Ints, or numpy arrays of tp."""
    if rule != "replicate":
        return kv_heads
    return kv_heads + (tp - kv_heads) * (tp > kv_heads)  # max(kv_heads, tp), for ints and arrays alike


def tp_model(spec):
    """``spec.model`` as each of its tp ranks holds it, ``n_kv_heads`` at :func:`tp_kv_heads` (the model itself unless
    K/V heads are replicated: :func:`kv_replicated`): what parameters, gradients, optimizer states and saved K/V per
    rank are priced on. The model's own FLOPs and parameter count stay ``spec.model``'s. MLA: the model."""
    cfg, tp = spec.model, spec.tp
    if tp == 1 or is_mla(cfg) or not kv_replicated(cfg.kv_heads, tp, spec.framework.kv_heads_over_tp):
        return cfg
    return replace(cfg, n_kv_heads=tp_kv_heads(cfg.kv_heads, tp, "replicate"))


def tp_compute_model(spec):
    """The model whose FLOPs per token a tp rank runs one tp-th of: :func:`tp_model` without sequence parallelism
    (each rank projects its replicated K/V head over all its tokens), the model itself with it (BigCode's
    Megatron-LM projects K/V on the rank's sequence shard, then all-gathers them: the split's FLOPs)."""
    return spec.model if spec.layout.sequence_parallel else tp_model(spec)


def kv_replica_elements(spec) -> tuple[float, int]:
    """(elements of one layer's K/V output per micro-batch, b s x 2 kv_local head_dim; elements of one layer's K/V
    projection weights and biases on a rank) where the spec's tp ranks keep K/V heads whole (:func:`kv_replicated`;
    BigCode's Megatron-LM reduces the first over tp each micro-batch, the second each step with sequence parallelism:
    xpar.estimate.step_parts.kv_replica_times); (0, 0) otherwise."""
    cfg, t = spec.model, spec.tp
    if t == 1 or is_mla(cfg) or not kv_replicated(cfg.kv_heads, t, spec.framework.kv_heads_over_tp):
        return 0.0, 0
    width = 2 * (tp_model(spec).kv_heads // t) * cfg.head_size  # wk and wv rows on a rank
    return spec.train.micro_batch_size * spec.seq_len * width, width * cfg.hidden + (width if cfg.bias else 0)
