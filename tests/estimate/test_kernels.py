"""Properties of the kernel-level compute model (xpar.estimate.compute.kernels, xpar.estimate.compute.kernel_block; issue 42)."""
from dataclasses import replace

import numpy as np
import pytest

from xpar.config.checks.hardware import hardware_value_problems, load_hardware_preset
from xpar.config.presets import preset_dict, presets
from xpar.config.schema import FrameworkConfig, ModelConfig
from xpar.estimate.compute.kernel_block import (BlockShape, block_step_times, block_times, expert_tokens, logits_times,
                                        shape_of)
from xpar.estimate.compute.kernels import (HALF_TILE_RATE, attention_flops, head_dim_rate, attention_time, device_of, gemm_fraction_of_peak,
                                   gemm_terms, gemm_time, kernel_overhead)

H100 = device_of(load_hardware_preset("h100_80gb_8gpu"))
A100 = device_of(load_hardware_preset("a100_80gb_8gpu"))
# A 30B-A3B-like MoE (Qwen3-30B-A3B's shape): 128 experts of width 768, top-8, hidden 2048, head_dim 128 (not 2048 / 32)
MOE_30B = BlockShape(hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144, experts=128, top_k=8, expert_ffn=768)
GPT2_SMALL = BlockShape(hidden=768, heads=12, kv_heads=12, head_dim=64, ffn=3072, gated=False)  # ~124M parameters
LLAMA_70B = BlockShape(hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672)
# DeepSeek-V3's MLA: q through a 1536 bottleneck, kv through 512, heads of 128 + 64 (rope) for q, k and 128 for v
DSV3_MLA = BlockShape(hidden=7168, heads=128, kv_heads=128, head_dim=56, ffn=18432, q_lora_rank=1536, kv_lora_rank=512,
                      qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128)


def test_a_768_wide_expert_gemm_reaches_less_of_peak_than_an_8192_wide_one():
    narrow, wide = gemm_fraction_of_peak(4096, [768, 8192], 2048, H100)
    assert narrow < 0.8 * wide  # 96 tiles on 132 SMs (one partial wave) against 8 nearly full waves
    assert wide == pytest.approx(0.803 * 1024 / (8 * 132), rel=1e-9)  # MAMF fraction x wave efficiency


def test_large_square_gemms_approach_the_device_maximum_and_small_ones_do_not():
    sizes = np.array([512, 1024, 4096, 16384])
    frac = gemm_fraction_of_peak(sizes, sizes, sizes, H100, launch=True)
    assert list(frac) == sorted(frac) and frac[-1] <= 0.803 and frac[-1] > 0.75 and frac[0] < 0.2


def test_tile_quantisation_at_m_just_above_a_tile():
    """M = 129 needs two 128-row tiles: the compute term doubles (split-K filled the SMs at M = 128), but a
    GEMM this skinny on an H100 is HBM-bound (arithmetic intensity ~ M = 129 FLOP/byte, under the ridge
    794e12 / 3.0e12 ~ 260), so its time does not; where compute bounds (M = 1024 -> 1025 over 8192 x 8192),
    one row past a tile adds waves: +39 % time for +0.1 % FLOPs."""
    compute, memory = gemm_terms([128, 129], 8192, 8192, H100)
    assert compute[1] == pytest.approx(2 * compute[0]) and (memory > compute).all()
    t128, t129 = gemm_time([128, 129], 8192, 8192, H100)
    assert t129 == pytest.approx(t128, rel=0.01)
    t1024, t1025 = gemm_time([1024, 1025], 8192, 8192, H100)
    # 128 x 256 tiles: 256 = 2 waves of 132 SMs at M = 1024, 288 = 3 at 1025; the half-width tile (at 0.9 of the
    # rate) takes 1025 in 576 tiles = 5 waves of half the work: the library's better choice, +39 % time
    assert t1025 / t1024 == pytest.approx(min(3, 5 * 0.5 / HALF_TILE_RATE) / 2, rel=1e-9)
    f128, f129 = gemm_fraction_of_peak([128, 129], 8192, 8192, A100)  # A100: ridge ~147, compute shows at 129
    t_a = gemm_time([128, 129], 8192, 8192, A100)
    assert t_a[1] > 1.3 * t_a[0] and f129 < f128


