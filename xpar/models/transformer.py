"""Decoder-only transformer (Llama or GPT shapes). Knows nothing of parallelism.

Pipeline friendly (as in torchtitan's composability notes): blocks live in a
``ModuleDict`` keyed by their global index, so a pipeline stage that keeps only its own
blocks keeps the same parameter names; the token embedding, position embedding, final
norm and output projection are optional, so one class serves every stage.

Shapes: tokens ``[B, S]`` (int64) -> logits ``[B, S, V]``; between stages ``[B, S, H]``. Attention's
head count and the two seams strategies set (``positions``, ``Attention.core``): docs/concepts/design-notes.md.
"""
from __future__ import annotations

import zlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from xpar.config.schema import ModelConfig


def _norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=cfg.bias)


def sequence_positions(S: int, device: torch.device) -> torch.Tensor:
    """Positions ``[S]`` (int64) of a module's S tokens: 0..S-1, the whole sequence."""
    return torch.arange(S, device=device)


def band_mask(pos_s: torch.Tensor, S: int, window: int = 0) -> torch.Tensor:
    """Which of ``S`` keys (positions 0..S-1) each query at ``pos_s`` ``[s]`` sees: ``[s, S]`` bool, the keys at
    positions <= its own (causal) and, with a ``window`` > 0, > its own - window (sliding-window attention:
    itself and the window - 1 tokens before it, as HF's ``sliding_window`` and gpt-oss's reference model)."""
    keys_S = torch.arange(S, device=pos_s.device)[None, :]
    seen = keys_S <= pos_s[:, None]
    return seen & (keys_S > pos_s[:, None] - window) if window > 0 else seen


