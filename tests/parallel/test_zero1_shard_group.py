"""ZeRO-1 with its optimizer states inside shard groups (parallel.zero_shard_size at zero_stage 1: InternEvo's
zero1 = s, Megatron-Core's distributed optimizer instances): executed on 4 gloo workers as DDP over dp 4 and
ZeroRedundancyOptimizer on groups of 2, equal to the single-process reference with 2x flat ZeRO-1's optimizer
states; estimated with 1/s of the states and the two-level reduction."""
from __future__ import annotations

import pytest

from tests.conftest import compose, spawn, spec_for
from tests.parallel.test_hsdp import _reference, _train
from xpar.config.validate import validate
from xpar.estimate.comm.dp import unit_elements, unit_times
from xpar.estimate.cost import assumptions_for, estimate

RUN = ("parallel.dp=4", "parallel.zero_stage=1", "train.steps=2", "train.warmup_steps=0")


@pytest.mark.slow
def test_zero1_in_shard_groups_on_4_workers_equals_the_reference():
    grouped, flat = spec_for(*RUN, "parallel.zero_shard_size=2", local_devices=4), spec_for(*RUN, local_devices=4)
    results = spawn(_train, 4, [grouped.to_dict(), flat.to_dict()])
    ref, ref_norms = _reference(grouped)
    for per_rank in results:
        mean = [sum(r[0][i] for r in per_rank) / len(per_rank) for i in range(len(ref))]
        assert mean == pytest.approx(ref, rel=1e-4)
        for _, norms, _ in per_rank:
            assert norms == pytest.approx(ref_norms, rel=1e-4)
    opt_grouped = sum(r[2]["optimizer"] for r in results[0])
    opt_flat = sum(r[2]["optimizer"] for r in results[1])
    assert opt_grouped == pytest.approx(2 * opt_flat, rel=0.05)  # each state held by 2 ranks, not 1


BASE = ("model=7b", "hardware=a100_80gb_64gpu", "train=cluster", "tracking=off", "framework=megatron_core",
        "parallel.zero_stage=1", "hardware.nics_per_node=4", "hardware.inter_node_gb_per_s=12.5")


def test_zero1_in_shard_groups_is_estimated_with_states_over_the_group_and_two_level_reductions():
    grouped, flat = validate(compose(*BASE, "parallel.zero_shard_size=8")), validate(compose(*BASE))
    eight = validate(compose(*BASE, "hardware.nodes=1"))  # flat ZeRO-1 over the 8 ranks of one node
    e_g, e_f, e_8 = estimate(grouped), estimate(flat), estimate(eight)
    assert e_g.memory.optimizer == pytest.approx(e_8.memory.optimizer)
    assert e_g.memory.optimizer == pytest.approx(8 * e_f.memory.optimizer, rel=0.02)
    a = assumptions_for(grouped)
    units = unit_elements(grouped, 0)
    tg, tf, t8 = unit_times(grouped, a, units), unit_times(flat, a, units), unit_times(eight, a, units)
    assert sum(tg["gather"]) < sum(tf["gather"])  # the parameters gathered inside the node, not across nodes
    assert sum(tg["reduce"]) > sum(t8["reduce"])  # + the all-reduce of 1/8 across the 8 replicas
