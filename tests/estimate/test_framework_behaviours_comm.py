"""Framework behaviours of 2024-26 runs (issue 43), second part: memory refusals that name the nearest
settings that fit; Megatron-Core's per-chunk dp overlap; SHARP; FP8 parameter gathers; Transformer
Engine's FP8 weight copies. Each with its source in the profile (conf/framework/*.yaml). Pure CPU."""
from __future__ import annotations

import pytest

from tests.conftest import spec_for
from xpar.config.checks import ConfigError

GPT3 = ("model=175b", "parallel=175b_1024gpu", "hardware=a100_80gb_1024gpu", "framework=megatron_core")


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_a_memory_refusal_names_the_nearest_settings_that_fit_and_each_works_when_followed():
    """GPT-3 175B under Megatron-Core with the source's recompute unstated (none) and micro-batch 2:
    refused, its first line names the nearest setting that fits; the list holds Megatron's partial
    full recompute (--recompute-num-layers: fewer blocks than a chunk holds), and every line estimates."""
    given = (*GPT3, "parallel.recompute=none", "train.micro_batch_size=2")
    with pytest.raises(ConfigError) as e:
        spec_for(*given)
    [msg] = e.value.problems
    first = msg.splitlines()[0]
    assert "does not fit device memory" in first and "Nearest settings that fit: " in first
    nearest = first.split("Nearest settings that fit: ")[1].split(" (estimated")[0]
    listed = [line.strip().split(":")[0] for line in msg.splitlines() if line.startswith("      ")]
    assert listed[0] == nearest
    partial = [x for x in listed if "parallel.recompute_layers=" in x]
    assert partial and "parallel.recompute=full" in partial[0]
    for overrides in listed:
        followed = spec_for(*given, *overrides.split())
        assert followed.mode == "estimate"
    k = int(partial[0].split("parallel.recompute_layers=")[1].split()[0])
    assert 0 < k < max(followed.layout.layer_split)


def _planner_equals_scalar(model: str, hardware: str, framework: str, hw_changes: dict = None,
                           fw_changes: dict = None, n: int = 6, seed: int = 3, dtype: str = "bf16") -> int:
    """The planner's columns (xpar.estimate.columns) equal the scalar estimate on ``n`` random layouts of a
    context whose hardware / framework dicts are changed; returns how many were compared."""
    import numpy as np

    from tests.plan.test_plan_vector import _mismatches, context, memory_args, random_candidates
    from xpar.estimate.columns.step_time import time_columns
    from xpar.estimate.cost import estimate
    from xpar.plan.context import spec_of

    ctx = context(model, hardware, framework)
    ctx.hardware.update(hw_changes or {})
    ctx.framework.update(fw_changes or {})
    ctx.train.update(dtype=dtype)
    cols = random_candidates(ctx, np.random.default_rng(seed), n)
    specs = [spec_of(ctx, cols, i) for i in range(n)]
    ests = [estimate(sp) for sp in specs]
    bad = _mismatches(ctx, cols, time_columns(specs[0], cols, *memory_args(ests)), ests)
    assert not bad, "\n".join(bad[:5])
    return n


def test_sharp_halves_an_all_reduces_bus_bytes_and_leaves_the_default_alone():
    """hardware.sharp (NVLink / InfiniBand SHARP: NCCL's NVLS and CollNet): an all-reduce sends the buffer
    once, not the ring's 2 (n - 1) / n; a reduce-scatter keeps its bytes and takes one hop each way."""
    from dataclasses import replace

    from xpar.estimate.comm.collectives import collective_time, group_of, ring_time, sharp_time

    spec = spec_for(*GPT3)
    hw, on = spec.hardware, replace(spec.hardware, sharp=True)
    g = group_of(hw, 128, 8)  # a dp group of 128 across 128 nodes
    big = 4e9
    ring = ring_time(hw, "allreduce", big, g)
    tree = collective_time(hw, "allreduce", big, g, "tree")
    assert collective_time(hw, "allreduce", big, g) == pytest.approx(min(ring, tree))
    assert collective_time(on, "allreduce", big, g) == pytest.approx(sharp_time(on, "allreduce", big, g))
    # bandwidth-bound: the bytes halve
    assert sharp_time(on, "allreduce", big, g) == pytest.approx(ring * 128 / (2 * 127), rel=0.02)
    small = 1e4  # latency-bound: one hop up and down instead of 127 ring steps
    assert collective_time(on, "reduce_scatter", small, g) < 0.2 * collective_time(hw, "reduce_scatter", small, g)
    assert collective_time(on, "allgather", big, g) == collective_time(hw, "allgather", big, g)  # nothing to reduce


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_sharp_speeds_up_the_dp_all_reduce_of_a_megatron_run_and_the_planner_agrees():
    from xpar.estimate.cost import estimate

    base = estimate(spec_for(*GPT3, "parallel.recompute=full"))
    sharp = estimate(spec_for(*GPT3, "parallel.recompute=full", "hardware.sharp=true"))
    assert sharp.comm_time["dp"] < 0.6 * base.comm_time["dp"] and sharp.time_per_step_s < base.time_per_step_s
    assert _planner_equals_scalar("175b", "a100_80gb_1024gpu", "megatron_core", {"sharp": True}) == 6


