"""`xpar calibrate`: this machine measured into a hardware preset that a run then uses."""
import json
import os
import subprocess
import sys

import mlflow
import pytest

from tests.conftest import spec_for


def test_alpha_beta_fit_recovers_the_model():
    """Timings made from t = steps * alpha + ring_bytes / beta give alpha and beta back."""
    from xpar.calibrate.preset import fit_alpha_beta
    from xpar.estimate.comm.collectives import ring_steps
    from xpar.estimate.comm.volume import ring_factor

    alpha, beta, n = 25e-6, 3e9, 4
    timings = {c: {s: ring_steps(c, n) * alpha + (s if c == "send_recv" else ring_factor(c, n) * s) / beta
                   for s in (2 ** 10, 2 ** 16, 2 ** 22)} for c in ("allreduce", "allgather", "send_recv")}
    timings["reduce_scatter"] = {"unsupported": "not in this backend"}
    got = fit_alpha_beta(timings, n)
    assert got == pytest.approx((alpha, beta), rel=1e-6)


def test_pipeline_sends_pay_the_measured_point_to_point_latency():
    """gloo here: a send/recv costs ~50 us, a collective ~0.3-4 ms per step. calibrate fits the
    send/recv latency on its own (hardware.p2p_latency_us) and a pipeline send pays it, not the
    collectives' step latency; without it the old sum holds."""
    from dataclasses import replace

    from xpar.calibrate.preset import fit_p2p_latency
    from xpar.estimate.comm.collectives import p2p_time

    beta = 2e9
    timings = {"send_recv": {s: 50e-6 + s / beta for s in (2 ** 10, 2 ** 16, 2 ** 20)},
               "allreduce": {2 ** 10: 2e-3}}
    assert fit_p2p_latency(timings, beta) == pytest.approx(50e-6)
    assert fit_p2p_latency({"send_recv": {"unsupported": "x"}}, beta) is None
    hw = spec_for("hardware=local", "hardware.intra_node_gb_per_s=2", "hardware.intra_node_latency_us=900",
                  "hardware.collective_latency_us=0", "hardware.link_efficiency=1").hardware
    assert p2p_time(hw, 2e6, False) == pytest.approx(900e-6 + 1e-3)
    assert p2p_time(replace(hw, p2p_latency_us=50.0), 2e6, False) == pytest.approx(50e-6 + 1e-3)


def test_measured_ring_step_curves_replace_alpha_beta_inside_a_node():
    """calibrate turns each collective's timings on w workers into seconds per ring step by chunk
    (payload / w; send/recv: the message), made non-decreasing; a single-node group then pays
    ring steps x the curve at its chunk (linear between points, the last segment extended), a
    group across nodes and a preset without curves keep the alpha-beta model."""
    from dataclasses import replace

    from xpar.calibrate.preset import monotone, ring_step_curves
    from xpar.estimate.comm.collectives import Group, collective_time, curve_at, p2p_time

    w = 2
    timings = {"allgather": {2 ** 20: 1e-3, 2 ** 24: 20e-3, 2 ** 26: 200e-3},  # super-linear, as gloo's here
               "allreduce": {2 ** 20: 3e-3, 2 ** 24: 2e-3, 2 ** 26: 40e-3},  # a slow outlier at 1 MiB
               "send_recv": {2 ** 20: 1e-3, 2 ** 26: 30e-3}, "broadcast": {2 ** 20: 1e-3, 2 ** 26: 50e-3},
               "reduce_scatter": {"unsupported": "x"}}
    curves = ring_step_curves(timings, w)
    assert set(curves) == {"allgather", "allreduce", "send_recv", "broadcast"}
    assert curves["broadcast"] == [[2 ** 20, 1e3], [2 ** 26, 50e3]]  # the whole message each step
    assert curves["allgather"] == [[2 ** 19, 1e3], [2 ** 23, 20e3], [2 ** 25, 200e3]]
    assert [us for _, us in curves["allreduce"]] == pytest.approx([1.25e3, 1.25e3, 20e3])  # 2 steps, pooled
    assert monotone([3.0, 1.0, 2.0, 5.0]) == pytest.approx([2.0, 2.0, 2.0, 5.0])
    assert curve_at([[10, 1.0], [20, 3.0]], 15) == 2.0 and curve_at([[10, 1.0], [20, 3.0]], 5) == 1.0
    assert curve_at([[10, 1.0], [20, 3.0]], 40) == 7.0
    hw = spec_for("hardware=local", "hardware.intra_node_gb_per_s=2", "hardware.collective_latency_us=0",
                  "hardware.link_efficiency=1").hardware
    measured = replace(hw, ring_step_us_by_bytes=curves)
    assert collective_time(measured, "allgather", 2 ** 26, Group(2, 2)) == pytest.approx(0.2)
    assert collective_time(measured, "allgather", 3 * 2 ** 25, Group(2, 2)) == pytest.approx(0.32)  # extended
    assert collective_time(measured, "allgather", 2 ** 25, Group(4, 4)) == pytest.approx(3 * 20e-3)  # 8 MiB chunks
    assert collective_time(measured, "allreduce", 2 ** 24, Group(2, 2)) == pytest.approx(2.5e-3)
    assert p2p_time(measured, 2 ** 20, False) == pytest.approx(1e-3)
    assert collective_time(measured, "broadcast", 2 ** 26, Group(3, 3)) == pytest.approx(2 * 50e-3)  # root to 2
    for kind, group in (("reduce_scatter", Group(2, 2)), ("allgather", Group(4, 2))):  # no curve; across nodes
        assert collective_time(measured, kind, 2 ** 24, group) == collective_time(hw, kind, 2 ** 24, group)


