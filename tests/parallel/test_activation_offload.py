"""Activation offload executed (parallel.activation_offload_layers, xpar.parallel.offload: torch's save_on_cpu on the
first N blocks): the same loss and gradients as without it, the offloaded blocks' activations off the device by
the estimate's bytes a block, equal to the single-process reference on gloo workers under dp, ZeRO-3 (FSDP2) and
tp, and the combinations xpar does not run refused in one line."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import spawn, spec_for
from tests.parallel.test_hsdp import _train as hsdp_train
from xpar.config.checks import ConfigError
from xpar.estimate.cost import assumptions_for, estimate, peak_memory
from xpar.estimate.memory.activation_host import block_bytes_of
from xpar.estimate.memory.model_states import MemoryOptions

STEPS = ("train.steps=2", "train.warmup_steps=0")


def _one_pass(n: int) -> tuple:
    """The tiny model's loss, gradients and measured peak of saved activations (bytes) with ``n`` blocks offloaded."""
    from xpar.models.transformer import Transformer
    from xpar.parallel.factory import cross_entropy
    from xpar.parallel.memory_accounting import ActivationTracker
    from xpar.parallel.offload import apply_activation_offload

    model = Transformer(spec_for("parallel.dp=1", local_devices=1).model)
    model.init_weights(0)
    apply_activation_offload(model, n, "cpu")
    rows = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(1))
    with ActivationTracker(model.parameters()) as tracker:
        loss = cross_entropy(model(rows[:, :-1]), rows[:, 1:])
    loss.backward()
    return float(loss.detach()), [p.grad for p in model.parameters()], tracker.peak


def test_offloaded_blocks_compute_the_same_and_leave_the_estimates_bytes():
    """Loss and every gradient bit-equal; each offloaded block takes what the estimate says a block keeps (xpar's
    save_on_cpu: L - N blocks held, none in flight) off the measured activations, to 2 %."""
    loss0, grads0, peak0 = _one_pass(0)
    for n in (1, 3):
        loss, grads, peak = _one_pass(n)
        assert loss == loss0 and all(torch.equal(a, b) for a, b in zip(grads, grads0))
        spec = spec_for("parallel.dp=1", "train.micro_batch_size=4", f"parallel.activation_offload_layers={n}",
                        local_devices=1)
        block = block_bytes_of(spec, MemoryOptions.of(assumptions_for(spec)))
        assert (peak0 - peak) / n == pytest.approx(block, rel=0.02)
        plain = spec_for("parallel.dp=1", "train.micro_batch_size=4", local_devices=1)
        assert peak_memory(plain).activations - peak_memory(spec).activations == pytest.approx(n * block, rel=1e-9)


def test_on_a_cpu_the_copies_cost_nothing_and_the_note_says_why():
    spec = spec_for("parallel.dp=2", "parallel.activation_offload_layers=2", local_devices=2)
    est = estimate(spec)
    assert est.time_breakdown["act_offload"] == 0.0
    assert any("save_on_cpu" in n and "the copies cost 0 s" in n and "2 blocks' activations held" in n
               for n in est.notes)


def test_save_on_cpu_copies_are_exposed_where_the_device_has_a_host_link():
    """Under xpar's profile (save_on_cpu: copies on the compute stream) every copy shows: 2 N block / link per
    micro-batch; Megatron-Core's hides them behind the blocks' compute."""
    cluster = ("model=7b", "hardware=h100_80gb_8gpu", "hardware.device_memory_gb=400", "parallel.dp=8", "parallel.zero_stage=1", "run.mode=estimate",
               "train.micro_batch_size=1", "train.global_batch_size=64", "parallel.activation_offload_layers=4")
    spec = spec_for(*cluster, local_devices=8)
    block = block_bytes_of(spec, MemoryOptions.of(assumptions_for(spec)))
    est = estimate(spec)
    per_mb = 2 * 4 * block / (spec.hardware.pcie_gb_per_s * 1e9)
    assert est.time_breakdown["act_offload"] == pytest.approx(spec.micro_batches * per_mb, rel=1e-9)
    core = estimate(spec_for(*cluster, "framework=megatron_core", local_devices=8))
    assert core.time_breakdown["act_offload"] < est.time_breakdown["act_offload"]


@pytest.mark.parametrize("extra, says", [
    (("parallel.pp=2", "parallel.dp=1", "parallel.micro_batches=2"), "needs parallel.pp=1"),
    (("parallel.recompute=full",), "needs parallel.recompute=none"),
    (("parallel.activation_offload_layers=4",), "fewer blocks than the model has (0 <= N < 4)"),
])
def test_execute_mode_refuses_what_it_does_not_run_in_one_line(extra, says):
    with pytest.raises(ConfigError) as e:
        spec_for("parallel.dp=2", "parallel.activation_offload_layers=2", *extra, local_devices=2)
    assert says in str(e.value) and len(e.value.problems) == 1


_train = hsdp_train  # worker: every rank's (losses, grad_norms, memory) per spec


@pytest.mark.slow
def test_offload_on_2_workers_equals_the_reference_under_dp_zero3_and_tp():
    from xpar.run.reference import reference_run

    layouts = (("parallel.dp=2",), ("parallel.dp=2", "parallel.zero_stage=3"),
               ("parallel.dp=1", "parallel.tp=2", "parallel.sequence_parallel=true"))
    specs = [spec_for(*lay, *STEPS, "parallel.activation_offload_layers=3", local_devices=2) for lay in layouts]
    results = spawn(_train, 2, [s.to_dict() for s in specs])
    for spec, per_rank in zip(specs, results):
        ref = reference_run(spec)  # the single process, no offload
        mean = [sum(r[0][i] for r in per_rank) / len(per_rank) for i in range(len(ref["losses"]))]  # each rank: its data
        assert mean == pytest.approx(ref["losses"], rel=1e-4)
        for _, norms, _ in per_rank:  # the pre-clip global gradient norm, on every rank
            assert norms == pytest.approx(ref["grad_norms"], rel=1e-4)
