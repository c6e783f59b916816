"""framework.moe_graph_break (issue 42): torchtitan's MoE layer breaks torch.compile's graph where ep > 1, and torch's
checkpoint runs a region with a graph break eagerly (torch/utils/checkpoint.py, ``@torch._disable_dynamo``), so under
activation checkpointing a compiled MoE block's element-wise kernels are eager ones
(xpar.estimate.compute.kernel_costs.eager_share)."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import compose
from xpar.config.remat import spec_recompute
from xpar.config.validate import validate
from xpar.estimate.compute.kernel_costs import kernel_layer_columns, kernel_layer_costs

QWEN3 = ("model=qwen3_30b_a3b", "model.seq_len=4096", "framework=torchtitan", "framework.ep_dispatcher=deepep",
         "hardware=b200_180gb_node", "parallel.dp=8", "parallel.zero_stage=3", "train.micro_batch_size=8",
         "train.global_batch_size=64", "train.dtype=bf16", "train.compile_loss=true")


def _spec(recompute: str, compile_: bool = True, ep: int = 8):
    return validate(compose("tracking=off", "run.progress=false", *QWEN3, f"parallel.ep={ep}",
                            f"parallel.recompute={recompute}", f"train.compile={str(compile_).lower()}"),
                    local_devices=2)


def _costs(spec, breaks: bool = True, passes: float = 3.0):
    from xpar.estimate.cost import assumptions_for

    return kernel_layer_costs(spec, replace(assumptions_for(spec), moe_graph_break=breaks, elementwise_passes=passes))


def test_torchtitan_profile_says_its_moe_layer_breaks_the_graph():
    from xpar.config.presets import preset_dict

    assert preset_dict("framework", "torchtitan")["moe_graph_break"] is True
    assert preset_dict("framework", "fsdp2_bf16")["moe_graph_break"] is False
    assert preset_dict("framework", "megatron_core").get("moe_graph_break", False) is False


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_checkpointed_deepep_block_under_compile_moves_eager_traffic(recompute):
    """Qwen3-30B-A3B, DeepEP ep 8, compiled, under full or op-level selective AC: every block (all MoE) runs eagerly, so
    its memory-bound seconds are the uncompiled run's; with the profile's graph break turned off, the compiled
    (fused) traffic, each eager pass one fused pass more (the atomic scatters, aten kernels either way, unchanged);
    the GEMMs, attention and launch terms are unchanged."""
    spec = _spec(recompute)
    on, off, eager = _costs(spec), _costs(spec, breaks=False), _costs(_spec(recompute, compile_=False))
    two = _costs(spec, passes=2.0)
    for k in ("mem_f", "mem_b"):
        assert on[k] == pytest.approx(eager[k], rel=1e-12)
        assert on[k] - two[k] == pytest.approx(two[k] - off[k], rel=1e-9) and two[k] - off[k] > 0.2 * off[k]
    for k in ("mm_f", "mm_b", "ovh_f", "ovh_b"):
        assert on[k] == pytest.approx(off[k], rel=1e-12)


def test_without_checkpointing_or_ep_the_compiled_block_stays_fused():
    """No AC: the block compiles in pieces between the breaks (fused traffic kept); ep 1: no dispatcher to break on."""
    for spec in (_spec("none"), _spec("full", ep=1)):
        assert _costs(spec)["mem_f"] == pytest.approx(_costs(spec, breaks=False)["mem_f"], rel=1e-12)
        assert _costs(spec)["mem_f"] < 0.7 * _costs(replace(spec, train=replace(spec.train, compile=False)))["mem_f"]


def test_columns_price_each_rows_policy_as_the_scalar_estimate():
    """The planner's columns (one row per recompute policy) equal the scalar layer costs of each policy's spec."""
    from xpar.estimate.cost import assumptions_for

    specs = [_spec(r) for r in ("none", "selective", "full")]
    assume = assumptions_for(specs[0])
    picked = [spec_recompute(s, assume.selective_recompute, assume.recompute_layer_fraction) for s in specs]
    cols = kernel_layer_columns(specs[0], assume, [1] * 3, [8] * 3, [False] * 3, [p for p, _ in picked],
                                [sh for _, sh in picked])
    for i, s in enumerate(specs):
        one = kernel_layer_costs(s, assume)
        for k, v in one.items():
            assert cols[k][i] == pytest.approx(v, rel=1e-12), (i, k)
    assert cols["mem_f"][2] > 1.5 * cols["mem_f"][0] and cols["mem_f"][1] == pytest.approx(cols["mem_f"][2], rel=1e-12)


@pytest.mark.slow
def test_torch_runs_a_checkpointed_block_with_a_graph_break_eagerly():
    """On the CPU stand-in of torchtitan's DeepEP block (benchmarks/ttcompile_graph_breaks.py): without AC Dynamo hands
    its backend graphs around the breaks (the attention half and the router among them); inside torch's non-reentrant
    checkpoint it hands none, forward or backward."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import ttcompile_graph_breaks as stand_in

    graphs, breaks = stand_in.capture(checkpointed=False)
    assert len(graphs) >= 4 and any("scaled_dot_product_attention" in g for g in graphs)
    assert any("softmax" in g and "topk" in g for g in graphs) and breaks
    graphs, _ = stand_in.capture(checkpointed=True)
    assert graphs == []