def test_cpu_share_and_the_cores_a_run_got():
    """The workers' CPU share between two schedstat samples (ns on a core / ns runnable) and the
    cores that makes: all of them when the share is 1 or the workers are fewer; 8 workers on 2
    cores at share 0.2 had 1.6 cores (the estimate's stretch then 5, not 4)."""
    from xpar.run.fidelity import cores_got, cpu_share, task_cpu_ns

    before = {(1, 1): (100, 0), (1, 2): (0, 0), (9, 9): (5, 5)}
    after = {(1, 1): (400, 100), (1, 2): (100, 400)}  # thread (9, 9) ended: left out
    assert cpu_share(before, after) == pytest.approx((300 + 100) / (300 + 100 + 100 + 400))
    assert cpu_share({}, {}) == 1.0
    assert cores_got(1.0, 2, 1, 2) == 2 and cores_got(0.5, 2, 1, 2) == 1.0 and cores_got(0.2, 8, 1, 2) == 1.6
    assert cores_got(1.0, 2, 1, 2, steal=0.1) == pytest.approx(1.8)  # the hypervisor ran another guest 10 % of the time
    from xpar.run.fidelity import machine_jiffies, steal_fraction
    assert steal_fraction((10, 1000), (30, 1200)) == pytest.approx(0.1) and steal_fraction((0, 0), (0, 0)) == 0.0
    steal, total = machine_jiffies()
    assert 0 <= steal <= total and total > 0  # Linux /proc/stat
    mine = task_cpu_ns([os.getpid()], main_only=True)
    assert list(mine) == [(os.getpid(), os.getpid())] and mine[os.getpid(), os.getpid()][0] > 0


def test_matmul_efficiency_fit_is_the_cost_model_curve():
    from xpar.calibrate.preset import fit_matmul_efficiency
    rates = {n: 1e11 * 0.8 * n / (n + 32) for n in (64, 256, 512)}
    assert fit_matmul_efficiency(rates, 1e11, 32) == pytest.approx(0.8)


