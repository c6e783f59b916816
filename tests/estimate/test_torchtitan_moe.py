"""torchtitan's MoE block priced from what its kernels do (issue 42): the aten atomic scatters that sum the routed
copies back into their tokens (framework.moe_scatter, xpar.estimate.moe_dispatch) and torch._grouped_mm's rate on
Blackwell (framework.expert_gemm_kernel, xpar.estimate.compute.kernels)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tests.conftest import spec_for
from xpar.config.checks.framework import check_framework
from xpar.config.checks.hardware import load_hardware_preset
from xpar.config.presets import preset_dict
from xpar.config.schema import FrameworkConfig
from xpar.estimate.compute.kernel_block import (BlockShape, block_times, scatter_target_bytes, split_bias_bytes,
                                                split_up_grad_bytes)
from xpar.estimate.compute.kernels import TORCH_GROUPED_MM_RATE, device_of, expert_gemm_rate, memory_time
from xpar.estimate.cost import estimate
from xpar.estimate.moe_dispatch import ATOMIC_SCATTER_SLOWDOWN, atomic_scatter_seconds
from xpar.estimate.step_parts import assumptions_for

B200 = device_of(load_hardware_preset("b200_180gb_node"))
H100 = device_of(load_hardware_preset("h100_80gb_8gpu"))
# Qwen3-30B-A3B's block: 128 experts of width 768, top-8, hidden 2048
MOE_30B = BlockShape(hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144, experts=128, top_k=8, expert_ffn=768)


@pytest.mark.parametrize("backward", [False, True])
def test_an_atomic_scatter_prices_the_copies_at_its_slowdown_over_a_streaming_pass(backward):
    """Micro-batch 8 x 4096 tokens at ep 8 (torchtitan's DeepEP row): forward the combine's scatter_add_, backward
    the index_add_ gradient of the token gather, each (copies + tokens) x hidden x 2 bytes at 11.1x a streaming
    pass; the forward's streaming unpermute is no longer counted as memory traffic, and nothing else changes."""
    kw = dict(ep=8, dispatcher="deepep", backward=backward)
    fused, atomic = (block_times(MOE_30B, 8, 4096, B200, moe_scatter=s, **kw) for s in ("fused", "atomic"))
    tokens = 8 * 4096
    nbytes = (tokens * 8 + tokens) * 2048 * 2
    assert float(atomic.atomics) == pytest.approx(ATOMIC_SCATTER_SLOWDOWN * float(memory_time(nbytes, B200)))
    assert float(atomic.atomics) == pytest.approx(float(atomic_scatter_seconds(tokens * 8, tokens, 2048, 8e12)))
    assert float(fused.atomics) == 0.0
    twice = 2 if backward else 1  # the backward's element-wise traffic is twice the forward's
    # the unpermute's streamed bytes, less the scatter's zeroed target and its sum with a zeroed output (4 T h)
    streamed = memory_time((nbytes - 4 * tokens * 2048 * 2) * twice, B200)
    assert float(fused.memory - atomic.memory) == pytest.approx(float(streamed))
    assert (fused.gemm, fused.experts, fused.attention) == (atomic.gemm, atomic.experts, atomic.attention)
    assert float(atomic.busy - fused.busy) == pytest.approx(float(atomic.atomics - streamed))
    dense = block_times(BlockShape(hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144), 8, 4096, B200,
                        moe_scatter="atomic", backward=backward)
    assert float(dense.atomics) == 0.0  # a dense block has no copies to scatter


def test_torch_grouped_mm_runs_below_the_dense_rate_on_blackwell_and_at_it_elsewhere():
    """torch._grouped_mm on B200 at 0.83 (forward) and 0.67 (backward) of the dense GEMM rate in BF16 (torchao's
    grouped and dense benchmarks); on an H100, with no public figure, and for FP8 experts at the dense rate; only the
    routed experts change."""
    fwd_rate, bwd_rate = TORCH_GROUPED_MM_RATE["blackwell"]
    assert expert_gemm_rate("torch_grouped_mm", B200) == (fwd_rate, bwd_rate) == (0.83, 0.67)
    assert expert_gemm_rate("torch_grouped_mm", H100) == expert_gemm_rate("dense", B200) == (1.0, 1.0)
    assert expert_gemm_rate("torch_grouped_mm", B200, "mxfp8") == (1.0, 1.0)  # torchao's scaled kernels, not this one
    for backward, rate in ((False, fwd_rate), (True, bwd_rate)):
        dense, torch_mm = (block_times(MOE_30B, 8, 4096, B200, ep=8, expert_gemm_kernel=k, backward=backward)
                           for k in ("dense", "torch_grouped_mm"))
        assert float(torch_mm.experts) == pytest.approx(float(dense.experts) / rate)
        assert (float(torch_mm.gemm), float(torch_mm.memory)) == (float(dense.gemm), float(dense.memory))
        on_h100 = (block_times(MOE_30B, 8, 4096, H100, ep=8, expert_gemm_kernel=k, backward=backward).experts
                   for k in ("dense", "torch_grouped_mm"))
        assert len({float(x) for x in on_h100}) == 1
    with pytest.raises(ValueError, match="expert_gemm_kernel='loop'"):
        expert_gemm_rate("loop", B200)


def test_torchtitan_runs_atomic_scatters_and_torch_grouped_mm_the_te_stacks_do_not():
    """torchtitan's profile names its kernels; NeMo AutoModel (TE's fused permutation) and MaxText (a gather-and-sum
    unpermute) keep the fused scatter and the dense rate; a value outside the choices is refused."""
    titan = FrameworkConfig(**preset_dict("framework", "torchtitan"))
    assert (titan.moe_scatter, titan.expert_gemm_kernel) == ("atomic", "torch_grouped_mm")
    for name in ("fsdp2_bf16", "maxtext", "megatron_core", "xpar"):
        fw = FrameworkConfig(**preset_dict("framework", name))
        assert (fw.moe_scatter, fw.expert_gemm_kernel) == ("fused", "dense"), name
    bad = check_framework(FrameworkConfig(moe_scatter="sorted", expert_gemm_kernel="loop"))
    assert any("framework.moe_scatter='sorted'" in b for b in bad)
    assert any("framework.expert_gemm_kernel='loop'" in b for b in bad)


def qwen3_b200(*overrides: str):
    """torchtitan's DeepEP row on one B200 node (refusal_hunt3.md row 22's layout, held out: not its figure)."""
    return spec_for("model=qwen3_30b_a3b", "run.mode=estimate", "hardware=b200_180gb_node", "framework=torchtitan",
                    "framework.ep_dispatcher=deepep", "parallel.ep=8", "parallel.dp=8", "parallel.zero_stage=3",
                    "parallel.recompute=full", "train.dtype=bf16", "train.compile=true", "train.micro_batch_size=8",
                    "train.global_batch_size=64", "run.dry_run=false", *overrides, local_devices=8)


def test_the_step_adds_the_scatters_and_the_grouped_gemm_time_of_every_block_pass():
    """48 MoE blocks, one micro-batch, full recompute (the forward's memory-bound kernels twice; its experts' GEMMs but
    w2, which torch's non-reentrant checkpoint stops before: 2/3 again): the step grows by each block's atomic
    scatters less the streamed unpermute (in memory_bound) and by the grouped GEMMs' extra time (in matmul), and
    by nothing else."""
    old = ("framework.moe_scatter=fused", "framework.expert_gemm_kernel=dense")
    spec, before = qwen3_b200(), qwen3_b200(*old)
    assert assumptions_for(spec).moe_scatter == "atomic" and assumptions_for(before).moe_scatter == "fused"
    a, b = estimate(spec), estimate(before)
    from xpar.estimate.compute.kernel_costs import rerun_shares, training_device
    device = training_device(spec.hardware, "sdpa")
    again = rerun_shares("full", assumptions_for(spec).checkpoint_early_stop)
    assert (again["memory"], again["mlp"]) == (1.0, pytest.approx(2 / 3))
    kw = dict(ep=8, dispatcher="deepep", host_us_per_kernel=assumptions_for(spec).host_op_us)
    f, bw = (block_times(MOE_30B, 8, 4096, device, backward=x, moe_scatter="atomic", **kw) for x in (False, True))
    f0, bw0 = (block_times(MOE_30B, 8, 4096, device, backward=x, **kw) for x in (False, True))
    grad_sum = memory_time(split_up_grad_bytes(8 * 4096 * 8, 2048), device)  # torch._grouped_mm's split w1 / w3
    extra_mem = ((1 + again["memory"]) * (f.atomics + f.memory - f0.memory) + (bw.atomics + bw.memory - bw0.memory)
                 + grad_sum)
    assert a.time_breakdown["memory_bound"] - b.time_breakdown["memory_bound"] == pytest.approx(48 * float(extra_mem))
    g, g0 = (block_times(MOE_30B, 8, 4096, device, expert_gemm_kernel=k, **kw).experts
             for k in ("torch_grouped_mm", "dense"))
    gb, gb0 = (block_times(MOE_30B, 8, 4096, device, backward=True, expert_gemm_kernel=k, **kw).experts
               for k in ("torch_grouped_mm", "dense"))
    extra_mm = (1 + again["mlp"]) * (g - g0) + (gb - gb0)
    assert a.time_breakdown["matmul"] - b.time_breakdown["matmul"] == pytest.approx(48 * float(extra_mm))
    assert a.time_breakdown["ep_comm"] == b.time_breakdown["ep_comm"]
    assert 1.2 < a.time_per_step_s / b.time_per_step_s < 1.4


@pytest.mark.parametrize("scatter", ["fused", "atomic"])
def test_torchtitans_split_gate_and_up_gemms_sum_their_input_gradients_in_the_backward(scatter):
    """torchtitan's _run_experts_grouped_mm runs w1 and w3 as two grouped GEMMs on one input, so the backward adds
    their two (copies x hidden) input gradients: one aten add (read 2, write 1) in BlockTerms.atomics, backward only,
    and only under torch_grouped_mm (a fused up projection has one dgrad). Nothing else moves."""
    kw = dict(ep=8, dispatcher="deepep", moe_scatter=scatter)
    for backward in (False, True):
        dense, titan = (block_times(MOE_30B, 8, 4096, B200, expert_gemm_kernel=k, backward=backward, **kw)
                        for k in ("dense", "torch_grouped_mm"))
        copies = 8 * 4096 * 8  # 32,768 tokens a rank, top-8, even routing: the rank receives as many copies
        grad_sum = memory_time(3 * copies * 2048 * 2, B200) if backward else 0.0
        assert float(split_up_grad_bytes(copies, 2048)) == 3 * copies * 2048 * 2
        assert float(titan.atomics - dense.atomics) == pytest.approx(float(grad_sum))
        assert (float(titan.memory), float(titan.gemm)) == (float(dense.memory), float(dense.gemm))
    assert float(grad_sum) > 0.4e-3  # 3.2 GB a block's backward on B200: ~0.45 ms, 2 % of the block


def test_the_atomic_combine_still_writes_its_zeroed_target_and_adds_the_shared_output():
    """Under framework.moe_scatter 'atomic' the forward keeps 4 x tokens x hidden bf16 of streamed traffic beside the
    scatter (torch.zeros target, zeros_like / shared output, their add); it is independent of top-k, where the copies'
    streamed read it replaces grows with k."""
    tokens = 8 * 4096
    assert float(scatter_target_bytes(tokens, 2048)) == 4 * tokens * 2048 * 2
    for k in (1, 8):
        sh = BlockShape(hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144, experts=128, top_k=k,
                        expert_ffn=768)
        fused, atomic = (block_times(sh, 8, 4096, B200, ep=8, moe_scatter=s) for s in ("fused", "atomic"))
        assert float(fused.memory - atomic.memory) == pytest.approx(
            float(memory_time((k + 1 - 4) * tokens * 2048 * 2, B200)))


def test_automodels_eager_expert_biases_move_their_split_add_and_fp32_bytes_only_where_the_model_has_them():
    """gpt-oss's expert biases under NeMo AutoModel (framework.expert_bias_add 'split', fsdp2_bf16): 8 bytes an element
    of the gate/up output and 28 of the down output (fp32 by the probabilities' promotion), forward and backward alike,
    in BlockTerms.atomics (eager either way); a model without biases, or 'fused', moves nothing more; the profile
    names it and a value outside the choices is refused."""
    sh = BlockShape(hidden=2880, heads=64, kv_heads=8, head_dim=64, ffn=2880, experts=32, top_k=4, expert_ffn=2880,
                    expert_bias=True)
    copies = 2 * 4096 * 4  # micro-batch 2 x 4096 tokens at ep 8, top-4, even routing: as many copies received
    expected = memory_time(copies * (8 * 2 * 2880 + 28 * 2880), H100)
    assert float(split_bias_bytes(copies, 2 * 2880, 2880)) == copies * (8 * 5760 + 28 * 2880)
    for backward in (False, True):
        fused, split = (block_times(sh, 2, 4096, H100, ep=8, dispatcher="deepep", expert_bias_add=k, backward=backward)
                        for k in ("fused", "split"))
        assert float(split.atomics - fused.atomics) == pytest.approx(float(expected))
        assert (float(split.memory), float(split.experts)) == (float(fused.memory), float(fused.experts))
        plain = replace(sh, expert_bias=False)
        assert float(block_times(plain, 2, 4096, H100, ep=8, expert_bias_add="split", backward=backward).atomics) == 0
    assert FrameworkConfig(**preset_dict("framework", "fsdp2_bf16")).expert_bias_add == "split"
    assert FrameworkConfig(**preset_dict("framework", "megatron_core")).expert_bias_add == "fused"
    assert any("framework.expert_bias_add='loop'" in b for b in check_framework(FrameworkConfig(expert_bias_add="loop")))