def causal_attention(q_BNSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, window: int = 0) -> torch.Tensor:
    """Causal attention of q ``[B, N, S, D]`` over k, v ``[B, K, S, D]`` (K = n_kv heads, N a
    multiple of K: grouped-query K/V repeated here), within ``window`` keys where > 0 (the band of
    :func:`band_mask` as SDPA's ``attn_mask``); returns ``[B, N, S, D]``."""
    n_q, n_kv, S = q_BNSD.shape[1], k_BKSD.shape[1], k_BKSD.shape[2]
    if n_kv != n_q:
        k_BKSD = k_BKSD.repeat_interleave(n_q // n_kv, dim=1)
        v_BKSD = v_BKSD.repeat_interleave(n_q // n_kv, dim=1)
    if window > 0:
        mask_SS = band_mask(torch.arange(S, device=q_BNSD.device), S, window)
        return F.scaled_dot_product_attention(q_BNSD, k_BKSD, v_BKSD, attn_mask=mask_SS)
    return F.scaled_dot_product_attention(q_BNSD, k_BKSD, v_BKSD, is_causal=True)


def rope(x_BSND: torch.Tensor, theta: float, positions_S: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021), half-split convention, at ``positions_S``
    (default 0..S-1)."""
    S, D = x_BSND.shape[1], x_BSND.shape[-1]
    if positions_S is None:
        positions_S = torch.arange(S, device=x_BSND.device)
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, device=x_BSND.device, dtype=torch.float32) / D))
    ang_SD = torch.outer(positions_S.to(torch.float32), inv_freq)
    cos, sin = ang_SD.cos()[None, :, None, :], ang_SD.sin()[None, :, None, :]
    x1, x2 = x_BSND.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x_BSND.dtype)


class Attention(nn.Module):
    """Causal self-attention with grouped-query K/V (n_kv_heads <= n_heads), within ``window`` keys where
    > 0 (a local layer: ``cfg.is_local_layer``). Seams (module docstring): ``positions`` for RoPE,
    ``core(q, k, v, window=...)`` for the attention of q over k, v (given before the grouped K/V heads are repeated)."""

    def __init__(self, cfg: ModelConfig, window: int = 0):
        super().__init__()
        self.window = window
        kv_dim = cfg.kv_heads * cfg.head_size
        self.head_dim = cfg.head_size
        self.position = cfg.position
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.hidden, cfg.q_dim, bias=cfg.bias)  # q_dim = n_heads x head dim
        self.wk = nn.Linear(cfg.hidden, kv_dim, bias=cfg.bias)
        self.wv = nn.Linear(cfg.hidden, kv_dim, bias=cfg.bias)
        self.wo = nn.Linear(cfg.q_dim, cfg.hidden, bias=cfg.bias)
        self.positions = sequence_positions
        self.core = causal_attention

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        q = self.wq(x_BSH)
        k = self.wk(x_BSH)
        v = self.wv(x_BSH)
        # Local head counts come from the (possibly tensor-parallel) output widths.
        n_q, n_kv = q.shape[-1] // self.head_dim, k.shape[-1] // self.head_dim
        q = q.view(B, S, n_q, self.head_dim)
        k = k.view(B, S, n_kv, self.head_dim)
        v = v.view(B, S, n_kv, self.head_dim)
        if self.position == "rope":
            pos = self.positions(S, x_BSH.device)
            q, k = rope(q, self.rope_theta, pos), rope(k, self.rope_theta, pos)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, N, S, D]
        o = self.core(q, k, v, window=self.window)
        return self.wo(o.transpose(1, 2).reshape(B, S, n_q * self.head_dim))


NON_GATED = {"gelu": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
             "squared_relu": lambda x: torch.square(F.relu(x))}
"""The non-gated MLP activations by model.activation (xpar.config.checks.config.CHOICES)."""


class MLP(nn.Module):
    """SwiGLU (w2(silu(w1 x) * w3 x), 3 matrices) or a non-gated w2(act(w1 x)) with 2 matrices: GELU
    (tanh), ReLU (OPT, Zhang et al. 2022) or squared ReLU (relu(x)^2: Primer, So et al. 2021; Nemotron-4),
    of inner width ``ffn`` (default cfg.ffn_hidden; an expert's: cfg.expert_ffn)."""

    def __init__(self, cfg: ModelConfig, ffn: Optional[int] = None):
        super().__init__()
        f = cfg.ffn_hidden if ffn is None else ffn
        self.swiglu = cfg.activation == "swiglu"
        self.act = NON_GATED.get(cfg.activation)
        self.w1 = nn.Linear(cfg.hidden, f, bias=cfg.bias)
        self.w2 = nn.Linear(f, cfg.hidden, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.hidden, f, bias=cfg.bias) if self.swiglu else None

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(F.silu(self.w1(x_BSH)) * self.w3(x_BSH))
        return self.w2(self.act(self.w1(x_BSH)))


class MoE(nn.Module):
    """Mixture of experts (Shazeer et al. 2017; Mixtral's routing, Jiang et al. 2024): a router
    scores the E experts per token, each token goes to its top k, weighted by the softmax over
    those k scores, plus every shared expert (DeepSeek-V3's), summed. Dropless: every routed
    token is computed (capacity_factor is the estimate's). Shapes: x [B, S, H] -> [B, S, H].

    The routed experts live in a ``ModuleDict`` keyed by their global index (``experts.<e>.w1``,
    the names a ``ModuleList`` gives), so a module holding a subset of them keeps the same
    parameter names, as a pipeline stage keeps its blocks'. ``dispatch`` is the one seam a
    parallel strategy uses: ``dispatch(experts, x [T, H], gates [T, k], experts [T, k]) -> [T, H]``
    computes the routed part (default :func:`run_experts`, every expert here;
    xpar.parallel.expert installs an all-to-all one)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.moe_top_k
        self.groups, self.group_topk = cfg.moe_router_groups, cfg.moe_router_group_topk
        self.router = nn.Linear(cfg.hidden, cfg.n_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): MLP(cfg, cfg.expert_ffn) for e in range(cfg.n_experts)})
        self.shared = (MLP(cfg, cfg.expert_ffn * cfg.n_shared_experts) if cfg.n_shared_experts else None)
        self.dispatch = run_experts

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        logits_TE = self.router(x_TH)
        if self.groups:
            logits_TE = group_limited(logits_TE, self.groups, self.group_topk, self.top_k)
        scores_TK, experts_TK = logits_TE.topk(self.top_k, dim=-1)
        gates_TK = scores_TK.softmax(dim=-1, dtype=torch.float32).to(x_TH.dtype)
        out_TH = self.dispatch(self.experts, x_TH, gates_TK, experts_TK)
        if self.shared is not None:
            out_TH = out_TH + self.shared(x_TH)
        return out_TH.view_as(x_BSH)


def group_limited(logits_TE: torch.Tensor, groups: int, group_topk: int, top_k: int) -> torch.Tensor:
    """Router logits [T, E] with every expert outside each token's ``group_topk`` best groups at -inf: groups
    of E / ``groups`` consecutive experts, scored by the sum of their top (``top_k`` // ``group_topk``) logits
    (group-limited routing: DeepSeek-V3 Sec. 2.1.2 node-limited routing; Megatron-Core's group_limited_topk)."""
    T, E = logits_TE.shape
    grouped_TGe = logits_TE.view(T, groups, E // groups)
    score_TG = grouped_TGe.topk(top_k // group_topk, dim=-1).values.sum(dim=-1)
    keep_TG = torch.zeros_like(score_TG, dtype=torch.bool).scatter_(1, score_TG.topk(group_topk, dim=-1).indices, True)
    return grouped_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, E)


def run_experts(experts: nn.ModuleDict, x_TH: torch.Tensor, gates_TK: torch.Tensor,
                experts_TK: torch.Tensor) -> torch.Tensor:
    """The routed experts' weighted sum per token, every expert held here: for each expert e
    (global index = its key), its tokens' rows through it, times their gates, added into [T, H].
    An expert that received no tokens runs on its empty slice (0 rows), so its parameters get
    zero gradients rather than none: every replica's backward covers the same parameters
    whatever the router picked (pytorch#158719, torchtitan#2747)."""
    out_TH = torch.zeros_like(x_TH)
    for key, expert in experts.items():
        token, slot = (experts_TK == int(key)).nonzero(as_tuple=True)
        out_TH = out_TH.index_add(0, token, expert(x_TH[token]) * gates_TK[token, slot, None])
    return out_TH


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP is a
    :class:`MoE` where the model puts experts (``cfg.is_moe_layer(layer)``), the attention local where the
    model puts a sliding window (``cfg.is_local_layer(layer)``)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = _norm(cfg)
        self.attention = Attention(cfg, cfg.sliding_window if cfg.is_local_layer(layer) else 0)
        self.ffn_norm = _norm(cfg)
        self.feed_forward = MoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        h = x_BSH + self.attention(self.attention_norm(x_BSH))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it.

    Args:
        cfg: the model shape.
        layers: global indices of the blocks this module holds (default: all).
        first: holds the token (and learned position) embedding.
        last: holds the final norm and the output projection.
    """

    def __init__(self, cfg: ModelConfig, layers: Optional[list[int]] = None,
                 first: bool = True, last: bool = True):
        super().__init__()
        self.cfg = cfg
        layers = list(range(cfg.n_layers)) if layers is None else list(layers)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden) if first else None
        self.pos_embeddings = (nn.Embedding(cfg.seq_len, cfg.hidden)
                               if first and cfg.position == "learned" else None)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in layers})
        self.norm = _norm(cfg) if last else None
        self.output = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False) if last else None
        if first and last and cfg.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.positions = sequence_positions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(x)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(self.positions(x.shape[1], x.device))
        else:
            h = x
        for block in self.layers.values():
            h = block(h)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Seeded init keyed by parameter name, so any subset of blocks (a pipeline stage)
        gets exactly the values it has in the whole model. Weights ~ N(0, 0.02), norms 1,
        biases 0."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name.split(".")[-2]:
                p.fill_(1.0)
            else:
                g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(p.dtype))
