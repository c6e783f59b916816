"""Estimate mode end to end: cluster presets resolve to their reference hardware, the
fake-process-group dry run agrees with the cost model's parameter bytes, the estimator agrees
with what runs executed here measure, and layouts that do not fit are refused."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import mlflow
import pytest

from tests.conftest import spawn, spec_for
from xpar.config.validate import ConfigError


def _xpar(cwd, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "xpar", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def _only_run(cwd):
    mlflow.set_tracking_uri(f"sqlite:///{cwd / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["xpar"])
    assert len(runs) == 1
    return runs.iloc[0]


# --- (a) the two headline commands ------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("args,hardware,world", [
    (("parallel=3d", "model=70b"), "a100_80gb_64gpu", 64),
    (("parallel=175b_1024gpu",), "a100_80gb_1024gpu", 1024),
], ids=["3d-70b", "175b_1024gpu"])
def test_headline_commands_estimate_on_the_reference_cluster(tmp_path, args, hardware, world):
    r = _xpar(tmp_path, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ESTIMATE" in r.stdout and "Recorded in MLflow" in r.stdout
    assert f"hardware={hardware} assumed" in " ".join(r.stdout.split())
    run = _only_run(tmp_path)
    assert run["status"] == "FINISHED"
    assert run["tags.xpar.mode"] == "estimate" and run["tags.xpar.hardware"] == hardware
    assert "assumed" in run["tags.xpar.notes"]
    assert run["params.hardware.name"] == hardware  # the params say what was estimated
    m = {k[len("metrics."):]: v for k, v in run.items() if k.startswith("metrics.")}
    assert m["estimate/dryrun_param_bytes_diff"] == 0 and m["estimate/dryrun_ranks"] == 6
    assert m["estimate/dryrun_param_bytes"] == m["estimate/analytic_param_bytes"]  # elements x 2 (paper widths)
    assert m["memory/params_bytes"] >= 2 * m["estimate/dryrun_param_bytes"]  # fp32 master weights (+ bf16 copies)
    assert m["estimate/memory_fits"] == 1 and 0 < m["throughput/mfu"] < 1
    for term in ("params", "grads", "optimizer", "activations", "comm_buffers", "framework_overhead"):
        assert m[f"memory/{term}_bytes"] >= 0
    assert 0 < m["pipeline/bubble_ratio"] < 0.2 and m["comm/tp_ring_bytes"] > 0
    client = mlflow.tracking.MlflowClient()
    artifacts = {a.path for a in client.list_artifacts(run["run_id"])}
    assert {"estimate_memory.png", "estimate_step_time.png", "dryrun.json", "config.yaml"} <= artifacts
    assert world == int(m["throughput/tokens_per_s"] / m["throughput/tokens_per_s_per_device"] + 0.5)


@pytest.mark.slow
def test_layout_that_does_not_fit_exits_2_before_anything_runs(tmp_path):
    r = _xpar(tmp_path, "parallel=70b_8gpu")
    assert r.returncode == 2
    assert "does not fit device memory" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "mlflow.db").exists()  # refused before MLflow


# --- (e) presets -----------------------------------------------------------------------------

def test_preset_resolves_local_hardware_to_its_reference_cluster():
    s = spec_for("parallel=3d", "model=70b")
    assert s.hardware.name == "a100_80gb_64gpu" and s.mode == "estimate" and s.world_size == 64
    assert s.hardware.device_memory_gb == 85.0 and s.hardware.peak_tflops == 312  # through the schema
    assert s.dp == 2 and s.train.dtype == "bf16" and s.train.micro_batch_size == 1  # train=cluster
    assert any("hardware=a100_80gb_64gpu assumed: the preset's reference cluster" in n for n in s.notes)
    other = spec_for("parallel=3d", "model=70b", "hardware=h100_80gb_64gpu")  # an explicit choice wins
    assert other.hardware.name == "h100_80gb_64gpu" and not any("assumed" in n for n in other.notes)
    with pytest.raises(ConfigError) as e:  # asked to execute here: no assumption, this machine's refusal
        spec_for("parallel=3d", "model=70b", "run.mode=execute")
    assert "does not fit this machine" in str(e.value) and "assumed" not in str(e.value)


def test_cluster_presets_select_their_model_and_command_line_wins():
    s = spec_for("parallel=175b_1024gpu")
    assert (s.model.name, s.tp, s.pp, s.dp, s.world_size) == ("175b", 8, 16, 8, 1024)
    assert s.global_batch == 1536 and s.layout.recompute == "full"
    assert spec_for("parallel=70b_64gpu").model.name == "70b"
    assert spec_for("parallel=7b_8gpu").model.name == "7b"
    assert spec_for("parallel=175b_1024gpu", "model=70b", "parallel.pp=8").model.name == "70b"
    assert spec_for("parallel=dp").model.name == "tiny"  # other presets untouched


def test_unknown_reference_hardware_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        spec_for("parallel=3d", "model=70b", "parallel.reference_hardware=tpu_v9")
    assert "parallel.reference_hardware='tpu_v9' is not a hardware preset" in str(e.value)


# --- (d) the memory check --------------------------------------------------------------------

def test_not_fit_names_stage_rank_excess_and_that_nothing_fits_on_one_node():
    with pytest.raises(ConfigError) as e:
        spec_for("parallel=70b_8gpu")
    msg = str(e.value)
    assert "does not fit device memory" in msg and "pipeline rank 0" in msg and "global ranks 0-7" in msg
    assert "more than the 85.0 GB" in msg and "optimizer 69.0 GB" in msg  # 8 B/param of AdamW, fp32 master in params
    assert "Breakdown: params 34.5 GB stored" in msg and "micro-batches in flight" in msg
    assert "it would fit: 73.2 GB per device" in msg  # the offload line, then no contradiction after it:
    assert "No layout of model=70b fits hardware=a100_80gb_8gpu with the optimizer states on the devices" in msg
    assert "xpar plan model=70b hardware=a100_80gb_8gpu ranks every layout that fits so" in msg
    assert "a100_80gb_64gpu (parallel=70b_64gpu)" in msg


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_not_fit_lists_alternatives_that_do_fit():
    with pytest.raises(ConfigError) as e:
        spec_for("parallel=7b_8gpu", "parallel.zero_stage=0")
    msg = str(e.value)
    from xpar.estimate.cost import peak_memory
    over = peak_memory(spec_for("parallel=7b_8gpu", "parallel.zero_stage=0", "hardware=a100_80gb_8gpu", "hardware.device_memory_gb=400")).total - 85e9
    assert f"{over / 1e9:.1f} GB more than the 85.0 GB" in msg and "global rank 0)" in msg
    assert "ddp_buckets" in msg  # the breakdown names DDP's bucket copy of the gradients
    listed = [line.strip().split(":")[0] for line in msg.splitlines() if line.startswith("      ")]
    assert listed and "parallel.zero_stage=2" in listed
    for overrides in listed:  # every alternative offered does fit
        s = spec_for("parallel=7b_8gpu", "parallel.zero_stage=0", *overrides.split())
        assert s.mode == "estimate"


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_70b_plain_dp_on_8_gpus_is_refused_with_breakdown_and_alternatives():
    with pytest.raises(ConfigError) as e:
        spec_for("parallel=dp", "model=70b", "hardware=a100_80gb_8gpu", "train=cluster")
    msg = str(e.value)
    assert "does not fit device memory" in msg and "global rank 0)" in msg
    assert "Breakdown: params" in msg and "ddp_buckets" in msg  # the refused rank's terms
    assert "offloaded to host memory" in msg and "would still not fit" in msg
    assert "No layout of model=70b fits hardware=a100_80gb_8gpu:" in msg and "parallel=70b_64gpu" in msg
    assert "with the optimizer states on the devices" not in msg  # offloaded, it would still not fit


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_memory_headroom_refuses_what_leaves_too_little_free():
    """hardware.memory_headroom keeps a fraction of device memory free: the same layout fits
    without it and is refused with it, the message naming the usable bytes."""
    from xpar.estimate.cost import peak_memory

    s = spec_for("parallel=7b_8gpu")
    share = peak_memory(s).total / 85e9
    headroom = round(1 - share + 0.05, 2)  # leaves 5 % less than the peak needs
    with pytest.raises(ConfigError) as e:
        spec_for("parallel=7b_8gpu", "hardware=a100_80gb_8gpu", f"hardware.memory_headroom={headroom}")
    assert "usable" in str(e.value) and f"hardware.memory_headroom={headroom:g}" in str(e.value)
    fits = spec_for("parallel=7b_8gpu", "hardware=a100_80gb_8gpu", f"hardware.memory_headroom={round(1 - share - 0.02, 2)}")
    assert fits.mode == "estimate"
    with pytest.raises(ConfigError) as e:
        spec_for("parallel=7b_8gpu", "hardware=a100_80gb_8gpu", "hardware.memory_headroom=1.5")
    assert "must be a fraction of device memory in [0, 1)" in str(e.value)


def test_estimate_on_pipeline_names_the_loaded_stage():
    s = spec_for("parallel=3d", "model=70b")
    from xpar.estimate.preflight.check import fit_problem
    tight = replace(s, hardware=replace(s.hardware, device_memory_gb=50))
    msg = fit_problem(tight)
    assert "pipeline rank 0 (stages 0,4)" in msg and "of 4 pipeline ranks are over" in msg


# --- (b) dry run vs the cost model -----------------------------------------------------------

@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
@pytest.mark.parametrize("overrides,coords", [
    (("parallel=70b_64gpu",), None),                                        # 70B TP8 x DP8, ZeRO-3
    (("parallel=70b_64gpu", "parallel.zero_stage=2"), [(0, 0, 0), (0, 7, 7)]),
    (("parallel=175b_1024gpu",), [(0, 0, 0), (15, 7, 0)]),                 # first and last stage
    (("parallel=7b_8gpu", "parallel.zero_stage=1", "hardware=h100_80gb_8gpu",   # DDP on meta; fp32 master
      "hardware.device_memory_gb=141"), None),  # + grads + DDP buckets need > 80 GB: H200-sized memory
    (("parallel=pp", "model=small", "model.tied_embeddings=false", "hardware=a100_80gb_8gpu", "train=cluster",
      "parallel.pp=4", "parallel.micro_batches=4"), None),                  # DDP + PipelineStage
], ids=["70b-tp8-dp8-z3", "70b-tp8-dp8-z2", "175b-first-last", "7b-zero1", "small-pp4"])
def test_dry_run_param_bytes_equal_the_analytic_ones(overrides, coords):
    from xpar.run.dryrun import dry_run

    spec = spec_for(*overrides)
    d = dry_run(spec, coords)
    assert d.ranks and d.max_diff == 0, d.to_dict()
    for r in d.ranks:
        assert r.dryrun == r.analytic and r.local_numel > 0


def test_dry_run_turns_torch_refusals_into_plan_errors():
    from xpar.run.dryrun import PlanError, dry_run

    s = spec_for("parallel=pp", "model=small", "model.tied_embeddings=false", "hardware=a100_80gb_8gpu",
                 "train=cluster", "parallel.pp=4", "parallel.micro_batches=4", "parallel.schedule=1f1b")
    bad = replace(s, layout=replace(s.layout, micro_batches=2))  # past validation on purpose (1f1b: m >= pp)
    with pytest.raises(PlanError) as e:
        dry_run(bad)
    assert "could not build rank 0 (pp=0, dp=0, tp=0) of 8" in str(e.value)
    assert "Number of microbatches (2)" in str(e.value)


def test_estimate_report_fields(tmp_path):
    from xpar.run.estimate_mode import estimate_report

    spec = spec_for("parallel=3d", "model=70b", "run.dry_run=false")
    r = estimate_report(spec, tmp_path)
    assert r.mode == "estimate" and r.world_size == 64 and r.peak_rank == 0
    assert set(r.memory) == {"params", "grads", "optimizer", "activations", "comm_buffers", "framework_overhead"}
    assert r.peak_bytes_per_device == pytest.approx(sum(r.memory.values()))
    x = r.extra  # the memory sub-terms add up to their terms
    assert x["estimate/params_master_bytes"] + x["estimate/params_compute_bytes"] == pytest.approx(r.memory["params"])
    assert x["estimate/activations_saved_bytes"] + x["estimate/activations_transient_bytes"] == pytest.approx(
        r.memory["activations"])
    assert sum(v for k, v in x.items() if k.startswith("estimate/buffer_")) == pytest.approx(r.memory["comm_buffers"])
    assert x["estimate/memory_usable_bytes"] == 85e9  # no headroom in the preset
    times = {k: v for k, v in r.extra.items() if k.startswith("estimate/time_")}
    assert len(times) == 8 and sum(times.values()) == pytest.approx(r.step_time_s)  # TIME_TERMS, host_overhead 0 here
    assert r.extra["pipeline/bubble_ratio_theory"] == pytest.approx(3 / (2 * 16 + 3))
    assert all(Path(p).stat().st_size > 10_000 for p in r.artifacts) and len(r.artifacts) == 2


# --- (c) estimate vs measured, for runs executed here ------------------------------------------

RUN = ("train.steps=2", "train.warmup_steps=1")
PP = ("parallel=pp", "model=tiny")
LAYOUTS = {
    "dp": ("parallel=dp", "parallel.micro_batches=2"),
    "zero1": ("parallel=zero1", "parallel.micro_batches=2"),
    "zero2": ("parallel=zero2", "parallel.micro_batches=2"),
    "zero3": ("parallel=zero3", "parallel.micro_batches=2"),
    "tp": ("parallel=tp",),
    "tp_sp": ("parallel=tp", "parallel.sequence_parallel=true"),
    "tp_m2": ("parallel=tp", "parallel.micro_batches=2"),  # replicate defers its reduction
    "pp_1f1b": PP,
    "pp_gpipe": (*PP, "parallel.schedule=gpipe"),
    "pp_interleaved": (*PP, "parallel.schedule=interleaved_1f1b", "parallel.micro_batches=4"),
    "pp_zero_bubble": (*PP, "parallel.schedule=zero_bubble", "parallel.micro_batches=4"),
    "pp_zbv": (*PP, "parallel.schedule=zbv", "parallel.micro_batches=4"),
    "pp_dualpipev": (*PP, "parallel.schedule=dualpipev", "parallel.micro_batches=4"),
    "pp_looped_bfs": (*PP, "parallel.schedule=looped_bfs", "parallel.micro_batches=4"),
}
BF16 = ("train.dtype=bf16",)
LAYOUTS.update({f"{k}_bf16": (*LAYOUTS[k], *BF16) for k in ("dp", "zero1", "zero2", "zero3", "tp", "pp_1f1b",
                                                              "pp_interleaved")})
LAYOUTS.update({f"{k}_{rc}": (*LAYOUTS[k], f"parallel.recompute={rc}") for k in ("dp", "zero3", "tp", "tp_sp", "pp_1f1b")
                for rc in ("full", "selective")})
LAYOUTS.update({"zero2_bf16_full": (*LAYOUTS["zero2_bf16"], "parallel.recompute=full"),
                "dp_bf16_selective": (*LAYOUTS["dp_bf16"], "parallel.recompute=selective"),
                "pp_1f1b_zero3_bf16": (*LAYOUTS["pp_1f1b_bf16"], "parallel.zero_stage=3")})
"""Every strategy and schedule, fp32 and bf16 mixed precision, recompute none/full/selective
as executed: one spawn of 2 gloo workers (~25 s here)."""


def measure(payload: dict) -> dict:
    """Worker: train each spec through xpar's real path; rank 0 returns every rank's memory,
    mesh coordinates and TP communication."""
    from xpar.config.spec import RunSpec
    from xpar.run.worker import run_rank

    out = {}
    for name, d in payload.items():
        with tempfile.TemporaryDirectory() as tmp:
            stats = run_rank(RunSpec.from_dict(d), Path(tmp))
        if stats is not None:
            out[name] = [{"coords": s["coords"], "memory": s["memory"], "comm": s.get("comm")} for s in stats]
    return out


@pytest.fixture(scope="module")
def measured():
    specs = {n: spec_for(*o, *RUN) for n, o in LAYOUTS.items()}
    return specs, spawn(measure, 2, {n: s.to_dict() for n, s in specs.items()})


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_estimated_memory_equals_measured(measured, layout):
    """Model states per device exactly (bf16: fp32 master + bf16 copies + fp32 grads + AdamW);
    activations (saved_tensors_hooks peak) and the peak (states + activations, what the CPU
    accounting counts) within 5 % on every rank (measured: within 3.5 %; the rest is
    RMSNorm's rstd, RoPE's cos/sin, and zero-bubble schedules freeing part of a micro-batch at
    I where the estimate frees it at W)."""
    from xpar.estimate.cost import assumptions_for, peak_memory
    from xpar.estimate.memory.per_device import model_state_bytes

    specs, out = measured
    spec = specs[layout]
    assert assumptions_for(spec).fused_rmsnorm is False  # hardware=local on CPU
    for rank in out[layout]:
        pp, dp = rank["coords"]["pp"], rank["coords"]["dp"]
        got = rank["memory"]
        assert model_state_bytes(spec, pp, dp, assumptions_for(spec)) == {k: got[k] for k in ("params", "grads", "optimizer")}
        est = peak_memory(spec, pp)
        assert est.activations == pytest.approx(got["activations"], rel=0.05), (layout, rank["coords"])
        measured_peak = sum(got[k] for k in ("params", "grads", "optimizer", "activations"))
        assert est.total == pytest.approx(measured_peak, rel=0.05), (layout, rank["coords"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp", "tp_sp"])
def test_estimated_tp_comm_equals_measured(measured, layout):
    from xpar.estimate.cost import assumptions_for, estimate
    from xpar.run.estimate_mode import comm_metrics

    specs, out = measured
    est = comm_metrics(specs[layout], estimate(specs[layout], assumptions_for(specs[layout])).comm_bytes)
    got = out[layout][0]["comm"]
    for k in ("comm/tp_ring_bytes", "comm/tp_allgather_bytes", "comm/tp_reduce_scatter_bytes"):
        assert est[k] == pytest.approx(got[k], rel=0.02, abs=1), k  # not counted: loss_parallel's [b, s] all-reduces


@pytest.mark.slow
def test_estimate_mode_on_this_machine_reports_the_measured_layout(measured, tmp_path):
    """run.mode=estimate hardware=local gives the Report the cost model gives the executed
    layout: the same per-device bytes as measured on the most loaded rank."""
    from xpar.run.estimate_mode import estimate_report

    specs, out = measured
    est_spec = spec_for(*LAYOUTS["zero3"], *RUN, "run.mode=estimate")
    assert est_spec.mode == "estimate" and est_spec.world_size == 2 and est_spec.hardware.name == "local"
    r = estimate_report(est_spec, tmp_path)
    got = out["zero3"][0]["memory"]
    assert {k: r.memory[k] for k in ("params", "grads", "optimizer")} == {k: got[k] for k in ("params", "grads", "optimizer")}
    assert r.memory["framework_overhead"] == 0  # conf/hardware/local.yaml
    assert r.extra["estimate/dryrun_param_bytes_diff"] == 0


def test_an_executed_runs_fidelity_estimate_says_what_it_leaves_out():
    """On an uncalibrated hardware=local the run's own estimate has no link, HBM or host figures
    (its fidelity/step_time_ratio counts matmuls only): the run's notes say so and how to measure
    them; on a preset with every figure nothing is added."""
    from xpar.run.job import fidelity_notes
    local = fidelity_notes(spec_for("hardware=local"))
    assert any("no link bandwidth" in n for n in local) and any("xpar calibrate hardware=local" in n for n in local)
    assert fidelity_notes(spec_for("parallel=3d", "model=70b")) == []


def test_a_memory_refusal_under_a_profile_without_flash_attention_says_what_flash_attention_gives():
    """framework=megatron (Megatron-LM 2021: flash_attention false) keeps the s x s scores: a run of that framework
    that used FlashAttention (Falcon's) is told framework.flash_attention=true and whether the layout then fits
    (found by the refusal hunt, benchmarks/refusal_hunt.md); following it, the layout is accepted."""
    args = ("framework=megatron", "model=7b", "hardware=a100_80gb_64gpu", "train.seq_len=8192", "train.micro_batch_size=2",
            "parallel.tp=8", "parallel.sequence_parallel=true", "train.dtype=bf16")
    with pytest.raises(ConfigError) as e:
        spec_for(*args)
    note = next(line for line in str(e.value).splitlines() if "framework.flash_attention=true" in line)
    assert "needs" in note and note.endswith("and fits."), note
    assert spec_for(*args, "framework.flash_attention=true").mode == "estimate"


def test_a_context_parallel_estimate_logs_the_gradient_bytes_of_its_dp_x_cp_group():
    """``parallel.dp=1 parallel.cp=2`` reduces its gradients over the two cp ranks (850 KiB measured for the tiny
    model) but its estimate logged no comm/dp_* figure (the group read as dp = 1): now as dp 2 x cp 1's."""
    from tests.conftest import spec_for
    from xpar.estimate.cost import estimate
    from xpar.run.estimate_mode import comm_metrics
    cp = spec_for("parallel.dp=1", "parallel.cp=2", "run.mode=estimate")
    dp = spec_for("parallel.dp=2", "run.mode=estimate")
    got, want = comm_metrics(cp, estimate(cp).comm_bytes), comm_metrics(dp, estimate(dp).comm_bytes)
    assert got["comm/dp_allreduce_bytes"] == pytest.approx(want["comm/dp_allreduce_bytes"]) and got["comm/dp_allreduce_bytes"] > 0


def test_estimate_of_a_folded_ep_layout_skips_the_dry_run_with_a_note(tmp_path):
    """ep above dp x cp (MoE parallel folding, etp < tp: DeepSeek-V3 on 512 H100 at tp 2, ep 64, dp 32,
    dgxc-benchmarking) is estimated; the engine cannot build it, so its dry run is skipped with a note
    instead of torch's ProcessGroup error (benchmarks/refusal_hunt2.md). ep inside dp x cp is still built."""
    from xpar.run.dryrun import not_buildable
    from xpar.run.estimate_mode import estimate_report

    common = ("model=moe_tiny", "parallel.tp=2", "parallel.dp=2", "parallel.etp=1", "parallel.sequence_parallel=true",
              "run.mode=estimate", "hardware=h100_80gb_8gpu", "hardware.devices_per_node=4")
    folded = spec_for(*common, "parallel.ep=4", local_devices=4)
    assert folded.layout.ep > folded.layout.dp * folded.layout.cp
    r = estimate_report(folded, tmp_path)
    assert r.step_time_s > 0 and "estimate/dryrun_ranks" not in r.extra
    assert any(n.startswith("dry run skipped: ep=4") for n in r.notes), r.notes
    inside = spec_for(*common, "parallel.ep=2", local_devices=4)
    assert not_buildable(inside) is None and not_buildable(folded) is not None


def test_dry_run_that_disagrees_with_the_estimate_says_so():
    """A MoE under tp: xpar's engine keeps each expert whole on every tp rank (xpar.parallel.tensor.block_plan),
    the estimate splits it over etp = tp ranks; the dry run found it and only a metric said so
    (mixtral_8x7b tp8 dp8 ZeRO-3: estimate/dryrun_param_bytes_diff 9.865e+09 and no note). Where they agree, no note."""
    from xpar.run.dryrun import dry_run, gap_note
    from xpar.track.report import format_bytes

    moe = spec_for("model=moe_tiny", "parallel.tp=2", "parallel.dp=4", "hardware=h100_80gb_8gpu", "run.mode=estimate")
    d = dry_run(moe, [(0, 0, 0)])
    note = gap_note(moe, d)
    assert d.max_diff > 0 and note is not None, d.to_dict()
    r = d.ranks[0]
    assert note.startswith(f"dry run: xpar's engine holds {format_bytes(r.dryrun['params'])} of params on rank 0")
    assert f"the estimate counts {format_bytes(r.analytic['params'])}" in note and "replicates each expert over the tp=2" in note
    dense = spec_for("model=moe_tiny", "parallel.tp=1", "parallel.dp=8", "hardware=h100_80gb_8gpu", "run.mode=estimate")
    assert gap_note(dense, dry_run(dense, [(0, 0, 0)])) is None


def test_dry_run_builds_a_megatron_1f1b_with_fewer_micro_batches_than_stages(tmp_path):
    """framework=megatron runs 1F1B with m < pp (framework.microbatch_rule=megatron, issue 43) and validation takes it,
    but the dry run built torch's Schedule1F1B with that m: `model=7b hardware=h100_80gb_64gpu train=cluster
    framework=megatron parallel.pp=4 parallel.micro_batches=2` exited 2 on torch's 'Number of microbatches (2) must be
    greater than or equal to the number of stages (4)'. The count moves no parameter: the dry run builds m = pp."""
    from xpar.run.dryrun import buildable
    from xpar.run.estimate_mode import estimate_report

    spec = spec_for("model=tiny", "framework=megatron", "parallel.dp=2", "parallel.pp=4", "parallel.schedule=1f1b",
                    "parallel.micro_batches=2", "run.mode=estimate", "hardware=h100_80gb_8gpu", local_devices=8)
    assert spec.layout.micro_batches == 2 and buildable(spec).layout.micro_batches == 4
    r = estimate_report(spec, tmp_path)
    assert r.step_time_s > 0 and r.extra["estimate/dryrun_ranks"] > 0


def test_an_estimate_beyond_the_dry_runs_world_size_skips_it_with_a_note():
    """`model=7b hardware=b200_180gb_64gpu train=cluster hardware.nodes=1000000` (8 million ranks) validated in a
    second and then built torch's device mesh of 8 million fake ranks for minutes (killed at 300 s, nothing said):
    above DRY_RUN_MAX_WORLD the dry run is skipped with a note; below it, built as before."""
    from xpar.run.dryrun import DRY_RUN_MAX_WORLD, not_buildable

    huge = spec_for("model=7b", "hardware=b200_180gb_64gpu", "train=cluster", "hardware.nodes=1000000")
    assert huge.world_size == 8_000_000 > DRY_RUN_MAX_WORLD
    assert not_buildable(huge).startswith("dry run skipped: 8,000,000 ranks, above the 131,072 it builds")
    assert not_buildable(spec_for("model=7b", "hardware=b200_180gb_64gpu", "train=cluster")) is None
