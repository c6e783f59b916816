"""Pipeline parallelism: every torch schedule against the single-process reference, the
zero-bubble + ZeRO-3 trap, 3D (pp x dp x tp), micro-batch rules, layer splits and the bubble
ratio (measured, simulated, theory).

Multi-process checks cost seconds per process start on 2 cores, so each world size is ONE
spawn running all its cases in a row: 2 workers (pp=2: all seven schedules), 4 workers
(pp2 x dp2 under ZeRO), 8 workers (pp2 x dp2 x tp2).
"""
from __future__ import annotations

import math
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import reference_losses, spawn, spec_for

STEPS = 3
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zero_bubble", "zbv", "dualpipev"]
ZB = ["zero_bubble", "zbv", "dualpipev"]
RUN = [f"train.steps={STEPS}", "train.warmup_steps=1", "model=tiny"]  # parallel=pp selects mini


def _run(spec_dict: dict):
    """Train one spec through xpar's real path (worker side); rank 0 gets every rank's stats."""
    from xpar.config.spec import RunSpec
    from xpar.run.worker import run_rank

    with tempfile.TemporaryDirectory() as tmp:
        return run_rank(RunSpec.from_dict(spec_dict), Path(tmp))


def run_all(payload: dict) -> dict:
    """Worker: train each named spec; rank 0 returns per-rank losses and the bubble metrics."""
    from xpar.config.spec import RunSpec
    from xpar.track.bubble import summarize

    out = {}
    for name, d in payload.items():
        stats = _run(d)
        if stats is not None:
            extra, timeline = summarize(RunSpec.from_dict(d), stats)
            out[name] = {"losses": [s["losses"] for s in stats], "extra": extra,
                         "timeline_ranks": len(timeline["actions"]),
                         "activations": [s["memory"]["activations"] for s in stats],
                         "memory": [s["memory"] for s in stats], "coords": [s["coords"] for s in stats]}
    return out


def _grad_error(spec_dict: dict, zero_stage: int) -> dict:
    """Worker: one pipelined forward/backward of step 0 (no optimizer step) with the dp axis
    wrapped for ``zero_stage``; rank 0 compares the full gradients with the reference."""
    import torch
    import torch.distributed as dist

    from xpar.config.spec import RunSpec
    from xpar.parallel.factory import build_engine
    from xpar.parallel.mesh import build_mesh
    from xpar.run.data import TokenSource

    spec = RunSpec.from_dict(spec_dict)
    spec = replace(spec, layout=replace(spec.layout, zero_stage=zero_stage))
    mesh = build_mesh("cpu", spec.pp, spec.dp, spec.tp)
    engine = build_engine(spec, mesh)
    xs, ys = TokenSource(spec).micro_batches(0, mesh["dp"].get_local_rank(), "cpu")
    first = any(st.is_first for st in engine.stages)
    last = any(st.is_last for st in engine.stages)
    engine.schedule.step(*((torch.cat(xs),) if first else ()), target=torch.cat(ys) if last else None,
                         losses=[], return_outputs=False)
    grads = {}
    for chunk in engine.chunks:
        for name, p in chunk.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.removeprefix("module.")] = g
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, grads)
    if dist.get_rank() != 0:
        return {}
    _, ref = reference_losses(spec, steps=1, grads=True)
    got = {}
    for g in gathered:
        got.update(g)
    errors = {n: (float((got[n] - r).abs().max() / r.abs().max()) if got.get(n) is not None else float("inf"))
              for n, r in ref.items()}
    return {"max_rel_error": max(errors.values()), "n_params": len(ref), "n_missing": len(ref) - len(got),
            "n_bad": sum(e > 1e-4 for e in errors.values())}


