"""Time side of the cost model: the Megatron 2021 calibration bound, the schedule simulator
against the closed forms, communication volumes. Pure CPU, no process groups."""
from __future__ import annotations

import math
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from xpar.calibrate import published as calibration
from xpar.calibrate.published import make_spec, preset
from xpar.estimate import cost
from xpar.estimate.comm import collectives as col
from xpar.estimate.comm import overlap as ov
from xpar.estimate.comm import volume as comm
from xpar.estimate import schedule as sch
from xpar.estimate.cost import Assumptions, estimate, with_hardware
from xpar.config.remat import extra_forward_flops_per_layer
from xpar.estimate.compute.flops import forward_flops_per_token
from xpar.estimate.memory.model_states import param_shapes

DATA = Path(__file__).parents[1] / "data"
H100_FIT = 0.769
"""The H100 sustained_efficiency the dense H100 sources fit (NeMo and Llama 3; benchmarks/estimate_calibration.py)
since the attention core's rate by key length (framework.attention_kernel; 0.765 after issue 44's Megatron-Core
bucket rule and head unit, before it); the shipped preset (0.771) is the fit before both."""


@pytest.fixture(scope="module")
def megatron():
    return calibration.megatron_errors(calibration.read_table(DATA / "megatron_2021_table1.csv"))


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_megatron_table1_each_row_within_12_percent(megatron):
    """Every Table 1 row within 12 % under the kernel model (issue 42; within 10 % under FLOPs over one
    matmul efficiency, max 7.5 %): the worst are 7.5B (tp 4) and 18.4B (tp 8) without pipelining, 11.3 %
    and 11.0 % under, their blocking tp all-reduces 11-18 % of the estimated step."""
    bad = [(r["params_b"], round(100 * e, 1)) for r, _, e in megatron if abs(e) > 0.12]
    assert not bad, f"rows off by more than 12% (params_b, % error): {bad}"


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_megatron_table1_median_error_at_most_6_percent(megatron):
    assert len(megatron) == 10
    assert statistics.median(abs(e) for *_, e in megatron) <= 0.06


def spec(model="7b", hardware="a100_80gb_64gpu", train=None, **parallel):
    par = dict(name="t", dp="auto", tp=1, pp=1, zero_stage=0, micro_batches=1, schedule="1f1b")
    par.update(parallel)
    tr = dict(micro_batch_size=1, global_batch_size="auto", dtype="bf16")
    tr.update(train or {})
    return make_spec(preset("model", model), par, preset("hardware", hardware), tr)


# --- schedule simulator ----------------------------------------------------------------------

@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8), (8, 3), (8, 32)])
def test_simulated_bubble_equals_theory_gpipe_1f1b(p, m):
    for name, acts in (("gpipe", sch.gpipe_actions(p, m)), ("1f1b", sch.one_f_one_b_actions(p, m))):
        res = sch.simulate(acts, {"F": 1.0, "B": 2.0})
        assert res.bubble_ratio == pytest.approx(sch.closed_form_bubble(name, p, m), abs=1e-12)
        assert res.makespan == pytest.approx(3.0 * (m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 1)])
def test_pipeline_time_of_uneven_stages_is_the_simulated_makespan(p, m):
    """The cost model's pipeline, m x the slowest stage + beta / (1 - beta) x m x the others'
    mean (xpar.estimate.cost.step_time, fill_time), is the makespan of the replayed GPipe and 1F1B
    orders with one stage slower than the rest (GPT-2 small's last stage holds the LM head); the
    mean over all stages would overstate it."""
    from xpar.estimate.cost import fill_time, step_time

    per_stage = [1.0 + 0.25 * r for r in range(p - 1)] + [2.5]  # F + B seconds per micro-batch
    def seconds(a):
        return per_stage[a.stage] * (1 / 3 if a.kind == "F" else 2 / 3)
    slow = {"matmul": max(per_stage), "memory_bound": 0.0, "tp_comm": 0.0, "pp_comm": 0.0, "dp_comm": 0.0,
            "host": 0.0, "host_step": 0.0, "dp_end": 0.0}
    for name, acts in (("gpipe", sch.gpipe_actions(p, m)), ("1f1b", sch.one_f_one_b_actions(p, m))):
        beta = sch.closed_form_bubble(name, p, m)
        got, _ = step_time(slow, m, beta, fill_time(sum(per_stage), max(per_stage), p), 0.0)
        assert got == pytest.approx(sch.simulate(acts, seconds).makespan)
        mean_over_all, _ = step_time(slow, m, beta, sum(per_stage) / p, 0.0)
        assert mean_over_all > got * 1.02


@pytest.mark.parametrize("per_stage", [[2.5, 1.0, 1.0, 1.0], [1.0, 2.5, 1.0, 1.5], [1.0, 1.0, 2.0, 1.2]])
def test_pipeline_time_of_a_slow_stage_elsewhere_is_an_upper_bound(per_stage):
    """With the slowest stage not last, GPipe's makespan is still (m - 1) max + sum (the
    estimate), 1F1B's is at most that: the cost model never estimates such a pipeline short."""
    from xpar.estimate.cost import fill_time, step_time

    p, m = len(per_stage), 4
    def seconds(a):
        return per_stage[a.stage] * (1 / 3 if a.kind == "F" else 2 / 3)
    slow = {"matmul": max(per_stage), "memory_bound": 0.0, "tp_comm": 0.0, "pp_comm": 0.0, "dp_comm": 0.0,
            "host": 0.0, "host_step": 0.0, "dp_end": 0.0}
    for name, acts in (("gpipe", sch.gpipe_actions(p, m)), ("1f1b", sch.one_f_one_b_actions(p, m))):
        got, _ = step_time(slow, m, sch.closed_form_bubble(name, p, m), fill_time(sum(per_stage), max(per_stage), p), 0.0)
        makespan = sch.simulate(acts, seconds).makespan
        assert got == pytest.approx(makespan) if name == "gpipe" else got >= makespan - 1e-9


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 4)])
def test_torch_orders_replay_to_theory(p, m, v):
    assert sch.simulate(sch.torch_actions("1f1b", p, m)).bubble_ratio == pytest.approx(sch.closed_form_bubble("1f1b", p, m))
    got = sch.simulated_bubble("interleaved_1f1b", p, m, v)
    assert got == pytest.approx(sch.closed_form_bubble("interleaved_1f1b", p, m, v))


def test_torch_1f1b_last_rank_labels_fixed():
    last = sch.torch_actions("1f1b", 4, 8)[3]
    assert [str(a) for a in last[:4]] == ["3F0", "3B0", "3F1", "3B1"]


def test_zero_bubble_beats_1f1b_and_simulator_times():
    assert sch.simulated_bubble("zero_bubble", 4, 8, 2) < sch.closed_form_bubble("interleaved_1f1b", 4, 8, 2)
    assert sch.simulated_bubble("zbv", 4, 8, 2) < sch.closed_form_bubble("1f1b", 4, 8)
    res = sch.simulate(sch.one_f_one_b_actions(2, 2), {"F": 1.0, "B": 2.0})
    A = sch.Action
    assert res.times[A("F", 1, 0)] == (1.0, 2.0) and res.times[A("B", 0, 0)] == (4.0, 6.0)
    assert res.makespan == 9.0 and res.busy == [6.0, 6.0]


def test_simulator_rejects_a_deadlocking_order():
    A = sch.Action
    with pytest.raises(ValueError, match="deadlock"):
        sch.simulate([[A("B", 0, 0), A("F", 0, 0)], [A("F", 1, 0), A("B", 1, 0)]])


# --- communication ---------------------------------------------------------------------------

def test_tp_layer_is_two_allreduces_forward_two_backward():
    b, s, h, t, e = 2, 1024, 4096, 8, 2
    one = 2 * (t - 1) / t * b * s * h * e
    assert comm.tp_layer_bytes(b, s, h, t, e) == {"tp_allreduce": 4 * one, "tp_allgather": 0.0, "tp_reduce_scatter": 0.0}
    sp = comm.tp_layer_bytes(b, s, h, t, e, sp=True)
    assert sp["tp_allgather"] == sp["tp_reduce_scatter"] == 2 * one and sp["tp_allreduce"] == 0
    assert comm.tp_layer_bytes(b, s, h, t, e, recompute="full")["tp_allreduce"] == 6 * one


def test_dp_comm_bytes_ddp_zero2_zero3():
    from xpar.estimate.memory.model_states import root_elements
    ddp = comm.comm_bytes(spec(zero_stage=0))
    psi = sum(math.prod(sh) for _, sh in param_shapes(spec(), 0)) * 2  # bf16 gradients
    n = 64
    assert ddp["dp_allreduce"] == pytest.approx(2 * (n - 1) / n * psi)
    z2, z3 = comm.comm_bytes(spec(zero_stage=2)), comm.comm_bytes(spec(zero_stage=3))
    assert sum(z2.values()) == pytest.approx(sum(ddp.values()))
    # ZeRO paper: 1.5 x DP, less the root's backward gather (FSDP keeps the root from forward to backward)
    root = comm.allgather_bytes(root_elements(spec(), 0) * 2, n)
    assert sum(z3.values()) == pytest.approx(1.5 * sum(ddp.values()) - root)