H100_FP8 = ("model=70b", "hardware=h100_80gb_64gpu", "train=cluster", "framework=megatron_core", "train.dtype=fp8",
            "parallel.tp=8", "parallel.pp=1", "parallel.dp=auto", "parallel.zero_stage=1", "parallel.recompute=full",
            "parallel.micro_batches=auto", "train.global_batch_size=64")


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_fp8_param_gather_moves_one_byte_per_block_element_and_only_under_fp8():
    """Megatron-Core --fp8-param-gather (framework.fp8_param_gather): the distributed optimizer's parameter
    all-gather of the blocks moves FP8 (1 byte), the root (embedding, output) stays bf16; off under bf16. Unit by
    unit under a fixed bucket (one all-gather per unit; Megatron-Core's own rule gathers per bucket, the units' shares
    of it: test_megatron_core_buckets_grow_with_dp_and_gather_per_bucket)."""
    from xpar.estimate.cost import assumptions_for, estimate
    from xpar.estimate.comm.dp import unit_elements, unit_times

    fixed = "framework.bucket_rule=fixed"
    off, on = spec_for(*H100_FP8, fixed), spec_for(*H100_FP8, fixed, "framework.fp8_param_gather=true")
    units = unit_elements(on, 0)
    t_off, t_on = unit_times(off, assumptions_for(off), units), unit_times(on, assumptions_for(on), units)
    assert t_on["gather"][0] == t_off["gather"][0]  # the root in bf16
    assert t_on["gather"][1] < 0.6 * t_off["gather"][1]  # a block: half the bytes (latency aside)
    assert t_on["reduce"] == t_off["reduce"]  # gradients reduce-scattered as before
    assert estimate(on).comm_time["dp"] < estimate(off).comm_time["dp"]
    bf16 = ("train.dtype=bf16",)
    assert estimate(spec_for(*H100_FP8, *bf16, "framework.fp8_param_gather=true")).time_per_step_s == \
        estimate(spec_for(*H100_FP8, *bf16)).time_per_step_s
    assert _planner_equals_scalar("70b", "h100_80gb_64gpu", "megatron_core", fw_changes={"fp8_param_gather": True},
                                  dtype="fp8") == 6


MC70 = ("model=70b", "hardware=h100_80gb_64gpu", "train=cluster", "framework=megatron_core", "parallel.tp=8",
        "parallel.pp=4", "parallel.dp=auto", "parallel.zero_stage=1", "parallel.recompute=full",
        "parallel.micro_batches=auto", "train.global_batch_size=64")


def test_transformer_engine_fp8_weight_copies_raise_the_peak_from_bf16_to_fp8():
    """Transformer Engine keeps each linear weight's FP8 copy and transpose (framework.fp8_weight_copies,
    megatron_core): published peaks rise 3.5-8.2 GB from BF16 to FP8; xpar's fell (FP8-saved inputs only).
    +2 bytes per block linear weight element on the device; none with FP8 parameters or without the flag."""
    from xpar.estimate.cost import peak_memory
    from xpar.estimate.frameworks.fp8_weights import block_linear_numel
    from xpar.estimate.memory.model_states import param_shapes

    bf16, fp8 = peak_memory(spec_for(*MC70, "train.dtype=bf16")), peak_memory(spec_for(*MC70, "train.dtype=fp8"))
    assert fp8.total > bf16.total + 3e9
    spec = spec_for(*MC70, "train.dtype=fp8")
    linear = block_linear_numel(tuple(param_shapes(spec, fp8.pp_rank)))
    assert 0.9 * 70e9 / 32 < linear < 70e9 / 32  # a rank's share of the blocks' linear weights (not embeddings)
    plain = peak_memory(spec_for(*MC70, "train.dtype=fp8", "framework.fp8_weight_copies=false"))
    assert fp8.params - plain.params == 2 * linear and plain.total < bf16.total  # what xpar said before
    assert peak_memory(spec_for(*MC70, "train.dtype=fp8", "framework.fp8_param_gather=true")).params == plain.params


