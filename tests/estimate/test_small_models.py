"""Small models and short steps priced as their code runs (issue 42): the cross-entropy over the vocabulary by the
framework's loss kernel (framework.loss_kernel: xpar.estimate.compute.kernel_block.LOSS_BYTES); a small model's weight
gradients (K = the tokens, a small output) split along K to fill whole waves (kernels.SPLIT_K_WAVES).

A GPT-2 124M step of llm.c (karpathy/llm.c scripts/run_gpt2_124M.sh: 64 x 1024 tokens a GPU, vocabulary padded to
50,304) spends a tenth of its time over the logits when they are priced as eager fp32 passes; llm.c's
fused_classifier_kernel5 reads each bf16 row and overwrites it with its gradient in one kernel.
"""
from __future__ import annotations

import numpy as np
import pytest

from xpar.config.checks.hardware import load_hardware_preset
from xpar.config.validate import validate
from xpar.estimate.compute.kernel_block import LOSS_BYTES, logits_times
from xpar.estimate.compute.kernel_costs import kernel_layer_costs, training_device
from xpar.estimate.compute.kernels import HBM_FRACTION, device_of, gemm_fraction_of_peak, split_k_min_depth
from xpar.estimate.cost import assumptions_for, estimate
from xpar.plan.verify import compose_line

GPT2_124M_LLMC = ("python -m xpar run.mode=estimate tracking=off framework=megatron_core framework.loss_kernel={loss} "
                  "hardware=a100_80gb_8gpu model=175b model.name=gpt2_124m model.n_layers=12 model.hidden=768 "
                  "model.n_heads=12 model.ffn_hidden=3072 model.vocab_size=50304 model.seq_len=1024 parallel.dp=8 "
                  "parallel.zero_stage=1 train.dtype=bf16 train.micro_batch_size=64 train.global_batch_size=512")


def _spec(loss: str):
    return validate(compose_line(GPT2_124M_LLMC.format(loss=loss)))


def test_a_fused_loss_reads_the_bf16_logits_once_forward_and_writes_their_gradient_once_backward():
    """'fused': 2 bytes a logit forward, 4 backward (6 in all) against eager fp32's 8 + 8, at the same GEMMs."""
    spec = _spec("fused")
    device = training_device(spec.hardware)
    tokens, vocab = np.array([65536.0, 8192.0]), 50304
    hbm = device.hbm_bytes_per_s * HBM_FRACTION
    for backward, per_logit in ((False, 2.0), (True, 4.0)):
        g_fused, m_fused = logits_times(tokens, 768, vocab, device, 1, "bf16", backward, loss="fused")
        g_fp32, m_fp32 = logits_times(tokens, 768, vocab, device, 1, "bf16", backward, loss="fp32")
        np.testing.assert_allclose(m_fused, per_logit * tokens * vocab / hbm, rtol=1e-12)
        np.testing.assert_allclose(m_fp32, 8.0 * tokens * vocab / hbm, rtol=1e-12)
        np.testing.assert_array_equal(g_fused, g_fp32)
    assert sum(LOSS_BYTES["fused"]) == 6.0 and sum(LOSS_BYTES["fp32"]) == 16.0


def test_the_estimate_prices_the_loss_kernel_the_profile_names():
    """GPT-2 124M on 8 A100 at llm.c's 64 x 1024 tokens: framework.loss_kernel=fused saves the logits' 10 bytes in
    16 in the step's memory-bound term and nothing else (the GEMMs, the blocks, communication unchanged)."""
    fp32, fused = (_spec(k) for k in ("fp32", "fused"))
    a32, afu = (kernel_layer_costs(s, assumptions_for(s)) for s in (fp32, fused))
    for k in ("mm_f", "mm_b", "mem_f", "mem_b", "logits_mm_f", "logits_mm_b"):
        assert afu[k] == a32[k], k
    assert afu["logits_mem_f"] == pytest.approx(a32["logits_mem_f"] / 4, rel=1e-12)
    assert afu["logits_mem_b"] == pytest.approx(a32["logits_mem_b"] / 2, rel=1e-12)
    e32, efu = estimate(fp32, assumptions_for(fp32)), estimate(fused, assumptions_for(fused))
    saved = a32["logits_mem_f"] + a32["logits_mem_b"] - afu["logits_mem_f"] - afu["logits_mem_b"]
    assert e32.time_per_step_s - efu.time_per_step_s == pytest.approx(saved, rel=1e-6)
    assert 0.04 < saved / e32.time_per_step_s < 0.08  # a twentieth of a 124M model's step at 65,536 tokens


