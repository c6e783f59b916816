"""The planner's vectorised step time (xpar.estimate.columns.step_time) equals the scalar estimate, layout by layout.

Random valid candidates (seeded) over models tiny/7b/70b/175b, the A100 and H100 presets, the four
framework profiles, every schedule, ZeRO 0-3, every recompute policy (xpar.config.remat) and optimizer offload
on or off; each figure of ``time_columns`` is compared with ``estimate(spec_of(...))`` at
relative 1e-9.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from xpar.config.presets import preset_dict

from xpar.config.layout import SCHEDULES, microbatch_ok, zero_stage_run
from xpar.config.remat import MODULE_POLICIES, RECOMPUTE
from xpar.estimate.cost import TIME_TERMS, estimate
from xpar.plan.context import COLUMNS, PlanContext, spec_of
from xpar.estimate.columns.step_time import TIME_KEYS, time_columns

CONF = pathlib.Path(__file__).resolve().parents[2] / "conf"
MODELS = ("tiny", "7b", "70b", "175b")
HARDWARE = ("a100_80gb_8gpu", "a100_80gb_64gpu", "a100_80gb_1024gpu", "h100_80gb_8gpu", "h100_80gb_64gpu")
FRAMEWORKS = ("xpar", "megatron", "torchtitan", "deepspeed")




def context(model: str, hardware: str, framework: str) -> PlanContext:
    return PlanContext(model=preset_dict("model", model), hardware=preset_dict("hardware", hardware), train={"dtype": "bf16"},
                       framework=preset_dict("framework", framework))


def _one(ctx: PlanContext, rng: np.random.Generator):
    """One random candidate row, or None when the draw has no valid v."""
    mdl, hw = ctx.model, ctx.hardware
    world = int(hw["devices_per_node"]) * int(hw.get("nodes", 1))
    heads, layers = mdl["n_heads"], mdl["n_layers"]
    kv = mdl.get("n_kv_heads") or heads
    tp = int(rng.choice([t for t in range(1, 9) if heads % t == 0 and kv % t == 0 and world % t == 0]))
    pp = int(rng.choice([p for p in range(1, world // tp + 1) if (world // tp) % p == 0 and layers % p == 0]))
    fw = ctx.framework  # what the framework runs: its schedules and ZeRO stages
    schedule = str(rng.choice(list(fw["schedules"])))
    rec = SCHEDULES[schedule]
    vs = {"1": [1], "2": [2]}.get(rec.stages_per_rank, [x for x in range(2, 9) if layers % (pp * x) == 0])
    vs = [v for v in vs if layers % (pp * v) == 0]
    if not vs:
        return None
    m = int(rng.choice([x for x in range(1, 4 * pp + 9) if microbatch_ok(schedule, pp, x)]))
    if schedule == "interleaved_1f1b" and pp > 1 and (pp < fw.get("interleaved_min_pp", 2) or (
            fw.get("interleaved_m_per_pp") and m % pp)):
        return None  # Megatron-LM's interleaving rules (framework.interleaved_*)
    zero = zero_stage_run(schedule, pp, int(rng.choice(fw["pp_zero_stages" if pp > 1 else "zero_stages"])))
    policies = [p for p in RECOMPUTE if p not in MODULE_POLICIES or mdl.get("kv_lora_rank")]  # MLA's: MLA models
    recompute = str(rng.choice(["none", "full"] if rec.zero_bubble else policies))  # SAC
    if fw.get("ddp_alone") and zero == 0 and tp * pp > 1 or tp > (fw.get("moe_max_tp") or tp) and mdl.get("n_experts"):
        return None  # torchtitan's DDP runs alone (framework.ddp_alone); AutoModel's MoE runs tp 1 (moe_max_tp)
    sp_runs = [bool(x) for x in fw.get("sequence_parallel", [False, True])]  # torchtitan: [true], sp with every tp
    sp = tp > 1 and (rng.random() < 0.5 or sp_runs == [True]) and True in sp_runs
    return (tp, pp, world // (tp * pp), int(rng.choice([1, 2, 4])), m, int(rng.choice(vs)), schedule, zero,
            bool(sp), recompute, bool(rng.random() < 0.5))


def random_candidates(ctx: PlanContext, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """``n`` valid candidate rows (xpar.plan.context columns): tp dividing the heads and kv
    heads, pp x v dividing the layers, m that the schedule accepts, the schedule and ZeRO stage
    among the framework's (its lists), the ZeRO stage that runs,
    sp only with tp > 1, no selective recompute with split-backward schedules; the optimizer
    offloaded (column ``offload``) on about half of them."""
    rows = []
    while len(rows) < n:
        r = _one(ctx, rng)
        if r is not None:
            rows.append(r if not r[-1] or _offload_accepted(ctx, r) else r[:-1] + (False,))
    return {k: np.array([r[i] for r in rows]) for i, k in enumerate(COLUMNS + ("offload",))}


def _offload_accepted(ctx: PlanContext, row: tuple) -> bool:
    """Whether the estimate accepts this row with the optimizer offloaded (the framework runs
    offload, ZeRO >= 1, the hardware has host figures and its host memory holds the states)."""
    from xpar.config.checks import ConfigError

    try:
        spec_of(ctx, {k: np.array([v]) for k, v in zip(COLUMNS + ("offload",), row)}, 0)
    except ConfigError:
        return False
    return True


def scalar_fields(e) -> dict[str, float]:
    """The Estimate's figures under time_columns' keys."""
    d = {k: getattr(e, k) for k in ("time_per_step_s", "bubble_ratio", "tokens_per_s", "tokens_per_s_per_device",
                                    "tflops_per_device", "hw_tflops_per_device", "mfu", "hfu")}
    d.update({f"time_{k}": e.time_breakdown[k] for k in TIME_TERMS})
    d.update({f"{k}_comm_issued_s": e.comm_time[k] for k in ("dp", "tp", "pp")})
    off = e.offload
    d.update(offload_host_step_s=off.get("host_step_s", 0.0),
             offload_pcie_s=off.get("grad_to_host_exposed_s", 0.0) + off.get("param_to_device_s", 0.0))
    return d


def memory_args(ests: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(memory_optimizer, optimizer_elements, memory_grads) of time_columns from the scalar
    estimates (the elements an offloaded optimizer moves; 0 where it does not offload, where they
    are unread)."""
    return (np.array([e.memory.optimizer for e in ests]),
            np.array([e.offload.get("elements", 0.0) for e in ests]), np.array([e.memory.grads for e in ests]))