def test_the_planners_memory_counts_the_fp8_weight_copies_as_the_estimate():
    import zlib

    import numpy as np

    from tests.plan.test_plan_memory import assert_equal, candidates, context

    ctx = context("70b", "h100_80gb_64gpu", "megatron_core", "fp8")
    rng = np.random.default_rng(zlib.crc32(b"fp8 copies"))
    cols = candidates(rng, ctx, 12)
    assert_equal(ctx, cols, range(12))


INTERLEAVED = ("model=175b", "hardware=a100_80gb_1024gpu", "train=cluster", "framework=megatron_core", "parallel.tp=8",
               "parallel.pp=8", "parallel.dp=auto", "parallel.zero_stage=1", "parallel.recompute=full",
               "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=4", "parallel.micro_batches=8",
               "train.global_batch_size=128")


def test_megatron_core_overlaps_each_chunks_dp_communication_behind_the_other_chunks():
    """framework.dp_overlap_per_chunk (Megatron-Core's; on in the megatron_core profile): under
    interleaving (v = 4) all but the last chunk's reduce-scatter hide behind the remaining backwards and the
    gathers behind the first forwards, so less dp communication is exposed than with one micro-batch to hide
    behind; at v = 1 nothing changes."""
    from xpar.estimate.cost import estimate

    per_chunk = estimate(spec_for(*INTERLEAVED))  # the profile's default
    on = estimate(spec_for(*INTERLEAVED, "framework.dp_overlap_per_chunk=true"))
    assert per_chunk.time_per_step_s == on.time_per_step_s
    one_mb = estimate(spec_for(*INTERLEAVED, "framework.dp_overlap_per_chunk=false"))
    exposed = per_chunk.time_breakdown["dp_comm_exposed"]
    assert 0 < exposed < 0.6 * one_mb.time_breakdown["dp_comm_exposed"]
    assert per_chunk.comm_time["dp"] == one_mb.comm_time["dp"]  # the same collectives, issued
    assert one_mb.time_per_step_s - per_chunk.time_per_step_s == pytest.approx(
        one_mb.time_breakdown["dp_comm_exposed"] - exposed)
    plain = ("parallel.schedule=1f1b", "parallel.virtual_stages=1")
    assert estimate(spec_for(*INTERLEAVED, *plain)).time_per_step_s == \
        estimate(spec_for(*INTERLEAVED, *plain, "framework.dp_overlap_per_chunk=false")).time_per_step_s


def test_per_chunk_overlap_hides_the_earlier_chunks_and_exposes_the_last_chunks_own():
    """xpar.estimate.frameworks.dp_chunks on a rank of v = 2 chunks of 2 blocks (and the root): with backward time to
    spare the earlier chunk's reductions cost only the overlap slowdown; the last chunk's overlap its own units."""
    from types import SimpleNamespace

    from xpar.estimate.frameworks.dp_chunks import chunk_units, gather_start, reduce_end
    from xpar.estimate.comm.overlap import simulate_pass

    a = SimpleNamespace(fsdp_prefetch=True, overlap_slowdown=0.1)
    compute, red = [1.0, 1.0, 1.0, 1.0, 0.5], [0.8, 0.8, 0.8, 0.8, 0.3]  # backward order, root last
    assert chunk_units(5, 2) == 3
    last = simulate_pass(compute[-3:], None, red[-3:], True, 0.1).exposed
    assert reduce_end(4, 2, a, compute, red) == pytest.approx(last + 0.1 * 1.6)  # 1.6 s behind 4 x 2 s
    assert reduce_end(1, 2, a, compute, [3.0] * 2 + red[2:]) == pytest.approx(last + (6.0 - 2.0) + 0.1 * 2.0)
    fwd, gat = compute[::-1], red[::-1]  # forward order, root first
    assert gather_start(4, 2, a, fwd, gat) == pytest.approx(simulate_pass(fwd[:3], gat[:3], None, True, 0.1).exposed
                                                            + 0.1 * 1.6)


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_the_planner_prices_per_chunk_overlap_as_the_estimate():
    on = {"dp_overlap_per_chunk": True}
    assert _planner_equals_scalar("175b", "a100_80gb_1024gpu", "megatron_core", fw_changes=on, n=10, seed=11) == 10
    assert _planner_equals_scalar("70b", "h100_80gb_64gpu", "megatron_core", fw_changes=on, n=10, seed=5) == 10


