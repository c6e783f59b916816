"""The routed copies a Megatron-Core MoE block keeps for backward (xpar.estimate.memory.activations.routed_copy_bytes,
framework.moe_routed_copies_kept): the grouped fc1 GEMM's input, k h per token, by hand on DeepSeek-V3's block; over
tp with sequence parallelism and etp; none under full or moe recompute; FP8 inputs at one byte."""
from __future__ import annotations

import pytest

from tests.conftest import compose
from xpar.config.validate import validate
from xpar.estimate.memory.activations import layer_bytes
from xpar.estimate.step_parts import assumptions_for

H, K, S = 7168, 8, 4096  # DeepSeek-V3: hidden, routed experts per token, sequence
MOE_SHARE = 58 / 61  # its MoE blocks (the first three are dense)


def dsv3(*overrides: str):
    """DeepSeek-V3 under megatron_core, validated, not memory-checked (only the block is compared)."""
    return validate(compose("tracking=off", "model=deepseek_v3", "run.mode=estimate", "hardware=h100_80gb_64gpu",
                            "framework=megatron_core", "train.dtype=bf16", "parallel.pp=8",
                            "parallel.zero_stage=1", "train.micro_batch_size=1", "train.global_batch_size=64",
                            "run.dry_run=false", *overrides), 64)


def _ep(overrides: tuple) -> tuple:
    """ep 8 unless an override names it."""
    return overrides if any(o.startswith("parallel.ep=") for o in overrides) else (*overrides, "parallel.ep=8")


def copies_per_token(*overrides: str, key: str = "none") -> float:
    """Bytes per token of the sequence the block keeps with the profile's copies less without them."""
    with_copies = dsv3(*_ep(overrides), "framework.moe_routed_copies_kept=1")
    without = dsv3(*_ep(overrides), "framework.moe_routed_copies_kept=0")
    a, b = (layer_bytes(s, assumptions_for(s), 1.0)[key] for s in (with_copies, without))
    return (a - b) / S


def test_megatron_core_keeps_the_fc1_input_of_each_routed_copy():
    """tp 1: each of the token's 8 routed copies, 7168 wide in bf16, on 58 of 61 blocks (an option: off by default,
    conf/framework/megatron_core.yaml says why)."""
    assert dsv3("parallel.ep=8").framework.moe_routed_copies_kept == 0
    assert copies_per_token("parallel.tp=1", "parallel.dp=8") == pytest.approx(2 * K * H * MOE_SHARE, rel=1e-12)


def test_sequence_parallel_splits_them_and_etp_gathers_them_again():
    """tp 2 with sequence parallelism: a rank routes half the tokens (etp 1); at etp 2 the expert group gathers
    its two ranks' tokens for fc1, so each rank keeps as many as at tp 1."""
    one = 2 * K * H * MOE_SHARE
    base = ("parallel.tp=2", "parallel.dp=4", "parallel.sequence_parallel=true", "parallel.ep=4")
    assert copies_per_token(*base, "parallel.etp=1") == pytest.approx(one / 2, rel=1e-12)
    assert copies_per_token(*base, "parallel.etp=2") == pytest.approx(one, rel=1e-12)


@pytest.mark.parametrize("policy", ["full", "moe"])
def test_none_kept_where_the_moe_layer_is_rerun(policy):
    """Full recompute keeps the block input only; --recompute-modules moe reruns router, dispatch and experts."""
    assert copies_per_token("parallel.tp=1", "parallel.dp=8", f"parallel.recompute={policy}", key="kept") == 0
    assert copies_per_token("parallel.tp=1", "parallel.dp=8", f"parallel.recompute={policy}", key="none") > 0


def test_fp8_keeps_them_at_one_byte():
    """Transformer Engine's FP8 GEMMs keep their FP8-cast input (framework.fp8_saves_inputs)."""
    assert copies_per_token("parallel.tp=1", "parallel.dp=8", "train.dtype=fp8") == pytest.approx(
        K * H * MOE_SHARE, rel=1e-12)


def test_the_busiest_rank_keeps_its_load_of_copies():
    """The peak device is the busiest ep rank (routed_load): its experts receive model.moe_imbalance times the even
    share of copies, and keep that many fc1 inputs."""
    assert copies_per_token("parallel.tp=1", "parallel.dp=8", "model.moe_imbalance=1.5") == pytest.approx(
        1.5 * 2 * K * H * MOE_SHARE, rel=1e-12)
