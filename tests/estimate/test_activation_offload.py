"""Activation offload (parallel.activation_offload_layers, xpar.estimate.memory.activation_offload): Megatron-Core's
--cpu-offloading as Transformer Engine runs it, in memory (blocks held), time (exposed host-link copies), host memory,
the refusals, the memory refusal's line, the planner's columns, and the Megatron-Bridge run it lets through."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.conftest import compose, spec_for
from xpar.config.checks import ConfigError
from xpar.estimate.columns.one_layout import layout_columns
from xpar.estimate.columns.peak_memory import memory_columns
from xpar.estimate.columns.step_time import time_columns
from xpar.estimate.cost import assumptions_for, estimate, layer_costs, peak_memory as memory
from xpar.estimate.memory.activation_host import block_bytes_of
from xpar.estimate.memory.activation_offload import exposed_time, resident_blocks, windows
from xpar.estimate.memory.model_states import MemoryOptions
from xpar.estimate.terms import time_key

ROW7 = ("framework=megatron_core", "hardware=gb200_nvl72_node", "hardware.devices_per_node=64", "hardware.nics_per_node=64",
        "hardware.nodes=2", "model=405b", "model.seq_len=8192", "parallel.tp=2", "parallel.sequence_parallel=true",
        "parallel.dp=64", "parallel.zero_stage=3", "train.dtype=fp8", "train.fp8_recipe=current",
        "train.micro_batch_size=1", "train.global_batch_size=64", "parallel.micro_batches=auto", "run.mode=estimate")
"""benchmarks/refusal_hunt4.md row 7: Llama 3.1 405B, Megatron-FSDP tp 2 on 128 GB200 (Megatron-Bridge 25.09), whose
recipe offloads 95 of the 126 blocks (cpu_offloading_num_layers 95)."""
SMALL = ("framework=megatron_core", "hardware=h100_80gb_8gpu", "model=7b", "parallel.tp=1", "parallel.dp=8",
         "parallel.zero_stage=1", "train.micro_batch_size=2", "train.global_batch_size=64", "run.mode=estimate")
"""Llama 2 7B over 8 H100 at micro-batch 2: 135 GB per device without offload (72 GB of activations, 2.16 GB a block)."""


def _small(*extra: str):
    """SMALL on 400 GB devices (it fits without offload)."""
    return spec_for(*SMALL, "hardware.device_memory_gb=400", *extra, local_devices=8)


def test_transformer_engine_windows_tile_the_blocks_and_one_group_stays_in_flight():
    """TE's layer_window_map for 95 groups over 126 blocks: 31 windows of 2 blocks, 64 of 1; 126 - 95 + 1 held."""
    assert windows(126, 95) == ((2, 31), (1, 64))
    assert windows(32, 8) == ((4, 8),) and windows(32, 0) == ()
    assert sum(k * n for k, n in windows(126, 95)) == 126
    assert resident_blocks(126, 95) == 32 and resident_blocks(126, 0) == 126


def test_copies_hide_behind_their_window_and_arrays_equal_floats():
    """A copy of 1 GB at 100 GB/s (10 ms) behind windows of 1 block (6 ms forward, 12 ms backward) and 2 blocks."""
    got = exposed_time(1e9, 100.0, 3, 2, 0.006, 0.012)  # windows: one of 2 blocks, one of 1
    assert got == pytest.approx(0.004, rel=1e-12)  # only the 1-block window's forward copy shows (10 - 6 ms)
    arr = exposed_time(np.array([1e9, 5e9]), 100.0, 3, 2, np.array([0.006, 0.006]), np.array([0.012, 0.012]))
    assert arr[0] == pytest.approx(got, rel=1e-15)
    assert arr[1] == pytest.approx((0.05 - 0.012) + (0.05 - 0.024) + (0.05 - 0.006) + (0.05 - 0.012), rel=1e-12)
    assert exposed_time(1e9, 100.0, 3, 2, 1.0, 2.0) == 0.0


def test_offloaded_blocks_leave_the_device_and_the_slow_link_shows_in_the_step():
    plain, spec = _small(), _small("parallel.activation_offload_layers=24", "hardware.pcie_gb_per_s=1")
    o = MemoryOptions.of(assumptions_for(spec))
    block = block_bytes_of(spec, o)
    assert memory(plain).activations - memory(spec).activations == pytest.approx(23 * block, rel=1e-9)
    e, c = estimate(spec), layer_costs(spec, assumptions_for(spec))
    per_mb = exposed_time(block, 1.0, 32, 24, c["mm_f"] + c["mem_f"], c["mm_b"] + c["mem_b"])
    assert per_mb > 0
    assert e.time_breakdown["act_offload"] == pytest.approx(spec.micro_batches * per_mb, rel=1e-9)
    assert sum(e.time_breakdown.values()) == pytest.approx(e.time_per_step_s, rel=1e-12)
    assert e.time_per_step_s == pytest.approx(estimate(plain).time_per_step_s + e.time_breakdown["act_offload"],
                                              rel=1e-9)
    assert any("24 of 32 blocks offloaded" in n for n in e.notes)


