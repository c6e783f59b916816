"""The estimate's step time and memory are the column model's on a column of one layout
(xpar.estimate.columns.one_layout, layout_memory): every pipeline rank a slot, with the blocks of the layout's own
split, whatever it is (issue 41: one orchestration for ``run.mode=estimate`` and ``xpar plan``)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tests.conftest import spec_for
from xpar.estimate.memory.activations import stage_chunk_bytes
from xpar.estimate.columns.layout_memory import layout_memory
from xpar.estimate.columns.peak_memory import memory_columns
from xpar.estimate.columns.one_layout import layout_columns, layout_slots
from xpar.estimate.columns.step_time import time_columns
from xpar.estimate.cost import assumptions_for, estimate, layer_costs
from xpar.estimate.memory.per_device import memory
from xpar.estimate.memory.model_states import MemoryOptions
from xpar.estimate.terms import time_key

HEAVY = [5] * 7 + [21] + [5] * 8
"""175B's 96 blocks over 16 stages, rank 7 holding 21: a split no plan candidate has."""


def _spec(split):
    return spec_for("parallel=175b_1024gpu", "hardware=a100_80gb_1024gpu", "hardware.device_memory_gb=400",
                    "run.mode=estimate", "parallel.schedule=1f1b", "parallel.virtual_stages=1",
                    f"parallel.layer_split=[{','.join(map(str, split))}]")


def test_every_rank_is_a_slot_with_its_own_blocks():
    spec = _spec(HEAVY)
    s = layout_slots(spec)
    assert s["n"][:, 0].tolist() == HEAVY and s["count"].sum() == spec.pp
    assert s["first"][:, 0].tolist() == [r == 0 for r in range(spec.pp)]
    assert s["last"][:, 0].tolist() == [r == spec.pp - 1 for r in range(spec.pp)]


def test_the_heaviest_rank_of_an_uneven_split_sets_the_step():
    """The matmul term is m x the 21-block rank's blocks x one block's matmul seconds."""
    spec = _spec(HEAVY)
    c = layer_costs(spec, assumptions_for(spec))
    est = estimate(spec)
    assert est.time_breakdown["matmul"] == pytest.approx(spec.micro_batches * 21 * (c["mm_f"] + c["mm_b"]), rel=1e-12)
    even = estimate(_spec([6] * 16))
    assert est.time_per_step_s > even.time_per_step_s


def test_estimate_equals_time_columns_on_its_own_column():
    """On an even split (a plan candidate) the one-row estimate and the planner's three-slot columns agree."""
    spec = _spec([6] * 16)
    est = estimate(spec)
    got = time_columns(spec, layout_columns(spec), [est.memory.optimizer], [0.0], [est.memory.grads])
    assert got["time_per_step_s"][0] == pytest.approx(est.time_per_step_s, rel=1e-9)
    for k, v in est.time_breakdown.items():
        assert got[time_key(k)][0] == pytest.approx(v, rel=1e-9, abs=1e-12)


def test_memory_prices_each_rank_on_its_own_stage():
    """The memory of one layout is the column model's one row with every rank a slot: under 1F1B
    rank r keeps min(m, pp - r) chunks of its own stage (21 blocks on rank 7), whatever the split."""
    spec = _spec(HEAVY)
    o = MemoryOptions.of(assumptions_for(spec))
    m, pp = spec.micro_batches, spec.pp
    for r in (0, 6, 7, 15):
        x = layout_memory(spec, o, r)
        assert x["pp_rank"] == r
        assert x["kept"] == pytest.approx(min(m, pp - r) * stage_chunk_bytes(spec, r, o)[0], rel=1e-12)
    totals = [layout_memory(spec, o, r)["total"] for r in range(pp)]
    assert memory(spec).pp_rank == totals.index(max(totals))
    assert memory(spec, 7).activations > memory(spec, 6).activations


def test_memory_columns_take_the_assumptions_given():
    """``memory_columns(..., assume=)`` prices under the framework options passed, not the base's."""
    spec = _spec([6] * 16)
    a = assumptions_for(spec)
    on = memory_columns(spec, layout_columns(spec), replace(a, cpu_offload_optimizer=True))
    off = memory_columns(spec, layout_columns(spec), replace(a, cpu_offload_optimizer=False))
    assert on["memory_optimizer"][0] == 0 < off["memory_optimizer"][0]
    assert off["memory_total"][0] == pytest.approx(memory(spec, assume=replace(a, cpu_offload_optimizer=False)).total,
                                                   rel=1e-12)


def test_memory_columns_shard_states_over_the_hsdp_group():
    """Under hierarchical ZeRO (parallel.zero_shard_size) the planner's columns hold the states
    sharded over the shard group, as the estimate does, not over all of dp."""
    spec = spec_for("parallel=70b_64gpu", "hardware=a100_80gb_64gpu", "run.mode=estimate", "parallel.zero_stage=3",
                    "parallel.zero_shard_size=4", local_devices=8)
    flat = spec_for("parallel=70b_64gpu", "hardware=a100_80gb_64gpu", "run.mode=estimate", "parallel.zero_stage=3",
                    local_devices=8)
    col = memory_columns(spec, layout_columns(spec))
    assert col["memory_optimizer"][0] == pytest.approx(memory(spec).optimizer, rel=1e-12)
    assert col["memory_total"][0] == pytest.approx(memory(spec).total, rel=1e-12)
    assert memory(spec).optimizer > memory(flat).optimizer