def test_micro_batch_1_and_4_of_a_narrow_moe_differ_as_the_kernel_shapes_say():
    """Experts on every rank (ep 1), 2048 tokens: at b = 1 each of the 128 experts gets 128 tokens (one
    tile row, the expert weights streamed from HBM for few FLOPs), at b = 4 512 tokens (compute-bound)."""
    assert expert_tokens(MOE_30B, np.array([2048, 8192]), 1).tolist() == [128, 512]
    b1 = block_step_times(MOE_30B, 1, 2048, H100)
    b4 = block_step_times(MOE_30B, 4, 2048, H100)
    per_token = np.array([b1.total / 2048, b4.total / 8192])
    assert per_token[0] > 1.4 * per_token[1]
    assert b1.experts / 2048 > 2 * b4.experts / 8192  # the grouped expert GEMMs carry the difference
    compute, memory = gemm_terms(np.array([128, 512]), 2 * 768, 2048, H100, groups=128)
    assert memory[0] > compute[0] and compute[1] > memory[1]  # HBM-bound at b = 1, compute-bound at b = 4
    ep8_1, ep8_4 = (block_step_times(MOE_30B, b, 2048, H100, ep=8).total / (b * 2048) for b in (1, 4))
    assert ep8_1 < 1.1 * ep8_4  # ep 8 gathers 8x the tokens per expert: 1024 at b = 1, the shapes no longer narrow


def test_a_100m_model_block_has_an_overhead_term_that_dominates_at_small_shapes():
    small = block_step_times(GPT2_SMALL, 1, 256, H100)
    assert small.overhead > 0 and small.kernels == 30
    assert small.overhead > max(small.gemm, small.attention, small.memory)
    assert small.overhead / small.total > 0.4
    big = block_step_times(GPT2_SMALL, 16, 2048, H100)
    assert big.overhead / big.total < 0.05  # the same kernels, long enough to hide their gaps
    eager = block_step_times(GPT2_SMALL, 1, 256, H100, host_us_per_kernel=20.0)  # host issues slower than kernels run
    assert eager.total == pytest.approx(max(float(small.busy + small.overhead), 30 * 20e-6))


def test_fp8_prices_the_attention_core_at_the_bf16_rate():
    h100 = load_hardware_preset("h100_80gb_8gpu")
    bf16 = block_times(LLAMA_70B, 1, 16384, H100, tp=8)
    fp8 = block_times(LLAMA_70B, 1, 16384, H100, tp=8, dtype="fp8")
    assert fp8.attention == bf16.attention  # FlashAttention in BF16 under Transformer Engine / torchao
    assert fp8.gemm < 0.7 * bf16.gemm  # the GEMMs at the FP8 peak (x 0.709 / 0.803)
    assert fp8.kernels > bf16.kernels  # one cast per GEMM input
    heads, flops = 64 / 8, attention_flops(1, 16384, 16384, 64 / 8, 128, 128)
    waves = np.ceil(8 * 128 / 132) * 132 / (8 * 128)  # 8 heads x 128 query blocks over 132 SMs: 7.8 -> 8 waves
    assert bf16.attention == pytest.approx(flops / (h100.peak_tflops * 1e12 * 0.65) * waves, rel=1e-9)
    assert heads * 2 * 16384 ** 2 * 256 / 2 == pytest.approx(flops, rel=0.01)  # the causal half
    with pytest.raises(ValueError, match="fp8"):
        gemm_time(4096, 4096, 4096, A100, "fp8")  # an A100 has no FP8 tensor cores


