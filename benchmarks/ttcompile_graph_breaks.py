"""Where torch.compile breaks torchtitan's DeepEP MoE block, and what it fuses (issue 42, helper h42-ttcompile).

A small CPU stand-in of one Qwen3 MoE TransformerBlock as torchtitan @022f885f runs it with
``[compile] components = ["model", "loss"]`` and ``[activation_checkpoint] mode = "full"`` (the recipe of
benchmarks/refusal_hunt3.md rows 22-25): the block wrapped by ``ptd_checkpoint_wrapper`` (non-reentrant), then
``torch.compile(block, fullgraph=False)`` (torchtitan/models/llama4/infra/parallelize.py ``apply_compile``: MoE
blocks are not fullgraph). The op pattern is the source's:

- attention: wq, wk, wv; per-head ``nn.RMSNorm`` on q and k; RoPE by ``rotate_half``; SDPA; wo
  (torchtitan/models/qwen3/model/model.py ``Attention.forward``, ``apply_rotary_emb``);
- router: gate Linear, fp32 softmax, top-k, the debug round-robin ``arange % E`` and gather, route_norm, ``histc``,
  ``tokens_per_expert.add_`` (torchtitan/models/moe/moe.py ``TokenChoiceTopKRouter.forward``, ``MoE.forward``);
- DeepEP dispatch and combine: ``torch.autograd.Function`` subclasses calling DeepEP's ``Buffer`` (a C++ extension
  Dynamo cannot trace, no ``torch.library`` registration: torchtitan/distributed/deepep/fused_a2a.py
  ``FusedDispatch``, ``FusedCombine``), the received counts as a host list turned into a tensor; here the opaque
  call is ``torch._dynamo.graph_break()`` and the counts come back through ``tolist()``;
- permute: the routing map's ``.bool().T.contiguous()``, ``arange``/``expand``, two ``masked_select``, ``index_select``
  (torchtitan/distributed/deepep/utils.py ``permute``); experts: ``torch._grouped_mm`` w1 and w3 apart, SiLU x up, w2
  (moe.py ``_run_experts_grouped_mm``); ``unpermute`` under its own ``torch.compile(fullgraph=True)``;
  ``torch.zeros_like(x)`` and ``routed_output + out``, then the block's residual add.

``python benchmarks/ttcompile_graph_breaks.py`` prints the graphs Dynamo captures (their ops) and its graph-break
reasons, so which of the block's element-wise ops run inside a compiled graph and which run eagerly. Results differ by
torch version (this prints the one it ran on); docs/concepts/kernels.md ("torch.compile around DeepEP") records them.
"""
from __future__ import annotations

import collections
import functools

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, FFN, EP_LOCAL = 64, 4, 2, 16, 8, 2, 32, 8


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.q_norm, self.k_norm = nn.RMSNorm(HEAD_DIM), nn.RMSNorm(HEAD_DIM)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_norm(self.wq(x).view(b, s, -1, HEAD_DIM))
        k = self.k_norm(self.wk(x).view(b, s, -1, HEAD_DIM))
        v = self.wv(x).view(b, s, -1, HEAD_DIM)
        q, k = (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
        rep = HEADS // KV_HEADS
        k = k.unsqueeze(3).expand(b, s, KV_HEADS, rep, HEAD_DIM).reshape(b, s, HEADS, HEAD_DIM)
        v = v.unsqueeze(3).expand(b, s, KV_HEADS, rep, HEAD_DIM).reshape(b, s, HEADS, HEAD_DIM)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).contiguous().view(b, s, -1))


class Dispatch(torch.autograd.Function):
    """DeepEP's FusedDispatch: an opaque extension call, the received counts as a host list."""

    @staticmethod
    def forward(ctx, x, indices, probs):
        torch._dynamo.graph_break()  # Buffer.get_dispatch_layout / Buffer.dispatch: a pybind call
        counts = torch.bincount(indices.view(-1), minlength=EXPERTS).tolist()  # num_recv_tokens_per_expert_list
        return x.clone(), indices.clone(), probs.clone(), torch.tensor(counts, device=x.device)

    @staticmethod
    def backward(ctx, gx, gi, gp, gc):
        return gx.clone(), None, gp.clone()


class Combine(torch.autograd.Function):
    """DeepEP's FusedCombine: an opaque extension call."""

    @staticmethod
    def forward(ctx, x):
        torch._dynamo.graph_break()  # Buffer.combine: a pybind call
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g.clone()


