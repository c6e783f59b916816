"""ZeRO-1 whose owners broadcast their updated tensors (framework.zero1=owner_broadcast, framework=internevo:
InternEvo's hybrid ZeRO): a broadcast chain per owner of a unit's tensors, so at hundreds of dp ranks across
nodes the parameter sync is latency-bound, and sharding the states inside a node (parallel.zero_shard_size=8)
moves it onto the node's links. Pure CPU, no workers."""
from __future__ import annotations

import pytest

from tests.conftest import compose
from xpar.config.validate import validate
from xpar.estimate.comm.collectives import collective_time, group_of
from xpar.estimate.comm.dp import unit_elements, unit_tensors, unit_times
from xpar.estimate.cost import assumptions_for, estimate
from xpar.estimate.frameworks.owner_broadcast import owner_broadcast_times, owners_of_unit

SLOW_NICS = ("hardware.nics_per_node=4", "hardware.inter_node_gb_per_s=12.5")
BASE = ("model=7b", "hardware=a100_80gb_node", "hardware.nodes=32", "tracking=off", "framework=internevo",
        "parallel.zero_stage=1", "parallel.recompute=none", "train.micro_batch_size=2", "train.dtype=bf16", *SLOW_NICS)


def test_a_unit_is_broadcast_once_per_owner_of_its_tensors():
    assert [owners_of_unit(9, dp) for dp in (1, 4, 9, 1024)] == [1, 4, 9, 9]
    chain = lambda b: 1e-3 + b * 1e-9  # 1 ms of latency a broadcast
    one, many = owner_broadcast_times([1000, 1000], [2, 2], [1, 9], 1024, chain)
    assert one == pytest.approx(1e-3 + 2000e-9)
    assert many == pytest.approx(9e-3 + 2000e-9)  # the same bytes, nine latencies


def test_internevo_prices_flat_zero1_above_zero1_inside_a_node():
    flat = validate(compose(*BASE, "train.global_batch_size=1024"))
    node = validate(compose(*BASE, "train.global_batch_size=1024", "parallel.zero_shard_size=8"))
    assert flat.dp == 256
    a = assumptions_for(flat)
    assert a.zero1 == "owner_broadcast"
    units = unit_elements(flat, 0)
    t_flat, t_node = unit_times(flat, a, units), unit_times(node, a, units)
    k = unit_tensors(flat, units)[1]
    chain = collective_time(flat.hardware, "broadcast", units[1] * 2 / k, group_of(flat.hardware, 256, 1))
    assert t_flat["gather"][1] == pytest.approx(k * chain)  # a block: k owners, k chains over 32 nodes
    assert sum(t_node["gather"]) < sum(t_flat["gather"]) / 5  # broadcasts inside the node
    e_flat, e_node = estimate(flat), estimate(node)
    assert e_node.time_per_step_s < e_flat.time_per_step_s  # InternEvo's table: zero1=8 1.6x flat ZeRO-1 at 1024 A100
    eight = validate(compose(*BASE, "train.global_batch_size=32", "hardware.nodes=1"))  # flat over one node's 8
    assert e_node.memory.optimizer == pytest.approx(estimate(eight).memory.optimizer)  # whole tensors over 8 owners
    assert e_node.memory.optimizer > 5 * e_flat.memory.optimizer  # over 256: the largest tensor bounds a rank