def test_mla_and_a_head_dim_other_than_hidden_over_heads_are_priced_with_their_own_widths():
    mla = block_times(DSV3_MLA, 1, 4096, H100, tp=8)
    as_mha = block_times(replace(DSV3_MLA, q_lora_rank=0, kv_lora_rank=0), 1, 4096, H100, tp=8)  # MHA at 7168 / 128
    flops_ratio = (192 + 128) / (56 + 56)  # per head: q.k over 192 dims and p.v over 128, against 56 + 56
    rate_ratio = head_dim_rate(192) / head_dim_rate(56)  # a 56-wide head runs FlashAttention slower
    assert mla.attention / as_mha.attention == pytest.approx(flops_ratio / rate_ratio, rel=0.05)
    assert head_dim_rate(56) < head_dim_rate(64) < head_dim_rate(128) == head_dim_rate(192) == 1.0
    assert mla.kernels == as_mha.kernels + 3  # q down, kv down, kv up against one fused qkv
    qwen = block_times(MOE_30B, 1, 4096, H100)
    narrow = block_times(replace(MOE_30B, head_dim=2048 // 32), 1, 4096, H100)
    assert qwen.attention == pytest.approx(2 * head_dim_rate(64) * narrow.attention, rel=0.02)  # 128 against 64: twice the FLOPs at a higher rate


def test_capacity_factor_and_router_imbalance_set_the_busiest_experts_tokens():
    assert expert_tokens(MOE_30B, 4096, 8) == 2048
    assert expert_tokens(replace(MOE_30B, imbalance=1.3), 4096, 8) == np.ceil(2048 * 1.3)
    assert expert_tokens(replace(MOE_30B, capacity_factor=1.0, imbalance=1.3), 4096, 8) == 2048  # capped, padded
    loop = block_times(MOE_30B, 1, 4096, H100, ep=8, grouped_gemm=False)
    grouped = block_times(MOE_30B, 1, 4096, H100, ep=8)
    assert loop.kernels == grouped.kernels + 2 * (128 // 8 - 1) and loop.overhead > grouped.overhead


def test_vectorised_calls_equal_scalar_calls():
    b, s = np.array([1, 2, 4, 1, 8]), np.array([2048, 2048, 4096, 1024, 512])
    tp, ep, cp = np.array([1, 2, 1, 2, 4]), np.array([1, 8, 4, 2, 16]), np.array([1, 1, 2, 1, 1])
    for shape in (MOE_30B, DSV3_MLA, GPT2_SMALL):
        for dtype in ("bf16", "fp8"):
            cols = block_step_times(shape, b, s, H100, tp=tp, ep=ep, cp=cp, dtype=dtype)
            for i in range(len(b)):
                one = block_step_times(shape, int(b[i]), int(s[i]), H100, tp=int(tp[i]), ep=int(ep[i]),
                                       cp=int(cp[i]), dtype=dtype)
                for name in ("gemm", "experts", "attention", "memory", "overhead", "kernels"):
                    assert getattr(cols, name)[i] == getattr(one, name)
    sizes = np.array([[100, 129], [4096, 8193]])
    assert gemm_time(sizes, 768, 2048, H100).shape == (2, 2)
    assert gemm_time(sizes, 768, 2048, H100)[1, 0] == gemm_time(4096, 768, 2048, H100)
    assert attention_time([1, 2], 4096, 4096, 32, 128, 128, H100)[1] == attention_time(2, 4096, 4096, 32, 128, 128,
                                                                                        H100)
    assert kernel_overhead([10, 10], [1e-3, 0.0], H100, 50e-6).tolist() == [pytest.approx(20e-6), 500e-6]


def test_a_block_of_an_xpar_model_preset_and_the_devices_of_every_gpu_preset():
    shape = shape_of(ModelConfig(hidden=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336))
    assert (shape.head_dim, shape.kv_heads, shape.gated, shape.experts) == (128, 8, True, 0)
    for name in presets("hardware"):
        hw = load_hardware_preset(name)
        if hw.device != "cuda":
            with pytest.raises(ValueError, match="sm_count"):
                device_of(hw)
            continue
        t = block_step_times(shape, 1, 4096, device_of(hw), tp=np.array([1, 8]))
        assert (t.total > 0).all() and t.total[1] < t.total[0]


def test_kernel_model_fields_are_range_checked():
    hw = load_hardware_preset("h100_80gb_8gpu")
    bad = replace(hw, sm_count=0, gemm_tile_m=100, gemm_efficiency=1.2, attention_bwd_efficiency=0.0,
                  kernel_launch_us=-1.0)
    problems = hardware_value_problems(bad)
    named = {"sm_count", "gemm_tile_m", "gemm_efficiency", "attention_bwd_efficiency", "kernel_launch_us"}
    assert named <= set(problems)
    assert "e.g. hardware.sm_count=132" in problems["sm_count"]
    assert hardware_value_problems(hw) == {}


def test_context_parallel_ranks_share_the_causal_work_and_the_logits_are_priced():
    whole = attention_flops(1, 8192, 8192, 32, 128, 128)
    assert attention_flops(1, 8192 / 4, 8192, 32, 128, 128) == pytest.approx(whole / 4)  # cp 4: a quarter each
    assert whole == pytest.approx(2 * 32 * 8192 ** 2 * 256 * (64 + 1) / 128)  # 64 blocks a side: 65/128 computed
    gemm, memory = logits_times(8192, 4096, 128256, H100, tp=np.array([1, 8]))
    assert gemm[0] == gemm_time(8192, 128256, 4096, H100) and gemm[1] < gemm[0] / 7 and (memory > 0).all()


def test_megatron_cores_host_time_bounds_a_small_models_short_blocks_only():
    """framework=megatron_core's host time a kernel (its Transformer Engine modules' ~115-140 us a forward): a
    ~124M model's block at micro-batch 2 waits on the host; at micro-batch 16, and a 70B-wide block at 1, do not."""
    host = FrameworkConfig(**preset_dict("framework", "megatron_core")).host_op_us
    assert host >= 20.0  # not eager PyTorch's ~4 us launch alone
    small = block_step_times(GPT2_SMALL, 2, 1024, H100, host_us_per_kernel=host)
    assert float(small.overhead) > 0.25 * float(small.busy)
    for shape, b in ((GPT2_SMALL, 16), (replace(GPT2_SMALL, hidden=8192, heads=64, kv_heads=8, head_dim=128,
                                                  ffn=28672), 1)):
        t = block_step_times(shape, b, 1024, H100, host_us_per_kernel=host)
        assert float(t.overhead) == pytest.approx(float(t.kernels) * H100.launch_s), (shape, b)
