"""FLOPs of a block's attention by its shape: multi-head or grouped-query attention (MHA/GQA), and
DeepSeek's multi-head latent attention (MLA: DeepSeek-AI 2024, "DeepSeek-V2", Sec. 2.1; "DeepSeek-V3",
Sec. 2.1.1), where queries and keys/values are projected through low-rank latents
(``model.q_lora_rank``, ``model.kv_lora_rank``), each head's query and key are a no-position part
(``qk_nope_head_dim``) and a rotary part (``qk_rope_head_dim``, one rotary key shared by the heads),
and values are ``v_head_dim`` wide. Training runs MLA's projections as written (not absorbed).
Pure (no torch), in the config layer so that xpar.estimate.compute.flops and xpar.config.remat read the same
counts. Units: FLOP per token, 2 per multiply-add.
"""
from __future__ import annotations


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


def attention_core_flops(cfg, seq_len: int, causal: bool = False) -> float:
    """Forward FLOPs per token of one block's attention core, scores Q K^T and context P V over s keys
    (the whole square; half when ``causal``): 2 s n (d_qk + d_v); 4 s q for MHA/GQA (d_qk = d_v = head
    dim), 2 s n (nope + rope + v_head_dim) for MLA."""
    if is_mla(cfg):
        widths = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    else:
        widths = 2 * cfg.q_dim
    return 2 * seq_len * widths * (0.5 if causal else 1.0)