def _mismatches(ctx: PlanContext, cols: dict, got: dict, ests: list) -> list[str]:
    bad = []
    for i, e in enumerate(ests):
        for k, want in scalar_fields(e).items():
            if not (got[k][i] == pytest.approx(want, rel=1e-9, abs=1e-15)):
                bad.append(f"{ctx.model['name']}/{ctx.hardware['name']}/{ctx.framework['name']} "
                           f"{ {c: cols[c][i].item() for c in cols} } {k}: {got[k][i]!r} != {want!r}")
    return bad


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
@pytest.mark.parametrize("model", MODELS)
def test_time_columns_equal_scalar_estimate(model):
    rng = np.random.default_rng(MODELS.index(model))
    bad, checked, offloaded = [], 0, 0
    for hardware in HARDWARE:
        for framework in FRAMEWORKS:
            ctx = context(model, hardware, framework)
            cols = random_candidates(ctx, rng, 2)
            specs = [spec_of(ctx, cols, i) for i in range(2)]
            ests = [estimate(sp) for sp in specs]
            got = time_columns(specs[1], cols, *memory_args(ests))
            assert set(got) == set(TIME_KEYS) and all(len(x) == 2 for x in got.values())
            bad += _mismatches(ctx, cols, got, ests)
            checked += 2
            offloaded += int((got["offload_host_step_s"] > 0).sum())
    assert checked == 40 and not bad, "\n".join(bad[:20])
    assert offloaded >= 5  # the offloaded step is exercised (where the framework runs offload: xpar, deepspeed)


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_time_columns_many_layouts_one_context():
    """Twenty-four layouts of 175B on 1024 A100 in one call (shared keys, pp classes)."""
    ctx = context("175b", "a100_80gb_1024gpu", "xpar")
    cols = random_candidates(ctx, np.random.default_rng(7), 24)
    specs = [spec_of(ctx, cols, i) for i in range(24)]
    ests = [estimate(sp) for sp in specs]
    got = time_columns(specs[0], cols, *memory_args(ests))
    assert len(set(cols["pp"].tolist())) >= 4
    bad = _mismatches(ctx, cols, got, ests)
    assert not bad, "\n".join(bad[:20])


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
@pytest.mark.parametrize("k", [0, 1, 3])
def test_time_columns_equal_scalar_estimate_with_recompute_layers(k):
    """parallel.recompute_layers = k (of n_layers / (pp v) blocks per stage, clipped): the share
    recomputed depends on the stages, so the vectorised keys carry pp x v; still equal."""
    from dataclasses import replace

    ctx = context("7b", "a100_80gb_64gpu", "xpar")
    cols = random_candidates(ctx, np.random.default_rng(5 + k), 12)
    cols["recompute"] = np.where(cols["recompute"] == "none", "full", cols["recompute"])
    specs = [spec_of(ctx, cols, i) for i in range(12)]
    specs = [replace(sp, parallel=replace(sp.parallel, recompute_layers=k)) for sp in specs]
    ests = [estimate(sp) for sp in specs]
    got = time_columns(specs[0], cols, *memory_args(ests))
    assert len(set((cols["pp"] * cols["v"]).tolist())) >= 3
    bad = _mismatches(ctx, cols, got, ests)
    assert not bad, "\n".join(bad[:20])


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
@pytest.mark.parametrize("staged", [None, 2])
def test_time_columns_equal_scalar_estimate_on_lighter_ends(staged):
    """pp x v stages that do not divide the blocks, split with lighter ends (xpar.estimate.columns.stage_split): the
    middle ranks hold more blocks than the end ones, every schedule
    the framework runs, also with parallel.recompute_layers (``staged``: the end stages' shares differ);
    every figure equal to the scalar estimate."""
    from dataclasses import replace

    from tests.plan.test_plan_memory import UNEVEN, uneven_candidates

    bad, checked = [], 0
    for model, n_layers, hardware, framework in UNEVEN:
        if not isinstance(framework, str):
            continue
        ctx = context(model, hardware, framework)
        ctx = replace(ctx, model=dict(ctx.model, n_layers=n_layers))
        cols = uneven_candidates(ctx, 2, n_layers + (staged or 0))
        if staged:
            cols["recompute"] = np.where(cols["recompute"] == "none", "full", cols["recompute"])
        specs = [spec_of(ctx, cols, i) for i in range(len(cols["tp"]))]
        specs = [replace(sp, parallel=replace(sp.parallel, recompute_layers=staged)) for sp in specs]
        ests = [estimate(sp) for sp in specs]
        bad += _mismatches(ctx, cols, time_columns(specs[0], cols, *memory_args(ests)), ests)
        checked += len(ests)
    assert checked >= 20 and not bad, "\n".join(bad[:20])


