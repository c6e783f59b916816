"""A Llama block as torchtitan writes it (composite RMSNorm with its fp32 upcast, RoPE through complex views, GQA
K/V repeated before SDPA, SwiGLU), for tests that check what torch saves for the backward
(tests/estimate/test_compile.py)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope(x, freqs):
    """x (b, s, heads, d) rotated by complex ``freqs`` (1, s, 1, d / 2)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs).flatten(3).type_as(x)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, hidden // heads
        self.n1, self.n2 = RMSNorm(hidden), RMSNorm(hidden)
        self.wq = nn.Linear(hidden, hidden, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)
        self.w1, self.w3 = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, freqs):
        b, s, h = x.shape
        y = self.n1(x)
        q = rope(self.wq(y).view(b, s, self.heads, self.hd), freqs)
        k = rope(self.wk(y).view(b, s, self.kv_heads, self.hd), freqs)
        v = self.wv(y).view(b, s, self.kv_heads, self.hd)
        k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=2) for t in (k, v))
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, h))
        z = self.n2(x)
        return x + self.w2(F.silu(self.w1(z)) * self.w3(z))


def saved_activations(fn, b: int, s: int, hidden: int) -> list[tuple]:
    """(shape, dtype) of each distinct storage ``fn`` saves for its backward on a (b, s, hidden) bf16 input whose
    leading dimension is b or b s (activations, not weights); runs the backward."""
    torch.manual_seed(0)
    hd = fn.hd if hasattr(fn, "hd") else fn._orig_mod.hd
    freqs = torch.polar(torch.ones(s, hd // 2), torch.randn(s, hd // 2))[None, :, None, :]
    x = torch.randn(b, s, hidden, dtype=torch.bfloat16, requires_grad=True)
    saved = {}

    def pack(t):
        if not isinstance(t, nn.Parameter) and t.dim() and t.shape[0] in (b, b * s):
            saved[t.untyped_storage().data_ptr()] = (tuple(t.shape), t.dtype)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x, freqs)
    out.sum().backward()
    return list(saved.values())
