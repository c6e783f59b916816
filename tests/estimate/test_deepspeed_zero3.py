"""What DeepSpeed's 2021 ZeRO-3 gathers and reduces, tensor by tensor (xpar.estimate.frameworks.deepspeed_zero3), and its time."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest

from xpar.calibrate import published as cal
from xpar.calibrate.published import framework_assumptions
from xpar.estimate.cost import estimate
from xpar.estimate.frameworks.deepspeed_zero3 import block_traffic, modules, traffic
from xpar.estimate.comm.dp import unit_elements, unit_times
from xpar.estimate.memory.model_states import block_shapes

DATA = Path(__file__).parents[1] / "data"


@lru_cache(maxsize=1)
def _rows() -> list:
    """The (gpu, spec, assumptions, published, metric) cases of Narayanan et al. 2021 Table 2's ZeRO-3 rows."""
    return [("A100",) + cal.table2_zero3_row(r) for r in cal.read_table(DATA / "narayanan_2021_table2_zero3.csv")]


def _gpt(row: int = 0, hidden: int = 0):
    """The 2021 GPT of a row of Narayanan et al. Table 2's ZeRO-3 rows (0: 175B, 3: 530B), or the
    175B's at another hidden size (ffn 4 h, heads of 128)."""
    cfg = _rows()[row][1].model
    return replace(cfg, hidden=hidden, n_heads=hidden // 128, ffn_hidden=4 * hidden) if hidden else cfg


@pytest.mark.parametrize("row", [0, 3])
def test_gpt3_block_gathers_its_four_weights_and_three_of_them_again_in_the_backward(row):
    """At GPT-3 sizes the biases and norms persist (< 1e5 elements), 4 weights gather
    (query_key_value fused as Megatron's), and under full recompute only the MLP's second
    linear is within 1e9 elements of its backward (2 x 4 h^2 >= 1e9): query_key_value, the
    attention output and the MLP's first linear, 8 h^2 of the block's 12 h^2, are gathered again.
    Every one of the 12 gradient tensors is reduced; 8 persist."""
    shapes = block_shapes(_gpt(row), 1)
    t = block_traffic(shapes, 100_000, 1e9, "full", True)
    assert (t.gathered, t.regathered, t.reduced, t.persistent) == (4, 3, 12, 8)
    assert t.regathered_share == pytest.approx(8 / 12, rel=1e-3)
    assert [m[0] for m in modules(shapes, 100_000, True)] == [0, 1, 1, 0, 1, 1]  # norm, qkv, out, norm, fc1, fc2
    assert block_traffic(shapes, 100_000, 1e9, "none", True).regathered == 0  # no recompute: gathered once a pass
    assert block_traffic(shapes, 100_000, 1e9, "selective", True).regathered == 0
    assert block_traffic(shapes, 100_000, 1e9, "full", False).gathered == 6  # xpar's own q, k, v projections


def test_a_small_block_is_kept_from_its_recompute_to_its_backward():
    """h = 4096: twice the elements after query_key_value (2 x 9 h^2 = 3e8) is under 1e9: nothing is
    gathered again. With reuse distance 0 (DeepSpeed: keep nothing) every submodule is; FSDP's unit (None) never."""
    shapes = block_shapes(_gpt(hidden=4096), 1)
    assert block_traffic(shapes, 100_000, 1e9, "full", True).regathered == 0
    assert block_traffic(shapes, 100_000, 0.0, "full", True).regathered == 4
    fsdp = block_traffic(shapes, 0, None, "full", False)
    assert (fsdp.gathered, fsdp.regathered, fsdp.reduced, fsdp.persistent) == (16, 0, 16, 0)


def test_persistence_is_decided_on_the_fused_tensor():
    """h = 256: each projection's weight has 65,536 elements (under 1e5), the fused query_key_value
    196,608: DeepSpeed holds the fused tensor, so it gathers; unfused, the three persist."""
    shapes = block_shapes(_gpt(hidden=256), 1)
    fused, unfused = modules(shapes, 100_000, True), modules(shapes, 100_000, False)
    assert fused[1][:2] == (1, 3 * 256 * 256)
    assert [m[0] for m in unfused[1:4]] == [0, 0, 0]


def test_second_gathers_add_to_the_backward_only_for_deepspeed_2021():
    """unit_times: DeepSpeed 2021 under full recompute gathers a block's 8/12 again in its backward
    (bytes and host ops); torchtitan's FSDP2 unit is gathered once for the recompute and backward."""
    _, spec, _, _, _ = _rows()[0]
    units = unit_elements(spec, 0)
    ds = unit_times(spec, framework_assumptions("deepspeed_2021"), units)
    assert ds["gather_backward"][0] == ds["gather"][0]  # the root: never gathered again
    assert ds["gather_backward"][1] > 1.5 * ds["gather"][1]
    tt = unit_times(spec, framework_assumptions("torchtitan"), units)
    assert tt["gather_backward"] == tt["gather"]
    assert traffic(spec, framework_assumptions("torchtitan")).regathered == 0


def test_persistent_tensors_cost_host_time_after_each_step_growing_with_dp():
    """Each step gathers the persistent tensors back and unpacks them per tensor and rank
    (zero3_persist_host_ops_per_rank x host_op_us): at 175B, 770 tensors (8 per block and the final
    norm's 2) x 4 ops x 4 us x dp -- 19 s at dp 1536, 4 times the figure at 384; nothing without it."""
    a = framework_assumptions("deepspeed_2021")
    ends = {}
    for _, spec, assume, _, _ in _rows()[:3]:
        with_ = estimate(spec, assume).time_breakdown["dp_comm_exposed"]
        without = estimate(spec, replace(assume, zero3_persist_host_ops_per_rank=0.0)).time_breakdown["dp_comm_exposed"]
        ends[spec.dp] = with_ - without
    assert ends[1536] == pytest.approx(770 * 4 * a.host_op_us * 1e-6 * 1536, rel=0.01)
    assert ends[1536] == pytest.approx(4 * ends[384], rel=0.01)


def test_gradients_are_all_reduced_flat_at_deepspeeds_default():
    """reduce_scatter false (DeepSpeed's default): the gradients go through an all-reduce (twice a
    reduce-scatter's time for these sizes) with no per-tensor host ops; with it true, reduce-scatters
    through the list API (zero3_reduce_host_ops_per_rank per rank and tensor)."""
    _, spec, assume, _, _ = _rows()[2]
    units = unit_elements(spec, 0)
    flat = unit_times(spec, assume, units)["reduce"][1]
    listed = unit_times(spec, replace(assume, grad_reduce_scatter=True), units)["reduce"][1]
    bare = unit_times(spec, replace(assume, grad_reduce_scatter=True, zero3_reduce_host_ops_per_rank=0.0), units)
    assert flat == pytest.approx(2 * bare["reduce"][1], rel=0.15)
    assert listed - bare["reduce"][1] == pytest.approx(12 * 4 * assume.host_op_us * 1e-6 * spec.dp, rel=0.05)


def test_reported_bytes_count_the_second_gathers_and_the_all_reduce():
    """The estimate's comm bytes follow what the time prices: under full recompute 8/12 of the
    blocks' bytes gathered again (not without recompute); gradients all-reduced (2x a reduce-scatter's
    bytes) at DeepSpeed's default, reduce-scattered with grad_reduce_scatter."""
    _, spec, a, _, _ = _rows()[0]
    full = estimate(spec, a).comm_bytes
    none = estimate(replace(spec, layout=replace(spec.layout, recompute="none")), a).comm_bytes
    rs = estimate(spec, replace(a, grad_reduce_scatter=True)).comm_bytes
    assert full["dp_allgather"] - none["dp_allgather"] == pytest.approx(2 / 3 * none["dp_allgather"] / 2, rel=0.02)
    assert full["dp_reduce_scatter"] == 0 and full["dp_allreduce"] == pytest.approx(2 * rs["dp_reduce_scatter"])