def test_planner_columns_equal_the_estimate_with_offload():
    """The column model prices the offloaded layout as the estimate does (time and memory), its term a column."""
    spec = _small("parallel.activation_offload_layers=20", "hardware.pcie_gb_per_s=2")
    est = estimate(spec)
    got = time_columns(spec, layout_columns(spec), [est.memory.optimizer], [0.0], [est.memory.grads])
    assert got["time_per_step_s"][0] == pytest.approx(est.time_per_step_s, rel=1e-9)
    for k, v in est.time_breakdown.items():
        assert got[time_key(k)][0] == pytest.approx(v, rel=1e-9, abs=1e-12)
    assert got["time_act_offload"][0] > 0
    mem = memory_columns(spec, layout_columns(spec))
    assert mem["memory_total"][0] == pytest.approx(memory(spec).total, rel=1e-12)
    assert mem["memory_activations"][0] < memory_columns(_small(), layout_columns(_small()))["memory_activations"][0]


@pytest.mark.parametrize("extra, says", [
    (("framework=torchtitan", "parallel.zero_stage=2"), "framework=torchtitan runs no activation offload"),
    (("parallel.pp=2", "parallel.dp=4"), "needs parallel.pp=1"),
    (("parallel.recompute=full",), "needs parallel.recompute=none"),
    (("parallel.activation_offload_layers=32",), "fewer blocks than the model has (0 <= N < 32)"),
    (("hardware.pcie_gb_per_s=null",), "has no hardware.pcie_gb_per_s"),
    (("hardware.pcie_gb_per_s=0",), "(null: unknown, no optimizer or activation offload), got 0.0; e.g. "
                                    "hardware.pcie_gb_per_s=50"),  # the link times both offloads
    (("hardware.host_memory_gb=100",), "the host holds at most 5 blocks'"),  # 8 x 2.16 GB a block
])
def test_refusals_name_the_rule_and_values_that_work(extra, says):
    with pytest.raises(ConfigError) as e:
        _small("parallel.activation_offload_layers=8", *extra)
    assert says in str(e.value)


def test_memory_refusal_names_the_fewest_blocks_to_offload_that_fit():
    """Where the framework runs it, the refusal's first line names the offload that fits, checked: 25 blocks (8 held)."""
    with pytest.raises(ConfigError) as e:
        spec_for(*SMALL, local_devices=8)
    first = str(e.value).split("\n")[0]
    assert "parallel.activation_offload_layers=25 (estimated 83.3 GB per device" in first
    spec_for(*SMALL, "parallel.activation_offload_layers=25", local_devices=8)  # accepted as named
    assert not memory(spec_for(*SMALL, "parallel.activation_offload_layers=24", local_devices=8)).fits  # the fewest
    with pytest.raises(ConfigError) as e:
        spec_for(*SMALL, "framework=torchtitan", "parallel.zero_stage=2", local_devices=8)
    assert "activation_offload_layers" not in str(e.value)  # a framework without it is not told to use it


def test_plan_refuses_the_setting_only_where_the_framework_does_not_run_it():
    from xpar.plan.inputs import plan_inputs
    _, problems = plan_inputs(compose(*SMALL[:-1], "run.mode=plan", "parallel.activation_offload_layers=4"), [])
    assert not problems  # megatron_core runs it: the plan searches it (tests/plan/test_plan_act_offload.py)
    _, problems = plan_inputs(compose(*SMALL[:-1], "run.mode=plan", "framework=torchtitan",
                                      "parallel.activation_offload_layers=4"), [])
    assert any("framework=torchtitan runs no activation offload" in p for p in problems)


def test_the_megatron_bridge_405b_run_is_accepted_with_its_recipe_offload():
    """Refused on main (290 GB per device, 222.5 GB of activations); with the recipe's 95 of 126 blocks offloaded
    it fits the 198 GB GB200, its copies hidden behind the blocks' compute on NVLink-C2C (225 GB/s a GPU)."""
    with pytest.raises(ConfigError) as e:
        spec_for(*ROW7, local_devices=128)
    assert "parallel.activation_offload_layers=" in str(e.value).split("\n")[0]  # the refusal's first line names it
    spec = spec_for(*ROW7, "parallel.activation_offload_layers=95", local_devices=128)
    mem = memory(spec)
    assert mem.fits and mem.activations < 0.3 * 222.5e9
    est = estimate(spec)
    assert est.time_breakdown["act_offload"] == 0.0
    plain = replace(spec, parallel=replace(spec.parallel, activation_offload_layers=None))
    assert est.time_per_step_s == pytest.approx(estimate(plain).time_per_step_s, rel=1e-12)
