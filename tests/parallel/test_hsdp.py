"""Hierarchical ZeRO (parallel.zero_shard_size: torch FSDP2's HSDP): executed on 4 gloo workers as 2
shard groups of 2 (a 2-D (replicate, shard) mesh), equal to the single-process reference, its states
sharded 2 ways; estimated with the gathers and reduce-scatters inside the shard group and the
all-reduce across the replicas."""
from __future__ import annotations

import pytest

from tests.conftest import compose, spawn, spec_for
from xpar.config.checks import ConfigError
from xpar.config.validate import validate
from xpar.estimate.cost import estimate
from xpar.estimate.comm.dp import unit_elements, unit_times
from xpar.estimate.cost import assumptions_for

HSDP = ("parallel.dp=4", "parallel.zero_shard_size=2", "train.steps=2", "train.warmup_steps=0")


def _train(spec_dicts: list[dict]) -> list:
    """Worker: every rank's (losses, grad_norms, memory) per spec."""
    import tempfile
    from pathlib import Path

    from xpar.config.spec import RunSpec
    from xpar.run.worker import run_rank

    out = []
    for d in spec_dicts:
        with tempfile.TemporaryDirectory() as tmp:
            stats = run_rank(RunSpec.from_dict(d), Path(tmp))
        if stats is not None:
            out.append([[s["losses"], s["grad_norms"], s["memory"]] for s in stats])
    return out


def _reference(spec):
    from xpar.run.reference import reference_run
    out = reference_run(spec)
    return out["losses"], out["grad_norms"]


@pytest.mark.slow
def test_hsdp_on_4_workers_equals_the_reference_and_shards_two_ways():
    specs = [spec_for(*HSDP, f"parallel.zero_stage={z}", local_devices=4) for z in (2, 3)]
    flat = spec_for("parallel.dp=4", "parallel.zero_stage=3", "train.steps=2", "train.warmup_steps=0", local_devices=4)
    results = spawn(_train, 4, [s.to_dict() for s in specs + [flat]])
    for spec, per_rank in zip(specs, results[:2]):
        ref, ref_norms = _reference(spec)
        mean = [sum(r[0][i] for r in per_rank) / len(per_rank) for i in range(len(ref))]  # each rank: its data
        assert mean == pytest.approx(ref, rel=1e-4)
        for _, norms, _ in per_rank:  # the pre-clip global gradient norm, on every rank
            assert norms == pytest.approx(ref_norms, rel=1e-4)
    hsdp3, flat3 = results[1][0][2], results[2][0][2]
    # optimizer states: 1/2 of the model per rank under shard groups of 2, 1/4 under flat ZeRO-3 over 4
    assert hsdp3["optimizer"] == pytest.approx(2 * flat3["optimizer"], rel=0.05)
    assert hsdp3["params"] == pytest.approx(2 * flat3["params"], rel=0.05)


def test_hsdp_is_estimated_with_states_sharded_by_the_group_and_two_level_reductions():
    base = ("model=7b", "hardware=a100_80gb_64gpu", "train=cluster", "tracking=off", "parallel.zero_stage=3")
    hsdp = validate(compose(*base, "parallel.zero_shard_size=8"))
    flat = validate(compose(*base))
    eight = validate(compose(*base, "hardware.nodes=1"))  # flat ZeRO-3 over the 8 ranks of one node
    assert hsdp.dp == flat.dp == 64 and eight.dp == 8
    e_h, e_f, e_8 = estimate(hsdp), estimate(flat), estimate(eight)
    for k in ("params", "grads", "optimizer"):  # states as flat ZeRO over the 8-rank shard group
        assert getattr(e_h.memory, k) == pytest.approx(getattr(e_8.memory, k))
    assert e_h.memory.optimizer == pytest.approx(8 * e_f.memory.optimizer, rel=0.01)
    a = assumptions_for(hsdp)
    units = unit_elements(hsdp, 0)
    th, t8 = unit_times(hsdp, a, units), unit_times(eight, a, units)
    assert th["gather"] == t8["gather"]  # gathers inside the node's shard group
    assert all(h > e for h, e in zip(th["reduce"], t8["reduce"]))  # + the all-reduce across the 8 replicas


def test_hsdp_refusals_name_what_works():
    with pytest.raises(ConfigError, match=r"values that work: \[1, 2, 4\]"):
        validate(compose("tracking=off", "parallel.dp=4", "parallel.zero_stage=3", "parallel.zero_shard_size=3"),
                 local_devices=4)
    with pytest.raises(ConfigError, match="parallel.zero_stage=1, 2 or 3"):
        validate(compose("tracking=off", "parallel.dp=4", "parallel.zero_stage=0", "parallel.zero_shard_size=2"),
                 local_devices=4)


def test_shard_groups_that_split_an_expert_group_are_refused_with_sizes_that_work():
    """mixtral_8x7b at dp16 tp4 ep8 on 64 H100: a shard group of 4 dp ranks (16 ranks) holds half of one expert's
    ep x etp = 32 ranks; the estimate priced its experts 'sharded over 1 expert-dp rank' (Megatron-Core and
    torchtitan refuse such groups); 8 and 16 hold whole expert groups."""
    est = ("tracking=off", "run.mode=estimate", "model=mixtral_8x7b", "hardware=h100_80gb_64gpu", "train=cluster",
           "framework=torchtitan", "parallel.dp=16", "parallel.tp=4", "parallel.ep=8",
           "parallel.sequence_parallel=true", "parallel.zero_stage=3")
    with pytest.raises(ConfigError, match=r"unevenly.*= 16 ranks.*= 32; values that work: \[8, 16\]"):
        validate(compose(*est, "parallel.zero_shard_size=4"), local_devices=2)
    assert validate(compose(*est, "parallel.zero_shard_size=8"), local_devices=2).layout.dp == 16
