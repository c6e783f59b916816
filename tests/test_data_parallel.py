"""DDP and ZeRO-1/2/3 against a single-process reference, and the memory ZeRO promises."""
import pytest

from tests.helpers import reference_losses, run_specs, spawn, spec_for

LAYOUTS = ["dp", "zero1", "zero2", "zero3"]


@pytest.fixture(scope="module")
def results():
    specs = [spec_for(f"parallel={p}", "train.steps=5", "train.warmup_steps=1", "parallel.micro_batches=2")
             for p in LAYOUTS]
    out = spawn(run_specs, 2, [s.to_dict() for s in specs])
    return specs, dict(zip(LAYOUTS, out))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_losses_match_single_process(results, layout):
    specs, out = results
    spec = specs[LAYOUTS.index(layout)]
    assert spec.dp == 2 and spec.micro_batches == 2 and spec.global_batch == 16
    ref = reference_losses(spec)
    per_rank = out[layout][0]
    for step in range(5):  # global loss = mean over the dp replicas' micro-batch means
        got = sum(r[step] for r in per_rank) / len(per_rank)
        assert got == pytest.approx(ref[step], rel=1e-4), (layout, step, got, ref[step])
    assert ref[-1] < ref[0]  # it trains


def test_zero_shards_what_each_stage_promises(results):
    _, out = results
    mem = {k: out[k][1][0] for k in LAYOUTS}  # rank 0
    ddp = mem["dp"]
    assert ddp["optimizer"] == 2 * ddp["params"]  # AdamW: exp_avg + exp_avg_sq, fp32
    # ZeRO-1: optimizer states ~1/dp (ZeroRedundancyOptimizer partitions whole parameters)
    assert mem["zero1"]["optimizer"] == pytest.approx(ddp["optimizer"] / 2, rel=0.1)
    assert mem["zero1"]["grads"] == ddp["grads"] and mem["zero1"]["params"] == ddp["params"]
    # ZeRO-2: gradients too (FSDP2 shards dim 0; tiny's dims are even so exactly 1/2)
    assert mem["zero2"]["grads"] == ddp["grads"] / 2
    assert mem["zero2"]["optimizer"] == ddp["optimizer"] / 2
    assert mem["zero2"]["params"] == ddp["params"]
    # ZeRO-3: parameters too
    assert mem["zero3"]["params"] == ddp["params"] / 2
    assert mem["zero3"]["grads"] == ddp["grads"] / 2
    for k in LAYOUTS:
        assert mem[k]["activations"] > 0