def _gathers_per_step(spec_dict: dict) -> list[int]:
    """Worker: all-gathers each rank issues in its second schedule step (FSDP2 calls
    ``dist.all_gather_single``), every rank's count on rank 0 in rank order."""
    import torch
    import torch.distributed as dist

    from xpar.config.spec import RunSpec
    from xpar.parallel.factory import build_engine
    from xpar.parallel.mesh import build_mesh
    from xpar.run.data import TokenSource

    spec = RunSpec.from_dict(spec_dict)
    mesh = build_mesh("cpu", spec.pp, spec.dp, spec.tp)
    engine, real, calls = build_engine(spec, mesh), dist.all_gather_single, [0]
    xs, ys = TokenSource(spec).micro_batches(0, mesh["dp"].get_local_rank(), "cpu")
    first, last = any(st.is_first for st in engine.stages), any(st.is_last for st in engine.stages)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    for step in range(2):
        calls[0], dist.all_gather_single = 0, counted if step else real
        try:
            engine.schedule.step(*((torch.cat(xs),) if first else ()), target=torch.cat(ys) if last else None,
                                 losses=[], return_outputs=False)
        finally:
            dist.all_gather_single = real
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, calls[0])
    return counts


def zero_checks(payload: dict) -> dict:
    """Worker (pp2 x dp2): gradients of each zero-bubble spec as xpar runs it, and with
    FSDP2 reshard_after_forward=True forced (the trap); then training losses, and the
    all-gathers of a ZeRO-3 1F1B step."""
    out = {"grads": {}, "trap": {}, "runs": run_all(payload["runs"])}
    for name, d in payload["grads"].items():
        out["grads"][name] = _grad_error(d, d["layout"]["zero_stage"])
        out["trap"][name] = _grad_error(d, 3)
    out["gathers"] = _gathers_per_step(payload["runs"]["1f1b_zero3"])
    return out


@pytest.fixture(scope="module")
def pp2():
    specs = {s: spec_for("parallel=pp", f"parallel.schedule={s}", *RUN) for s in SCHEDULES}
    return specs, spawn(run_all, 2, {n: s.to_dict() for n, s in specs.items()})


@pytest.fixture(scope="module")
def pp2_dp2():
    zero = ["parallel=pp", "parallel.dp=2", "parallel.zero_stage=3", *RUN]
    grads = {s: spec_for(*zero, f"parallel.schedule={s}", local_devices=4) for s in ("zero_bubble", "zbv")}
    runs = {"zbv_zero3": grads["zbv"], "1f1b_zero3": spec_for(*zero, "parallel.schedule=1f1b", local_devices=4)}
    payload = {"grads": {n: s.to_dict() for n, s in grads.items()}, "runs": {n: s.to_dict() for n, s in runs.items()}}
    return {**grads, **runs}, spawn(zero_checks, 4, payload)


@pytest.fixture(scope="module")
def three_d():
    specs = {"3d_local": spec_for("parallel=3d_local", *RUN, local_devices=8),
             "3d_zbv_sp": spec_for("parallel=3d_local", "parallel.schedule=zbv", "parallel.sequence_parallel=true",
                                   *RUN, local_devices=8)}
    return specs, spawn(run_all, 8, {n: s.to_dict() for n, s in specs.items()})


def _check_losses(spec, per_rank: list[list], name: str) -> None:
    """The pipeline's loss (on the ranks holding the last stage, mean over dp) equals the
    single-process loss of the same global batch at every step."""
    ref = reference_losses(spec, STEPS)
    for step in range(STEPS):
        seen = [r[step] for r in per_rank if r[step] is not None]
        assert len(seen) == spec.dp * spec.tp, (name, step, seen)
        got = sum(seen) / len(seen)
        assert got == pytest.approx(ref[step], rel=1e-4), (name, step, got, ref[step])
    assert ref[-1] < ref[0]


