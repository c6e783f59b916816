"""FLOPs of a training step, shared by measured runs (MFU) and the estimator.

Convention (Narayanan et al. 2021, Sec. 5.1 / Appendix; Korthikanti et al. 2022, Sec. 6):
2 FLOPs per multiply-add, backward = 2 x forward, every matmul counted:
attention q/k/v/o projections with GQA-aware K/V widths, attention scores Q.K^T and context P.V
over the full (non-causal) s x s square, a sliding window ignored (``window=True`` counts it), MLP
with 3 matrices (SwiGLU) or 2 (GELU), and the output logits; not norms, softmax, activations, optimizer.
A block with experts counts what a token goes through: the router and its top k and shared
experts (the active parameters; DeepSeek-AI 2024, "DeepSeek-V3", counts 37B of 671B so); MLA
its low-rank projections and its core at its head dims (xpar.config.attention).
For GPT shapes this reduces to the papers' closed forms:

    model FLOPs per iteration    = 72 B s l h^2 (1 + s/(6h) + V/(12 l h))
    with full recompute (HFU)    = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))
"""
from __future__ import annotations

from xpar.config.attention import attention_core_flops, attention_projection_flops
from xpar.config.remat import extra_forward_flops_per_token, policy_name, spec_recompute
from xpar.config.schema import ModelConfig


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False,
                            window: bool = False) -> dict[str, float]:
    """Forward FLOPs per token, by term. Units: FLOP per token.

    Returns a dict with ``matmul`` (per-layer projections and MLP, times l), ``attention``
    (scores and context, times l; halved when ``causal``; a sliding window's blocks at their window's
    keys only with ``window``: :func:`xpar.config.attention.attention_core_flops`) and ``logits``.
    """
    h, f = cfg.hidden, cfg.ffn_hidden
    n_mlp = 3 if cfg.activation == "swiglu" else 2
    projections = sum(attention_projection_flops(cfg).values())  # GQA-aware; MLA's low-rank projections
    matmul = projections + 2 * n_mlp * h * f
    # a block with experts: the router, the top k routed experts and the shared ones (active parameters)
    moe = projections + 2 * (h * cfg.n_experts + n_mlp * h * cfg.expert_ffn * (cfg.moe_top_k + cfg.n_shared_experts))
    attention = attention_core_flops(cfg, seq_len, causal, window)  # 4 s q; MLA: 2 s n (d_qk + d_v)
    dense_layers = cfg.n_layers - cfg.moe_layers
    return {"matmul": dense_layers * matmul + cfg.moe_layers * moe, "attention": cfg.n_layers * attention,
            "logits": 2 * h * cfg.vocab_size}


def model_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False, window: bool = False) -> float:
    """Model FLOPs per trained token (forward + backward = 3 x forward, no recompute); a sliding window
    counted only with ``window`` (:func:`forward_flops_per_token`)."""
    return 3.0 * sum(forward_flops_per_token(cfg, seq_len, causal, window).values())


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: str = "none",
                             causal: bool = False, selective: str = "op", share: float = 1.0) -> float:
    """FLOPs actually executed per token, recompute included (for HFU): model FLOPs plus the
    forward work the policy reruns on ``share`` of the blocks
    (:func:`xpar.config.remat.extra_forward_flops_per_layer`). full: the whole layer forward runs
    twice (4 x forward for the layers; the logits are not recomputed); Megatron's selective:
    the attention scores/context (Korthikanti et al. 2022, Sec. 4.2); ``selective``: what
    recompute=selective means; none: equals model FLOPs.
    """
    extra = extra_forward_flops_per_token(cfg, seq_len, policy_name(recompute, selective), share, causal)
    return model_flops_per_token(cfg, seq_len, causal) + extra


def spec_hardware_flops_per_token(spec) -> float:
    """:func:`hardware_flops_per_token` of a RunSpec: its policy and share of blocks recomputed
    (:func:`xpar.config.remat.spec_recompute`, the framework profile's meaning of selective)."""
    policy, share = spec_recompute(spec)
    return hardware_flops_per_token(spec.model, spec.seq_len, policy, share=share)
