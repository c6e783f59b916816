"""framework.moe_recompute_graph_kept (issue 43): a MoE dispatcher that keeps the routing probabilities on its module
(the Primus-Turbo DeepEP manager of torchtitan's deepep branch @022f885f) keeps, under full recompute, each MoE block's
recomputed attention and router graph from its backward to its next forward
(xpar.estimate.memory.activations.moe_kept_graph_bytes); checked on torch's non-reentrant checkpoint."""
from __future__ import annotations

import gc
from dataclasses import replace

import numpy as np
import pytest

from tests.conftest import compose
from xpar.config.validate import validate
from xpar.estimate.memory import per_device as mem
from xpar.estimate.memory.model_states import MemoryOptions
from xpar.estimate.step_parts import Assumptions

QWEN3 = ("model=qwen3_30b_a3b", "model.seq_len=4096", "framework=torchtitan", "framework.ep_dispatcher=deepep",
         "hardware=b200_180gb_node", "parallel.dp=8", "parallel.ep=8", "parallel.zero_stage=3",
         "train.micro_batch_size=8", "train.global_batch_size=64", "train.dtype=bf16", "train.compile=true", "train.compile_loss=true")


def _spec(recompute: str):
    return validate(compose("tracking=off", "run.progress=false", *QWEN3, f"parallel.recompute={recompute}"),
                    local_devices=2)


def _memory(spec, kept: bool):
    from xpar.estimate.cost import assumptions_for

    return mem.memory(spec, assume=replace(assumptions_for(spec), moe_recompute_graph_kept=kept))


def test_full_recompute_keeps_each_moe_blocks_attention_and_router_graph():
    """Qwen3-30B-A3B (48 MoE blocks, h 2048, 32 heads of 128, K/V expanded before SDPA) under full recompute: after
    the backward every block holds the no-recompute bytes of its attention sublayer and router, per token 2 norm inputs
    and 2 projection inputs (2 h each, bf16), Q, K, V and the context (2 x 4096 each) and the log-sum-exp (4 x 32);
    the peak is the larger of that and the forward's (token ids beside both). No recompute and op-level SAC are unchanged."""
    spec = _spec("full")
    tokens, h, q = spec.seq_len * spec.train.micro_batch_size, 2048, 4096
    kept = 48 * tokens * (4 * 2 * h + 4 * 2 * q + 4 * 32)
    off, on = (_memory(spec, k) for k in (False, True))
    ids = 8 * tokens  # the int64 token ids beside (xpar.estimate.memory.activations.token_id_bytes)
    assert on.activations - ids == pytest.approx(max(off.activations - ids, kept), rel=1e-12)
    assert on.activations > 2 * off.activations
    assert on.total - off.total == pytest.approx(on.activations - off.activations, rel=1e-12)
    for rc in ("none", "selective"):
        s = _spec(rc)
        assert _memory(s, True).total == _memory(s, False).total


def test_plan_memory_columns_equal_the_estimate_with_the_moe_graph_kept():
    """The planner's vectorised peak memory prices moe_recompute_graph_kept as the scalar estimate does."""
    from tests.plan.test_plan_memory import assert_equal, candidates, context
    from xpar.config.presets import preset_dict

    fw = {**preset_dict("framework", "torchtitan"), "moe_recompute_graph_kept": True}
    ctx = context("qwen3_30b_a3b", "h100_80gb_64gpu", fw)
    cols = candidates(np.random.default_rng(5), ctx, 10)
    assert (cols["recompute"] == "full").any()
    assert_equal(ctx, cols, range(10))


def test_torch_keeps_a_recompute_graph_that_a_module_attribute_reaches():
    """What the option assumes, on torch: a checkpointed block whose router stores its probabilities on the module
    (cleared only after the last op that saves a tensor, as the manager's combine clears them) keeps the recompute's
    graph of everything before the router, with its saved tensors, after the backward; without early stop the
    recompute reaches the clearing and nothing is kept."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self, h: int, e: int):
            super().__init__()
            self.wq, self.gate = nn.Linear(h, h, bias=False), nn.Linear(h, e, bias=False)
            self.w1, self.w2 = nn.Linear(h, 4 * h, bias=False), nn.Linear(4 * h, h, bias=False)
            self.probs = None

        def forward(self, x):
            a = x + self.wq(torch.tanh(x))  # attention stand-in: tanh keeps its output, wq its input (the same)
            self.probs = F.softmax(self.gate(a), dim=-1)  # router: gate keeps a, softmax its output
            y = self.w2(F.relu(self.w1(a)))  # experts: the last tensors saved
            self.probs = None  # the manager's combine
            return a + y

    def live() -> int:
        gc.collect()
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in gc.get_objects() if type(t) is torch.Tensor}.values())

    def kept_after_backward(early_stop: bool) -> int:
        """Bytes freed when the probabilities the module still holds after the backward are dropped."""
        torch.manual_seed(0)
        blk, x = Block(64, 8), torch.randn(512, 64, requires_grad=True)
        checkpoint(blk, x, use_reentrant=False, early_stop=early_stop).sum().backward()
        before = live()
        blk.probs = None
        return before - live()

    n = 512 * 4
    assert kept_after_backward(False) == 0
    assert kept_after_backward(True) >= n * (64 + 64 + 8)  # tanh's output, a, the probabilities (fp32)