def test_time_columns_optimizer_term_without_memory_given():
    """Without memory_optimizer, the optimizer term comes from the memory model (vectorised
    where xpar.estimate.columns.peak_memory is present): still equal to the estimate."""
    ctx = context("7b", "h100_80gb_64gpu", "megatron")
    cols = random_candidates(ctx, np.random.default_rng(11), 6)
    specs = [spec_of(ctx, cols, i) for i in range(6)]
    ests = [estimate(sp) for sp in specs]
    got = time_columns(specs[0], cols)
    assert all(e.time_breakdown["optimizer"] > 0 for e in ests)
    bad = _mismatches(ctx, cols, got, ests)
    assert not bad, "\n".join(bad[:20])


@pytest.mark.slow
def test_step_time_columns_import_no_torch():
    code = "import xpar.estimate.columns.step_time, sys; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_time_columns_runs_without_torch():
    """Every schedule, 70B on 64 H100: time_columns imports no torch (bubbles in closed form,
    parameter shapes written out)."""
    code = """
import sys, numpy as np
from tests.plan.test_plan_vector import context, random_candidates
from xpar.plan.context import spec_of
from xpar.estimate.columns.step_time import time_columns
ctx = context("70b", "h100_80gb_64gpu", "torchtitan")
cols = random_candidates(ctx, np.random.default_rng(3), 60)
assert len(set(cols["schedule"].tolist())) == 7
out = time_columns(spec_of(ctx, cols, 0), cols, np.zeros(60), None, np.zeros(60))
assert np.isfinite(out["time_per_step_s"]).all() and (out["time_per_step_s"] > 0).all()
assert 'torch' not in sys.modules, 'torch imported'
"""
    root = pathlib.Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("schedule,vs", [("looped_bfs", (2, 3)), ("zero_bubble", (2, 3)), ("zbv", (2,)),
                                         ("dualpipev", (2,)), ("interleaved_1f1b", (2, 3))])
