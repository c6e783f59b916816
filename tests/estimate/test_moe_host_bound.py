"""Host-bound MoE blocks (issue 42; benchmarks/moe_host_bound.py, benchmarks/moe_host_bound.md): the two-point split
of a step into fixed and per-token parts, and the host's seconds per MoE block against the GPU's."""
from __future__ import annotations

import pytest

from benchmarks.hunt_score import build
from benchmarks.moe_host_bound import moe_block_host, split_fixed
from xpar.estimate.cost import assumptions_for

QWEN3_B200 = ("python -m xpar run.mode=estimate tracking=off parallel.micro_batches=auto framework=torchtitan "
              "framework.ep_dispatcher=deepep model=qwen3_30b_a3b model.seq_len=4096 parallel.tp=1 parallel.pp=1 "
              "parallel.ep=8 parallel.zero_stage=3 train.dtype=bf16 hardware=b200_180gb_node parallel.dp=8 "
              "train.micro_batch_size={mb} train.global_batch_size={gb}")


def test_split_fixed_recovers_the_line_through_two_steps():
    """0.2 s fixed and 60 us a token: steps of 32,768 and 40,960 tokens give back both parts; one token count
    twice has no line."""
    steps = [(t, 0.2 + 60e-6 * t) for t in (32768, 40960)]
    fixed, per = split_fixed(*steps[0], *steps[1])
    assert fixed == pytest.approx(0.2) and per == pytest.approx(60e-6)
    with pytest.raises(ValueError):
        split_fixed(32768, 1.0, 32768, 2.0)


def test_moe_block_is_not_host_bound_at_micro_batch_8_and_is_at_micro_batch_1_with_slow_ops():
    """The host's seconds are the block's kernels at the per-op cost; the dispatcher synchronises in the forward only.
    At micro-batch 8 even 25 us an op is under a third of the block's GPU time; at micro-batch 1 and 250 us
    (the per-op cost a host-bound reading of the published B200 step would need) the host exceeds it."""
    spec, _ = build(QWEN3_B200.format(mb=8, gb=64))
    assume = assumptions_for(spec)
    big = moe_block_host(spec, assume, host_us=25.0)
    for p in big.values():
        assert p["host"] == pytest.approx(p["kernels"] * 25e-6)
        assert p["host"] < p["busy"] / 3
    assert big["forward"]["sync"] > 0 and big["backward"]["sync"] == 0
    small, _ = build(QWEN3_B200.format(mb=1, gb=8))
    slow = moe_block_host(small, assumptions_for(small), host_us=250.0)
    assert slow["forward"]["host"] > slow["forward"]["busy"]


def test_moe_block_host_refuses_a_dense_model():
    spec, _ = build(QWEN3_B200.format(mb=1, gb=8).replace("model=qwen3_30b_a3b", "model=7b").replace(
        "framework.ep_dispatcher=deepep ", "").replace("parallel.ep=8", "parallel.ep=1"))
    with pytest.raises(ValueError):
        moe_block_host(spec, assumptions_for(spec))
