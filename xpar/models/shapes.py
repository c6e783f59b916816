"""Analytic parameter counts from a model shape (the one place the count is derived).

Matches ``sum(p.numel())`` of :class:`xpar.models.transformer.Transformer` exactly; the
presets' tests pin it to the published counts (Llama 2: 6.74e9 / 13.02e9 / 68.98e9;
GPT-3 175B: 174.6e9 as counted by Megatron, Narayanan et al. 2021, which includes the
position embedding and one tied embedding matrix).
"""
from __future__ import annotations

from dataclasses import dataclass

from xpar.config.schema import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts (elements, not bytes) by part of the model."""

    embedding: int
    """Token embedding plus learned position embedding (first stage)."""
    per_layer: int
    """One transformer block: attention, MLP, two norms (biases included when present)."""
    final_norm: int
    output: int
    """Output projection; 0 when tied to the token embedding."""
    n_layers: int

    moe_per_layer: int = 0
    """One block with experts: attention, two norms, the router and every expert (routed and shared)."""
    moe_active_per_layer: int = 0
    """Of those, what one token uses: attention, norms, router, its top k and the shared experts."""
    moe_layers: int = 0
    """Blocks with experts (the rest hold ``per_layer``)."""

    @property
    def total(self) -> int:
        dense = self.n_layers - self.moe_layers
        return (self.embedding + dense * self.per_layer + self.moe_layers * self.moe_per_layer
                + self.final_norm + self.output)

    @property
    def active(self) -> int:
        """Parameters one token goes through (the total for a dense model; MoE: top k and shared
        experts only): the count behind a MoE model's FLOPs per token."""
        return self.total - self.moe_layers * (self.moe_per_layer - self.moe_active_per_layer)

    def stage(self, n_layers: int, first: bool, last: bool) -> int:
        """Parameters of one pipeline stage holding ``n_layers`` blocks. An untied last
        stage holds the output projection; a tied one holds its own copy of it."""
        n = n_layers * self.per_layer
        if first:
            n += self.embedding
        if last:
            n += self.final_norm + (self.output or (self.embedding_tokens if not first else 0))
        return n

    embedding_tokens: int = 0
    """Elements of the token embedding alone (the size of a tied output copy)."""


def param_count(cfg: ModelConfig) -> ParamCount:
    """Count parameters of the shape ``cfg``.

    Per block: attention h*q (q; q = n_heads x head dim) + 2*h*kv_dim (k, v) + q*h (o); MLP 3*h*f (SwiGLU) or 2*h*f
    (GELU); two norms (h each, 2h with LayerNorm biases); linear biases when cfg.bias. A block with
    experts: the router (h x E), E expert MLPs of width cfg.expert_ffn and the shared experts (one
    MLP of n_shared x expert_ffn, as :class:`xpar.models.transformer.MoE` holds them) in place of the MLP.
    """
    h, kv, q = cfg.hidden, cfg.kv_heads * cfg.head_size, cfg.q_dim  # q = h unless model.head_dim is set
    norm = h * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    attn = 2 * h * q + 2 * h * kv + ((q + h + 2 * kv) if cfg.bias else 0)
    per_layer = attn + mlp_params(cfg, cfg.ffn_hidden) + 2 * norm
    expert, router = mlp_params(cfg, cfg.expert_ffn), h * cfg.n_experts
    shared = mlp_params(cfg, cfg.expert_ffn * cfg.n_shared_experts) if cfg.n_shared_experts else 0
    moe_base = attn + 2 * norm + router + shared
    tok = cfg.vocab_size * h
    emb = tok + (cfg.seq_len * h if cfg.position == "learned" else 0)
    output = 0 if cfg.tied_embeddings else cfg.vocab_size * h
    return ParamCount(embedding=emb, per_layer=per_layer, final_norm=norm, output=output,
                      n_layers=cfg.n_layers, embedding_tokens=tok, moe_layers=cfg.moe_layers,
                      moe_per_layer=moe_base + cfg.n_experts * expert if cfg.n_experts else 0,
                      moe_active_per_layer=moe_base + cfg.moe_top_k * expert if cfg.n_experts else 0)


def mlp_params(cfg: ModelConfig, ffn: int) -> int:
    """Elements of one MLP of inner width ``ffn``: 3 h f (SwiGLU) or 2 h f (GELU), biases if any."""
    n_mlp = 3 if cfg.activation == "swiglu" else 2
    return n_mlp * cfg.hidden * ffn + (((n_mlp - 1) * ffn + cfg.hidden) if cfg.bias else 0)