def test_replay_closed_forms_equal_the_replay(schedule, vs):
    """bubble_theory's closed forms of the uniform replay (xpar.estimate.schedule.replay_closed_form)
    equal the replay of the action list (below and above pp micro-batches)."""
    from xpar.estimate.schedule import replay_closed_form, simulated_bubble

    checked = 0
    for pp in (3, 4):
        for m in sorted({1, 2, pp - 1, pp, pp + 1, 2 * pp, 2 * pp + 1}):
            if not microbatch_ok(schedule, pp, m) or (schedule == "interleaved_1f1b" and m >= pp):
                continue
            for v in vs:
                assert replay_closed_form(schedule, pp, m, v) == pytest.approx(simulated_bubble(schedule, pp, m, v),
                                                                             rel=1e-12), (pp, m, v)
                checked += 1
    assert checked >= 4


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_time_columns_on_the_plan_space():
    """Layouts drawn from the planner's own space (xpar.plan.space: every v dividing the layers,
    b up to 8, ZeRO at dp = 1 dropped, ...) for 70B on 64 H100: equal to the scalar estimate."""
    from xpar.plan.space import Constraints, enumerate_layouts

    ctx = context("70b", "h100_80gb_64gpu", "xpar")
    space = enumerate_layouts(ctx.model, 64, 8, ctx.model["seq_len"], Constraints(global_batch=(256, 256)))
    pick = np.random.default_rng(5).choice(len(space), 40, replace=False)
    cols = {k: v[pick] for k, v in space.cols.items()}
    specs = [spec_of(ctx, cols, i) for i in range(40)]
    ests = [estimate(sp) for sp in specs]
    got = time_columns(specs[0], cols, *memory_args(ests))
    bad = _mismatches(ctx, cols, got, ests)
    assert not bad, "\n".join(bad[:20])


def _cpu_columns(hw: dict, model: str, seed: int, n: int):
    """(specs, scalar estimates, time_columns) of ``n`` random fp32 layouts of ``model`` on the CPU
    hardware ``hw`` (framework xpar), after checking the planner equals the scalar estimate."""
    ctx = PlanContext(model=preset_dict("model", model), hardware=hw, train={"dtype": "fp32"},
                      framework=preset_dict("framework", "xpar"))
    cols = random_candidates(ctx, np.random.default_rng(seed), n)
    specs = [spec_of(ctx, cols, i) for i in range(n)]
    ests = [estimate(sp) for sp in specs]
    got = time_columns(specs[0], cols, *memory_args(ests))
    bad = _mismatches(ctx, cols, got, ests)
    assert not bad, "\n".join(bad[:20])
    return specs, ests, got


def test_time_columns_on_local_cpu_hardware():
    """hardware=local (this machine: CPU assumptions, no HBM or link figures, so no memory-bound
    or communication time), fp32: equal to the scalar estimate."""
    hw = dict(preset_dict("hardware", "local"), devices_per_node=4)
    for model in ("tiny", "mini"):
        specs, _, got = _cpu_columns(hw, model, 2, 6)
        assert specs[0].hardware.device == "cpu" and (got["time_dp_comm_exposed"] == 0).all()


