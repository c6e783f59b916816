"""Flash attention's rate by key length on Blackwell (hardware.attention_half_seq, issue 42): the presets' curve
against cuDNN's own training SDPA benchmark on GB200 (NVIDIA/cudnn-frontend benchmark/sdpa_benchmark_training/
artifacts/sdpa_bf16_benchmark_results_NVIDIA_GB200.csv @d48a60eb: cuDNN 9.17, 128 query / 8 key-value heads,
head_dim 128, causal, batch 1), the H100's curve kept."""
from dataclasses import replace

import numpy as np
import pytest

from xpar.config.checks.hardware import load_hardware_preset
from xpar.config.checks.ranges import range_problems
from xpar.config.schema import XparConfig
from xpar.estimate.compute.kernels import ATTENTION_HALF_SEQ, attention_time, device_of

SEQ = np.array([512, 1024, 2048, 4096, 8192, 16384])
CUDNN_GB200_TFLOPS = {"fwd": np.array([408, 733, 1069, 1386, 1584, 1668]),
                      "bwd": np.array([329, 527, 655, 1054, 1211, 1304])}
"""The csv's cudnn_fe rows (FLOPs of the unmasked elements: 2 b h n (d_qk + d_v) forward, 2 b h n (3 d_qk + 2 d_v)
backward, n = s (s + 1) / 2), TFLOP/s."""
GB200 = device_of(load_hardware_preset("gb200_nvl72_node"))


def _model_tflops(device, backward: bool) -> np.ndarray:
    flops = 2 * 128 * SEQ * (SEQ + 1) / 2 * 256 * (2.5 if backward else 1.0)
    return np.array([flops[i] / float(attention_time(1, s, s, 128, 128, 128, device, kv_heads=8, backward=backward))
                     for i, s in enumerate(SEQ)]) / 1e12


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_gb200_curve_follows_cudnn_relative_to_16k(direction):
    model = _model_tflops(GB200, direction == "bwd")
    measured = CUDNN_GB200_TFLOPS[direction]
    rel_err = model / model[-1] - measured / measured[-1]
    assert np.sqrt(np.mean(rel_err ** 2)) < 0.06
    assert abs(model[-1] / measured[-1] - 1) < 0.05  # the 16k level: the preset's 0.65 / 0.52 of 2.5 PFLOP/s


def test_the_h100_curve_would_price_blackwell_short_sequences_too_fast():
    h100_curve = replace(GB200, attention_half_seq=ATTENTION_HALF_SEQ)
    at_4k = _model_tflops(h100_curve, False)[3] / _model_tflops(h100_curve, False)[-1]
    assert at_4k > 0.9 > CUDNN_GB200_TFLOPS["fwd"][3] / CUDNN_GB200_TFLOPS["fwd"][-1]


def test_hopper_and_ampere_presets_keep_the_h100_fit():
    for name in ("h100_80gb_node", "h200_141gb_node", "a100_80gb_node"):
        assert device_of(load_hardware_preset(name)).attention_half_seq == ATTENTION_HALF_SEQ
    assert device_of(load_hardware_preset("b200_180gb_node")).attention_half_seq == GB200.attention_half_seq == 1300


def test_attention_half_seq_must_be_positive():
    c = XparConfig()
    c.hardware.attention_half_seq = 0.0
    line = range_problems(c)["hardware.attention_half_seq"]
    assert "got 0.0" in line and "e.g. hardware.attention_half_seq=360" in line


def test_planner_columns_equal_the_estimate_on_blackwell_fp8():
    """The planner prices the Blackwell presets' GEMM fractions and attention curve as the estimate does."""
    from tests.plan.test_plan_vector import _mismatches, memory_args, random_candidates
    from xpar.config.presets import preset_dict
    from xpar.estimate.columns.step_time import time_columns
    from xpar.estimate.cost import estimate
    from xpar.plan.context import PlanContext, spec_of

    for hardware in ("b200_180gb_64gpu", "gb200_nvl72_node"):
        ctx = PlanContext(model=preset_dict("model", "7b"), hardware=preset_dict("hardware", hardware),
                          train={"dtype": "fp8"}, framework=preset_dict("framework", "megatron_core"))
        cols = random_candidates(ctx, np.random.default_rng(3), 3)
        specs = [spec_of(ctx, cols, i) for i in range(3)]
        assert all(sp.hardware.attention_half_seq == 1300 for sp in specs)
        ests = [estimate(sp) for sp in specs]
        bad = _mismatches(ctx, cols, time_columns(specs[0], cols, *memory_args(ests)), ests)
        assert not bad, "\n".join(bad[:5])