def test_logged_dp_bytes_are_the_bytes_the_estimate_times():
    """bf16 training under xpar's recipe reduces fp32 gradients (framework.grad_reduce_bytes 4):
    the estimate's logged comm bytes count 4 bytes per gradient element, as its timing does
    (they counted the training dtype's 2 while the time used 4)."""
    for z, key in ((0, "dp_allreduce"), (3, "dp_reduce_scatter")):
        s = spec(zero_stage=z)
        assert s.train.dtype == "bf16"
        assert estimate(s).comm_bytes[key] == pytest.approx(2 * comm.comm_bytes(s)[key])
        assert estimate(s, Assumptions.megatron_2021()).comm_bytes[key] == pytest.approx(comm.comm_bytes(s)[key])


def test_pp_and_tp_comm_of_a_3d_layout():
    s = spec(tp=8, pp=2, micro_batches=4, schedule="1f1b")
    c0, c1 = comm.comm_bytes(s, 0), comm.comm_bytes(s, 1)
    bsh = 1 * 4096 * 4096 * 2
    assert c0["pp_send_recv"] == c1["pp_send_recv"] == 4 * bsh  # one direction each, m = 4
    layers = 16 * 4 * 4 + 4  # 16 layers x 4 all-reduces x m, + embedding all-reduce per micro-batch
    assert c0["tp_allreduce"] == pytest.approx(layers * 2 * 7 / 8 * bsh)


# --- the estimate ------------------------------------------------------------------------------

def test_estimate_is_consistent():
    s = spec(tp=2, pp=2, zero_stage=2, micro_batches=8, schedule="1f1b", recompute="full")
    e = estimate(s)
    assert sum(e.time_breakdown.values()) == pytest.approx(e.time_per_step_s)
    assert e.tokens_per_s == pytest.approx(s.tokens_per_step / e.time_per_step_s)
    assert e.mfu == pytest.approx(e.tflops_per_device / 312)
    assert e.hfu > e.mfu and e.hfu == pytest.approx(e.mfu * 4 / 3, rel=0.05)
    assert e.bubble_ratio == pytest.approx(1 / 9)
    assert set(comm.KEYS) == set(e.comm_bytes)


def test_estimate_responds_to_layout():
    few, many = estimate(spec(pp=4, micro_batches=4)), estimate(spec(pp=4, micro_batches=32))
    assert many.bubble_ratio < few.bubble_ratio and many.mfu > few.mfu
    inside = estimate(spec("175b", tp=8, pp=8, micro_batches=8))
    across = estimate(spec("175b", tp=16, pp=4, micro_batches=8))
    assert across.time_breakdown["tp_comm"] > 1.5 * inside.time_breakdown["tp_comm"]  # tp spans nodes
    slow_link = estimate(with_hardware(spec(tp=8), link_efficiency=0.4))
    assert slow_link.time_per_step_s > estimate(spec(tp=8)).time_per_step_s
    assert cost.matmul_efficiency(spec().hardware, 4096) > cost.matmul_efficiency(spec().hardware, 128)


def test_overlapped_gradient_reduction_exposes_less_than_after_the_flush():
    s = spec(zero_stage=0, micro_batches=4)
    after = estimate(s, replace(Assumptions(), dp_overlap=False)).time_breakdown["dp_comm_exposed"]
    assert estimate(s).time_breakdown["dp_comm_exposed"] < 0.5 * after
    mega = estimate(s, Assumptions.megatron_2021()).time_breakdown
    assert mega["memory_bound"] > estimate(s).time_breakdown["memory_bound"]  # unfused softmax, dropout


# --- collectives (alpha-beta with topology) and unit-by-unit overlap ---------------------------

def test_ring_latency_counts_steps_and_node_crossings():
    hw = spec().hardware  # 8 nodes x 8
    g = col.group_of(hw, 64, 1)
    assert (g.size, g.per_node, g.nodes) == (64, 8, 8)
    lat = col.ring_time(hw, "allgather", 1.0, g) - 1.0 * 63 / 64 / (8 * 25e9 * 0.8)
    assert lat == pytest.approx((8.4 + 56 * 3.4 + 7 * 9.6) * 1e-6)
    # tp inside a node: NVLink bandwidth; dp stride 8 across nodes: one member per node, one NIC
    big = 1e9
    assert col.ring_time(hw, "allreduce", big, col.group_of(hw, 8, 1)) < col.ring_time(hw, "allreduce", big,
                                                                                       col.group_of(hw, 8, 8))
    assert col.group_of(hw, 8, 8).per_node == 1


def test_cross_node_ring_bandwidth_is_the_nodes_nics_as_nccl_tests_measure_it():
    """Published nccl-tests all-reduce bus bandwidths on A100 nodes with 4 x 200 Gb/s NICs for 8
    GPUs (tests/data/nccl_tests_busbw.csv): 86-96 GB/s across 2-3 nodes, 233 GB/s in one. The
    alpha-beta model's ring (bus bandwidth min(NVLink, members per node x NIC share x NIC) x
    link_efficiency, NCCL's latencies) is within 25 % of each: 3 % above in one node, 7-21 %
    below across nodes (21 % at 128 MiB over 24 ranks, ring latency included: link_efficiency 0.8
    is conservative there). One NIC per GPU (the node's NICs split over its 8 GPUs, 12.5 GB/s:
    the reading that makes ZeRO-3 over 1024 A100s slow) would be 7x too slow."""
    from xpar.calibrate.published import read_table
    hw0 = spec().hardware
    for row in read_table(DATA / "nccl_tests_busbw.csv"):
        nodes, k, size = int(row["nodes"]), int(row["gpus_per_node"]), float(row["bytes"])
        hw = replace(hw0, devices_per_node=k, nodes=nodes, nics_per_node=int(row["nics"]),
                     inter_node_gb_per_s=int(row["nic_gbit"]) / 8)
        n = nodes * k
        t = col.collective_time(hw, "allreduce", size, col.group_of(hw, n, 1), "ring")
        busbw = 2 * (n - 1) / n * size / t / 1e9
        published = float(row["busbw_gb_s"])
        assert 0.75 * published < busbw < 1.05 * published, (row["url"], busbw, published)
        if nodes > 1:
            one_nic_per_gpu = int(row["nics"]) * int(row["nic_gbit"]) / 8 / k * hw.link_efficiency
            assert published > 7 * one_nic_per_gpu, (published, one_nic_per_gpu)


def test_torch_zero1_syncs_parameters_by_broadcast_after_the_step():
    """torch's ZeroRedundancyOptimizer syncs the updated parameters by broadcasts from their
    owners (one per tensor, async, waited together: measured 39 per step on the tiny model), not
    all-gathers: per unit the broadcast of its bytes (the volume of a broadcast, one latency);
    Megatron's distributed optimizer keeps its all-gather."""
    from xpar.estimate.comm import dp as dpm
    s = spec(zero_stage=1)
    units = dpm.unit_elements(s, 0)
    g = col.group_of(s.hardware, s.dp, s.tp)
    torch_zero1 = dpm.unit_times(s, Assumptions(), units)["gather"]
    assert torch_zero1[1] == pytest.approx(col.collective_time(s.hardware, "broadcast", units[1] * 2, g))
    megatron = dpm.unit_times(s, replace(Assumptions(), zero1="distributed_optimizer"), units)["gather"]
    assert megatron[1] == pytest.approx(col.collective_time(s.hardware, "allgather", units[1] * 2, g))
    assert torch_zero1[1] > megatron[1]  # a broadcast moves every byte to every rank: (n-1)/n less for a ring gather


def test_zero3_under_pp_gathers_each_forward_and_the_first_backward():
    """Under pp torch keeps a ZeRO-3 stage's parameters unsharded after each backward but the
    last (counted in a real run: tests/parallel/test_pipeline.py), so per step the units are gathered
    before each of the m forwards and once before the backward: the backward's gathers are
    issued once and exposed once (``first_backward``), not every micro-batch as without pp."""
    from xpar.estimate.comm.dp import dp_exposure
    a, gather, red = Assumptions(), [1.0, 1.0, 1.0], [2.0, 2.0, 2.0]
    idle = [0.0, 0.0, 0.0]  # no compute to hide behind: every collective exposed
    pp2, pp1 = (dp_exposure(3, p, a, idle, idle, gather, red) for p in (2, 1))
    assert pp2["issued_per_microbatch"] == 3.0 and pp2["issued_once"] == 6.0 + 3.0
    assert pp2["first_backward"] == pytest.approx(3.0) and pp2["per_microbatch"] == pytest.approx(3.0)
    # without pp: every unit gathered for its forward, the blocks (not the root, kept) for their backward
    assert pp1["issued_per_microbatch"] == 3.0 + 2.0 + 6.0 and pp1["first_backward"] == 0.0