def test_cpu_matmul_efficiency_makes_the_cost_model_time_the_measured_reference_block():
    """On a CPU, matmul_efficiency is fitted so that the cost model's forward and backward of the
    reference block (layer_costs at that efficiency + its operators' host time) equals the
    measured seconds; a block measured faster than its non-matmul terms gives 1, never more."""
    from types import SimpleNamespace as NS

    from xpar.calibrate.measure import REFERENCE_BATCH, REFERENCE_BLOCK
    from xpar.calibrate.preset import fit_block_efficiency
    from xpar.config.schema import HardwareConfig, ModelConfig
    from xpar.estimate.cost import Assumptions, layer_costs
    from xpar.estimate.compute.host import block_ops

    cfg, peak, hbm, op_us = ModelConfig(**REFERENCE_BLOCK), 0.2, 0.015, 2.5
    spec = NS(model=cfg, seq_len=cfg.seq_len, tp=1, train=NS(micro_batch_size=REFERENCE_BATCH, dtype="fp32"),
              parallel=NS(recompute_layers=None),
              layout=NS(layer_split=(cfg.n_layers,), recompute="none", sequence_parallel=False),
              hardware=HardwareConfig(device="cpu", peak_tflops=peak, hbm_tb_per_s=hbm, matmul_efficiency=0.7))
    c = layer_costs(spec, Assumptions.xpar_cpu())
    measured = sum(c.values()) - sum(v for k, v in c.items() if k.startswith("logits")) + sum(block_ops(cfg)) * op_us * 1e-6
    assert fit_block_efficiency(measured, peak, hbm, op_us) == pytest.approx(0.7)
    assert fit_block_efficiency(c["mem_f"], peak, hbm, op_us) == 1.0
    from xpar.calibrate.preset import preset_values
    values = preset_values({512: 2e11}, hbm * 1e12, 1e-3, 1e9, "cpu", {"op_overhead_us": op_us}, measured)
    assert values["matmul_efficiency"] == pytest.approx(0.7)
    assert preset_values({512: 2e11}, hbm * 1e12, 1e-3, 1e9, "cuda", None, measured)["matmul_efficiency"] == 1.0  # GEMMs


def test_large_collectives_are_timed_in_calls_that_take_no_page_faults():
    """gloo allocates a message-sized temporary per all-gather: on a freshly grown heap some
    calls fault on every page of it (0.8-1.1 s for 256 MiB here, 0.15 s without). settled_time
    keeps the calls during which no rank faulted on more than 1 % of the message's pages."""
    import mmap
    import time

    import torch.distributed as dist

    from xpar.calibrate.measure import settled_time
    from xpar.run.launch import free_port

    calls = []

    def call():  # every other call writes 64 MiB of fresh pages, and is slow
        calls.append(len(calls))
        if len(calls) % 2:
            with mmap.mmap(-1, 2 ** 26) as fresh:
                fresh.madvise(mmap.MADV_NOHUGEPAGE)  # a fault per 4 KiB page, whatever the host's THP setting
                fresh.write(bytes(2 ** 26))
        time.sleep(0.01 if len(calls) % 2 else 0.001)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        t = settled_time(call, 3, 2 ** 26)
    finally:
        dist.destroy_process_group()
    assert t < 0.005 and len(calls) == 6  # a warm-up call, then two faulting and three settled


