"""The attention core's rate by kernel and key length (xpar.estimate.compute.kernels.sequence_rate, UNMASKED_GAIN) and
under context parallelism as Transformer Engine's and torch's rings run it, one kernel per cp step with merged
partial outputs (framework.cp_attention_merge, xpar.estimate.cp_attention; issue 42). Pure CPU, no workers."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tests.conftest import spec_for
from xpar.config.checks.framework import check_framework
from xpar.config.schema import FrameworkConfig
from xpar.estimate.compute.kernels import (SEQUENCE_RATE_FLOOR, UNMASKED_GAIN, attention_flops, attention_time,
                                           sequence_rate)
from xpar.estimate.compute.kernel_costs import training_device
from xpar.estimate.cost import estimate
from xpar.estimate.cp_attention import merge_bytes, ring_extra_times, ring_step_times
from xpar.estimate.step_parts import assumptions_for

BASE = ("model=7b", "hardware=h100_80gb_64gpu", "parallel.tp=8", "parallel.pp=1",
        "parallel.zero_stage=1", "parallel.sequence_parallel=true", "parallel.micro_batches=auto",
        "train.micro_batch_size=1", "train.dtype=bf16", "run.mode=estimate", "framework=megatron_core")


def _spec(seq: int, cp: int, *extra: str):
    """The 7B at tp 8 and dp 2 over cp x 16 H100s."""
    return spec_for(*BASE, f"hardware.nodes={2 * cp}", f"model.seq_len={seq}", f"parallel.cp={cp}", "parallel.dp=2",
                    "train.global_batch_size=8", *extra)


def _rate(device, seq, **kw):
    """FLOP/s of one forward (or backward) kernel over ``seq`` keys: 16 heads, 16k tokens a batch (the FA3 paper's)."""
    b = max(1, 16384 // seq)
    flops = attention_flops(b, seq, seq, 16, 128, 128, kw.get("causal", True)) * (2.5 if kw.get("backward") else 1)
    return float(flops / attention_time(b, seq, seq, 16, 128, 128, device, **kw))


def test_a_kernel_over_fewer_keys_runs_slower_and_saturates_at_16k():
    """The FA3 paper's curves (Fig. 5-6): cuDNN's causal forward at 4k is 518 / 539 of its 16k rate, at 1k 410 / 539;
    the curve gives 0.94 and 0.76; beyond 16k the rate stays at the preset's; under 512 keys it is read at 512."""
    dev = training_device(spec_for(*BASE).hardware, "cudnn")
    rates = [_rate(dev, s) for s in (1024, 4096, 16384, 65536)]
    assert rates[0] < rates[1] < rates[2] == pytest.approx(rates[3], rel=0.02)  # the same but for the last wave
    assert rates[1] / rates[2] == pytest.approx(518 / 539, abs=0.03) and rates[0] / rates[2] == pytest.approx(410 / 539, abs=0.03)
    assert sequence_rate(128) == sequence_rate(SEQUENCE_RATE_FLOOR) < sequence_rate(1024)
    assert _rate(dev, 4096, backward=True) < _rate(dev, 16384, backward=True)


def test_an_unmasked_forward_runs_faster_than_a_causal_one_and_the_backward_alike():
    """Fig. 5: FlashAttention-2 370 / 335, cuDNN 595 / 539, FlashAttention-3 648 / 616 at 16k; Fig. 6 is unmasked."""
    dev = training_device(spec_for(*BASE).hardware, "cudnn")
    causal, unmasked = _rate(dev, 16384), _rate(dev, 16384, causal=False, unmasked=True)
    assert unmasked / causal == pytest.approx(UNMASKED_GAIN, rel=1e-6) and 1.05 <= UNMASKED_GAIN <= 1.10
    assert _rate(dev, 16384, causal=False, unmasked=True, backward=True) == pytest.approx(
        _rate(dev, 16384, causal=False, backward=True), rel=1e-9)
    assert _rate(dev, 2048, causal=False, unmasked=True) / _rate(dev, 2048) > UNMASKED_GAIN  # saturates sooner


def test_the_ring_adds_its_step_kernels_and_merges_and_nothing_without_them():
    """megatron_core (TE's ring, bf16 merges) at 32k tokens over cp 8 (chunks of 2k keys): its step kernels over 2-4k
    keys and merges cost more than the folded core over 32k keys; torch's float32 merges more again; none at cp 1,
    with framework.cp_attention_merge null (xpar's engine: one kernel over the gathered K/V) or on a CPU."""
    spec = _spec(32768, 8)
    a = assumptions_for(spec)
    ring = ring_extra_times(spec, a)
    assert a.cp_attention_merge == "bf16" and ring["f"] > 0 and ring["b"] > 0
    fp32 = ring_extra_times(spec, replace(a, cp_attention_merge="fp32"))
    assert fp32["f"] > ring["f"] and fp32["b"] > ring["b"]
    assert ring_extra_times(spec, replace(a, cp_attention_merge=None)) == {"f": 0.0, "b": 0.0}
    assert ring_extra_times(_spec(32768, 1), a) == {"f": 0.0, "b": 0.0}
    cpu = spec_for("model=tiny", "hardware=local", "parallel.cp=2", "parallel.dp=1", "train.global_batch_size=2",
                   "train.micro_batch_size=1", "model.seq_len=256", "run.mode=estimate")
    assert ring_extra_times(cpu, assumptions_for(cpu)) == {"f": 0.0, "b": 0.0}


def test_the_ring_costs_less_of_the_core_the_longer_its_chunks():
    """The same 7B layer's backward: at 1M tokens over cp 32 (chunks of 16k keys, at the curve's top) the ring's extra
    is a smaller share of the core than at 32k over cp 8 (2k keys). Forward at 1M: the unmasked steps outrun the folded
    causal kernel, and the term takes no credit for it (at least 0)."""
    shares = []
    for seq, cp in ((1048576, 32), (32768, 8)):
        spec = _spec(seq, cp)
        dev, b = training_device(spec.hardware, "cudnn"), spec.train.micro_batch_size
        folded = float(attention_time(b / cp, seq, seq, 4, 128, 128, dev, kv_heads=4, backward=True))
        shares.append(ring_extra_times(spec, assumptions_for(spec))["b"] / folded)
    assert 0 < shares[0] < shares[1]
    assert ring_extra_times(_spec(1048576, 32), assumptions_for(_spec(1048576, 32)))["f"] == 0.0


def test_merges_move_the_accumulators_bytes_per_step():
    """Forward: the output's 2c rows at step 0 (read the bf16 partial, write the accumulator) and 1.5c on the mean later
    step (read the partial, read and write the accumulator); backward dQ and dK, dV the same way."""
    b, s, cp, h, kv, d = 1, 32768, 4, 8, 8, 128
    c = s / (2 * cp)
    assert merge_bytes(b, s, cp, h, kv, d, d, "bf16", False) == pytest.approx(
        h * d * (2 * c * 4 + 3 * 1.5 * c * 6))
    assert merge_bytes(b, s, cp, h, kv, d, d, "fp32", True) == pytest.approx(
        (h * d + 2 * kv * d) * (2 * c * 6 + 3 * 1.5 * c * 10))


def test_the_step_kernels_do_the_folded_cores_flops():
    """Step 0 causal over 2c and cp - 1 unmasked steps of 2c x c queries and keys: the causal square over s / cp
    queries, at the steps' rates (equal rates give the folded core's seconds within the diagonal blocks' rounding)."""
    spec = _spec(1048576, 32)
    dev = replace(training_device(spec.hardware, "cudnn"), launch_s=0.0)
    ring = ring_step_times(1, 1048576, 32, 4, 4, 128, 128, dev, backward=True)
    folded = float(attention_time(1 / 32, 1048576, 1048576, 4, 128, 128, dev, kv_heads=4, backward=True))
    assert ring == pytest.approx(folded, rel=0.02)


def test_estimate_adds_the_ring_as_its_own_term_and_reruns_it_with_the_core():
    """cp_attention is in the breakdown and the step; full recompute reruns the core, so the ring's forward again."""
    spec = _spec(131072, 4)
    est = estimate(spec)
    assert est.time_breakdown["cp_attention"] > 0
    assert est.time_per_step_s == pytest.approx(sum(est.time_breakdown.values()), rel=1e-9)
    full = estimate(_spec(131072, 4, "parallel.recompute=full"))
    ring = ring_extra_times(spec, assumptions_for(spec))
    m = spec.micro_batches * spec.model.n_layers
    assert full.time_breakdown["cp_attention"] == pytest.approx(m * (2 * ring["f"] + ring["b"]), rel=1e-9)
    assert est.time_breakdown["cp_attention"] == pytest.approx(m * (ring["f"] + ring["b"]), rel=1e-9)


def test_unknown_kernels_and_merges_are_refused_with_the_values_that_work():
    out = check_framework(FrameworkConfig(attention_kernel="fa4", cp_attention_merge="fp16"))
    assert any("framework.attention_kernel='fa4'" in x and "cudnn_2024" in x for x in out)
    assert any("framework.cp_attention_merge='fp16'" in x and "null, bf16, fp32" in x for x in out)
