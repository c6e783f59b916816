"""DDP and ZeRO-1/2/3 against a single-process reference, and the memory ZeRO promises."""
import pytest

from tests.conftest import reference_losses, run_specs, spawn, spec_for

LAYOUTS = ["dp", "zero1", "zero2", "zero3"]


def _held_grads(spec_dict: dict) -> dict:
    """Worker: gradient bytes a ZeRO-3 rank holds (xpar.parallel.memory_accounting.grad_bytes_held: ``.grad``
    plus FSDP2's unsharded gradients of a deferred reduction) after one micro-batch's
    backward with FSDP2's gradient sync on, then, from zero, with it off."""
    from xpar.config.spec import RunSpec
    from xpar.parallel.factory import build_engine
    from xpar.parallel.memory_accounting import (
        _nbytes,
        dp_full_param_bytes,
        fsdp_params,
        grad_bytes_held,
    )
    from xpar.parallel.mesh import build_mesh
    from xpar.run.data import TokenSource

    spec = RunSpec.from_dict(spec_dict)
    engine = build_engine(spec, build_mesh("cpu", spec.pp, spec.dp, spec.tp))
    model, fps = engine.chunks[0], fsdp_params(engine.chunks)
    xs, ys = TokenSource(spec).micro_batches(0, engine.mesh["dp"].get_local_rank(), "cpu")
    held = {}
    for sync in (True, False):
        engine.optimizer.zero_grad(set_to_none=True)
        model.set_requires_gradient_sync(sync)
        engine.loss_fn(model(xs[0]), ys[0]).backward()
        held["sync" if sync else "deferred"] = grad_bytes_held(engine.chunks, fps)
    params = list(model.parameters())
    return {**held, "shard": sum(_nbytes(p) for p in params), "whole": sum(dp_full_param_bytes(p) for p in params)}


def _workers(payload: dict) -> dict:
    return {"runs": run_specs(payload["runs"]), "held": _held_grads(payload["held"])}


@pytest.fixture(scope="module")
def results():
    specs = [spec_for(f"parallel={p}", "train.steps=5", "train.warmup_steps=1", "parallel.micro_batches=2")
             for p in LAYOUTS]
    out = spawn(_workers, 2, {"runs": [s.to_dict() for s in specs], "held": specs[LAYOUTS.index("zero3")].to_dict()})
    return specs, dict(zip(LAYOUTS, out["runs"])) | {"held": out["held"]}


@pytest.mark.slow
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


@pytest.mark.slow
def test_zero_shards_what_each_stage_promises(results):
    _, out = results
    mem = {k: out[k][1][0] for k in LAYOUTS}  # rank 0
    ddp = mem["dp"]
    assert ddp["optimizer"] == 2 * ddp["params"]  # AdamW: exp_avg + exp_avg_sq, fp32
    # ZeRO-1: optimizer states ~1/dp (ZeroRedundancyOptimizer partitions whole parameters)
    assert mem["zero1"]["optimizer"] == pytest.approx(ddp["optimizer"] / 2, rel=0.1)
    assert mem["zero1"]["grads"] == ddp["grads"] and mem["zero1"]["params"] == ddp["params"]
    # ZeRO-2: gradients too (FSDP2 shards dim 0; tiny's dims are even so exactly 1/2). The
    # grads term is the most held at once, FSDP2's unsharded gradients of a deferred
    # reduction included (probed after every micro-batch): 1/2 with m = 2 because xpar
    # reduce-scatters every micro-batch.
    assert mem["zero2"]["grads"] == ddp["grads"] / 2
    assert mem["zero2"]["optimizer"] == ddp["optimizer"] / 2
    assert mem["zero2"]["params"] == ddp["params"]
    # ZeRO-3: parameters too
    assert mem["zero3"]["params"] == ddp["params"] / 2
    assert mem["zero3"]["grads"] == ddp["grads"] / 2
    for k in LAYOUTS:
        assert mem[k]["activations"] > 0