def test_groups_of_a_node_share_its_nics():
    """The dp rings of the 8 tp ranks of a node cross nodes at once: with one NIC per node each
    gets an eighth of it (the same time as 8 NICs of 1/8 the bandwidth); a group holding the whole
    node gets the NICs there are (4 x 100 Gb/s: 4 NICs' worth, as before); pipeline sends too."""
    hw = spec().hardware
    one_nic = replace(hw, nics_per_node=1)
    eighth = replace(hw, nics_per_node=8, inter_node_gb_per_s=hw.inter_node_gb_per_s / 8)
    dp = col.group_of(hw, 8, 8)  # one member per node
    for kind in ("allreduce", "allgather", "reduce_scatter"):
        assert col.collective_time(one_nic, kind, 1e9, dp, "ring") == pytest.approx(
            col.collective_time(eighth, kind, 1e9, dp, "ring"))
        assert col.collective_time(one_nic, kind, 1e9, dp, "ring") > 7 * col.collective_time(hw, kind, 1e9, dp, "ring")
    whole = col.group_of(hw, 64, 1)  # all 8 devices of each node in one ring
    four = replace(hw, nics_per_node=4)
    assert col.ring_time(four, "allgather", 1e9, whole) == pytest.approx(
        col.ring_time(replace(hw, inter_node_gb_per_s=hw.inter_node_gb_per_s / 2), "allgather", 1e9, whole))
    assert col.p2p_time(one_nic, 1e8, True) == pytest.approx(col.p2p_time(eighth, 1e8, True))


def test_tree_wins_small_allreduce_at_scale_and_hierarchical_cuts_latency():
    hw = spec("7b", "a100_80gb_1024gpu").hardware
    g = col.group_of(hw, 1024, 1)
    small, large = 1e6, 4e9
    assert col.collective_time(hw, "allreduce", small, g, "tree") < col.collective_time(hw, "allreduce", small, g, "ring")
    assert col.collective_time(hw, "allreduce", large, g, "ring") < col.collective_time(hw, "allreduce", large, g, "tree")
    assert col.collective_time(hw, "allreduce", small, g) == min(
        col.collective_time(hw, "allreduce", small, g, a) for a in ("ring", "tree"))
    # two levels: 7 + 127 steps instead of 1023 -> far less latency on a small all-gather
    assert col.collective_time(hw, "allgather", small, g, "hierarchical") < 0.3 * col.ring_time(hw, "allgather", small, g)
    with pytest.raises(ValueError, match="unknown collective algorithm"):
        col.collective_time(hw, "allgather", small, g, "butterfly")


def test_prefetch_hides_the_next_units_gather_behind_this_units_compute():
    # 4 units of 1 s compute, 0.5 s gathers: only the first gather is exposed
    assert ov.simulate_pass([1.0] * 4, [0.5] * 4).exposed == pytest.approx(0.5)
    # without prefetch every gather waits for the previous unit
    assert ov.simulate_pass([1.0] * 4, [0.5] * 4, prefetch=False).exposed == pytest.approx(2.0)
    # gathers longer than compute: the link is the bottleneck, makespan 4 x 2 s of gathers + the
    # last unit's 1 s, of which 4 s compute
    assert ov.simulate_pass([1.0] * 4, [2.0] * 4).exposed == pytest.approx(5.0)
    # reductions hide behind the units after them, the last one is exposed
    assert ov.simulate_pass([1.0] * 4, None, [0.5] * 4).exposed == pytest.approx(0.5)
    # compute slowed while hidden communication runs beside it
    assert ov.simulate_pass([1.0] * 4, [0.5] * 4, slowdown=0.2).exposed == pytest.approx(0.5 + 0.2 * 1.5)


