"""What DeepSpeed's 2021 ZeRO-3 gathers, tensor by tensor (xpar.estimate.zero3_tensors), and its time."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest

from xpar.calibrate import published as cal
from xpar.calibrate.published import framework_assumptions
from xpar.estimate.dp import traffic, unit_elements, unit_times
from xpar.estimate.model_states import block_shapes
from xpar.estimate.zero3_tensors import block_traffic, modules

DATA = Path(__file__).parent / "data"


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
    """At GPT-3 sizes the biases and norms persist (< 1e5 elements: never gathered), 4 weights
    gather (query_key_value fused as Megatron's), and under full recompute only the MLP's second
    linear is within 1e9 elements of its backward (2 x 4 h^2 >= 1e9): query_key_value, the
    attention output and the MLP's first linear, 8 h^2 of the block's 12 h^2, are gathered again.
    Every one of the 12 gradient tensors is reduce-scattered."""
    shapes = block_shapes(_gpt(row), 1)
    t = block_traffic(shapes, 100_000, 1e9, "full", True)
    assert (t.gathered, t.regathered, t.reduced) == (4, 3, 12)
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
    assert (fsdp.gathered, fsdp.regathered, fsdp.reduced) == (16, 0, 16)


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