@pytest.mark.slow
def test_zero3_holds_whole_gradients_only_when_the_reduction_is_deferred(results):
    """The observable behind the grads term: after a backward with FSDP2's gradient sync
    off, the rank holds the whole unsharded gradients (torch keeps them on its private
    ``FSDPParam._unsharded_param``), which the sharded ``p.grad`` alone would not show; with
    sync on, only the 1/dp shards. xpar's accumulation keeps sync on for ZeRO-2/3."""
    held = results[1]["held"]
    assert held["shard"] * 2 == held["whole"]
    assert held["sync"] == held["shard"]
    assert held["deferred"] == held["whole"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_measured_collectives_are_the_estimates_counts(results, layout):
    """Every rank's logged dp collectives (xpar.parallel.comm_log: FSDP2's all-gathers and
    reduce-scatters, ZeroRedundancyOptimizer's broadcasts, DDP's bucket all-reduce from its logger)
    carry exactly the payload bytes per step that the estimate counts (xpar.estimate.comm.volume), and at
    least one call of each kind the estimate names."""
    from xpar.estimate.cost import estimate
    from xpar.run.fidelity import estimated_comm

    specs, out = results
    spec = specs[LAYOUTS.index(layout)]
    expected = {k[len("fidelity/estimate_"):]: v for k, v in estimated_comm(spec, estimate(spec)).items()
                if k.endswith("_bytes") and v}
    assert expected, layout
    for timing in out[layout][2]:
        comm = timing["comm"]
        measured = {k[len("comm/"):].replace("dp_", "comm_dp_", 1): v for k, v in comm.items()
                    if k.startswith("comm/dp_") and k.endswith("_bytes") and "scalar" not in k}
        assert measured == pytest.approx(expected, rel=1e-9), (layout, measured, expected)
        for key in expected:
            assert comm[f"comm/{key[len('comm_'):-len('_bytes')]}_calls"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero2", "zero3"])
def test_compute_and_exposed_collectives_make_up_the_step(results, layout):
    """On each rank, the thread's time on a core (its compute on a CPU), the time blocked in the
    logged collectives and the time it waited for a core (other processes: this suite runs two
    files at once) make up the measured step within 10 %, the median over the timed steps of their
    ratio: the split names where the step of an executed ZeRO-2/3 run went (issue 31). Measured
    0.96-0.98 with the cores free; with the rest of the suite on the same 2 cores (the worker's
    thread had a core for less than 0.9 of the time it wanted one) 0.84-0.90: a thread preempted
    while it holds the GIL stalls the main thread outside any collective. Such a run is tagged
    "measured under contention" (tests/run/test_run.py); it is held to 25 % here."""
    from statistics import median

    specs, out = results
    w = specs[LAYOUTS.index(layout)].train.warmup_steps
    for timing in out[layout][2]:
        parts = zip(timing["thread_cpu_s"], timing["core_wait_s"], timing["comm_exposed_s"], timing["step_times_s"])
        ratios = [(cpu + wait + comm) / step for cpu, wait, comm, step in list(parts)[w:]]
        tolerance = 0.10 if timing["cpu_share"] >= 0.9 else 0.25
        assert median(ratios) == pytest.approx(1.0, abs=tolerance), (layout, ratios, timing["cpu_share"], timing["comm"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_exposed_communication_in_total_is_at_least_each_collectives(results, layout):
    """The table's total exposed communication is the sum of the collectives it lists (each the
    max over ranks of the rank's median over the timed steps), never less than one of them (issue 45:
    9.7 ms total beside a 14.1 ms all-gather in every ZeRO job), and the step split stacks those same
    figures under the table's (median) step time."""
    from xpar.track.report import summarize_measured
    from xpar.track.plots import step_split_terms

    specs, out = results
    spec = specs[LAYOUTS.index(layout)]
    losses, memory, timing = out[layout]
    stats = [dict(t, rank=r, losses=losses[r], memory=memory[r], grad_norms=[], lrs=[]) for r, t in enumerate(timing)]
    report = summarize_measured(spec, stats)
    parts = {k: v for k, v in report.extra.items() if k.startswith("time/comm_") and k.endswith("_exposed_s")
             and k != "time/comm_exposed_s"}
    assert parts, report.extra  # every dp layout logs its collectives
    total = report.extra["time/comm_exposed_s"]
    assert all(total >= v for v in parts.values()) and total == pytest.approx(sum(parts.values()))
    split = step_split_terms(report.extra, report.step_time_s)
    assert report.step_time_s == report.extra["throughput/step_time_median_s"]  # the table's statistic
    assert sum(split.values()) >= report.step_time_s - 1e-12  # 'other' fills the median step, no more
    assert {f"time/comm_{k}_exposed_s" for k in split} >= set(parts)
