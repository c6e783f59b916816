"""Learned attention sinks (model.attention_sinks, gpt-oss) priced by the framework's path (framework.sink_attention,
issue 42): the fused path (cuDNN through Transformer Engine) adds its dsink reduction's traffic and nothing else, the
unfused path the s x s scores and the sink column's copy, in time and memory; the planner's figures equal the
estimate's; the setting's refusals (no path, execute mode) and acceptance."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.conftest import spec_for
from tests.estimate.test_sliding_window import GPT_OSS
from tests.plan.test_plan_five import assert_equal_to_scalar, space_of
from xpar.config.checks import ConfigError
from xpar.estimate.compute.kernel_block import BF16, block_times, shape_of, sink_bytes
from xpar.estimate.compute.kernel_costs import training_device
from xpar.estimate.compute.kernels import memory_time
from xpar.estimate.cost import estimate
from xpar.plan.context import PlanContext
from xpar.plan.space import Constraints

SINKS = ("model.attention_sinks=true", "model.sliding_window=128", "model.sliding_window_pattern=2")


def _block(spec, sinks, backward, flash=True, local=False):
    sh = shape_of(spec.model, local=local)
    dev = training_device(spec.hardware)
    return block_times(sh, 1, 4096, dev, ep=8, backward=backward, sinks=sinks, flash=flash)


@pytest.mark.parametrize("local", [False, True])
def test_fused_sinks_add_the_dsink_reduction_traffic_only(local):
    """gpt-oss's block on an H100 (64 heads, s 4096): the fused path's forward is the flash block's; its backward's
    core is longer by the fp32 stats and rowsum read once, 8 bytes a query row and head, over the HBM rate (in the
    core's seconds, rerun where the core is); nothing else moves."""
    spec = spec_for(*GPT_OSS, local_devices=64)
    dev = training_device(spec.hardware)
    fwd = {k: _block(spec, k, False, local=local) for k in (None, "fused")}
    assert float(fwd["fused"].total) == float(fwd[None].total)
    bwd = {k: _block(spec, k, True, local=local) for k in (None, "fused")}
    extra = float(memory_time(8 * 64 * 4096, dev))
    assert float(bwd["fused"].attention - bwd[None].attention) == pytest.approx(extra, rel=1e-12)
    assert float(bwd["fused"].memory) == float(bwd[None].memory)
    assert float(bwd["fused"].gemm + bwd["fused"].experts) == float(bwd[None].gemm + bwd[None].experts)
    assert extra < 1e-3 * float(bwd[None].total)  # ~1 us against a millisecond block


@pytest.mark.parametrize("backward", [False, True])
def test_unfused_sinks_cost_the_scores_and_the_sink_column_copy(backward):
    """The unfused path on the same block: the unfused core (s x s scores through HBM) plus one more read and write of
    the bf16 scores (the sink column's concatenation forward, the slice's padded gradient backward) and one kernel."""
    spec = spec_for(*GPT_OSS, local_devices=64)
    dev = training_device(spec.hardware)
    flash, plain, sunk = (_block(spec, None, backward), _block(spec, None, backward, flash=False),
                          _block(spec, "unfused", backward, flash=False))
    copy = float(memory_time(2 * BF16 * 64 * 4096 * 4096, dev))
    assert float(sunk.attention - plain.attention) == pytest.approx(copy, rel=1e-12)
    assert float(sunk.memory) == float(plain.memory)
    assert float(sunk.kernels - plain.kernels) == 1
    assert float(sunk.total) > float(flash.total) + copy
    assert sink_bytes(None, 1, 4096, 4096, 64, backward)[0] == 0


def test_the_estimate_prices_each_path_and_keeps_the_scores_where_unfused():
    """The whole step: fused sinks within 0.1 % of no sinks (the dsink pass), unfused slower with the s x s scores
    kept for backward (peak memory up by more than a layer's scores at micro-batch 1; the layout is then refused for
    memory, as 64 H100 could not have run it)."""
    none = estimate(spec_for(*GPT_OSS, *SINKS[1:], local_devices=64))
    spec = spec_for(*GPT_OSS, *SINKS, local_devices=64)
    fused = estimate(spec)
    unfused = estimate(replace(spec, framework=replace(spec.framework, sink_attention="unfused")))
    assert 1.0 < fused.time_per_step_s / none.time_per_step_s < 1.001
    assert fused.memory.total == none.memory.total
    assert unfused.time_per_step_s > 1.2 * fused.time_per_step_s
    assert unfused.memory.total - fused.memory.total > 64 * 4096 * 4096 * BF16


def test_plan_figures_equal_the_estimate_with_sinks():
    """gpt-oss with sinks on 64 H100 (framework=megatron_core, ep 8, the published batch): sampled candidates of
    the planner's columns equal the scalar estimate, on the fused path and the unfused one (slower, the same
    candidates)."""
    from xpar.config.presets import preset_dict

    model = dict(preset_dict("model", "tiny"), name="gpt_oss_120b", n_layers=36, hidden=2880, n_heads=64,
                 n_kv_heads=8, head_dim=64, ffn_hidden=2880, n_experts=128, moe_top_k=4, expert_ffn_hidden=2880,
                 vocab_size=201088, seq_len=4096, bias=True, sliding_window=128, sliding_window_pattern=2,
                 attention_sinks=True)
    rate = {}
    for path in ("fused", "unfused"):
        fw = dict(preset_dict("framework", "megatron_core"), sink_attention=path)
        ctx = PlanContext(model=model, hardware=preset_dict("hardware", "h100_80gb_64gpu"),
                          train={"dtype": "bf16", "seq_len": 4096}, framework=fw)
        cols = space_of(ctx, Constraints(global_batch=(1280, 1280), ep=(8,), pp=4, max_tp=1, zero_stages=(1,),
                                         schedules=("1f1b",), recompute=("none",))).cols
        assert len(cols["tp"]) >= 3
        pick = np.sort(np.random.default_rng(7).choice(len(cols["tp"]), size=3, replace=False))
        rate[path] = assert_equal_to_scalar(ctx, {k: v[pick] for k, v in cols.items()})["tokens_per_s"]
    assert (rate["unfused"] < rate["fused"]).all()


@pytest.mark.parametrize("overrides, says", [
    (("framework=torchtitan",), "framework=torchtitan prices no sink path; set framework.sink_attention=fused"),
    (("framework=xpar",), "framework=xpar prices no sink path"),
    (("run.mode=execute", "framework.sink_attention=fused"), "is estimated, not executed, by xpar"),
])
def test_sinks_are_refused_without_a_path_and_in_execute_mode(overrides, says):
    with pytest.raises(ConfigError) as err:
        spec_for("model=tiny", "run.mode=estimate", "model.attention_sinks=true", *overrides)
    assert says in str(err.value) and len(err.value.problems) == 1


def test_sinks_are_accepted_with_a_path_and_the_path_needs_a_known_name():
    spec = spec_for("model=tiny", "run.mode=estimate", "model.attention_sinks=true", "framework.sink_attention=unfused")
    assert spec.model.attention_sinks and spec.framework.sink_attention == "unfused"
    assert spec_for("model=tiny", "run.mode=estimate", "framework=megatron_core",
                    "model.attention_sinks=true").framework.sink_attention == "fused"
    with pytest.raises(ConfigError, match="framework.sink_attention must be one of"):
        spec_for("model=tiny", "run.mode=estimate", "framework.sink_attention=partly")
    plain = spec_for("model=tiny", "run.mode=estimate")  # default: no sinks, the framework's path unread
    assert not plain.model.attention_sinks and estimate(plain).time_per_step_s == estimate(
        replace(plain, framework=replace(plain.framework, sink_attention="unfused"))).time_per_step_s