def _zero3_175b(gpus: int):
    hw = preset("hardware", "a100_80gb_1024gpu")
    hw["nodes"] = gpus // 8
    par = dict(name="zero3", dp="auto", tp=1, pp=1, zero_stage=3, micro_batches=1, recompute="full")
    train = dict(micro_batch_size=1536 // gpus, global_batch_size=1536, dtype="bf16")
    return make_spec(preset("model", "175b"), par, hw, train)


def test_zero3_weak_scaling_loses_speed_to_exposed_dp_communication():
    """GPT-3 175B, ZeRO-3 without tp/pp, global batch 1536 on 384 -> 768 -> 1536 A100s
    (micro-batch 4 -> 2 -> 1, as Narayanan et al. 2021 Table 2): TFLOP/s per GPU falls, and at
    1536 exposed dp communication is the largest term after the matmuls and the cause of the
    loss (the rest scales with the per-device batch)."""
    est = {n: estimate(_zero3_175b(n)) for n in (384, 768, 1536)}
    tf = [est[n].tflops_per_device for n in (384, 768, 1536)]
    assert tf[0] > tf[1] > tf[2], tf
    top = est[1536].time_breakdown
    others = {k: v for k, v in top.items() if k not in ("matmul", "dp_comm_exposed")}
    assert top["dp_comm_exposed"] > 3 * max(others.values()), top
    # per unit of matmul time, the overhead grew by the dp term
    share = {n: {k: v / est[n].time_breakdown["matmul"] for k, v in est[n].time_breakdown.items()} for n in est}
    grown = {k: share[1536][k] - share[384][k] for k in share[384] if k != "matmul"}
    assert max(grown, key=grown.get) == "dp_comm_exposed" and grown["dp_comm_exposed"] > 0.8 * sum(
        v for v in grown.values() if v > 0)


def test_interleaved_theory_falls_back_to_the_action_list_when_m_below_pp():
    """(p-1)/(v*m+p-1) assumes the chunks interleave; with one micro-batch on pp=2 they run
    one after another and the bubble is 1/2, as torch's own action order shows."""
    from xpar.estimate.schedule import bubble_theory as theory
    assert theory("interleaved_1f1b", 2, 1, 2) == pytest.approx(0.5)
    assert theory("interleaved_1f1b", 2, 2, 2) == pytest.approx(1 / 5)


# --- calibration across public sources (leave-one-source-out) ----------------------------------

@pytest.fixture(scope="module")
def loso():
    cases = calibration.load_cases(DATA)
    return cases, calibration.leave_one_source_out(cases)


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_each_public_source_held_out_is_predicted_within_bounds(loso):
    """Fit the one constant per GPU family (hardware.sustained_efficiency under the kernel model,
    issue 42) on the other sources, predict this one: median |error| <= 8 % and max <= 13 % for every
    fitted source (measured: worst median 6.5 %, Llama 3's (NeMo's 6.4 %); worst max 11.1 %, Table 1's 7.5B row;
    benchmarks/estimate_calibration.py prints the tables); the constants fitted on all sources are
    those in the hardware presets (within 0.01: A100 0.81, H100 0.771)."""
    cases, res = loso
    assert set(res) == {"megatron_2021_table1", "torchtitan_fsdp2_a100", "llama3_2024_table4", "torchtitan_h100_2024",
                        "narayanan_2021_table2_ptdp", "narayanan_2021_table2_zero3", "llmfoundry_mpt_a100",
                        "llmfoundry_mpt_h100", "ibm_fms_fsdp_2024", "korthikanti_2022_table5", "dgxc_nemo_h100_bf16",
                        "smith_2022_mtnlg", "bigscience_bloom_2022"}
    for name, r in res.items():
        held = [abs(e) for e in r["held_out"]]
        if name in calibration.CHECK_ONLY:  # FSDP at scale, never fitted: their own tests below
            continue
        if name == "torchtitan_h100_2024":  # 500 W H100 of unknown peak: the A100 fit over-predicts it (+23, +26 %
            # since its SDPA attention runs at FlashAttention-2's rates, framework.attention_kernel sdpa; +34, +37 % before)
            assert min(r["held_out"]) > 0.2 and max(abs(e) for e in r["calibration"]) < 0.05, r
            continue
        assert statistics.median(held) <= 0.08 and max(held) <= 0.13, (name, r["held_out"])
    fitted = next(iter(res.values()))["fit_all"]
    assert fitted["A100"] == pytest.approx(preset("hardware", "a100_80gb_64gpu")["sustained_efficiency"], abs=0.01)
    assert fitted["H100"] == pytest.approx(preset("hardware", "h100_80gb_64gpu")["sustained_efficiency"], abs=0.01)


def test_tp_and_pp_overlap_hide_what_the_framework_overlaps():
    """tp_overlap (async TP, Megatron-Core tp-comm-overlap) and pp_overlap hide their share;
    the communication issued stays the same."""
    s = spec(tp=8, pp=2, micro_batches=8, schedule="1f1b", sequence_parallel=True)
    base, over = estimate(s), estimate(s, replace(Assumptions(), tp_overlap=0.8, pp_overlap=1.0))
    assert over.time_breakdown["tp_comm"] == pytest.approx(0.2 * base.time_breakdown["tp_comm"])
    # an overlapped send keeps its fixed part (latency) exposed (issue 44: the per-chunk cost of interleaving)
    assert 0 < over.time_breakdown["pp_comm"] < 0.1 * base.time_breakdown["pp_comm"]
    assert over.comm_time["tp"] == pytest.approx(base.comm_time["tp"]) and over.time_per_step_s < base.time_per_step_s


@pytest.mark.parametrize("sp, recompute, hidden_share", [(False, "full", 2 / 6), (True, "none", 2 / 8)])
def test_async_tp_backward_hides_the_column_linears_input_gradient_collectives(sp, recompute, hidden_share):
    """framework.tp_async_backward (Megatron-LM 2022 on): the input-gradient all-reduce of QKV and the MLP's
    first linear (reduce-scatter with sequence parallelism) runs behind their weight-gradient GEMMs. Per layer:
    without sp, 2 of the 6 all-reduces of a fully recomputed layer (2 forward, 2 rerun, 2 backward); with sp, 2
    reduce-scatters of the 8 collectives (2 all-gathers + 2 reduce-scatters each way), a reduce-scatter being
    half of an all-gather + reduce-scatter pair's time within a node (same bytes on the ring)."""
    s = spec(tp=8, sequence_parallel=sp, recompute=recompute)
    base, hidden = estimate(s), estimate(s, replace(Assumptions(), tp_async_backward=True))
    tp = cost.tp_times(s)
    assert tp["b_async"] == pytest.approx(hidden_share * (tp["f"] + tp["b"]), rel=0.02)
    assert hidden.comm_time["tp"] == pytest.approx(base.comm_time["tp"])
    assert base.time_breakdown["tp_comm"] - hidden.time_breakdown["tp_comm"] == pytest.approx(
        s.model.n_layers * tp["b_async"], rel=1e-6)


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_deepspeed_zero3_2021_falls_with_scale_as_published(loso):
    """Narayanan et al. 2021 Table 2, DeepSpeed ZeRO-3 without model parallelism at a fixed
    global batch: published 144 -> 88 -> 44 TFLOP/s per GPU (175B on 384/768/1536 A100s) and
    138 -> 98 -> 48 (530B on 640/1120/2240); never fitted. DeepSpeed of 2021
    (conf/framework/deepspeed_2021.yaml, xpar.estimate.frameworks.deepspeed_zero3, read in its v0.3.16 code)
    gathers each parameter tensor through torch's list API after a device synchronize (host ops per
    rank and tensor, not overlapped), keeps biases and norms whole but gathers them back after each
    step, gathers 8/12 of a block again for its backward under full recompute, and all-reduces the
    gradients (reduce_scatter at its default). Median |error| 13.0 % under the kernel model (issue 42;
    9.3 % under FLOPs over one matmul efficiency): worse because 26-78 % of these steps is DeepSpeed's
    communication and host ops, which the kernel model leaves as they were, while their large GEMMs
    are priced faster (0.81 x 0.869 = 0.70 of the peak against 0.667), so the optimistic 530B rows
    grow more so. Every 175B row within 10 % (+3.9, +9.9, -1.2 %), the 530B rows optimistic by 16-29 %
    (the largest at 2240 GPUs: what 530B adds is not found in the code), in the published order; at
    the largest scale the exposed dp communication is most of the step."""
    cases, res = loso
    rows = cases["narayanan_2021_table2_zero3"]
    errs = res["narayanan_2021_table2_zero3"]["held_out"]
    assert statistics.median(abs(e) for e in errs) <= 0.14, errs
    assert all(abs(e) <= 0.10 for e in errs[:3]) and all(0.15 < e < 0.30 for e in errs[3:]), errs
    for lo, hi in ((0, 3), (3, 6)):  # 175B, 530B
        published = [c[3] for c in rows[lo:hi]]
        predicted = [c[3] * (1 + e) for c, e in zip(rows[lo:hi], errs[lo:hi])]
        assert published == sorted(published, reverse=True) and predicted == sorted(predicted, reverse=True)
    _, spec, assume, _, _ = rows[2]
    est = estimate(spec, assume)
    assert est.time_breakdown["dp_comm_exposed"] > 0.6 * est.time_per_step_s, est.time_breakdown


def test_fp32_matmuls_run_at_the_fp32_peak_on_a_gpu_and_at_the_measured_one_on_a_cpu():
    """train.dtype=fp32 on an A100 runs its GEMMs on CUDA cores (19.5 TFLOP/s; torch uses no TF32
    for fp32 matmuls by default): under the kernel model (issue 42) every GEMM of a block, forward and
    backward, and the logits' GEMM take 312 / 19.5 = 16x bf16's time. The attention core stays priced
    as bf16 FlashAttention (xpar.estimate.compute.kernels.attention_time), so the step's matmul term grows by
    14.1x, not 16x (asserted: between 12x and 16x). Its element-wise kernels move 4-byte activations,
    twice bf16's traffic. Its MFU is a fraction of the fp32 peak. A CPU
    preset ('hardware=local', FLOPs over one efficiency) has one measured peak for both."""
    from tests.conftest import spec_for
    from xpar.estimate.compute.kernel_block import block_times, logits_times, shape_of
    from xpar.estimate.compute.kernel_costs import training_device
    gpu = {d: estimate(spec_for("model=7b", "hardware=a100_80gb_8gpu", "train=cluster", "parallel.zero_stage=3",
                                "run.mode=estimate", f"train.dtype={d}")) for d in ("bf16", "fp32")}
    s = spec_for("model=7b", "hardware=a100_80gb_8gpu", "train=cluster", "parallel.zero_stage=3", "run.mode=estimate")
    device, shape = training_device(s.hardware), shape_of(s.model)
    for backward in (False, True):
        b16, b32 = (block_times(shape, 2, 4096, device, dtype=d, backward=backward) for d in ("bf16", "fp32"))
        assert b32.gemm == pytest.approx(b16.gemm * 312 / 19.5)
        assert b32.memory == pytest.approx(2 * b16.memory)  # fp32 activations: twice bf16's element-wise bytes
        l16, l32 = (logits_times(8192, 4096, 32000, device, 1, d, backward)[0] for d in ("bf16", "fp32"))
        assert l32 == pytest.approx(l16 * 312 / 19.5)
    ratio = gpu["fp32"].time_breakdown["matmul"] / gpu["bf16"].time_breakdown["matmul"]
    assert 12 < ratio < 312 / 19.5, ratio
    # MFU is a fraction of the training dtype's peak (it divided fp32 runs by the bf16 peak: 16x low)
    for d, peak in (("bf16", 312e12), ("fp32", 19.5e12)):
        assert gpu[d].mfu == pytest.approx(gpu[d].tflops_per_device * 1e12 / peak)
    cpu = {d: spec_for("hardware=local", "hardware.peak_tflops=0.1", f"train.dtype={d}") for d in ("bf16", "fp32")}
    assert cost.compute_peak(cpu["fp32"].hardware, "fp32") == cost.compute_peak(cpu["bf16"].hardware, "bf16") == 1e11


def _published_rows(name: str) -> list[dict]:
    return calibration.read_table(DATA / calibration.SOURCES[name][0])


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_mpt_fsdp_on_16_to_128_a100s_held_out(loso):
    """llm-foundry's MPT benchmarks (torch FSDP FULL_SHARD, 125M-70B on 16-128 A100s, 8 x 200 Gb/s
    per node), never fitted on (calibration.CHECK_ONLY: the constants are those fitted without
    them). Under the kernel model (issue 42) median |error| 3.7 % (3.5 % under FLOPs over one
    efficiency). Every row within 25 % but two, both over-predicted by more than 20 %: 70B on 64
    A100-40GB (+39 %; MFU 35.9 % against 48.9 % on 128; the estimate puts it at 36 of the device's
    42 GB: allocator pressure near capacity is not modelled) and 1B on 32 GPUs (+26 %; 18 % below its
    own 16- and 64-GPU rows in the table). Rows with full recompute (7B-70B) within -3.2 to +6.4 %,
    rows without (125M-3B) over-predicted by up to 25 %, most at 125M (+19.5 to +24.5 %, +12 to +16 % before the
    loss was priced by its kernel, session 14: llm-foundry's fused cross entropy reads the bf16 logits once where
    xpar priced eager fp32 passes; what is left is the smallest GEMMs' and launches' host time at h = 768, not
    priced: docs/accuracy/fit_history.md). Scale: from 16 to 128 GPUs the published throughput per GPU falls
    0.6-6.3 %, the estimate moves -1.0 to +1.8 %: each model's ratio within 0.06 of the published one
    (worst 0.054, 350M)."""
    cases, res = loso
    r, rows = res["llmfoundry_mpt_a100"], _published_rows("llmfoundry_mpt_a100")
    assert r["fit_all"] == r["fit_without"] and len(rows) == len(r["held_out"]) == 34
    errs = {(row["model"], row["gpus"], row["gpu_memory_gb"]): e for row, e in zip(rows, r["held_out"])}
    outliers = {("70b", "64", "40"), ("1b", "32", "40")}
    assert statistics.median(abs(e) for e in errs.values()) <= 0.05
    assert max(abs(e) for k, e in errs.items() if k not in outliers) <= 0.25, errs
    assert all(errs[k] > 0.20 for k in outliers), errs
    ratio = {}
    for row, c, e in zip(rows, cases["llmfoundry_mpt_a100"], r["held_out"]):
        if row["gpu_memory_gb"] == "40" and row["gpus"] in ("16", "128"):
            ratio.setdefault(row["model"], {})[row["gpus"]] = (c[3], c[3] * (1 + e))
    assert len([m for m in ratio.values() if len(m) == 2]) == 7
    for model, by in ratio.items():
        if len(by) == 2:
            published, estimated = (by["128"][i] / by["16"][i] for i in (0, 1))
            assert abs(estimated - published) <= 0.06, (model, published, estimated)


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_fsdp_on_thin_fabric_ibm_rows_held_out(loso):
    """The IBM/Meta FSDP blog (2024): Llama 2 34B/70B, FULL_SHARD, b = 2, s = 4096, full
    recompute, on 128 A100s with 400 Gb/s per node and 96 H100s with 800 Gb/s per node; never
    fitted on. Its full recompute is torch's non-reentrant checkpoint, which does not rerun the MLP's
    w2 (framework.checkpoint_early_stop; fms-fsdp wraps its blocks with checkpoint_wrapper
    NO_REENTRANT). Under the kernel model (issue 42): A100 rows under-predicted by 1 % / 7 % (4 % / 10 %
    under FLOPs over one efficiency; more when w2 was counted as rerun). H100 rows over-predicted by
    6.6-8.8 % at H100 0.771 with torch SDPA at FlashAttention-2's H100 rates (framework.attention_kernel sdpa; fms-fsdp
    calls SDPA; 10-13 % at FlashAttention-3's before), (10-13 % at 0.765 before the refit with the fused optimizer's passes, 11-14 % at
    0.773 before the refit with Megatron-Core's per-chunk dp overlap, issue 43; 12-17 % under FLOPs), as every torch-FSDP H100 row is (MPT's, next test): the estimate exposes
    about 9 % of the step to dp communication, what the blog reads in its traces ("a 10% gap due to
    network peeking out"); the blog suspects HBM bandwidth for the rest (HFU 0.44-0.45 published)."""
    cases, res = loso
    r, rows = res["ibm_fms_fsdp_2024"], _published_rows("ibm_fms_fsdp_2024")
    assert r["fit_all"] == r["fit_without"]
    for row, (gpu, spec, assume, ref, _), e in zip(rows, cases["ibm_fms_fsdp_2024"], r["held_out"]):
        est = estimate(calibration.with_fitted(spec, r["fit_all"][gpu]), assume)
        exposed = est.time_breakdown["dp_comm_exposed"] / est.time_per_step_s
        if gpu == "A100":
            assert -0.08 <= e < 0, (row["model"], e)
            assert 0.03 < exposed < 0.10, exposed
        else:
            assert 0.05 < e <= 0.12, (row["model"], e)
            assert 0.07 < exposed < 0.15, exposed


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_mpt_fsdp_on_128_to_512_h100s_held_out(loso):
    """llm-foundry's large-scale H100 table (torch FSDP: FULL_SHARD for 7B-70B, SHARD_GRAD_OP for
    1B/3B, fp32 reduce-scatters; 128, 256, 512 GPUs; fabric not published, the presets' 8 x 400
    Gb/s per node assumed), never fitted on. Under the kernel model (issue 42; H100 0.771): with full
    recompute (13B-70B; llm-foundry's non-reentrant checkpoint, w2 not rerun:
    framework.checkpoint_early_stop) over-predicted by 1.5-8.1 %; without (1B-7B) by 11.6-25.9 %
    (under FLOPs over one efficiency: 3-10 % and 12-26 %): what the rows without recompute lose is
    not in the kernels priced (small models: host time). Scale: the published throughput per GPU
    falls from 128 to 512 GPUs for every model (by 2.5-9.7 %); the estimate falls too but by
    0.4-3.0 %, and only through the compute slowed beside the hidden collectives (overlap_slowdown
    on ring latency that grows with the ranks: without it the estimate is flat). Halving the
    NIC bandwidth does not change the trend (a ring's bus bandwidth does not depend on its size);
    three times NCCL's latencies matches 7B but not 13B-70B, whose loss (2.5-4.8 %) no
    communication term reproduces. Asserted: the bounds above and each model's 512/128 ratio
    below 1 and within 0.07 of the published one (worst 0.067, 1B). The bound with recompute is 9 %, not
    8 %: these rows are never fitted and keep their fp32 states, but the H100 refit after the fused
    optimizer's passes at framework.optimizer_bytes (issue 43: the NeMo rows' 10- and 4-byte states; the
    fit's median |error| had two minima 0.001 points apart, 0.766 and 0.772, and the passes lift the first:
    0.765 -> 0.771) raises each estimate by ~0.8 %: 30B on 512 H100s +7.3 -> +8.1 %."""
    cases, res = loso
    r, rows = res["llmfoundry_mpt_h100"], _published_rows("llmfoundry_mpt_h100")
    assert r["fit_all"] == r["fit_without"] and len(rows) == len(r["held_out"]) == 18
    by: dict = {}
    for row, c, e in zip(rows, cases["llmfoundry_mpt_h100"], r["held_out"]):
        lo, hi = (0.005, 0.09) if row["ac"] == "true" else (0.10, 0.26)
        assert lo < e < hi, (row["model"], row["gpus"], e)
        by.setdefault(row["model"], {})[row["gpus"]] = (c[3], c[3] * (1 + e))
    assert len(by) == 6
    for model, d in by.items():
        published, estimated = (d["512"][i] / d["128"][i] for i in (0, 1))
        assert published < 1 and estimated < 1 and abs(estimated - published) <= 0.07, (model, published, estimated)


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_megatron_2022_selective_recompute_on_a100_held_out(loso):
    """Korthikanti et al. 2022 Table 5 (GPT 22B-1T on 8-2240 A100s, tp 8, dp 1 but one row):
    iteration times with full recompute and with sequence parallelism + selective recompute,
    never fitted on, with the Megatron-LM of 2022's asynchronous tp backward (the column-parallel
    linears' input-gradient collectives behind their weight-gradient GEMMs). Under the kernel model
    (issue 42, A100 0.81): median |error| 4.9 %, max 10.9 % (FLOPs over one efficiency: 5.4 %, 11.1 %).
    The 530B and 1T rows at dp 1 under-predicted (-2 % to -10 %): the constant that fits the source
    alone is 0.85 against the 0.81 fitted (2022's Megatron runs faster GEMMs than the 2021 Table 1).
    Worst: 22B with the paper's method (+10.9 %) and 1T with full recompute (-9.5 %), whose 1F1B bubble
    over pp 64 is a tenth of the estimated step (v = 1 assumed: 2 layers per rank, interleaving not
    stated). The gain of the paper's method over full recompute is overstated: estimated 1.35-1.43x
    against 1.29-1.32x published (asserted: above the published and within 0.15 of it; 22B the most,
    +0.14). Data parallelism: 530B at dp 8 (2240 GPUs) costs 3.5 % published (37.83 -> 39.15 s, the
    all-reduce after the flush, not overlapped), 0.9 % estimated: asserted below half."""
    cases, res = loso
    r, rows = res["korthikanti_2022_table5"], _published_rows("korthikanti_2022_table5")
    assert r["fit_all"] == r["fit_without"] and len(rows) == len(r["held_out"]) == 9
    errs = r["held_out"]
    assert statistics.median(abs(e) for e in errs) <= 0.06 and max(abs(e) for e in errs) <= 0.12, errs
    assert all(e < 0 for row, e in zip(rows, errs) if row["params_b"] in ("530", "1000") and row["dp"] == "1"), errs
    by = {(row["params_b"], row["mode"], row["dp"]): (c[3], c[3] * (1 + e))
          for row, c, e in zip(rows, cases["korthikanti_2022_table5"], errs)}
    for size in ("22", "175", "530", "1000"):
        published, estimated = (by[(size, "present", "1")][i] / by[(size, "full", "1")][i] for i in (0, 1))
        assert 1.28 < published < 1.33 and published < estimated < published + 0.15, (size, published, estimated)
    published, estimated = (by[("530", "present", "1")][i] / by[("530", "present", "8")][i] - 1 for i in (0, 1))
    assert published > 0.03 and 0 < estimated < published / 2, (published, estimated)


def _dgxc(cases, rows, model):
    return [(row, c) for row, c in zip(rows, cases["dgxc_nemo_h100_bf16"]) if row["model"] == model]


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_nemo_3d_on_h100_held_out_over_predicted(loso):
    """NVIDIA's DGX Cloud NeMo BF16 recipes on 16-2048 H100s (GPT-3 175B tp 4 pp 8 v 12,
    Nemotron-4 340B tp 8 pp 8 v 12, Nemotron-4 15B tp 4; sequence parallelism, distributed
    optimizer with overlapped gradient and parameter collectives, per model chunk under interleaving
    (framework.dp_overlap_per_chunk, issue 43), userbuffer TP overlap). Under the kernel model (issue 42),
    held out, the H100 sustained_efficiency from Llama 3 alone (0.711, at the V = 8 its paper implies)
    predicts every row within 10 %: 1-7 % under for 175B and 340B (MFU 53-55 % published), 8-10 % under
    for 15B (no pipeline). The constant that fits the source alone is 0.767 (0.773 before issue 44's
    Megatron-Core bucket rule and head unit; 0.774 with the step's dp
    collectives behind one micro-batch, 0.755 before its interleaved sends kept their fixed part exposed,
    issue 44); with Llama 3 in the H100 fit (0.771, the preset) every row is within 7 % (6 % at 0.765 before
    the refit with the fused optimizer's passes at framework.optimizer_bytes, issue 43; 4 % at 0.773 before the
    per-chunk overlap): the worst, 340B on its largest run, +6.3 %, is the row whose fall with scale the model
    does not reproduce (below). Scale: per-GPU throughput from the smallest to the largest run falls
    2.1 % (175B), 4.8 % (340B), 2.6 % (15B) published. With each chunk's reductions behind the other
    chunks' backwards only the last chunk's stay exposed, so the interleaved runs' estimate falls 0.2 % and
    1.6 %: asserted falling, by less than published (what else slows a step over 256 nodes is not in the
    model; with one micro-batch to hide behind they fell within 0.02 of published); 15B (no interleaving)
    within 0.025: under Megatron-Core's bucket of 1M elements per dp rank (framework.bucket_rule, issue 44) its dp
    communication no longer grows with dp, the estimate falls 0.5 % where the recipe's fell 2.6 % (1.0 % more than
    published with 100 MB buckets before). Since issue 44 (the bucket rule and the output head as its own dp unit)
    the sources alone fit 0.765 with Llama 3, not the preset's 0.771 (:data:`H100_FIT`; the preset is not refitted
    here: it moves every H100 and Blackwell figure), and 15B held out is 6.6-8.9 % under (7-10 % before)."""
    cases, res = loso
    r, rows = res["dgxc_nemo_h100_bf16"], _published_rows("dgxc_nemo_h100_bf16")
    assert len(rows) == len(r["held_out"]) == 18 and "dgxc_nemo_h100_bf16" not in calibration.CHECK_ONLY
    assert r["fit_without"]["H100"] == pytest.approx(0.711, abs=0.005)
    h100 = preset("hardware", "h100_80gb_64gpu")["sustained_efficiency"]
    assert r["fit_all"]["H100"] == pytest.approx(H100_FIT, abs=0.003) and 0 <= h100 - H100_FIT < 0.01
    assert max(abs(e) for e in r["calibration"]) < 0.07, r["calibration"]
    for row, e in zip(rows, r["held_out"]):
        lo, hi = (-0.11, -0.06) if row["pp"] == "1" else (-0.08, -0.01)
        assert lo < e < hi, (row["model"], row["gpus"], e)
    assert calibration.fit_efficiency(cases["dgxc_nemo_h100_bf16"]) == pytest.approx(0.767, abs=0.005)
    for model in ("gpt3_175b", "nemotron4_340b", "nemotron4_15b"):
        pairs = _dgxc(cases, rows, model)
        (_, small), (_, large) = pairs[0], pairs[-1]
        published = large[3] / small[3]
        eff = r["fit_all"]["H100"]
        estimated = calibration.predicted(large, eff) / calibration.predicted(small, eff)
        if pairs[0][0]["vp"] == "1":
            assert published < 1 and estimated < 1 and abs(estimated - published) <= 0.025, (model, published, estimated)
        else:
            assert published < estimated < 1, (model, published, estimated)


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_nemo_h100_rows_no_single_tp_overlap_explains_them(loso):
    """The NeMo H100 rows hinge on an unpublished knob, the share of tp communication that the
    userbuffer overlap hides (calibration.DGXC_TP_OVERLAP = 0.8); hiding more raises every row. At the
    H100 matmul efficiency of Llama 3 alone (0.575) no share from 0 to 1 puts all 18 rows within 5 %:
    even with every tp collective hidden, 15B (4 micro-batches of 4 x 4096 tokens, tp comm 17 % of its
    step when blocking) stays 4-6 % under (7-9 % before issue 44's bucket rule and head unit), so the tp knob cannot stand in for the efficiency
    (test_h100_efficiency_is_fitted_where_the_step_is_matmul). (At the 0.678 Llama 3 gave alone at the
    V = 2 assumed before, blocking tp put 175B and 340B within 5 % and 15B 5-11 % under.)"""
    eff = loso[1]["dgxc_nemo_h100_bf16"]["fit_without"]["H100"]
    rows = _published_rows("dgxc_nemo_h100_bf16")
    err = {}
    for tpo in [i / 10 for i in range(11)]:
        for row in rows:
            spec, a, *rest = calibration.dgxc_row(row, tp_overlap=tpo)  # blocking below the share: no async backward
            err.setdefault(tpo, {}).setdefault(row["model"], []).append(
                calibration.errors([("H100", spec, replace(a, tp_async_backward=False), *rest)], eff)[0])
    for model in err[0.0]:
        assert all(a < b for a, b in zip(err[0.0][model], err[1.0][model]))
    assert all(-0.10 < e < -0.035 for e in err[1.0]["nemotron4_15b"]), err[1.0]["nemotron4_15b"]
    assert all(max(abs(e) for m in by.values() for e in m) > 0.05 for by in err.values())


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_mtnlg_530b_production_layout_held_out_with_blooms_layer_overhead(loso):
    """MT-NLG 530B (Smith et al. 2022, Sec. 2.4): tp 8, pp 35, dp 8/10/12 on 2240-3360 A100s,
    global batch 1920, 126/121/113 TFLOP/s per GPU published; never fitted on. It ran Megatron-DeepSpeed
    (DeepSpeed's pipeline engine, 1F1B, ZeRO-1, full recompute assumed). Without a framework cost it
    is over-predicted by 19-24 %: the same model and tp/pp on the same cluster in Korthikanti et al.
    2022 (Megatron-LM, dp 1, v = 3) ran 43 % faster per GPU (estimated, with the
    layer overhead below: 24 %, a ratio of 0.81). Under the kernel model (issue 42): without a framework
    cost over-predicted by 21-26 % (FLOPs over one efficiency: 19-24 %); with the cost per layer and
    micro-batch fitted on BLOOM's Megatron-DeepSpeed runs (deepspeed_bloom's layer_overhead_ms 7.1 ms,
    tests/data/bigscience_bloom_2022.csv) within 13 % (+8 to +13 %). Scale: per-GPU throughput falls
    9.8 % from 280 to 420 nodes published, 5.9 % estimated (the bubble as m falls from 240 to 160):
    asserted in that order."""
    cases, res = loso
    r, rows = res["smith_2022_mtnlg"], _published_rows("smith_2022_mtnlg")
    assert r["fit_all"] == r["fit_without"] and len(rows) == len(r["held_out"]) == 3
    assert all(0.0 < e < 0.13 for e in r["held_out"]), r["held_out"]
    mt, k = cases["smith_2022_mtnlg"], cases["korthikanti_2022_table5"]
    eff = r["fit_all"]["A100"]
    without = calibration.errors([(g, sp, replace(a, layer_overhead_ms=0.0), p, m) for g, sp, a, p, m in mt], eff)
    assert all(0.20 < e < 0.28 for e in without), without
    k_full = next(c for c, row in zip(k, _published_rows("korthikanti_2022_table5"))
                  if row["params_b"] == "530" and row["mode"] == "full")
    published = mt[0][3] / k_full[3]
    estimated = calibration.predicted(mt[0], eff) / calibration.predicted(k_full, eff)
    assert published < 0.72 and 0.75 < estimated < 0.85, (published, estimated)
    drop_published = 1 - mt[2][3] / mt[0][3]
    drop_estimated = 1 - calibration.predicted(mt[2], eff) / calibration.predicted(mt[0], eff)
    assert 0.03 < drop_estimated < drop_published, (drop_published, drop_estimated)


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_megatron_deepspeeds_layer_overhead_is_fitted_on_bloom_and_checked_on_mtnlg(loso):
    """deepspeed_bloom's layer_overhead_ms is the fit on BLOOM's 8 runs (within 0.5 ms: 7.1 ms under the
    kernel model, issue 42; 5.7 ms under FLOPs over one efficiency), which puts every BLOOM row within 8 %
    (max 7.3 %) and lowers their median |error| (4.4 -> 1.2 %; was 4.3 -> 3.2 %); MT-NLG never enters the
    fit (previous test). The overhead is host time per layer and micro-batch: on every pipeline slot,
    so the bubble grows with it; it adds to the kernels' own launch time in host_overhead."""
    from xpar.calibrate.published import fit_layer_overhead, preset
    cases, res = loso
    bloom = cases["bigscience_bloom_2022"]
    eff = res["bigscience_bloom_2022"]["fit_all"]["A100"]
    ms = preset("framework", "deepspeed_bloom")["layer_overhead_ms"]
    assert fit_layer_overhead(bloom, eff) == pytest.approx(ms, abs=0.5)
    assert all(abs(e) < 0.08 for e in res["bigscience_bloom_2022"]["calibration"])
    without = calibration.errors([(g, sp, replace(a, layer_overhead_ms=0.0), p, m) for g, sp, a, p, m in bloom], eff)
    with_ = res["bigscience_bloom_2022"]["calibration"]
    assert statistics.median(abs(e) for e in with_) < statistics.median(abs(e) for e in without) - 0.005, without
    _, spec, a, _, _ = bloom[0]
    on, off = estimate(spec, a), estimate(spec, replace(a, layer_overhead_ms=0.0))
    assert on.time_breakdown["host_overhead"] - off.time_breakdown["host_overhead"] == pytest.approx(
        spec.micro_batches * max(spec.layout.layer_split) * ms * 1e-3, rel=0.01)
    assert on.time_breakdown["bubble"] > off.time_breakdown["bubble"]


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_h100_efficiency_is_fitted_where_the_step_is_matmul(loso):
    """The H100 constant (hardware.sustained_efficiency under the kernel model, issue 42) is fitted on
    the NeMo rows, whose steps are 82-93 % matmul, and the two Llama 3 rows (at the V = 8 their paper's
    stage split implies: tests/data/llama3_2024_table4.csv), which agree with each other within 2 % at
    the fit. Each source alone: NeMo 0.767 (0.773 before issue 44), Llama 3 0.711, 0.056 apart (under FLOPs over one
    efficiency within 0.03); at the fit (0.771, the preset; 0.765 since issue 44's bucket rule and head unit,
    :data:`H100_FIT`, the preset not refitted; with Megatron-Core's per-chunk dp overlap and
    the fused optimizer's passes at framework.optimizer_bytes: issue 43) every NeMo row is within 7 % (6 % at
    0.765 before the passes, 4 % at 0.773 before the overlap; the worst, 340B at its largest run, +6.3 %:
    its published fall with scale is not in the model). The never-fitted FSDP H100 checks
    (MPT, IBM) want less: at Llama 3's 0.711 their median |error| is 4.7 % and 4.9 %, at the fitted
    0.771 9.9 % and 11.9 % (asserted: more than 4 points apart)."""
    cases, res = loso
    llama = cases["llama3_2024_table4"]
    fitted = res["llama3_2024_table4"]["fit_all"]["H100"]
    at_fit = calibration.errors(llama, fitted)
    assert abs(at_fit[0] - at_fit[1]) < 0.02, at_fit
    assert all(abs(e) < 0.07 for e in calibration.errors(cases["dgxc_nemo_h100_bf16"], fitted))
    llama_alone = res["dgxc_nemo_h100_bf16"]["fit_without"]["H100"]
    nemo_alone = res["llama3_2024_table4"]["fit_without"]["H100"]
    assert 0.05 < nemo_alone - llama_alone < 0.07, (llama_alone, nemo_alone)
    assert fitted == pytest.approx(H100_FIT, abs=0.003)
    assert 0 <= preset("hardware", "h100_80gb_8gpu")["sustained_efficiency"] - fitted < 0.01
    for name in ("llmfoundry_mpt_h100", "ibm_fms_fsdp_2024"):
        h100 = [c for c in cases[name] if c[0] == "H100"]
        at = {e: statistics.median(abs(x) for x in calibration.errors(h100, e)) for e in (llama_alone, fitted)}
        assert at[llama_alone] < at[fitted] - 0.04, (name, at)


@pytest.mark.parametrize("p, m", [(2, 2), (4, 8), (8, 24), (16, 64)])
def test_published_zero_bubble_schedules_as_qi_et_al_state_them(p, m):
    """ZB-H1 and ZB-H2 (Qi et al. 2024 Sec. 3.1, Table 2) at equal F, B and W: ZB-H1's idle per
    rank is a third of 1F1B's, (p - 1) of 3 m + p - 1, at 1F1B's activations (p micro-batches on
    the first rank); ZB-H2 idles 0 with twice the activations less one (2 p - 1)."""
    from xpar.estimate.memory.activations import microbatches_in_flight
    one_f_one_b, h1, h2 = (sch.bubble_theory(s, p, m) for s in ("1f1b", "zb_h1", "zb_h2"))
    work = 3 * m  # F + I + W per micro-batch
    assert h1 * (work + p - 1) == pytest.approx(p - 1)
    assert one_f_one_b * (work + 3 * (p - 1)) == pytest.approx(3 * (p - 1))  # 1F1B idles 3 (p - 1)
    assert h2 == 0.0
    for r in range(p):
        assert microbatches_in_flight("zb_h1", p, m, rank=r) == microbatches_in_flight("1f1b", p, m, rank=r)
        assert microbatches_in_flight("zb_h2", p, m, rank=r) == min(m, 2 * (p - r) - 1)


def test_published_zero_bubble_schedules_are_estimated_under_their_framework():
    """framework=megatron_zb (Qi et al.'s Megatron-LM fork) estimates ZB-H1 faster than 1F1B and
    ZB-H2 faster still; memory: ZB-H1 = 1F1B, ZB-H2 more."""
    base = ("framework=megatron_zb", "parallel=3d", "model=70b", "parallel.zero_stage=1", "parallel.recompute=full",
            "parallel.virtual_stages=1", "train=cluster", "run.mode=estimate")
    from tests.conftest import spec_for
    est = {s: estimate(spec_for(*base, f"parallel.schedule={s}")) for s in ("1f1b", "zb_h1", "zb_h2")}
    assert est["1f1b"].time_per_step_s > est["zb_h1"].time_per_step_s > est["zb_h2"].time_per_step_s
    assert est["zb_h1"].memory.activations == est["1f1b"].memory.activations < est["zb_h2"].memory.activations


def test_fp8_estimates_on_fp8_hardware_and_is_refused_where_it_cannot_run():
    """train.dtype=fp8 (issue 30) under the kernel model (issue 42): each GEMM at hardware.peak_tflops_fp8
    (H100: 1979 TFLOP/s, twice the bf16 peak) x gemm_efficiency_fp8 over bf16 storage, each FP8 tile with its
    fixed cost (hardware.gemm_tile_fixed_us_fp8), so an 8192-cube GEMM takes (989 x 0.803) / (1979 x 0.709) = 0.566
    of its bf16 time x (main loop + 3 us) / main loop = 0.59; the step's matmul term falls less
    (0.65: the attention core and the logits stay bf16), its memory-bound term grows (a cast kernel per
    GEMM input); the memory stays bf16's; MFU is against the FP8 peak. Refused on hardware without FP8
    and in execute mode, in one line each."""
    from tests.conftest import spec_for
    from xpar.config.checks import ConfigError
    from xpar.estimate.compute.kernel_costs import training_device
    from xpar.estimate.compute.kernels import gemm_time
    base = ("parallel=3d", "model=70b", "hardware=h100_80gb_64gpu", "train=cluster", "parallel.recompute=full",
            "run.mode=estimate")
    bf16, fp8 = (estimate(spec_for(*base, f"train.dtype={d}")) for d in ("bf16", "fp8"))
    hw = spec_for(*base).hardware
    device = training_device(hw)
    gemm = gemm_time(8192, 8192, 8192, device, "fp8") / gemm_time(8192, 8192, 8192, device, "bf16")
    main = 2 * 128 * 256 * 8192 / (device.peak_flops["fp8"] * device.gemm_fraction["fp8"] / device.sms)  # one tile, s
    assert gemm == pytest.approx(hw.peak_tflops * hw.gemm_efficiency / (hw.peak_tflops_fp8 * hw.gemm_efficiency_fp8)
                                 * (main + hw.gemm_tile_fixed_us_fp8 * 1e-6) / main)
    ratio = fp8.time_breakdown["matmul"] / bf16.time_breakdown["matmul"]
    assert gemm < ratio < 0.65, ratio
    assert fp8.time_breakdown["memory_bound"] > bf16.time_breakdown["memory_bound"]
    assert fp8.memory.total == bf16.memory.total and fp8.time_per_step_s < bf16.time_per_step_s
    assert fp8.mfu == pytest.approx(fp8.tflops_per_device / 1979, rel=1e-9)
    for overrides, words in ((("hardware=a100_80gb_64gpu",), "has none"), (("run.mode=execute", "model=tiny",
                             "hardware=local", "parallel=dp", "train=default"), "estimated, not executed")):
        with pytest.raises(ConfigError) as e:
            spec_for(*base, "train.dtype=fp8", *overrides)
        assert words in str(e.value)


def test_fp8_keeps_the_attention_core_at_the_bf16_rate():
    """Under FP8 (Transformer Engine's recipes, torchao's float8) only the linear layers run in FP8:
    a layer's matmul seconds are its projections and MLP at the FP8 rate (peak_tflops_fp8 x
    efficiency x fp8_matmul_efficiency) plus its attention core (4 s h per token forward; rerun
    under full recompute) at the bf16 rate (peak_tflops x efficiency). At s = 32768 the core is a
    third of a 70B layer's FLOPs, so the FP8 matmul term rises by over 20 % over pricing it all at the FP8 rate;
    bf16 is unchanged."""
    from tests.conftest import spec_for
    base = ("parallel=3d", "model=70b", "hardware=h100_80gb_64gpu", "train=cluster", "parallel.recompute=full",
            "run.mode=estimate", "train.seq_len=32768")
    for dtype in ("fp8", "bf16"):
        s = spec_for(*base, f"train.dtype={dtype}")
        s = replace(s, hardware=replace(s.hardware, sm_count=None))  # the FLOP path: hardware without kernel figures
        hw, cfg, tok = s.hardware, s.model, s.seq_len * s.train.micro_batch_size / s.tp
        fwd = forward_flops_per_token(cfg, s.seq_len)
        layer, core = (fwd["matmul"] + fwd["attention"]) / cfg.n_layers, fwd["attention"] / cfg.n_layers
        bf16_rate = hw.peak_tflops * 1e12 * cost.matmul_efficiency(hw, cfg.hidden / s.tp)
        rate = bf16_rate if dtype == "bf16" else bf16_rate * hw.peak_tflops_fp8 / hw.peak_tflops * hw.fp8_matmul_efficiency
        a = cost.assumptions_for(s)
        c = cost.layer_costs(s, a)
        extra = extra_forward_flops_per_layer(cfg, s.seq_len, "full", early_stop=a.checkpoint_early_stop)
        delay = tok * core * (1 / bf16_rate - 1 / rate)  # the core at the bf16 rather than the FP8 rate
        assert core / layer > 0.3
        assert c["mm_f"] == pytest.approx(tok * layer / rate + delay, rel=1e-12)
        assert c["mm_b"] == pytest.approx(tok * (2 * layer + extra) / rate + 3 * delay, rel=1e-12)  # 2x + the rerun
        if dtype == "fp8":
            assert c["mm_f"] > 1.2 * tok * layer / rate  # what the whole layer at the FP8 rate gave
        else:
            assert c["mm_f"] == tok * layer / rate
    from xpar.estimate.compute.kernel_block import block_times, shape_of
    from xpar.estimate.compute.kernel_costs import training_device
    kernel = spec_for(*base)  # the kernel model: the core is FlashAttention in BF16 whatever the GEMMs' dtype
    dev, sh = training_device(kernel.hardware), shape_of(kernel.model)
    fp8, bf16 = (block_times(sh, 1, 32768, dev, tp=kernel.tp, dtype=d) for d in ("fp8", "bf16"))
    assert fp8.attention == bf16.attention and fp8.gemm < bf16.gemm


def test_context_parallelism_is_priced_as_dp_ranks_on_a_sequence_share_plus_the_kv_gathers():
    """parallel.cp (issue 30): cp ranks per sequence hold s / cp tokens (activations / cp), shard
    ZeRO over dp x cp, and add per layer an all-gather of K and V (again in the backward of a recomputed
    layer) and its gradients' reduce-scatter, exposed (xpar.estimate.context_parallel); the world is dp x
    cp x tp x pp."""
    from tests.conftest import spec_for
    from xpar.estimate.context_parallel import cp_layer_times, fold_cp
    base = ("model=70b", "hardware=h100_80gb_64gpu", "parallel.tp=8", "parallel.zero_stage=3", "parallel.recompute=full",
            "parallel.micro_batches=auto", "train=cluster", "train.seq_len=32768", "train.global_batch_size=16",
            "train.micro_batch_size=1", "run.mode=estimate")
    one, two = (spec_for(*base, f"parallel.cp={cp}") for cp in (1, 2))
    assert two.world_size == 64 and two.dp * two.layout.cp == one.dp and two.global_batch == 16
    e1, e2 = estimate(one), estimate(two)
    assert e2.memory.activations == pytest.approx(e1.memory.activations / 2, rel=0.01)
    assert e2.memory.params == e1.memory.params  # ZeRO-3 shards over dp x cp: the same 8 ranks as dp 8
    t = cp_layer_times(two)
    # recompute=full: each layer's backward gathers K and V again (xpar.estimate.context_parallel.cp_replay)
    assert e2.time_breakdown["cp_comm"] == pytest.approx(two.micro_batches * 80 * (2 * t["f"] + t["b"]))
    folded = estimate(fold_cp(two))
    assert e2.time_per_step_s == pytest.approx(folded.time_per_step_s + e2.time_breakdown["cp_comm"])
    assert e2.tokens_per_s == pytest.approx(two.tokens_per_step / e2.time_per_step_s)


def test_context_parallel_checks():
    """A seq_len that does not split into 2 cp chunks is refused; cp=2 now validates in execute
    mode (executed by xpar.parallel.context, tests/parallel/test_context_parallel.py)."""
    from tests.conftest import spec_for
    from xpar.config.checks import ConfigError
    with pytest.raises(ConfigError) as e:
        spec_for("parallel.cp=3", "run.mode=estimate", "model=70b", "hardware=h100_80gb_64gpu", "train=cluster",
                 "parallel.tp=8")
    assert "cp values that work" in str(e.value), str(e.value)
    spec = spec_for("parallel.cp=2", "parallel.dp=1")
    assert spec.cp == 2 and spec.world_size == 2 and spec.mode == "execute"


CP_FP8_STILL_REFUSED: dict[str, str] = {}
"""Rows of tests/data/cp_fp8_h100.csv the memory check still refuses, and why."""


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_published_context_parallel_moe_and_fp8_runs():
    """Runs with cp, FP8 and MoE with expert parallelism (tests/data/cp_fp8_h100.csv: dgxc, Megatron-LM,
    NeMo, Megatron-Bridge, Megatron-MoE-ModelZoo, Llama 3 and DeepSeek-V3 papers, NeMo AutoModel, torchtitan; 46 on
    H100/H800, torchtitan's 9 on its 500 W H100-96GB: tests/estimate/test_torchtitan_h100_rows.py): none
    refused by the memory check but :data:`CP_FP8_STILL_REFUSED`; median |error| of the published
    figure (in its source's FLOPs convention: xpar.calibrate.cp_fp8.published_figure) within 12 % over
    all of them (issue 30; under the kernel model, issue 42, measured 11.1 %, was 11.8 %) and within 22 %
    over the 19 MoE rows alone (measured 20.7 %, worse than the 14.3 % under FLOPs over one efficiency:
    Grok-1's FP8 rows +21-33 %, Qwen3-30B-A3B's small experts +176 %, DeepSeek-V3's whole-run average
    +45 %, the Qwen3-235B rows with cp 2-8 under-predicted by 13-26 %); the dense FP8 rows outside
    the dgxc ones (which fitted the FLOP model's fp8_matmul_efficiency; the kernel model's
    gemm_efficiency_fp8 is a published GEMM sweep, not fitted) on the 80 GB H100 within 6 % (measured 4.0 %)."""
    from xpar.calibrate.cp_fp8 import cp_fp8_case, published_figure
    from xpar.calibrate.published import read_table
    errors, refused, held_out, moe = {}, [], [], []
    for row in read_table(DATA / "cp_fp8_h100.csv"):
        case = cp_fp8_case(row)
        if case is None:
            continue
        spec, assume, metric, published = case
        e = estimate(spec, assume)
        if not e.memory.fits:
            refused.append(row["id"])
        got = published_figure(e, spec, metric)
        errors[row["id"]] = (published / got - 1) if metric == "step_s" else (got / published - 1)
        if row["dtype"] == "fp8" and row["moe"] != "true" and not row["id"].startswith("dgxc") and row["gpu"] == "H100":
            held_out.append(abs(errors[row["id"]]))
        if row["moe"] == "true":
            moe.append(abs(errors[row["id"]]))
    assert len(errors) >= 46 and set(refused) == set(CP_FP8_STILL_REFUSED), refused
    assert statistics.median(abs(x) for x in errors.values()) <= 0.12, errors
    assert len(moe) >= 18 and statistics.median(moe) <= 0.22, moe
    assert len(held_out) >= 5 and statistics.median(held_out) <= 0.06, held_out




def test_qwen3_rows_are_estimated_and_converted_at_their_head_dim():
    """Qwen3's heads are 128 wide (config.json head_dim; the Megatron-MoE ModelZoo's kv_channels), not
    hidden / n_heads = 64: the rows of tests/data/cp_fp8_h100.csv are estimated at 128, and the ModelZoo's
    TF/s compared in its own causal count at 128 (issue 42: the page converted at 64)."""
    from xpar.calibrate.cp_fp8 import cp_fp8_case, published_figure
    from xpar.calibrate.published import read_table
    from xpar.estimate.compute.flops import model_flops_per_token
    rows = [r for r in read_table(DATA / "cp_fp8_h100.csv") if r["model_name"].startswith("Qwen3")]
    assert len(rows) >= 8
    for row in rows:
        spec = cp_fp8_case(row)[0]
        assert spec.model.head_size == 128 and spec.model.q_dim == 128 * int(row["heads"]), row["id"]
    row = next(r for r in rows if r["id"] == "zoo_qwen3_235b_bf16_256_seq131072_cp8")
    spec, assume, metric, published = cp_fp8_case(row)
    e = estimate(spec, assume)
    causal = model_flops_per_token(spec.model, spec.seq_len, causal=True) / model_flops_per_token(spec.model, spec.seq_len)
    assert metric == "tflops_per_gpu_causal"
    assert published_figure(e, spec, metric) == pytest.approx(e.tflops_per_device * causal, rel=1e-12)