def test_time_columns_with_measured_collective_curves():
    """A calibrated CPU preset with gloo's measured ring-step curves (hardware.ring_step_us_by_bytes:
    all-gather and reduce-scatter dearer per byte than all-reduce, super-linear past a few MiB):
    equal to the scalar estimate, whose dp and pipeline times come from the curves."""
    curves = {"allreduce": [[512, 150.0], [2 ** 21, 1800.0], [2 ** 27, 78000.0]],
              "allgather": [[512, 160.0], [2 ** 21, 2300.0], [2 ** 27, 226000.0]],
              "reduce_scatter": [[512, 700.0], [2 ** 21, 4900.0], [2 ** 27, 285000.0]],
              "send_recv": [[1024, 40.0], [2 ** 22, 1000.0], [2 ** 28, 54000.0]]}
    hw = dict(preset_dict("hardware", "local"), device="cpu", devices_per_node=8, peak_tflops=0.11, hbm_tb_per_s=0.02,
              intra_node_gb_per_s=1.5, intra_node_latency_us=400.0, collective_latency_us=0.0, link_efficiency=1.0,
              op_overhead_us=2.1, dtensor_op_overhead_us=7.3, fsdp_unit_overhead_us=420.0, cpu_cores=2,
              ring_step_us_by_bytes=curves, sync_wait_us=900.0, optimizer_ns_per_element=3.4)
    specs, ests, got = _cpu_columns(hw, "mini", 4, 8)  # xpar calibrate's waits and AdamW rate in too
    assert (got["time_dp_comm_exposed"] > 0).any() and specs[0].world_size == 8  # 4x the 2 cores: waits unstretched


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_time_columns_with_host_overhead_and_shared_cores():
    """A calibrated CPU preset (xpar calibrate: host time per operator, per DTensor operator and
    per FSDP2 unit, links and memory measured, 2 cores shared by up to 8 workers): equal to the
    scalar estimate, and the host term and the oversubscription are exercised."""
    hw = dict(preset_dict("hardware", "local"), device="cpu", devices_per_node=8, peak_tflops=0.11, hbm_tb_per_s=0.02,
              intra_node_gb_per_s=1.5, intra_node_latency_us=400.0, collective_latency_us=0.0, link_efficiency=1.0,
              op_overhead_us=2.1, dtensor_op_overhead_us=7.3, fsdp_unit_overhead_us=420.0, cpu_cores=2)
    for model in ("tiny", "mini"):
        _, ests, got = _cpu_columns(hw, model, 3, 8)
        assert (got["time_host_overhead"] > 0).all()
        assert all(e.time_breakdown["host_overhead"] > 0 for e in ests)


def _equal_on(framework: str, rows: list) -> dict:
    """time_columns of ``rows`` (COLUMNS + offload tuples) of 175B on 64 A100 under ``framework``,
    asserted equal to the scalar estimate of each; returns the columns."""
    from xpar.calibrate.published import preset
    ctx = replace(context("175b", "a100_80gb_64gpu", "xpar"), framework=preset("framework", framework))  # with its defaults
    cols = {k: np.array([r[i] for r in rows]) for i, k in enumerate(COLUMNS + ("offload",))}
    specs = [spec_of(ctx, cols, i) for i in range(len(rows))]
    ests = [estimate(sp) for sp in specs]
    got = time_columns(specs[0], cols, *memory_args(ests))
    bad = _mismatches(ctx, cols, got, ests)
    assert not bad, "\n".join(bad[:20])
    return got


def test_time_columns_equal_scalar_estimate_for_deepspeed_2021_zero3():
    """DeepSpeed 2021's ZeRO-3 (framework=deepspeed_2021) gathers some tensors a second time in the
    backward under full recompute (xpar.estimate.frameworks.deepspeed_zero3): the vectorised dp time follows the
    layout's recompute as the scalar estimate does, on layouts with and without it."""
    rows = [(1, 1, 64, b, 1, 1, "1f1b", 3, False, rec, False) for b in (1, 2) for rec in ("full", "none", "selective")]
    dp = _equal_on("deepspeed_2021", rows + [(8, 1, 8, 1, 2, 1, "1f1b", 3, False, "full", False)])["time_dp_comm_exposed"]
    assert dp[0] > dp[1] * 1.1  # full recompute: the backward's second gathers


def test_time_columns_equal_scalar_estimate_with_a_layer_overhead():
    """Megatron-DeepSpeed's cost per layer and micro-batch (framework=deepspeed_bloom, layer_overhead_ms) is
    in the planner's host term as in the scalar estimate, pipelines and recompute policies alike."""
    rows = [(4, 4, 4, 1, 8, 1, "1f1b", 1, False, "full", False), (8, 2, 4, 2, 4, 1, "1f1b", 0, False, "none", False),
            (2, 8, 4, 1, 16, 1, "1f1b", 1, False, "selective", False)]
    got = _equal_on("deepspeed_bloom", rows)
    assert (got["time_host_overhead"] > 0).all()