def test_an_unknown_loss_kernel_is_refused_naming_the_ones_priced():
    device = training_device(_spec("fp32").hardware)
    with pytest.raises(ValueError, match="fp32, fused"):
        logits_times(1024, 768, 50304, device, loss="chunked")


def test_a_small_models_weight_gradient_is_split_along_its_tokens_to_fill_whole_waves():
    """GPT-2 124M's MLP weight gradient on an A100, (768 x 65,536) @ (65,536 x 3,072): 72 tiles of 128 x 256 on 108
    SMs. One wave of them leaves a third of the SMs idle (2/3 of the large-GEMM fraction); 3 slices of K a tile fill 2
    whole waves (kernels.SPLIT_K_WAVES), at the large-GEMM fraction. A shallow K is not split beyond one wave: a
    768-wide expert's (4096 x 2048) @ (2048 x 768) on an H100, whose slices would fall under split_k_min_depth."""
    device = training_device(_spec("fp32").hardware)
    frac = gemm_fraction_of_peak(768, 3072, 65536, device) / device.gemm_fraction["bf16"]
    assert float(frac) == pytest.approx(1.0, abs=0.01)  # before: 72 / 108 = 0.67
    depth = split_k_min_depth(device.peak_flops["bf16"] * device.gemm_fraction["bf16"], device)
    assert depth == pytest.approx(4 * 312e12 * device.gemm_fraction["bf16"] / (2.039e12 * HBM_FRACTION))
    assert depth < 65536 / 3 and float(gemm_fraction_of_peak(768, 3072, 1024, device)) < 0.7 * float(frac) * \
        device.gemm_fraction["bf16"]  # 1,024 tokens: slices under the depth, one partial wave as before
    h100 = device_of(load_hardware_preset("h100_80gb_8gpu"))
    narrow, wide = gemm_fraction_of_peak(4096, [768, 8192], 2048, h100)
    assert narrow < 0.8 * wide  # 96 tiles on 132 SMs: one partial wave, K = 2048 too shallow to split further


def test_the_llmc_profile_prices_llm_cs_fused_kernels_and_runs_data_parallel_only():
    """framework=llmc (conf/framework/llmc.yaml, llm.c's train_gpt2.cu): the fused loss and one element-wise pass; no
    tensor parallelism (refused in one line naming the limit)."""
    from xpar.config.checks import ConfigError
    typed_llmc = GPT2_124M_LLMC.format(loss="fused").replace("framework=megatron_core", "framework=llmc")
    llmc = validate(compose_line(typed_llmc))
    a = assumptions_for(llmc)
    assert (a.name, a.loss_kernel, a.elementwise_passes, a.zero1) == ("llmc", "fused", 1.0, "distributed_optimizer")
    mine, typed = kernel_layer_costs(llmc, a), kernel_layer_costs(_spec("fused"), assumptions_for(_spec("fused")))
    for k in ("mm_f", "mm_b", "mem_f", "mem_b", "logits_mem_f", "logits_mem_b"):
        assert mine[k] == pytest.approx(typed[k], rel=1e-12), k  # megatron_core's fused kernels, llm.c's loss
    with pytest.raises(ConfigError, match=r"framework=llmc does not run parallel.tp=2 \(framework.max_tp=1"):
        validate(compose_line(typed_llmc.replace("parallel.dp=8", "parallel.dp=4 parallel.tp=2")))