def _deepspeed_zero(dp: int, zero: int, *extra: str):
    hw = "a100_80gb_1024gpu"
    return spec_for("model=7b", f"hardware={hw}", f"hardware.nodes={dp // 8}", "train=cluster", "framework=deepspeed",
                    "parallel.tp=1", "parallel.pp=1", f"parallel.dp={dp}", f"parallel.zero_stage={zero}",
                    "parallel.recompute=full", "parallel.micro_batches=1", "train.micro_batch_size=1",
                    f"train.global_batch_size={dp}", *extra)


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
@pytest.mark.parametrize("zero", [1, 2])
def test_deepspeed_reduces_gradients_owner_by_owner_and_pays_each_owners_steps_at_scale(zero):
    """DeepSpeed's ZeRO-1/2 (stage_1_and_2.py average_tensor: one dist.reduce per partition a bucket spans,
    framework.zero_owner_reduce in conf/framework/deepspeed.yaml): at dp 512 the per-owner chains cost far
    more than one reduce-scatter; at dp 8 about the same bytes (a few owners per message)."""
    from xpar.estimate.cost import estimate
    from xpar.estimate.frameworks.owner_reduce import owners_spanned

    assert owners_spanned(100.0, 10.0, 512) == 11 and owners_spanned(5000.0, 10.0, 64) == 64
    owner, flat = (estimate(_deepspeed_zero(512, zero, *x)) for x in ((), ("framework.zero_owner_reduce=false",)))
    assert owner.comm_time["dp"] > 3 * flat.comm_time["dp"] and owner.time_per_step_s > 1.2 * flat.time_per_step_s
    small, small_flat = (estimate(_deepspeed_zero(8, zero, *x)) for x in ((), ("framework.zero_owner_reduce=false",)))
    assert small_flat.comm_time["dp"] <= small.comm_time["dp"] < 1.3 * small_flat.comm_time["dp"]
    off = ("framework.zero_owner_reduce=false",)
    zero3 = [estimate(_deepspeed_zero(512, 3, *x)).time_per_step_s for x in ((), off)]
    assert zero3[0] == zero3[1]  # ZeRO-3 reduce-scatters


def test_the_planner_prices_owner_by_owner_reduction_as_the_estimate():
    assert _planner_equals_scalar("70b", "a100_80gb_1024gpu", "deepspeed", n=10, seed=2) == 10


def test_a_memory_refusal_never_offers_moe_recompute_to_a_dense_model():
    """Megatron-Core's ``--recompute-modules moe`` reruns the MoE layers only: the nearest settings of a dense
    model's refusal once named ``parallel.recompute=moe`` (Llama 3 405B on 16,384 H100, which it does not change);
    a model with experts keeps it, as xpar plan searches them (xpar.config.remat.model_policies)."""
    from xpar.estimate.preflight.nearest_fit import recompute_choices
    dense = spec_for("model=7b", "hardware=h100_80gb_node", "framework=megatron_core", "parallel.tp=8",
                     "parallel.recompute=none")
    moe = spec_for("model=moe_tiny", "hardware=h100_80gb_node", "framework=megatron_core", "parallel.recompute=none")
    assert "moe" in dense.framework.recompute and "moe" not in recompute_choices(dense)
    assert "moe" in recompute_choices(moe) and "full" in recompute_choices(dense)


def test_a_layout_estimated_just_over_the_device_is_estimated_with_a_note_and_beyond_the_tolerance_refused():
    """Within MEMORY_TOLERANCE (5 %: the memory model's error where it runs high on published peaks) over the device
    a layout is estimated, labelled (a note, memory.fits False); 10 % over it is refused with the nearest settings."""
    from xpar.estimate.cost import peak_memory
    from xpar.estimate.preflight.check import MEMORY_TOLERANCE
    given = ("model=7b", "hardware=h100_80gb_node", "framework=megatron_core", "parallel.tp=8", "run.mode=estimate",
             "parallel.recompute=none", "train=cluster")
    need = peak_memory(spec_for(*given, "hardware.device_memory_gb=1000")).total
    near = spec_for(*given, f"hardware.device_memory_gb={need / 1.02 / 1e9}")
    assert not peak_memory(near).fits and near.mode == "estimate"
    assert [n for n in near.notes if "% over the" in n and "may not fit" in n and "2.0 % over" in n]
    assert MEMORY_TOLERANCE == 0.05
    with pytest.raises(ConfigError) as e:
        spec_for(*given, f"hardware.device_memory_gb={need / 1.10 / 1e9}")
    assert "does not fit device memory" in e.value.problems[0]
