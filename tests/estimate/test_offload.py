"""Optimizer offload (framework.cpu_offload_optimizer, xpar.estimate.memory.offload): its step time in the
estimate and the planner, the host-memory fit, the hardware it needs, and the refusals."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from xpar.calibrate.published import preset
from xpar.config.checks import ConfigError
from xpar.estimate.cost import estimate, with_hardware
from xpar.estimate.preflight.check import check_run
from xpar.estimate.memory.offload import HOST_STATE_BYTES, offload_time
from xpar.plan.context import PlanContext, spec_of
from xpar.plan.verify import compose_line

REPO = Path(__file__).resolve().parents[2]


def offloaded(model: str = "70b", hardware: str = "a100_80gb_8gpu", *extra: str):
    """The estimate-mode spec of ZeRO-3 over 8 A100s with the optimizer offloaded."""
    line = (f"python -m xpar model={model} hardware={hardware} train=cluster parallel=zero3 parallel.recompute=full "
            f"train.global_batch_size=64 parallel.micro_batches=auto framework=deepspeed framework.cpu_offload_optimizer=true run.mode=estimate "
            f"tracking=off " + " ".join(extra))
    return check_run(compose_line(line))


def test_offloaded_step_is_timed_and_sits_in_the_optimizer_term():
    spec = offloaded()
    e = estimate(spec)
    off = e.offload
    assert off["host_step_s"] > 0 and off["param_to_device_s"] > 0 and off["grad_to_host_s"] > 0
    assert e.memory.optimizer == 0  # the states are on the host
    assert e.time_breakdown["optimizer"] == pytest.approx(off["exposed_s"], rel=1e-12)  # nothing left on the device
    assert sum(e.time_breakdown.values()) == pytest.approx(e.time_per_step_s, rel=1e-12)
    # the node's 8 devices share the host: its step moves 8 x elements x (28 + 2) bytes at 409.6 GB/s
    assert off["host_step_s"] == pytest.approx(8 * off["elements"] * 30 / 409.6e9, rel=1e-12)
    assert off["host_bytes"] == 8 * off["elements"] * HOST_STATE_BYTES
    plain = estimate(replace(spec, framework=replace(spec.framework, cpu_offload_optimizer=False)))
    assert e.time_per_step_s > plain.time_per_step_s - plain.time_breakdown["optimizer"]


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_offload_time_grows_with_the_model_and_shrinks_with_pcie_bandwidth():
    small, big = estimate(offloaded("7b")), estimate(offloaded("70b"))
    for k in ("host_step_s", "param_to_device_s", "grad_to_host_s"):
        assert big.offload[k] > 5 * small.offload[k], k
    spec = offloaded()
    fast = estimate(with_hardware(spec, pcie_gb_per_s=2 * spec.hardware.pcie_gb_per_s))
    slow = estimate(spec)
    assert fast.offload["param_to_device_s"] == pytest.approx(slow.offload["param_to_device_s"] / 2, rel=1e-12)
    assert fast.offload["grad_to_host_s"] == pytest.approx(slow.offload["grad_to_host_s"] / 2, rel=1e-12)
    assert fast.offload["host_step_s"] == slow.offload["host_step_s"]
    assert fast.time_breakdown["optimizer"] < slow.time_breakdown["optimizer"]


def test_offload_time_on_arrays_equals_floats_and_hides_copies_behind_the_backward():
    args = dict(grad_bytes=2, param_bytes=2, pcie_gb_per_s=12.5, host_mem_gb_per_s=400.0, devices_per_node=8)
    n, copies, mb = np.array([1e9, 4e9, 8e9]), np.array([1, 16, 16]), np.array([0.01, 0.01, 100.0])
    arr = offload_time(n, copies, microbatch_compute_s=mb, **args)
    for j in range(3):
        one = offload_time(float(n[j]), int(copies[j]), microbatch_compute_s=float(mb[j]), **args)
        assert all(arr[k][j] == pytest.approx(v, rel=1e-15) for k, v in one.items())
    assert arr["grad_to_host_exposed_s"][2] == 0  # a long backward hides every copy
    one_copy = 4e9 * 2 / 12.5e9  # a short backward hides 2/3 of its compute from each of the 16 copies
    assert arr["grad_to_host_exposed_s"][1] == pytest.approx(16 * (one_copy - 0.01 * 2 / 3), rel=1e-12)


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_planner_offload_columns_equal_the_scalar_estimate():
    """Memory (device and host) and time of offloaded and plain candidates, planner against scalar."""
    from xpar.plan.evaluate import evaluate
    from xpar.plan.space import Constraints, enumerate_layouts
    ctx = PlanContext(model=preset("model", "70b"), hardware=preset("hardware", "a100_80gb_8gpu"),
                      train=dict(dtype="bf16", seq_len=4096), framework=preset("framework", "deepspeed"))
    fw = ctx.framework  # the layouts DeepSpeed runs (its schedules and ZeRO stages under pp)
    space = enumerate_layouts(ctx.model, 8, 8, 4096, Constraints(
        global_batch=(64, 64), offload=(False, True), schedules=tuple(fw["schedules"]),
        zero_stages=tuple(fw["zero_stages"]), pp_zero_stages=tuple(fw["pp_zero_stages"])))
    pick = np.random.default_rng(4).choice(len(space), 16, replace=False)
    cols = {k: v[pick] for k, v in space.cols.items()}
    assert 0 < cols["offload"].sum() < 16
    res = evaluate(ctx, cols)
    for i in range(16):
        e = estimate(spec_of(ctx, cols, i))
        assert res["memory_total"][i] == pytest.approx(e.memory.total, rel=1e-9)
        assert res["time_per_step_s"][i] == pytest.approx(e.time_per_step_s, rel=1e-9)
        assert res["host_bytes"][i] == pytest.approx(e.offload.get("host_bytes", 0.0), rel=1e-9)
        assert res["offload_host_step_s"][i] == pytest.approx(e.offload.get("host_step_s", 0.0), rel=1e-9)


def _plan(*overrides: str):
    from xpar.plan.command import search
    from xpar.plan.inputs import plan_argv, plan_inputs
    args = plan_argv(list(overrides))
    inputs, problems = plan_inputs(compose_line("python -m xpar " + " ".join(args)), args)
    assert not problems, problems
    return search(inputs)


def test_no_host_figures_no_offload_layouts_and_an_estimate_refuses_offload():
    plan = _plan("model=7b", "hardware=a100_80gb_8gpu", "hardware.pcie_gb_per_s=null")
    assert not plan.res["offload"].any() and plan.dropped["offload_hw"] > 0
    # issue 11.3: was accepted with a 0 s optimizer step (offload faster than none); now refused in one line
    with pytest.raises(ConfigError) as e:
        offloaded("13b", "a100_80gb_8gpu", "hardware.host_mem_gb_per_s=null", "hardware.host_memory_gb=null")
    [line] = e.value.problems
    assert "has no hardware.host_mem_gb_per_s, hardware.host_memory_gb (null)" in line
    fix = "hardware.host_mem_gb_per_s=409.6 hardware.host_memory_gb=2000"
    assert fix in line and "framework.cpu_offload_optimizer=false" in line
    offloaded("13b", "a100_80gb_8gpu", "hardware.host_mem_gb_per_s=null", "hardware.host_memory_gb=null", fix)


def test_frameworks_that_do_not_offload_get_no_offload_layouts():
    for fw in ("megatron", "torchtitan"):
        plan = _plan("model=7b", "hardware=a100_80gb_8gpu", f"framework={fw}", "plan.pp=1")
        assert not plan.res["offload"].any() and plan.dropped["offload"] > 0, fw


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_host_memory_must_hold_the_offloaded_states():
    with pytest.raises(ConfigError, match="host memory per node"):
        offloaded("70b", "a100_80gb_8gpu", "hardware.host_memory_gb=512")
    # 70B's 69e9 elements x 16 bytes = 1104 GB on balanced stages; a stage holding the embeddings takes more
    plan = _plan("model=70b", "hardware=a100_80gb_8gpu", "hardware.host_memory_gb=1108")
    assert plan.dropped["host_memory"] > 0 and (plan.res["host_bytes"][plan.ranked] <= 1108e9).all()


def test_offload_at_zero0_is_refused_at_any_dp_and_zero1_at_dp1_is_the_same_layout():
    line = "python -m xpar model=7b hardware=a100_80gb_8gpu train=cluster framework.cpu_offload_optimizer=true " \
           "run.mode=estimate tracking=off "
    with pytest.raises(ConfigError, match=r"needs parallel.zero_stage >= 1 \(got zero_stage=0, dp=8\)"):
        check_run(compose_line(line + "parallel=dp"))
    # issue 11.7: the plan's top line paired ZeRO-0 with offload at dp = 1, while its own drop reason said 1-3
    with pytest.raises(ConfigError, match=r"e.g. parallel.zero_stage=1\."):
        check_run(compose_line(line + "parallel.tp=8 parallel.dp=1 parallel.zero_stage=0 parallel.recompute=full"))
    one = check_run(compose_line(line + "parallel.tp=8 parallel.dp=1 parallel.zero_stage=1 parallel.recompute=full"))
    plain = estimate(replace(one, framework=replace(one.framework, cpu_offload_optimizer=False)))
    zero0 = replace(one, layout=replace(one.layout, zero_stage=0), framework=replace(one.framework, cpu_offload_optimizer=False))
    assert estimate(zero0).time_per_step_s == pytest.approx(plain.time_per_step_s, rel=1e-12)  # dp = 1: ZeRO-1 = ZeRO-0
    assert estimate(zero0).memory.total == pytest.approx(plain.memory.total, rel=1e-12)


def test_plan_offload_rows_run_zero_stage_1_or_more_and_the_drop_reason_agrees():
    plan = _plan("model=70b", "hardware=a100_80gb_8gpu", "framework=deepspeed")
    r, best = plan.res, plan.best
    assert r["offload"][best] and r["zero"][best] >= 1
    assert (r["zero"][r["offload"].astype(bool)] >= 1).all() and plan.dropped["offload_zero"] > 0
    assert not (r["zero"][~r["offload"].astype(bool) & (r["dp"] == 1)]).any()  # plain rows at dp = 1: ZeRO-0 kept
    from xpar.plan.command import reproduce
    line, spec = reproduce(plan)
    assert "parallel.zero_stage=0 framework.cpu_offload_optimizer=true" not in line and spec.layout.zero_stage >= 1


def test_deepspeed_2021_profile_runs_no_offload():
    plan = _plan("model=7b", "hardware=a100_80gb_8gpu", "framework=deepspeed_2021", "plan.pp=1")
    assert not plan.res["offload"].any() and plan.dropped["offload"] > 0


@pytest.mark.parametrize("fw", ["megatron", "torchtitan", "deepspeed_2021"])
def test_estimate_refuses_offload_where_the_framework_profile_runs_none(fw):
    with pytest.raises(ConfigError, match=f"framework={fw} runs no optimizer offload"):
        offloaded("7b", "a100_80gb_8gpu", f"framework={fw}")


@pytest.mark.parametrize("bad", ["[maybe]", "[]", "[1]"])
def test_framework_offload_must_be_booleans(bad):
    with pytest.raises(ConfigError, match=r"framework.offload=.* not allowed; .* values that work: \[false\]"):
        offloaded("7b", "a100_80gb_8gpu", f"framework.offload={bad}")


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_fit_refusal_suggests_offload_only_where_it_would_be_accepted():
    base = ("python -m xpar model=70b hardware=a100_80gb_8gpu train=cluster parallel=zero3 parallel.recompute=full "
            "train.global_batch_size=64 parallel.micro_batches=auto run.mode=estimate tracking=off ")
    with pytest.raises(ConfigError) as e:
        check_run(compose_line(base + "framework=deepspeed parallel.zero_stage=1"))
    assert "(framework.cpu_offload_optimizer=true: estimate only" in str(e.value)
    for fw in ("megatron parallel.zero_stage=1", "torchtitan"):
        with pytest.raises(ConfigError) as e:
            check_run(compose_line(base + f"framework={fw}"))
        assert "offload" not in str(e.value), fw


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_model_states_alone_count_the_framework_widths():
    """issue 11.11: under framework=xpar the device keeps fp32 parameters and gradients (8 bytes/param)."""
    with pytest.raises(ConfigError) as e:
        check_run(compose_line("python -m xpar model=70b hardware=a100_80gb_8gpu train=cluster parallel=zero3 "
                               "framework.cpu_offload_optimizer=true hardware.device_memory_gb=40 "
                               "run.mode=estimate tracking=off"))
    assert "alone (8 bytes/param in bf16 with AdamW under framework=xpar offloaded to host memory" in str(e.value)


@pytest.mark.slow
def test_execute_mode_refuses_offload_in_one_line_exit_2(tmp_path):
    p = subprocess.run([sys.executable, "-m", "xpar", "framework.cpu_offload_optimizer=true", "tracking=off",
                        f"hydra.run.dir={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "framework.cpu_offload_optimizer=true is estimated only" in p.stderr and "Traceback" not in p.stderr


def test_estimate_notes_are_printed_and_tagged_and_offload_parts_logged(tmp_path, capsys):
    """issue 11.3: Estimate.notes were written but never shown or logged."""
    import mlflow

    from xpar.run.job import run_job
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    line = ("python -m xpar model=13b hardware=a100_80gb_8gpu train=cluster parallel=zero3 framework=deepspeed "
            f"framework.cpu_offload_optimizer=true run.mode=estimate run.dry_run=false tracking.uri={uri}")
    report = run_job(compose_line(line), tmp_path / "out", tmp_path)
    out = capsys.readouterr().out
    assert "note: optimizer offloaded to host memory (ZeRO-Offload's schedule)" in " ".join(out.split())
    assert report.notes and report.notes[0].startswith("optimizer offloaded to host memory")
    client = mlflow.tracking.MlflowClient(uri)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert report.notes[0] in run.data.tags["xpar.notes"]
    m = run.data.metrics
    for part in ("grad_to_host_s", "grad_to_host_exposed_s", "host_step_s", "param_to_device_s", "exposed_s"):
        assert f"estimate/offload_{part}" in m, part
    assert m["estimate/offload_host_step_s"] > 0 and m["estimate/offload_host_bytes"] > 0
    assert m["estimate/offload_exposed_s"] == pytest.approx(m["estimate/time_optimizer_s"], rel=1e-9)


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_fit_alternatives_that_change_degrees_print_a_line_that_keeps_the_global_batch():
    """issue 12: 'global batch 8 kept' was promised over a line that ran global batch 2."""
    from xpar.estimate.preflight.check import alternatives
    base = ("python -m xpar model=13b hardware=a100_80gb_8gpu train=cluster parallel.dp=8 parallel.micro_batches=1 "
            "train.micro_batch_size=1 train.global_batch_size=8 run.mode=estimate tracking=off ")
    spec = check_run(compose_line(base + "parallel.zero_stage=3"))  # a valid spec to list alternatives around
    found = alternatives(spec, limit=40)
    degree = [label for label, _, _ in found if "parallel.tp=" in label or "parallel.pp=" in label]
    assert degree, found
    for label, _, _ in found:
        followed = check_run(compose_line(base + "parallel.zero_stage=3 " + label))
        assert followed.global_batch == 8, label


def test_host_memory_refusal_suggests_override_sets_that_pass_when_followed():
    """issue 11.10: the refusal suggested hardware.nodes=2, refused on its own (dp fixed by parallel=zero3)."""
    with pytest.raises(ConfigError) as e:
        offloaded("70b", "a100_80gb_8gpu", "hardware.host_memory_gb=512")
    [line] = e.value.problems
    assert "more than hardware.host_memory_gb=512; values that work (each checked): hardware.nodes=4 " in line
    fixes = line.split("values that work (each checked): ")[1].rstrip(".").split(", or ")
    assert len(fixes) >= 2
    for fix in fixes:
        offloaded("70b", "a100_80gb_8gpu", "hardware.host_memory_gb=512", fix)  # passes every check


def test_an_estimate_run_logs_no_host_system_metrics(tmp_path, monkeypatch):
    """MLflow's system metrics (the recording host's CPU and memory) beside a 64-GPU estimate said 99.8 % CPU of a
    machine the estimate is not about: estimate runs turn them off (xpar.track.runs.system_metrics); sampled every
    0.1 s here, so that even a run of a second would log them."""
    import mlflow

    from xpar.run.job import run_job
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.1")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    line = f"python -m xpar model=7b hardware=a100_80gb_8gpu train=cluster parallel=zero3 run.mode=estimate run.dry_run=false tracking.uri={uri}"
    run_job(compose_line(line), tmp_path / "out", tmp_path)
    client = mlflow.tracking.MlflowClient(uri)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert "throughput/tokens_per_s" in run.data.metrics
    assert not [k for k in run.data.metrics if k.startswith("system/")], sorted(run.data.metrics)