@torch.compile(fullgraph=True)
def unpermute(tokens, sorted_indices, shape):
    out = torch.zeros(shape, dtype=tokens.dtype, device=tokens.device)
    out.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, shape[1]), tokens)
    return out.to(tokens.dtype)


def permute(tokens, routing_map, probs):
    n = tokens.shape[0]
    routing_map = routing_map.bool().T.contiguous()
    idx = torch.arange(n, device=tokens.device).unsqueeze(0).expand(routing_map.shape[0], -1)
    sorted_indices = idx.masked_select(routing_map)
    permuted_probs = probs.T.contiguous().masked_select(routing_map)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.w1 = nn.Parameter(torch.randn(EXPERTS, FFN, DIM) * 0.02)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, DIM, FFN) * 0.02)
        self.w3 = nn.Parameter(torch.randn(EXPERTS, FFN, DIM) * 0.02)
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS), persistent=False)

    def router(self, x):
        scores = F.softmax(self.gate(x).to(torch.float32), dim=1)
        _, sel = torch.topk(scores, k=TOP_K, dim=1)
        sel = torch.arange(x.shape[0] * TOP_K, device=x.device).reshape(-1, TOP_K) % EXPERTS
        top = scores.gather(dim=1, index=sel)
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        counts = torch.histc(sel.view(-1).float(), bins=EXPERTS, min=0, max=EXPERTS)
        return top, sel, counts

    def experts(self, x, counts):
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs).type_as(x)

    def forward(self, x):
        b, s, d = x.shape
        x = x.view(-1, d)
        top, sel, counts = self.router(x)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        recv, idx, probs, recv_counts = Dispatch.apply(x, sel, top.float())
        routing_map = F.one_hot(idx, EXPERTS).sum(1)  # fused_indices_to_multihot (a Triton kernel in the source)
        prob_map = torch.zeros(idx.shape[0], EXPERTS, dtype=probs.dtype).scatter(1, idx, probs)
        tokens, _, sorted_indices = permute(recv, routing_map, prob_map)
        out = self.experts(tokens, recv_counts)
        routed = Combine.apply(unpermute(out, sorted_indices, recv.shape))
        return (routed + torch.zeros_like(x)).reshape(b, s, d)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.moe = Attention(), MoE()

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.moe(self.ffn_norm(x))


def wrapped(block):
    """torchtitan's ``_apply_full_ac``: ``ptd_checkpoint_wrapper(block, preserve_rng_state=False, early_stop=False)``
    (torch.distributed.algorithms._checkpoint.checkpoint_wrapper: non-reentrant torch.utils.checkpoint)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    return checkpoint_wrapper(block, preserve_rng_state=False, early_stop=False)


def capture(checkpointed: bool = True, dtype=torch.bfloat16):
    """(graphs, breaks): each FX graph Dynamo hands its backend while a checkpointed (or plain) block runs forward and
    backward, as {op name: count}; the graph-break reasons Dynamo logs. Raises whatever torch.compile raises."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    graphs, breaks = [], []

    def backend(gm, example_inputs):
        ops = collections.Counter(str(n.target).split(".")[-1] if n.op == "call_method" else
                                  getattr(n.target, "__name__", str(n.target))
                                  for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))
        graphs.append(dict(ops))
        return gm.forward

    block = Block().to(dtype)
    model = torch.compile(wrapped(block) if checkpointed else block, backend=backend, fullgraph=False)
    s = 16
    x = torch.randn(2, s, DIM, dtype=dtype, requires_grad=True)
    cos, sin = torch.randn(1, s, 1, HEAD_DIM, dtype=dtype), torch.randn(1, s, 1, HEAD_DIM, dtype=dtype)
    explain = torch._dynamo.explain(model)(x, cos, sin)
    breaks = [str(r.reason).splitlines()[0] for r in explain.break_reasons]
    torch._dynamo.reset()
    graphs.clear()
    model(x, cos, sin).sum().backward()
    return graphs, breaks


def main():
    print(f"torch {torch.__version__}")
    for checkpointed in (True, False):
        graphs, breaks = capture(checkpointed)
        print(f"\n== {'checkpointed (full AC)' if checkpointed else 'no AC'}: {len(graphs)} graphs, "
              f"{len(breaks)} breaks")
        for i, g in enumerate(graphs):
            print(f"graph {i}: " + ", ".join(f"{k} x{v}" if v > 1 else k for k, v in sorted(g.items())))
        for r in breaks:
            print("break:", r[:160])


if __name__ == "__main__":
    main()