@pytest.mark.slow
def test_calibrate_writes_a_preset_that_runs_use(tmp_path):
    """The preset is named for itself, calibrate says what it measures as it goes, and a run on the
    preset is labelled and tagged calibrated (issue 45)."""
    name = f"pytest_{os.getpid()}"
    r = subprocess.run([sys.executable, "-m", "xpar", "calibrate", "hardware=local", "--quick", "--name", name,
                        "--out", str(tmp_path / "cal")], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    from xpar.config.presets import conf_dir
    preset = conf_dir() / "hardware" / f"calibrated_{name}.yaml"
    try:
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"hardware=calibrated_{name}" in r.stdout
        assert f"name: calibrated_{name}" in preset.read_text()  # its own name, not local
        assert r.stderr.count("xpar calibrate: [") >= 6, r.stderr  # a progress line per stage
        raw = json.loads((tmp_path / "cal" / "calibration.json").read_text())
        assert set(raw["collectives"]) == {"allreduce", "allgather", "reduce_scatter", "broadcast", "send_recv"}
        assert raw["alpha_s"] >= 0 and raw["beta_bytes_per_s"] > 0
        curves = raw["preset"]["ring_step_us_by_bytes"]  # per collective, non-decreasing in chunk size
        assert set(curves) == set(raw["collectives"]) and len(curves["allgather"]) == 4
        assert all(a[1] <= b[1] for c in curves.values() for a, b in zip(c, c[1:]))
        spec = spec_for(f"hardware=calibrated_{name}")  # validates and resolves with the measured figures
        assert spec.mode == "execute"
        assert spec.hardware.peak_tflops == pytest.approx(raw["preset"]["peak_tflops"])
        assert spec.hardware.intra_node_gb_per_s == pytest.approx(raw["beta_bytes_per_s"] / 1e9)
        got = spec.hardware.ring_step_us_by_bytes["allgather"]
        assert [b for b, _ in got] == [b for b, _ in curves["allgather"]]
        assert [us for _, us in got] == pytest.approx([us for _, us in curves["allgather"]])
        host = raw["host"]  # host time per operator, per DTensor operator, per FSDP2 unit (xpar.estimate.compute.host)
        assert 0 < host["op_overhead_us"] < 1000 and host["dtensor_op_overhead_us"] > 0
        assert host["fsdp_unit_overhead_us"] > 0 and host["block_ops"] > 100
        assert host["tp_block_overhead_us"] > 0 and host["tp_last_overhead_us"] > 0  # DTensor under the tp plan
        assert spec.hardware.tp_block_overhead_us == pytest.approx(host["tp_block_overhead_us"])
        assert spec.hardware.op_overhead_us == pytest.approx(host["op_overhead_us"])
        assert spec.hardware.cpu_cores == len(os.sched_getaffinity(0))
        from xpar.calibrate.preset import (
            fit_block_efficiency,  # matmul_efficiency fitted to the reference block
        )
        assert raw["block_s"] > 0 and spec.hardware.matmul_efficiency == pytest.approx(fit_block_efficiency(
            raw["block_s"], raw["preset"]["peak_tflops"], raw["preset"]["hbm_tb_per_s"], host["op_overhead_us"]))
        from xpar.estimate.cost import estimate
        e = estimate(spec)
        assert e.time_breakdown["host_overhead"] > 0
        ns = raw["preset"]["optimizer_ns_per_element"]  # torch's AdamW step measured per element
        assert 0 < ns < 1000 and spec.hardware.optimizer_ns_per_element == pytest.approx(ns)
        grads = e.memory.grads * (1 + 2 + 3 * (spec.micro_batches - 1)) / (spec.hardware.hbm_tb_per_s * 1e12)
        assert e.time_breakdown["optimizer"] == pytest.approx(e.memory.optimizer / 8 * ns * 1e-9 + grads, rel=1e-9)
        assert 0 <= raw["preset"]["sync_wait_us"] < 1e5 and spec.hardware.sync_wait_us == raw["preset"]["sync_wait_us"]
        from xpar.estimate.cost import (
            peak_memory,  # memory is the local preset's: no CUDA context on a CPU
        )
        assert peak_memory(spec).total == pytest.approx(peak_memory(spec_for("hardware=local")).total, rel=1e-9)
        mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
        runs = mlflow.search_runs(experiment_names=["xpar"])
        assert list(runs["tags.xpar.mode"]) == ["calibrate"]
        assert runs["tags.xpar.contention"].iloc[0] in ("true", "false")
        run = subprocess.run([sys.executable, "-m", "xpar", f"hardware=calibrated_{name}", "train.steps=2",
                              "train.warmup_steps=1", "run.progress=false", "parallel.dp=2"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        assert "UNCALIBRATED" not in run.stdout and "fidelity/step_time_ratio (own" in run.stdout, run.stdout
        runs = mlflow.search_runs(experiment_names=["xpar"], filter_string="tags.`xpar.mode` = 'execute'")
        assert list(runs["tags.xpar.calibrated"]) == ["true"]
        assert list(runs["tags.xpar.hardware"]) == [f"calibrated_{name}"]
    finally:
        preset.unlink(missing_ok=True)


def test_a_calibration_under_contention_says_so():
    """Collectives measured with a core half the time they wanted one, on cores enough for every
    worker: the load of other processes is calibrated in, and calibrate warns."""
    from xpar.calibrate.command import contention_warning

    busy = {"allreduce": {1024: 0.5, 4096: 0.4}, "allgather": {1024: 0.45}}
    assert "contention" in contention_warning(busy, workers=2, threads=1, cores=2)
    assert contention_warning({"allreduce": {1024: 0.97}}, workers=2, threads=1, cores=2) is None
    assert contention_warning({"allreduce": {1024: 0.5}}, workers=4, threads=1, cores=2) is None  # 2 cores, 4 workers


@pytest.mark.slow
def test_calibrate_refuses_another_machine(tmp_path):
    r = subprocess.run([sys.executable, "-m", "xpar", "calibrate", "hardware=a100_80gb_8gpu"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "measures this machine" in r.stderr and "Traceback" not in r.stderr


def _dispatched(fn) -> int:
    from xpar.calibrate.measure import _count_ops
    return _count_ops(fn)


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("position", ["rope", "learned"])
def test_operator_counts_are_the_models(norm, position):
    """xpar.estimate.compute.host's operator counts equal what the model dispatches (TorchDispatchMode),
    for a block, the first stage's embeddings and the last stage's norm, logits and loss, over
    activation, bias and grouped K/V."""
    import itertools
    from dataclasses import replace

    import torch

    from xpar.estimate.compute.host import block_ops, end_ops
    from xpar.models.transformer import Block, Transformer
    from xpar.parallel.factory import cross_entropy

    base = spec_for("model=tiny").model
    for act, bias, kv in itertools.product(("swiglu", "gelu"), (False, True), (2, 4)):
        cfg = replace(base, norm=norm, position=position, activation=act, bias=bias, n_kv_heads=kv)
        block, x, out = Block(cfg), torch.randn(1, 8, cfg.hidden, requires_grad=True), []
        f = _dispatched(lambda: out.append(block(x)))
        b = _dispatched(lambda: out[0].backward(torch.ones_like(out[0])))
        assert (f, b) == block_ops(cfg), cfg
        tok, ends = torch.randint(0, cfg.vocab_size, (1, 8)), end_ops(cfg)
        first, h = Transformer(cfg, layers=[0], first=True, last=False), []  # a stage of one block: ends = stage - block
        assert _dispatched(lambda: h.append(first(tok))) - f == ends["first_f"]
        assert _dispatched(lambda: h[0].backward(torch.ones_like(h[0]))) - b == ends["first_b"]
        last, loss = Transformer(cfg, layers=[0], first=False, last=True), []
        assert _dispatched(lambda: loss.append(cross_entropy(last(x), tok))) - f == ends["last_f"]
        assert _dispatched(lambda: loss[0].backward()) - b == ends["last_b"]


def test_a_measured_optimizer_rate_replaces_bytes_over_bandwidth_for_the_unfused_adamw():
    """AdamW's step: bytes over HBM unless the hardware carries a measured rate; the measured rate
    describes torch's single-tensor AdamW (xpar's), not the fused ones other frameworks run."""
    from xpar.estimate.cost import optimizer_time
    fp32_states = 8 * 1e6  # 1e6 elements of two fp32 moments
    assert optimizer_time(fp32_states, "fp32", 0.02, 84.0) == pytest.approx(1e6 * 84 / 0.02e12)
    assert optimizer_time(fp32_states, "fp32", 0.02, 84.0, 5.0) == pytest.approx(1e6 * 5e-9)
    assert optimizer_time(fp32_states, "fp32", 0.02, None, 5.0) == optimizer_time(fp32_states, "fp32", 0.02, None)


def test_every_collective_and_send_waits_for_its_peers_once_per_call_unstretched():
    """hardware.sync_wait_us (xpar calibrate: a collective after compute against one alone) adds to
    every collective and pipeline send; a step whose workers outnumber the cores stretches its work,
    not its waits (a waiting worker holds no core)."""
    from dataclasses import replace

    from xpar.estimate.comm.collectives import Group, collective_time, p2p_time
    from xpar.estimate.cost import estimate, with_hardware
    spec = spec_for("parallel=tp", "model=tiny", "hardware=local", "hardware.peak_tflops=0.1",
                    "hardware.intra_node_gb_per_s=1.5", "hardware.cpu_cores=2")
    hw, waited = spec.hardware, replace(spec.hardware, sync_wait_us=1000.0)
    for n in (4096, 2 ** 22):
        assert collective_time(waited, "allreduce", n, Group(2, 2)) == pytest.approx(
            collective_time(hw, "allreduce", n, Group(2, 2)) + 1e-3)
        assert p2p_time(waited, n, False) == pytest.approx(p2p_time(hw, n, False) + 1e-3)
    assert collective_time(waited, "allreduce", 4096, Group(1, 1)) == 0  # no peers, no wait
    base, wait = estimate(spec), estimate(with_hardware(spec, sync_wait_us=1000.0))
    calls = spec.micro_batches * (4 * spec.model.n_layers + 2)  # tp all-reduces: 2 per layer each way, 2 ends
    assert wait.time_breakdown["tp_comm"] - base.time_breakdown["tp_comm"] == pytest.approx(calls * 1e-3)
    crowded = with_hardware(spec, cpu_cores=1)  # 2 workers on 1 core: work stretched 2x, waits not
    extra = estimate(with_hardware(crowded, sync_wait_us=1000.0)).time_per_step_s - estimate(crowded).time_per_step_s
    assert extra == pytest.approx(wait.time_per_step_s - base.time_per_step_s, rel=1e-6)


def test_host_time_only_where_measured():
    """GPU presets carry no host figures: their estimates have no host term; a CPU preset with
    the figures pays them per operator, more under FSDP2 (DTensor parameters, unit hooks), and
    a step stretches by workers / cores when they outnumber the cores."""
    from dataclasses import replace

    from xpar.estimate.cost import estimate

    gpu_spec = spec_for("model=7b", "hardware=a100_80gb_8gpu", "train=cluster", "parallel=zero3")
    gpu = estimate(gpu_spec)
    # on a GPU the host term is the kernel model's launch gaps only (kernel_launch_us per kernel; issue 42)
    assert 0 < gpu.time_breakdown["host_overhead"] < 0.01 * gpu.time_per_step_s
    no_gaps = replace(gpu_spec, hardware=replace(gpu_spec.hardware, kernel_launch_us=0.0))
    assert estimate(no_gaps).time_breakdown["host_overhead"] == 0
    figures = dict(op_overhead_us=2.0, dtensor_op_overhead_us=7.0, fsdp_unit_overhead_us=400.0)

    def est(*overrides, **hw):
        spec = spec_for(*overrides)
        return estimate(replace(spec, hardware=replace(spec.hardware, **hw)))

    bare, dp = est("parallel=dp"), est("parallel=dp", **figures)
    zero3 = est("parallel=zero3", **figures)
    assert bare.time_breakdown["host_overhead"] == 0 < dp.time_breakdown["host_overhead"]
    assert zero3.time_breakdown["host_overhead"] > dp.time_breakdown["host_overhead"] + 4 * 400e-6
    shared = est("parallel=dp", cpu_cores=1, **figures)  # 2 workers on 1 core
    assert shared.time_per_step_s == pytest.approx(2 * dp.time_per_step_s)


def test_tp_host_time_is_the_measured_block_and_ends_else_the_linears_operators():
    """With the tp figures xpar calibrate measures, a tp run pays them per block and micro-batch and
    once per stage end; presets without them (older calibrations) fall back to 13 DTensor
    operators per linear."""
    from dataclasses import replace

    from xpar.estimate.compute.host import LINEAR_OPS, host_costs

    spec = spec_for("parallel=tp", "hardware=local")
    base = dict(op_overhead_us=2.0, dtensor_op_overhead_us=7.0)
    old = host_costs(replace(spec, hardware=replace(spec.hardware, **base)))
    tp = dict(tp_block_overhead_us=3000.0, tp_first_overhead_us=400.0, tp_last_overhead_us=2500.0)
    new = host_costs(replace(spec, hardware=replace(spec.hardware, **base, **tp)))
    linears = 7  # the tiny preset's SwiGLU block: wq, wk, wv, wo, w1, w2, w3
    assert old["f"] + old["b"] - new["f"] - new["b"] == pytest.approx((linears * sum(LINEAR_OPS) * 7.0 - 3000.0) * 1e-6)
    assert new["first_f"] + new["first_b"] - old["first_f"] - old["first_b"] == pytest.approx(400e-6)
    assert new["last_f"] + new["last_b"] - old["last_f"] - old["last_b"] == pytest.approx(2500e-6)
    dp = host_costs(replace(spec_for("parallel=dp", "hardware=local"), hardware=replace(spec.hardware, **base, **tp)))
    assert dp["last_f"] + dp["last_b"] == pytest.approx(old["last_f"] + old["last_b"])  # no tp, no tp time


def test_estimated_idle_is_the_measured_definition():
    """fidelity's estimated bubble is 1 - sum busy / (pp x schedule time), as measured: the
    schedule's bubble for balanced stages without send time; a lighter stage idles too; exposed
    sends are idle time; host time after the schedule is left out."""
    from xpar.run.fidelity import estimated_idle

    m, beta = 4, 0.2
    balanced = {"matmul": m * 1.0, "bubble": beta / (1 - beta) * m * 1.0}
    assert estimated_idle(balanced, beta, 2) == pytest.approx(beta)
    uneven = {"matmul": m * 1.0, "bubble": beta / (1 - beta) * m * 0.5}  # stages of 1.0 and 0.5 s
    assert estimated_idle(uneven, beta, 2) == pytest.approx(1 - (m * 1.0 + m * 0.5) / (2 * (m * 1.0 + uneven["bubble"])))
    three = {"matmul": 8 * 1.0, "bubble": 2 / 8 * 8 * 0.5}  # stages of 1.0, 0.75 and 0.25 s; beta 2 / 10 at m 8
    assert estimated_idle(three, 0.2, 3) == pytest.approx(
        1 - (8 * 1.0 + 8 * 0.75 + 8 * 0.25) / (3 * (8.0 + three["bubble"])))
    sends = dict(balanced, matmul=m * 0.9, pp_comm=m * 0.1)  # same schedule, a tenth of it waiting on sends
    assert estimated_idle(sends, beta, 2) == pytest.approx(beta + 0.1 * (1 - beta))
    assert estimated_idle(dict(balanced, host_overhead=3.0), beta, 2, outside=3.0) == pytest.approx(beta)
    assert estimated_idle(balanced, 0.0, 2) == 0.0
    gathers = dict(balanced, matmul=m * 0.6, dp_comm_exposed=m * 0.4 + 2.0)  # FSDP gathers in the stages, 2 s after
    assert estimated_idle(gathers, beta, 2, outside=2.0) == pytest.approx(beta)
    # FSDP's reduction after the last backward: 1 s in the schedule, in no action of either rank
    reduce = dict(balanced, dp_comm_exposed=1.0)  # stages of 1 s each: schedule 4 + 1 + 1, busy 4 per rank
    assert estimated_idle(reduce, beta, 2, idle_inside=1.0) == pytest.approx(1 - 2 * 4.0 / (2 * 6.0))


def test_estimated_idle_of_3d_counts_fsdp_gathers_as_busy():
    """3D (pp x FSDP over dp): the gathers of each micro-batch run inside the stages' forward and
    backward, busy as measured; the estimated idle stays the schedule's bubble plus sends, in
    [0, 1) (it was negative when the gathers were in the mean micro-batch but not the schedule).
    The reduction after the last backward runs inside the schedule but outside every action
    (torch's perform_reduce_grad under FSDP): idle, more than with it left outside the schedule."""
    from dataclasses import replace

    from xpar.estimate.cost import estimate
    from xpar.run.fidelity import _dp_end, _host_outside, estimated_idle

    spec = spec_for("parallel=3d_local", "hardware.intra_node_gb_per_s=1.5", "hardware.hbm_tb_per_s=0.02",
                    "hardware.peak_tflops=0.1", "hardware.cpu_cores=2", "hardware.op_overhead_us=2",
                    local_devices=8)
    slow = {k: [[512, 2000.0], [2 ** 27, 2e5]] for k in ("allgather", "reduce_scatter")}  # gathers dominate
    spec = replace(spec, hardware=replace(spec.hardware, ring_step_us_by_bytes=slow))
    est = estimate(spec)
    t = est.time_breakdown
    assert t["dp_comm_exposed"] > t["bubble"] > 0
    idle = estimated_idle(t, est.bubble_ratio, spec.pp, _host_outside(spec), idle_inside=_dp_end(spec))
    assert est.bubble_ratio <= idle < 1
    assert _dp_end(spec) > 0 and idle > estimated_idle(t, est.bubble_ratio, spec.pp, _host_outside(spec) + _dp_end(spec))
    assert estimated_idle(dict(t, dp_comm_exposed=0.0), est.bubble_ratio, spec.pp, _host_outside(spec)) < 0  # the old sum


def test_passes_over_the_gradients_are_counted_on_the_cpu():
    """The optimizer term holds the passes over the gradients on the CPU (xpar.estimate.cost.
    gradient_time): autograd's accumulation (3 per micro-batch after the first) over the held
    gradients; over the reduced ones (1/dp of them under pp with ZeRO-2/3) the clip's norm (1)
    and scaling (2) and torch's division by m under pp (2); without the clip only the norm; none
    on a GPU preset."""
    from dataclasses import replace

    from xpar.estimate.cost import (
        assumptions_for,
        estimate,
        gradient_time,
        reduced_grad_bytes,
    )
    from xpar.estimate.compute.host import oversubscription

    assert gradient_time(1e9, 1e9, 4, 1, True, 0.01, 3.0) == pytest.approx(1e9 * (3 * 3 + 1 + 2) / 1e10)
    assert gradient_time(1e9, 5e8, 4, 2, True, 0.01, 3.0) == pytest.approx((1e9 * 3 * 3 + 5e8 * (1 + 2 + 2)) / 1e10)
    assert gradient_time(1e9, 1e9, 1, 2, False, 0.01, 3.0) == pytest.approx(1e9 / 1e10)
    assert gradient_time(1e9, 1e9, 4, 1, True, 0.01, 3.0, counted=False) == 0.0
    assert reduced_grad_bytes(8.0, 2, 2, 3) == 4.0 and reduced_grad_bytes(8.0, 2, 1, 3) == reduced_grad_bytes(8.0, 2, 2, 1) == 8.0
    for overrides in (("parallel=pp", "parallel.micro_batches=4"), ("parallel=dp", "train.max_grad_norm=null")):
        spec = spec_for("hardware=local", "hardware.hbm_tb_per_s=0.02", *overrides)
        a = assumptions_for(spec)
        e, without = estimate(spec, a), estimate(spec, replace(a, gradient_passes=False))
        want = gradient_time(e.memory.grads, e.memory.grads, spec.micro_batches, spec.pp,
                             spec.train.max_grad_norm is not None, 0.02, 3.0)
        stretch = oversubscription(spec.hardware.cpu_cores, spec.world_size, 1)  # 1 on 2 or more cores
        assert want > 0 and e.time_breakdown["optimizer"] - without.time_breakdown["optimizer"] == pytest.approx(
            want * stretch)
    gpu = spec_for("hardware=a100_80gb_8gpu", local_devices=8)
    assert not assumptions_for(gpu).gradient_passes


def test_calibrate_refuses_more_workers_than_the_host_holds_in_one_line(capsys):
    """`xpar calibrate --quick --workers 1000` on a 25 GB, 2-core host started 1000 workers and ran until killed
    (no preset, no message): refused before any worker starts, with the most this host holds, as a run is
    (xpar.estimate.preflight.check.host_memory_problem); the count it names is taken."""
    from xpar.calibrate.command import main, worker_problems

    host = 25.3e9  # 20.2 GB usable: 57 workers of 0.35 GB
    (line,) = worker_problems(1000, 1, host)
    assert "--workers 1000 need ~350.0 GB" in line and "use at most 57, e.g. --workers 8" in line
    assert worker_problems(57, 1, host) == [] and worker_problems(8, 1, host) == []
    assert worker_problems(58, 1, host) != []
    assert "e.g. --workers 2 --threads 1" in worker_problems(0, 1, host)[0]
    assert main(["--name", "x", "--workers", "100000", "--no-track"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xpar: invalid configuration:") and "--workers 100000 need" in err and "Traceback" not in err
