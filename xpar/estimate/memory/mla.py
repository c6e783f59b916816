"""Saved activations of multi-head latent attention (MLA: DeepSeek-AI 2024, "DeepSeek-V2" arXiv:2405.04434 Sec.
2.1; "DeepSeek-V3" arXiv:2412.19437 Sec. 2.1) at its own widths, and the module recompute policies that runs with
MLA use (:data:`xpar.config.remat.MODULE_POLICIES`), as Megatron-Core builds the block
(megatron/core/transformer/multi_latent_attention.py ``MLASelfAttention.get_query_key_value_tensors``):

- h -> ``linear_q_down_proj`` -> c_q [q_lora_rank] -> ``q_layernorm`` -> ``linear_q_up_proj`` -> q [n (nope + rope)];
- h -> ``linear_kv_down_proj`` -> [kv_lora_rank + rope] -> c_kv [kv_lora_rank] -> ``kv_layernorm`` ->
  ``linear_kv_up_proj`` -> [n (nope + v)], split into k_nope and v; the rotary key (rope wide) is shared by the heads;
- RoPE on q's and the shared key's rotary parts; query and key concatenated [n (nope + rope)] each, value [n v];
- the attention core (flash: keeps q, k, v, its output [n v] and the fp32 log-sum-exp) and ``linear_proj`` (n v -> h).

The down projections are replicated over tp (TELinear ``parallel_mode='duplicated'``), so the latents are kept on
every tp rank (on its sequence shard with sequence parallelism); the up projections and the core split the heads.
"""
from __future__ import annotations

from xpar.config.attention import is_mla
from xpar.config.remat import MODULE_POLICIES


def mla_widths(cfg) -> dict:
    """:func:`xpar.estimate.memory.activations.layer_activation_bytes` keywords for an MLA model's attention widths
    (elements per token): that function keeps Q and the context (the output projection's input) at one width ``q``,
    K and V at ``kv``. MLA's Q and K are n (nope + rope) wide, V and the context n v_head_dim (DeepSeek-V3: 128 x 192
    and 128 x 128): q = n v_head_dim and kv = n (nope + rope) give the same sums Q + K + V + context, and the same
    for every policy that keeps the context and V, or Q and V, together (xpar.config.remat.POLICIES). ``kv_matmul``
    alike. {} for a model without MLA."""
    if not is_mla(cfg):
        return {}
    qk = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    return {"q": cfg.n_heads * cfg.v_head_dim, "kv": qk, "kv_matmul": qk}


def latent_bytes(cfg, elem: int, linear_in: float, composite_norm: bool) -> float:
    """Bytes per token of MLA's latents kept for backward, beside what MHA keeps: the q and kv latents' RMSNorm
    inputs (c_q, q_lora_rank wide; c_kv, kv_lora_rank wide: ``elem`` each, or the composite norm's fp32 input and
    x * rstd, 8 bytes, with ``composite_norm``) and their outputs, the up projections' inputs (``linear_in`` bytes
    per element: ``elem``, or 1 where the framework keeps FP8 linear inputs, ``framework.fp8_saves_inputs``).
    Without a q_lora_rank the queries are projected from h directly (its input counted with MHA's). Not counted:
    the shared rotary key (rope wide, ~1 % of the latents beside q_lora_rank + kv_lora_rank) and RMSNorm's rstd.
    Replicated over tp (the down projections are); / tp with sequence parallelism (the caller). Units: bytes."""
    if not is_mla(cfg):
        return 0.0
    ranks = (cfg.q_lora_rank or 0) + cfg.kv_lora_rank
    return ranks * ((8 if composite_norm else elem) + linear_in)


def freed_bytes(cfg, policy: str, elem: int, t: int, sp: bool, fp8_inputs: bool, parallel_block: bool) -> float:
    """Bytes per token a module policy (:data:`xpar.config.remat.MODULE_POLICIES`) keeps less than no recompute,
    each module's output discarded after its consumer ran and rebuilt in the backward (Megatron-Core
    ``CheckpointWithoutOutput``: its inputs stay saved, already counted):

    - mla_up_proj: the up projections' products after RoPE, the core's inputs q and k (n (nope + rope)) and v
      (n v_head_dim), ``elem`` each, split by tp (``t``); the core's output and log-sum-exp stay;
    - layernorm: input_layernorm's and pre_mlp_layernorm's outputs (h each, one norm in a parallel block),
      ``elem`` or 1 byte with ``fp8_inputs`` (the linear's FP8 copy, discarded alike), / t with ``sp``;
    - moe_act: the routed experts' SwiGLU output, the down projection's input (top k x expert width per token
      in a MoE block, the mean over the blocks as :func:`xpar.config.remat.token_ffn`), ``elem`` or 1 byte.

    0 for any other policy. Units: bytes per token."""
    modules = MODULE_POLICIES.get(policy, ())
    kept_in = 1 if fp8_inputs else elem
    out = 0.0
    if "mla_up_proj" in modules and is_mla(cfg):
        out += elem * cfg.n_heads * (2 * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) + cfg.v_head_dim) / t
    if "layernorm" in modules:
        out += (1 if parallel_block else 2) * kept_in * cfg.hidden / (t if sp else 1)
    if "moe_act" in modules and cfg.n_experts:
        routed = cfg.moe_top_k * cfg.expert_ffn * cfg.moe_layers / cfg.n_layers
        out += kept_in * routed / t
    return out
