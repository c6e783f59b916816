"""The busiest rank's routed activations (issue 43): the routed experts' SwiGLU tensors on the rank whose experts
receive the most copies, by the figure the step time takes for that rank (xpar.estimate.memory.activations.routed_load)."""
from __future__ import annotations

import pytest

from tests.conftest import compose
from xpar.config.validate import validate
from xpar.estimate.memory import per_device as mem

QWEN3 = ("model=qwen3_30b_a3b", "model.seq_len=4096", "framework=torchtitan", "hardware=b200_180gb_node",
         "parallel.dp=8", "parallel.zero_stage=3", "parallel.recompute=none", "train.micro_batch_size=2",
         "train.global_batch_size=16", "train.dtype=bf16", "train.compile=true", "train.compile_loss=true")


def _activations(*extra: str) -> float:
    return mem.memory(validate(compose("tracking=off", "run.progress=false", *QWEN3, *extra), local_devices=2)).activations


def test_the_busiest_ep_rank_keeps_its_extra_routed_copies_swiglu_tensors():
    """Qwen3-30B-A3B, no recompute, compiled (SwiGLU keeps w1's and w3's outputs and the product, 3 x 2 bytes per
    element): at ep 8 with model.moe_imbalance=1.5 the busiest rank's experts receive half again the even k T copies,
    0.5 x 8 x 768 SwiGLU elements more per token in each of the 48 MoE blocks; a capacity factor of 1.25 pads every
    expert to 1.25 x its share whatever ep; at ep 1 dropless routing leaves the rank's k T copies as they are."""
    tokens = 4096 * 2
    per_moe_token = 3 * 2 * 8 * 768
    even = _activations("parallel.ep=8")
    assert _activations("parallel.ep=8", "model.moe_imbalance=1.5") - even == pytest.approx(
        tokens * 48 * 0.5 * per_moe_token, rel=1e-9)
    one = _activations("parallel.ep=1")
    assert _activations("parallel.ep=1", "model.moe_imbalance=1.5") == pytest.approx(one, rel=1e-12)
    assert _activations("parallel.ep=1", "model.capacity_factor=1.25") - one == pytest.approx(
        tokens * 48 * 0.25 * per_moe_token, rel=1e-9)
