"""The plan's space holds what practitioners run (issue 44): cp at every sequence length that leaves
each rank 4k tokens or more, micro-batches up to 16, an etp axis for MoE models (plan.etp=[0,1]; equal to
the scalar estimate), each profile's own schedules, and plan.* keys that widen or narrow each axis. Fast."""
from __future__ import annotations

import numpy as np

from tests.plan.test_plan_five import _sample, assert_equal_to_scalar, context, space_of
from xpar.plan.axes import default_cp, default_etp
from xpar.plan.space import Constraints, micro_batch_sizes, schedule_pairs


def test_cp_is_searched_from_8k_tokens_with_4k_tokens_or_more_per_rank():
    """NeMo's Llama 3 70B recipe: cp 2 at 8k tokens; Llama 3's 128k stage: cp 16; NeMo's 1M-token recipe: cp 32
    (benchmarks/refusal_hunt2.md row 3: outside the space when the default stopped at 16)."""
    assert default_cp(4096) == (1,)
    assert default_cp(8192) == (1, 2)
    assert default_cp(32768) == (1, 2, 4, 8)
    assert default_cp(131072) == (1, 2, 4, 8, 16, 32)
    assert 32 in default_cp(1 << 20) and max(default_cp(1 << 20)) == 256


def test_micro_batches_up_to_16_every_b_dividing_the_batch():
    """torchtitan's async-TP runs b 12 (refusal_hunt2.md rows 13-14: outside the space at every b to 8, powers of
    two above); a power-of-two batch keeps the powers of two."""
    assert micro_batch_sizes([1536], 16) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert micro_batch_sizes([96], 16) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert micro_batch_sizes([1024], 16) == [1, 2, 4, 8, 16]


def test_virtual_stages_narrowed_by_a_plan_key():
    pairs = schedule_pairs(126, (4, 8, 200))
    assert {v for s, v in pairs if s == "interleaved_1f1b"} == {4, 8}


def test_etp_axis_of_a_moe_model_equals_the_scalar_estimate():
    """Mixtral 8x7B on 64 H100: etp 1 (experts whole on each rank, ep folding tp ranks) beside etp = tp;
    ep x etp divides tp x cp x dp; figures equal to estimate() on sampled etp-1 candidates."""
    ctx = context("mixtral_8x7b", "h100_80gb_64gpu", 4096)
    assert default_etp(ctx.model) == (0,)  # etp = tp unless plan.etp asks for more
    space = space_of(ctx, Constraints(global_batch=(64, 64), ep=(1, 2, 8), etp=(0, 1), max_micro_batch_size=2))
    c = space.cols
    etp = np.where(c["etp"] == 0, c["tp"], c["etp"])
    assert set(np.unique(c["etp"]).tolist()) == {0, 1}
    assert ((c["tp"] * c["dp"] * c["cp"]) % (c["ep"] * etp) == 0).all()
    assert not ((c["etp"] == 1) & (c["tp"] == 1)).any()  # etp = tp is the default etp, kept once
    folded = (c["etp"] == 1) & (c["ep"] * 1 > c["dp"])  # ep spans tp ranks: only with etp < tp
    assert folded.any()
    assert_equal_to_scalar(ctx, _sample(c, (c["etp"] == 1) & (c["ep"] > 1), 10, 11))


def test_dense_model_has_no_etp_column():
    ctx = context("70b", "h100_80gb_64gpu", 4096)
    assert "etp" not in space_of(ctx, Constraints(global_batch=(64, 64), max_micro_batch_size=1)).cols


def test_plan_etp_key_widens_and_refuses_bad_values():
    from types import SimpleNamespace

    from xpar.plan.axes import resolve_axes
    moe = {"n_experts": 8}
    p = SimpleNamespace(cp=None, ep=None, dtype=None, etp=[1, 0], virtual_stages=[4, 8])
    axes, bad = resolve_axes(p, moe, 4096, "bf16")
    assert not bad and axes["etp"] == (0, 1) and axes["v"] == (4, 8)
    _, bad = resolve_axes(SimpleNamespace(cp=None, ep=None, dtype=None, etp=[-1]), moe, 4096, "bf16")
    assert len(bad) == 1 and "plan.etp=[-1] must be a list of whole numbers >= 0 (0: etp = tp)" in bad[0]


def test_megatron_core_plans_a_moe_model_at_etp_1_as_its_recipes_run_it():
    """framework.etp_degrees: megatron_core's plan of a MoE model searches etp = tp and etp 1 (the Megatron-Bridge
    MoE recipes' expert_tensor_parallel_size: 1), so a published tp 2-4 x ep 8-64 layout at etp 1 is in the space;
    hai_llm (DeepSeek-V3 trains without tp) and xpar keep etp = tp; a dense model has no etp axis."""
    from types import SimpleNamespace

    from xpar.plan.axes import resolve_axes
    p = SimpleNamespace(cp=None, ep=None, etp=None, virtual_stages=None, dtype=None)
    moe = context("mixtral_8x7b", "h100_80gb_64gpu", 4096, "megatron_core")
    assert resolve_axes(p, moe.model, 4096, "bf16", moe.framework)[0]["etp"] == (0, 1)
    assert default_etp(moe.model, context("mixtral_8x7b", "h100_80gb_64gpu", 4096, "hai_llm").framework) == (0,)
    assert default_etp(moe.model, context("mixtral_8x7b", "h100_80gb_64gpu", 4096).framework) == (0,)
    assert default_etp(context("70b", "h100_80gb_64gpu", 4096).model, moe.framework) == (0,)
    space = space_of(moe, Constraints(global_batch=(64, 64), ep=(8,), etp=(0, 1), max_micro_batch_size=1,
                                      schedules=("1f1b",), recompute=("none",)))
    c = space.cols
    assert ((c["tp"] == 4) & (c["ep"] == 8) & (c["etp"] == 1) & (c["dp"] == 16)).any()


def test_a_bad_etp_degrees_list_is_one_line():
    from xpar.config.checks.framework import check_framework
    from xpar.config.profile import FrameworkConfig
    lines = check_framework(FrameworkConfig(etp_degrees=[-1]))
    assert len(lines) == 1 and "framework.etp_degrees=[-1]" in lines[0]


def test_the_space_names_the_rule_that_drops_a_published_layouts_degrees():
    """enumerate_layouts(watch=...): the rule that drops the last layouts holding given degrees (why a published
    layout is outside the plan, benchmarks/plan_published.py); "" for degrees the space keeps."""
    from xpar.calibrate.published import preset
    from xpar.plan.space import enumerate_layouts
    model, c = preset("model", "175b"), Constraints(global_batch=(48, 48), vocab_multiple=128, schedules=("1f1b",))
    assert enumerate_layouts(model, 24, 8, 2048, c, watch={"tp": 12}).watch_dropped_by == "tp_nodes"
    assert enumerate_layouts(model, 24, 8, 2048, c, watch={"tp": 8, "pp": 4}).watch_dropped_by == "devices"
    kept = enumerate_layouts(model, 24, 8, 2048, c, watch={"tp": 8, "pp": 3})
    assert kept.watch_dropped_by == "" and ((kept.cols["tp"] == 8) & (kept.cols["pp"] == 3)).any()