# --- multi-process ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_matches_single_process(pp2, schedule):
    specs, out = pp2
    assert specs[schedule].pp == 2 and specs[schedule].micro_batches == 4
    _check_losses(specs[schedule], out[schedule]["losses"], schedule)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bubble_metrics_of_every_run(pp2, schedule):
    """Measured, simulated and theory are fractions; replaying the same actions with free
    communication cannot be slower than the real step (overhead >= 0 up to clock skew)."""
    extra = pp2[1][schedule]["extra"]
    for k in ("bubble_ratio", "bubble_ratio_sim", "bubble_ratio_theory"):
        assert 0.0 <= extra[f"pipeline/{k}"] < 1.0, (k, extra)
    assert extra["pipeline/bubble_overhead"] >= -0.02, extra
    assert extra["pipeline/bubble_ratio_sim"] >= extra["pipeline/bubble_ratio_theory"] - 0.1, extra
    assert pp2[1][schedule]["timeline_ranks"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_activation_peak_at_most_gpipes(pp2, schedule):
    """GPipe keeps every micro-batch of the rank's layers in flight, the most any schedule
    can. (Zero-bubble schedules exceeded it, growing every step, while the saved-tensor
    tracker made saved outputs reference cycles in graphs kept for the weight backward.)"""
    acts, gpipe = pp2[1][schedule]["activations"], pp2[1]["gpipe"]["activations"]
    for rank, (a, g) in enumerate(zip(acts, gpipe)):
        assert 0 < a <= 1.1 * g, (schedule, rank, a, g)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv"])
def test_zero_bubble_gradients_under_zero_match_reference(pp2_dp2, schedule):
    """pp2 x dp2 asking for ZeRO-3: xpar runs it as ZeRO-2 (FSDP2 reshard_after_forward=False)
    and every gradient equals the single-process one."""
    specs, out = pp2_dp2
    assert specs[schedule].layout.zero_stage == 2 and "reshard_after_forward=False" in specs[schedule].notes[0]
    r = out["grads"][schedule]
    assert r["n_missing"] == 0 and r["n_bad"] == 0 and r["max_rel_error"] <= 1e-4, r


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv"])
def test_reshard_after_forward_trap_is_real(pp2_dp2, schedule):
    """Why the guard exists: the same run with FSDP2 reshard_after_forward=True gives wrong
    gradients without an error. If this fails, torch fixed it and layout.zero_stage_run can go."""
    r = pp2_dp2[1]["trap"][schedule]
    assert r["n_bad"] > 0 and r["max_rel_error"] > 1e-2, r


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zbv_zero3", "1f1b_zero3"])
def test_pp_dp_training_matches_single_process(pp2_dp2, name):
    specs, out = pp2_dp2
    _check_losses(specs[name], out["runs"][name]["losses"], name)


@pytest.mark.slow
def test_zero3_under_pp_gathers_the_backward_once_per_step(pp2_dp2):
    """torch's PipelineStage turns FSDP2's reshard after backward off until the stage's final
    gradient reduction, while each forward reshards after itself: a ZeRO-3 stage gathers a
    unit before each action that finds it sharded, m + 1 times per step, as the cost model
    counts them (xpar.estimate.comm.dp, xpar.estimate.comm.volume), not the 2 m of a run without pp."""
    from xpar.estimate.comm.dp import unit_elements

    specs, out = pp2_dp2
    spec = specs["1f1b_zero3"]
    assert spec.layout.zero_stage == 3 and spec.micro_batches == 4
    for rank, count in enumerate(out["gathers"]):
        units = sum(1 for n in unit_elements(spec, spec.layout.coords(rank)[0]) if n)
        assert count == (spec.micro_batches + 1) * units, (rank, count, units)


def _check_model_states(spec, out: dict, name: str) -> None:
    """Measured model states of every rank equal the cost model's, term by term. Under pp,
    torch's PipelineStage defers FSDP2's gradient reduction to the stage's last backward, so
    each rank holds its stages' whole (dp-unsharded) gradients until then: measured by
    probing FSDP2's unsharded gradients just before each reduction, estimated as such."""
    from xpar.estimate.memory.per_device import model_state_bytes
    from xpar.estimate.memory.model_states import (
        STATE_BYTES,
        param_shapes,
        replicated_embedding_grad_numel,
    )

    for mem, c in zip(out["memory"], out["coords"]):
        est = model_state_bytes(spec, c["pp"], c["dp"])
        assert est == {k: mem[k] for k in ("params", "grads", "optimizer")}, (name, c, est, mem)
        # whole gradients, not the 1/dp shards (+ the tp embedding's Replicate gradient)
        whole = sum(math.prod(sh) for _, sh in param_shapes(spec, c["pp"]))
        whole += replicated_embedding_grad_numel(spec, c["pp"])
        assert mem["grads"] == whole * STATE_BYTES[spec.train.dtype][1], (name, c, mem["grads"], whole)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zbv_zero3", "1f1b_zero3"])
def test_pp_dp_model_states_equal_the_estimate(pp2_dp2, name):
    specs, out = pp2_dp2
    _check_model_states(specs[name], out["runs"][name], name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["3d_local", "3d_zbv_sp"])
def test_3d_model_states_equal_the_estimate(three_d, name):
    specs, out = three_d
    _check_model_states(specs[name], out[name], name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["3d_local", "3d_zbv_sp"])
def test_3d_matches_single_process(three_d, name):
    """pp2 x dp2 x tp2 on 8 workers: TP -> FSDP on dp -> PipelineStage on pp."""
    specs, out = three_d
    spec = specs[name]
    assert (spec.pp, spec.dp, spec.tp, spec.world_size) == (2, 2, 2, 8)
    _check_losses(spec, out[name]["losses"], name)


# --- pure ---------------------------------------------------------------------------------

def _torch_accepts(schedule: str, pp: int, m: int) -> bool:
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    from xpar.config.layout import SCHEDULES
    try:
        get_schedule_ops(SCHEDULES[schedule].torch_name, pp, m, None if schedule in ("gpipe", "1f1b") else 2)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_microbatch_rule_is_torchs(schedule):
    """plan.microbatch_ok says yes exactly where torch 2.13's schedule accepts m (pp 2 and 4,
    m 1..12); the multi-process tests above run the accepted counts."""
    from xpar.config.layout import microbatch_ok
    for pp in (2, 4):
        for m in range(1, 13):
            assert microbatch_ok(schedule, pp, m) == _torch_accepts(schedule, pp, m), (schedule, pp, m)


@pytest.mark.parametrize("schedule,m,expect", [
    ("1f1b", 1, "needs micro-batches >= pp = 2"),
    ("dualpipev", 3, "needs micro-batches >= 2*pp = 4"),
    ("interleaved_1f1b", 5, "divisible by its number of rounds max(1, m // pp) = 2"),
    ("zero_bubble", 7, "divisible by its number of rounds max(1, m // pp) = 3"),
])
def test_microbatch_messages(schedule, m, expect):
    from xpar.config.layout import microbatch_ok
    from xpar.config.validate import ConfigError
    with pytest.raises(ConfigError) as e:
        spec_for("parallel=pp", f"parallel.schedule={schedule}", f"parallel.micro_batches={m}")
    msg = str(e.value)
    assert expect in msg and f"micro_batches={m}" in msg, msg
    works = [int(x) for x in msg.split("micro_batches that work: [")[1].split("]")[0].split(",")]
    assert works and all(microbatch_ok(schedule, 2, k) for k in works), msg


@pytest.mark.parametrize("schedule", ["gpipe", "looped_bfs", "zbv"])
def test_schedules_without_microbatch_rule_accept_one(schedule):
    assert spec_for("parallel=pp", f"parallel.schedule={schedule}", "parallel.micro_batches=1").micro_batches == 1


@pytest.mark.parametrize("split,why", [("[1,2]", "sum 3"), ("[2,3]", "sum 5"), ("[4]", "len 1"), ("[1,1,1,1]", "len 4")])
def test_layer_split_must_cover_each_layer_once(split, why):
    from xpar.config.validate import ConfigError
    with pytest.raises(ConfigError) as e:
        spec_for("parallel=pp", f"parallel.layer_split={split}")
    assert "assign each of the 4 layers exactly once" in str(e.value) and why in str(e.value)


def test_uneven_layer_split_builds_those_stages():
    from xpar.parallel.factory import build_model
    spec = spec_for("parallel=pp", "parallel.layer_split=[1,3]")
    chunks = build_model(spec, [0, 1])
    assert [list(c.layers) for c in chunks] == [["0"], ["1", "2", "3"]]
    assert chunks[0].tok_embeddings is not None and chunks[0].output is None and chunks[1].output is not None


def test_virtual_stages_auto_and_stage_placement():
    assert spec_for("parallel=pp").layout.virtual_stages == 1
    inter = spec_for("parallel=pp", "parallel.schedule=interleaved_1f1b")
    assert inter.layout.virtual_stages == 2 and inter.layer_split == [1, 1, 1, 1]
    assert [inter.layout.stages_of(r) for r in (0, 1)] == [[0, 2], [1, 3]]  # loop
    zbv = spec_for("parallel=pp", "parallel.schedule=zbv")
    assert [zbv.layout.stages_of(r) for r in (0, 1)] == [[0, 3], [1, 2]]  # V


@pytest.mark.slow
def test_zero3_note_only_for_zero_bubble_schedules():
    assert spec_for("parallel=pp", "parallel.zero_stage=3", "parallel.schedule=1f1b").layout.zero_stage == 3
    for s in ZB:
        spec = spec_for("parallel=pp", "parallel.zero_stage=3", f"parallel.schedule={s}")
        assert spec.layout.zero_stage == 2 and spec.notes and s in spec.notes[0]


@pytest.mark.parametrize("m,value", [(1, 0.5), (2, 1 / 3), (4, 0.2), (8, 1 / 9)])
def test_theory_gpipe_1f1b(m, value):
    from xpar.estimate.schedule import bubble_theory as theory
    assert theory("gpipe", 2, m, 1) == pytest.approx(value)
    assert theory("1f1b", 2, m, 1) == pytest.approx(value)


def test_theory_interleaved_and_zero_bubble():
    from xpar.estimate.schedule import bubble_theory as theory
    assert theory("interleaved_1f1b", 2, 4, 2) == pytest.approx(1 / 9)
    assert theory("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    for s in ZB:  # from the action list: well below 1F1B's bubble at the same pp and m
        assert 0.0 <= theory(s, 2, 4, 2) < theory("1f1b", 2, 4, 1) / 2


def _record(per_rank: list[list]) -> list[dict]:
    return [{"pp_rank": r, "steps": [{"span": max(a[4] for a in acts), "actions": acts}]}
            for r, acts in enumerate(per_rank)]


def test_measured_bubble_of_an_ideal_gpipe_step_is_theory():
    """Synthetic records of a perfect GPipe step (F = 1, B = 2, p = 2, m = 4): measured,
    simulated and theory agree (0.2), and the timeline PNG renders."""
    from xpar.track.bubble import step_bubbles
    from xpar.estimate.schedule import gpipe_actions, simulate
    from xpar.track.plots import timeline_figure

    acts = gpipe_actions(2, 4)
    sim = simulate(acts, {"F": 1.0, "B": 2.0})
    per_rank = [[[a.kind, a.stage, a.mb, *sim.times[a]] for a in r] for r in acts]
    b = step_bubbles(_record(per_rank), 0)
    assert b["measured"] == pytest.approx(0.2) and b["simulated"] == pytest.approx(0.2)
    # the same actions, each started 10 % late: the replay still finds the ideal schedule
    late = [[[k, s, mb, t0 * 1.1, t0 * 1.1 + (t1 - t0)] for k, s, mb, t0, t1 in r] for r in per_rank]
    b2 = step_bubbles(_record(late), 0)
    assert b2["measured"] > 0.25 and b2["simulated"] == pytest.approx(0.2)
    fig = timeline_figure({"schedule": "gpipe", "pp": 2, "m": 4, "v": 1, "step": 0, "theory": 0.2, **b2})
    with tempfile.TemporaryDirectory() as d:
        fig.savefig(Path(d) / "t.png")
        assert (Path(d) / "t.png").stat().st_size > 5000
