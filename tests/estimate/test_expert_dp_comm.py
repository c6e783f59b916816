"""The routed experts' gradients reduced over the expert-dp ranks, not over dp (issue 43): the bytes of
moe_tiny dp2 ep2 equal its executed run's, the dp time of an ep layout prices its experts over the
smaller group (on the links its ranks have), and a dense model's figures do not move."""
import pytest

from tests.conftest import spec_for
from xpar.estimate.comm import dp as dp_comm
from xpar.estimate.comm.dp import unit_elements, unit_expert_elements, unit_times
from xpar.estimate.cost import assumptions_for, estimate
from xpar.estimate.memory.model_states import expert_dp_size, param_numel
from xpar.run.estimate_mode import comm_metrics

DENSE_BYTES = 615_680
"""The executed moe_tiny dp2 ep2 run's comm/dp_allreduce_bytes per step and device (601.25 KiB: DDP's
buckets, the experts left to xpar.parallel.expert.reduce_expert_grads, which at expert-dp 1 issues nothing)."""
EXPERT_BYTES = 3 * 2 * 3 * 64 * 64 * 4
"""moe_tiny's routed experts on an ep 2 rank: 3 MoE blocks x 2 of 4 experts x 3 matrices 64 x 64, fp32."""


def tiny(dp: int, *overrides: str):
    return spec_for("model=moe_tiny", "run.mode=estimate", f"parallel.dp={dp}", *overrides, local_devices=dp)


def test_moe_tiny_dp2_ep2_estimates_the_executed_dp_bytes():
    """dp2 ep2: the dense parameters all-reduced over dp (the measured 601.25 KiB), the experts not at all
    (expert-dp 1); before, all 889.25 KiB of the rank's parameters were priced over dp."""
    spec = tiny(2, "parallel.ep=2")
    m = comm_metrics(spec, estimate(spec).comm_bytes)
    assert expert_dp_size(spec) == 1 and param_numel(spec, 0) * 4 == DENSE_BYTES + EXPERT_BYTES
    assert m["comm/dp_allreduce_bytes"] == DENSE_BYTES
    assert not any(k.startswith("comm/edp_") for k in m)


@pytest.mark.parametrize("zero,key", [(0, "allreduce"), (2, "reduce_scatter")])
def test_dp4_ep2_reduces_the_experts_over_two_ranks(zero, key):
    """dp4 ep2 (expert-dp 2): the dense bytes over dp 4 as without ep, the experts' over their 2 ranks
    (``comm/edp_*``, payload = the experts' bytes)."""
    spec = tiny(4, "parallel.ep=2", f"parallel.zero_stage={zero}")
    m = comm_metrics(spec, estimate(spec).comm_bytes)
    assert expert_dp_size(spec) == 2
    assert m[f"comm/dp_{key}_bytes"] == DENSE_BYTES and m[f"comm/edp_{key}_bytes"] == EXPERT_BYTES


def mixtral(pp: int, ep: int):
    return spec_for("model=mixtral_8x7b", "hardware=h100_80gb_64gpu", "train=cluster", "run.mode=estimate",
                    "train.seq_len=4096", f"parallel.pp={pp}", "parallel.micro_batches=8", "parallel.recompute=full",
                    "parallel.zero_stage=1", "framework=megatron_core", f"parallel.ep={ep}")


def _as_before(monkeypatch):
    """The old pricing: every parameter over dp (the experts given no group of their own)."""
    monkeypatch.setattr(dp_comm, "expert_dp_size", lambda spec: spec.dp)


def _reduce_and_estimate(spec):
    assume = assumptions_for(spec)
    times = unit_times(spec, assume, unit_elements(spec, 1), None, unit_expert_elements(spec, 1))
    return sum(times["reduce"]), estimate(spec)


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_an_ep_layouts_dp_time_drops_where_expert_dp_is_smaller_in_the_node(monkeypatch, ep):
    """Mixtral pp8 dp8 (one node): the experts (most of a rank's elements) reduce over dp / ep ranks inside
    the node, not 8; the experts' reduction, the issued dp time and the step drop."""
    spec = mixtral(8, ep)
    assert sum(unit_expert_elements(spec, 1)) > 0.8 * sum(unit_elements(spec, 1))
    new, after = _reduce_and_estimate(spec)
    _as_before(monkeypatch)
    old, before = _reduce_and_estimate(spec)
    assert new < 0.85 * old
    assert after.comm_time["dp"] < before.comm_time["dp"] and after.time_per_step_s < before.time_per_step_s


def test_expert_dp_across_nodes_is_priced_on_its_ranks_nics(monkeypatch):
    """Mixtral pp4 dp16 (two nodes) at ep 8: expert-dp is 2 ranks, one per node (8 apart), each group
    crossing on its one rank's NIC while a dp group of 8 per node crosses on 8: the experts' reduction
    costs more than the old pricing over dp said, as its ranks' bytes cross through one NIC."""
    spec = mixtral(4, 8)
    new, after = _reduce_and_estimate(spec)
    _as_before(monkeypatch)
    old, before = _reduce_and_estimate(spec)
    assert new > 2 * old and after.comm_time["dp"] > before.comm_time["dp"]


def test_a_dense_models_figures_do_not_move(monkeypatch):
    """A dense model has no experts: its estimate is the same whatever the experts' group."""
    spec = spec_for("model=70b", "hardware=h100_80gb_64gpu", "train=cluster", "run.mode=estimate",
                    "parallel.pp=4", "parallel.tp=8", "parallel.micro_batches=8", "parallel.zero_stage=1",
                    "parallel.recompute=full")
    after = estimate(spec)
    _as_before(monkeypatch)
    before = estimate(spec)
    assert after.time_per_step_s == before.time_per_step_s and after.comm_bytes == before.comm_bytes
    assert not any(k.startswith("edp_") for k in after.comm_bytes)
