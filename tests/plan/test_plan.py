"""``xpar plan``: the layout space and its rules, the ranking against published layouts
(Narayanan et al. 2021 Table 1), the seed's scenarios, refusals, the MLflow record, the closed
loop on hardware=local, and the planner path without torch."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from xpar.calibrate.published import preset, read_table
from xpar.estimate.columns.stage_split import splittable
from xpar.estimate.cost import estimate
from xpar.plan.command import search
from xpar.plan.context import PlanContext, row, spec_of
from xpar.plan.inputs import PlanInputs, plan_inputs
from xpar.plan.space import RULES, Constraints, enumerate_layouts
from xpar.plan.verify import compose_line

DATA = Path(__file__).parents[1] / "data"
REPO = Path(__file__).resolve().parents[2]


def argv(*overrides: str) -> list[str]:
    """The overrides ``xpar plan <overrides>`` runs with (train=cluster added for clusters)."""
    from xpar.plan.inputs import plan_argv
    return plan_argv(list(overrides))


def cfg_of(*overrides: str):
    """The config ``python -m xpar plan <overrides>`` composes."""
    return compose_line("python -m xpar " + " ".join(argv(*overrides)))


def plan_of(*overrides: str):
    inputs, problems = plan_inputs(cfg_of(*overrides), argv(*overrides))
    assert not problems, problems
    return search(inputs)


def find(cols: dict, split: tuple = (0, None), **want) -> np.ndarray:
    """Rows of ``cols`` equal to ``want`` in every given column; with ``split`` (n_layers, blocks per
    stage), only those whose pp x v stages split the n_layers blocks so (xpar.estimate.columns.stage_split.plan_split;
    None: any split)."""
    from xpar.estimate.columns.stage_split import plan_split
    mask = np.ones(len(cols["tp"]), dtype=bool)
    for k, v in want.items():
        mask &= cols[k] == v
    n_layers, stages = split
    if stages is not None:
        mask &= [tuple(plan_split(n_layers, int(p * v))) == tuple(stages) for p, v in zip(cols["pp"], cols["v"])]
    return np.flatnonzero(mask)


# --- the space -----------------------------------------------------------------------------

def test_space_keeps_stages_with_lighter_ends_and_drops_impossible_splits():
    """pp x v stages that do not divide the blocks are kept where lighter ends exist (xpar.estimate.columns.stage_split):
    70 blocks on 384 devices keep pp 12 (5, 10 x 6, 5: BLOOM 176B), 16 (0, 14 x 5, 0) and 24 (2, 22 x 3,
    2); from pp 32 the stages between would take more than the 70 blocks: dropped under ``balanced``."""
    from xpar.estimate.columns.stage_split import splittable
    model = dict(preset("model", "175b"), n_layers=70)
    space = enumerate_layouts(model, 384, 8, 2048, Constraints(global_batch=(3072, 3072), schedules=("1f1b",)))
    c, pp = space.cols, set(np.unique(space.cols["pp"]).tolist())
    assert {12, 16, 24} <= pp and max(pp) == 24 and space.dropped["balanced"] > 0
    assert splittable(70, c["pp"] * c["v"]).all() and (70 % (c["pp"] * c["v"]) != 0).any()


def test_drop_reason_of_impossible_splits_says_what_fails():
    """The ``balanced`` drop reason names the failing condition (issue 45: it read "... leave fewer than 0
    for the first and last"): the stages between take more than every block."""
    from xpar.plan.space import RULES
    assert "take more than the n_layers blocks" in RULES["balanced"]
    assert not any("fewer than 0" in text for text in RULES.values())


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_space_counts_every_layout_once_and_keeps_only_valid_ones():
    model = preset("model", "70b")
    space = enumerate_layouts(model, 64, 8, 4096, Constraints(global_batch=(512, 512)))
    assert sum(space.dropped.values()) + len(space) == space.raw
    assert set(space.dropped) == set(RULES)
    c = space.cols
    assert (c["dp"] * c["tp"] * c["pp"] == 64).all() and (c["b"] * c["m"] * c["dp"] == 512).all()
    assert splittable(model["n_layers"], c["pp"] * c["v"]).all()  # evenly, or with lighter first/last stages
    assert (model["n_kv_heads"] % c["tp"] == 0).all() and not (c["sp"] & (c["tp"] == 1)).any()
    assert not ((c["pp"] == 1) & (c["schedule"] != "1f1b")).any()
    # every kept layout validates as `python -m xpar run.mode=estimate` would build it (a sample)
    ctx = PlanContext(model=model, hardware=preset("hardware", "a100_80gb_64gpu"),
                      train=dict(dtype="bf16", seq_len=4096), framework=preset("framework", "xpar"))
    for i in np.random.default_rng(0).choice(len(space), 25, replace=False):
        spec = spec_of(ctx, space.cols, int(i))
        r = row(space.cols, int(i))
        assert (spec.tp, spec.pp, spec.dp, spec.micro_batches, spec.layout.zero_stage) == \
               (r["tp"], r["pp"], r["dp"], r["m"], r["zero"])


def test_constraints_shape_the_space():
    model = preset("model", "70b")
    c = Constraints(global_batch=(256, 256), max_tp=4, pp=2, schedules=("1f1b",), zero_stages=(0, 1),
                    recompute=("full",))
    s = enumerate_layouts(model, 64, 8, 4096, c).cols
    assert set(s["tp"]) <= {1, 2, 4} and set(s["pp"]) == {2} and set(s["schedule"]) == {"1f1b"}
    assert set(s["zero"]) <= {0, 1} and set(s["recompute"]) == {"full"}
    ranged = enumerate_layouts(model, 64, 8, 4096, Constraints(global_batch=(256, 1024))).cols
    assert set(ranged["b"] * ranged["m"] * ranged["dp"]) == {256, 512, 1024}


def test_plan_figures_equal_the_scalar_estimate_of_each_layout():
    """The planner's context and columns reach the cost model as `run.mode=estimate` would: its
    best, worst and a middle layout equal xpar.estimate.cost.estimate on their RunSpec."""
    from xpar.estimate.cost import estimate
    plan = plan_of("model=70b", "hardware=a100_80gb_64gpu", "framework=megatron")
    for i in (plan.ranked[0], plan.ranked[len(plan.ranked) // 2], plan.ranked[-1]):
        e = estimate(spec_of(plan.ctx, plan.res, int(i)))
        assert e.tokens_per_s == pytest.approx(plan.res["tokens_per_s"][i], rel=1e-9)
        assert e.memory.total == pytest.approx(plan.res["memory_total"][i], rel=1e-9)
        assert e.mfu == pytest.approx(plan.res["mfu"][i], rel=1e-9) and e.memory.fits


def test_plan_figures_equal_the_estimate_of_torchtitan_moe_on_b200():
    """torchtitan's MoE on Blackwell (its atomic scatters and torch._grouped_mm rate, issue 42): the planner's
    best, middle and worst ep 8 layouts equal the scalar estimate of their RunSpec."""
    plan = plan_of("model=qwen3_30b_a3b", "hardware=b200_180gb_node", "framework=torchtitan", "plan.ep=[8]",
                   "plan.max_tp=1", "plan.pp=1", "plan.global_batch_size=64")
    assert plan.ctx.framework["moe_scatter"] == "atomic" and len(plan.ranked) > 3
    for i in (plan.ranked[0], plan.ranked[len(plan.ranked) // 2], plan.ranked[-1]):
        e = estimate(spec_of(plan.ctx, plan.res, int(i)))
        assert e.tokens_per_s == pytest.approx(plan.res["tokens_per_s"][i], rel=1e-9)
        assert e.time_breakdown["memory_bound"] == pytest.approx(plan.res["time_memory_bound"][i], rel=1e-9)


# --- Narayanan et al. 2021 Table 1: the published layouts are feasible and near the top -------

def megatron_inputs(r: dict) -> PlanInputs:
    """The plan of a Table 1 row: model and hardware as xpar.calibrate.published.megatron_2021_spec builds
    them, framework=megatron, the row's global batch fixed."""
    h, gpus = int(r["hidden"]), int(r["gpus"])
    model = dict(name=f"gpt_{r['params_b']}b", n_layers=int(r["layers"]), hidden=h, n_heads=int(r["heads"]),
                 n_kv_heads=None, ffn_hidden=4 * h, vocab_size=51200, seq_len=2048, activation="gelu",
                 norm="layernorm", position="learned", tied_embeddings=True, bias=True)
    hw = dict(preset("hardware", "a100_80gb_1024gpu"), nodes=gpus // 8)
    fw = preset("framework", "megatron")
    ctx = PlanContext(model=model, hardware=hw, train=dict(dtype="bf16", seq_len=2048), framework=fw)
    B = int(r["global_batch"])
    c = Constraints(global_batch=(B, B), zero_stages=tuple(fw["zero_stages"]), pp_zero_stages=tuple(fw["pp_zero_stages"]),
                    schedules=tuple(fw["schedules"]), interleaved_min_pp=fw["interleaved_min_pp"],
                    interleaved_m_per_pp=fw["interleaved_m_per_pp"])  # what Megatron-LM runs, as xpar plan framework=megatron
    return PlanInputs(ctx, c, (gpus,), None, 10, 0)


MEGATRON_2021 = preset("plan", "megatron_2021")
"""What Megatron-LM ran in Narayanan et al. 2021 (conf/plan/megatron_2021.yaml): full recompute, no
sequence parallelism, no distributed optimizer, 1F1B or interleaved 1F1B."""


def published_row(plan, r: dict) -> int:
    """The plan's row of a Table 1 layout (b = 1, v as xpar.calibrate.published.megatron_2021_spec)."""
    tp, pp, dp, layers = (int(r[k]) for k in ("tp", "pp", "dp", "layers"))
    per_rank = layers // pp
    v = next((d for d in range(2, per_rank + 1) if per_rank % d == 0), 1) if pp > 2 else 1
    sched = "interleaved_1f1b" if v > 1 else "1f1b"
    hit = find(plan.res, tp=tp, pp=pp, dp=dp, b=1, v=v, schedule=sched, zero=0, sp=False, recompute="full")
    assert len(hit) == 1, "the published layout is not in the plan's valid layouts"
    return int(hit[0])


def best_2021(plan) -> int:
    """The top-ranked layout among those Megatron-LM could run in 2021 (:data:`MEGATRON_2021`)."""
    res, top, m = plan.res, plan.ranked, MEGATRON_2021
    ok = np.isin(res["schedule"][top], m["schedules"]) & np.isin(res["recompute"][top], m["recompute"])
    ok &= np.isin(res["sp"][top], m["sequence_parallel"]) & np.isin(res["zero"][top], m["zero_stages"])
    return int(top[ok][0])


def table1_rows(keep) -> list:
    return [pytest.param(r, id=f"{r['params_b']}B") for r in read_table(DATA / "megatron_2021_table1.csv") if keep(r)]


def published_ratio(r: dict) -> tuple:
    """(plan, published row index, its tokens/s / the top 2021 layout's)."""
    plan = search(megatron_inputs(r))
    i = published_row(plan, r)
    assert plan.res["fits"][i], f"published layout estimated not to fit: {plan.res['memory_total'][i] / 1e9:.1f} GB"
    return plan, i, plan.res["tokens_per_s"][i] / plan.res["tokens_per_s"][best_2021(plan)]


AGAINST_PRACTICE = ("7.5", "18.4", "39.1")
"""Table 1 rows whose published layout the plan puts more than 15 % below the top 2021 layout."""


@pytest.mark.parametrize("r", table1_rows(lambda r: r["params_b"] not in AGAINST_PRACTICE))
def test_megatron_table1_layout_is_feasible_and_within_15_percent_of_the_top(r):
    """Over the whole space the published layout is valid and fits. Its tokens/s is compared with
    the top layout Megatron-LM could run then (conf/plan/megatron_2021.yaml); the unrestricted top
    (selective or no recompute, sequence parallelism, distributed optimizer: 2022 techniques) is
    estimated 1.3-1.7x faster than the published layouts (benchmarks/plan.py prints both ratios)."""
    _, _, ratio = published_ratio(r)
    assert ratio >= 0.85, f"published layout at {ratio:.3f} of the top 2021 layout's tokens/s"


@pytest.mark.parametrize("r", table1_rows(lambda r: r["params_b"] in AGAINST_PRACTICE))
def test_megatron_table1_rows_where_the_plan_goes_against_practice(r):
    """The rows the planner does not reproduce (open in issue 9): 18.4B, and under the kernel model
    (issue 42) 7.5B and 39.1B too. The cost model puts layouts of less tp above the published ones:
    tp2 x pp4 x dp32 interleaved (b 4) 1.31x above the published tp8 x dp32 (18.4B; 1.25x under FLOPs
    over one efficiency), which spends 18 % of its step in blocking 8-way tp all-reduces; tp2 x dp64
    (b 8) 1.27x above tp4 x dp32 (7.5B); tp2 x pp8 x dp32 (v 6, b 2) 1.24x above tp8 x pp2 x dp32
    (39.1B). Without sequence parallelism each tp rank also runs the norms and residual adds on every
    token, so the kernel model's element-wise time falls with tp too (1.55 -> 0.77 s at 18.4B).
    Narayanan et al. ran tp = 8 inside the node at 135 TFLOP/s (the estimate of the 18.4B row is 11 %
    low, 7.5B's 11 %). Plan and estimate agree on both layouts (asserted). This pins
    the finding and its cause: it fails once the cost model's tp or pp costs change, and a row then
    joins the test above."""
    plan, i, ratio = published_ratio(r)
    top = best_2021(plan)
    assert 0.7 < ratio < 0.85, ratio
    for j in (i, top):  # the scalar estimate of both layouts is the plan's
        assert estimate(spec_of(plan.ctx, plan.res, j)).tokens_per_s == pytest.approx(plan.res["tokens_per_s"][j])
    gap = {t: (plan.res[f"time_{t}"][i] - plan.res[f"time_{t}"][top]) for t in ("tp_comm", "pp_comm", "bubble")}
    assert max(gap, key=gap.get) == "tp_comm" and gap["tp_comm"] > 0, gap


# --- the seed's scenarios -------------------------------------------------------------------

def show(plan, capsys) -> str:
    from xpar.plan.show import print_plan
    print_plan(plan, "python -m xpar ...")
    out = capsys.readouterr().out
    assert "Winner:" in out and "What the next-best alternatives lose:" in out
    return out


def test_7b_on_8_a100_dp_alone_does_not_fit_a_zero_stage_does(capsys):
    plan = plan_of("model=7b", "hardware=a100_80gb_8gpu")
    show(plan, capsys)
    r = plan.res
    plain = find(r, tp=1, pp=1, zero=0)
    assert len(plain) and not r["fits"][plain].any(), "DP alone (tp=pp=1, ZeRO-0) fits"
    zero = find(r, tp=1, pp=1)
    assert r["fits"][zero][r["zero"][zero] > 0].any(), "no ZeRO stage with tp=pp=1 fits"
    # layouts without offload fit and are faster: the winner keeps its optimizer on the device
    assert not r["offload"][plan.best] and r["offload"][plan.ranked].any()


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_175b_on_1024_a100_tp_inside_the_node_pp_across_nodes(capsys):
    plan = plan_of("model=175b", "hardware=a100_80gb_1024gpu")
    out = show(plan, capsys)
    r, i = plan.res, plan.best
    assert r["tp"][i] <= 8 and 8 % r["tp"][i] == 0, out
    assert r["pp"][i] > 1 and r["tp"][i] * r["dp"][i] >= 8, out  # stages one node or more apart


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_70b_on_64_a100_prints_a_top_layout_and_its_reasoning(capsys):
    plan = plan_of("model=70b", "hardware=a100_80gb_64gpu")
    out = show(plan, capsys)
    r, i = plan.res, plan.best
    # 70B's model states (16 bytes per parameter, 1.1 TB) cannot sit whole on one 85 GB device
    assert r["tp"][i] * r["pp"][i] > 1 or r["zero"][i] == 3, out
    assert r["tp"][i] <= 8, out


def test_70b_on_8_a100_fits_with_the_optimizer_offloaded(capsys):
    """Mixed-precision AdamW keeps 16 bytes per parameter (1.1 TB for 70B) against 8 x 85 GB: no
    layout fits with the optimizer on the devices (the seed's rule of thumb); with the fp32
    master and AdamW states in the node's 2 TB of host memory (ZeRO-Offload) some do, and the
    plan prints a winner that offloads, its host step and PCIe time, and the line with
    framework.cpu_offload_optimizer=true."""
    plan = plan_of("model=70b", "hardware=a100_80gb_8gpu")
    out = show(plan, capsys)
    r, i = plan.res, plan.best
    assert r["offload"][plan.ranked].all() and r["tokens_per_s"][i] > 0, out
    assert "Optimizer offloaded to host memory" in out and "host AdamW" in out, out
    assert r["offload_host_step_s"][i] > 0 and r["offload_pcie_s"][i] >= 0
    assert 0 < r["host_bytes"][i] <= 2000e9 and r["memory_total"][i] <= 85e9
    from xpar.plan.command import reproduce
    line, spec = reproduce(plan)
    assert "framework.cpu_offload_optimizer=true" in line and spec.framework.cpu_offload_optimizer


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_plan_devices_count_the_cp_ranks_when_the_first_candidate_splits_sequences():
    """dp 8 does not divide a global batch of 4 sequences, so the first candidate of the space has cp 2 (dp 4): the
    plan is still on 8 devices (tp x pp x cp x dp), in its table's title and in the claimed gains that divide by it."""
    from xpar.plan.show import ranked_table

    plan = plan_of("model=7b", "hardware=h100_80gb_8gpu", "train.seq_len=8192", "plan.global_batch_size=4")
    assert plan.res["cp"][0] > 1
    assert plan.devices == 8
    assert set(plan.res["tp"] * plan.res["pp"] * plan.res["cp"] * plan.res["dp"]) == {8}
    assert "8 x H100" in str(ranked_table(plan).title)


def test_70b_on_8_a100_without_offload_fits_no_layout_and_names_the_smallest_cluster(capsys):
    err = refusal(capsys, "model=70b", "hardware=a100_80gb_8gpu", "plan.offload=[false]")
    assert "no layout of model=70b fits on 8 x A100-SXM4-80GB" in err
    import re
    fix = re.search(r"the smallest cluster that fits the model is 16 devices \((hardware.nodes=2 plan.global_batch_size=\d+)\)",
                    err)
    assert fix, err
    # followed, it plans (an 'auto' global batch would grow with the devices: the suggestion keeps the one it found)
    assert len(plan_of("model=70b", "hardware=a100_80gb_8gpu", "plan.offload=[false]", *fix.group(1).split()).ranked)


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_devices_range_finds_the_smallest_cluster_reaching_the_throughput():
    from xpar.plan.command import search_smallest
    inputs, problems = plan_inputs(cfg_of("model=70b", "hardware=a100_80gb_8gpu", "plan.devices=[8,512]",
                                          "plan.min_tokens_per_s=20000"))
    assert not problems
    plan = search_smallest(inputs)
    best = dict(plan.clusters)
    assert best[plan.devices] >= 20000 and all(v < 20000 for n, v in best.items() if n < plan.devices)
    assert 0 < best[8] < 20000  # 70B on one node: only with the optimizer offloaded, and slow
    # the powers of two find 64; the whole nodes between 32 and 64 are tried too (a fresh-user breaker: 40
    # devices reached 15,000 tokens/s where the plan said 64)
    assert set(range(40, 64, 8)) <= set(best) and plan.unsearched == ()
    from xpar.plan.show import cluster_lines
    assert cluster_lines(plan)[0] == f"Smallest cluster reaching 20,000 tokens/s: {plan.devices} devices."
    plan.unsearched = (128, 256, 15)  # more than BETWEEN_MAX counts between: said, not claimed smallest
    assert "the 15 whole-node counts between 128 and 256 were not searched" in cluster_lines(plan)[0]


# --- refusals ------------------------------------------------------------------------------

def refusal(capsys, *overrides: str) -> str:
    from xpar.plan.command import run_plan
    with pytest.raises(SystemExit) as e:
        run_plan(cfg_of(*overrides, "tracking=off"), Path("."), Path("."), argv(*overrides, "tracking=off"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("xpar: invalid configuration:") and "Traceback" not in err
    return err


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_bad_constraints_one_line_exit_2(capsys):
    err = refusal(capsys, "model=7b", "hardware=a100_80gb_8gpu", "plan.pp=3")
    assert "plan.pp=3" in err and "pp values that work: [1, 2, 4, 8]" in err
    err = refusal(capsys, "model=7b", "hardware=a100_80gb_8gpu", "plan.max_tp=0")
    assert "plan.max_tp=0 must be >= 1" in err
    err = refusal(capsys, "model=7b", "hardware=a100_80gb_8gpu", "framework=megatron", "plan.zero_stages=[3]")
    assert "framework=megatron runs ZeRO stages [0, 1]" in err
    err = refusal(capsys, "model=7b", "hardware=a100_80gb_8gpu", "framework=megatron", "plan.offload=[true]")
    assert "framework=megatron runs optimizer offload [false]" in err and "e.g. plan.offload=[false]" in err
    err = refusal(capsys, "model=7b", "hardware=a100_80gb_8gpu", "plan.execute_top=2")
    assert "needs hardware=local" in err
    err = refusal(capsys, "model=tiny", "hardware=local", "plan.execute_top=1")  # refusal() adds tracking=off
    assert "compares the runs it records in MLflow, and tracking is off" in err
    err = refusal(capsys, "model=7b", "hardware=a100_80gb_8gpu", "plan.min_tokens_per_s=1e9")
    assert "picks the smallest cluster of a range of plan.devices" in err
    # 296 A100s at global batch 1024: dp would be 37 x 2^k (pp 37's 35 stages between would need more than
    # the 32 blocks; 24 A100s pass since pp 3 splits them 11, 11, 10 -- lighter ends); the line gives a
    # batch and a device count that pass
    err = refusal(capsys, "model=7b", "hardware=a100_80gb_8gpu", "plan.devices=296")
    assert "the last are dropped because b x dp does not divide the global batch, most because tp x pp" in err
    assert "e.g. plan.global_batch_size=1036 or plan.devices=288" in err
    for fix in (["plan.devices=296", "plan.global_batch_size=1036"], ["plan.devices=288"]):
        assert plan_of("model=7b", "hardware=a100_80gb_8gpu", *fix).best is not None
    # the device count it names also fits (a fresh-user breaker: 405B on 40 was sent to 32, where nothing fits)
    # (405B's 126 blocks over pp 5 as 24, 3 x 26, 24 pass on 40 since lighter ends; none fits there; with the
    # plan's default 8 % memory headroom 48 devices no longer hold it either: 56 do)
    err = refusal(capsys, "model=405b", "hardware=a100_80gb_8gpu", "plan.devices=40")
    assert "the smallest cluster that fits the model is 56 devices" in err
    assert plan_of("model=405b", "hardware=a100_80gb_8gpu", "plan.devices=56").best is not None


@pytest.mark.parametrize("bad, says", [
    ("hardware.nodes=0", "hardware.nodes must be >= 1, got 0"), ("model.n_layers=0", "model.n_layers must be >= 1"),
    ("hardware.peak_tflops=0", "hardware.peak_tflops must be > 0 or null"),
    ("train.seq_len=0", "train.seq_len must be >= 1, got 0; e.g. train.seq_len=4096."),
    ("hardware.sync_wait_us=nan", "hardware.sync_wait_us must be >= 0 microseconds and finite"),
    ("hardware.optimizer_ns_per_element=inf", "hardware.optimizer_ns_per_element must be > 0 nanoseconds and finite"),
    ("hardware.cpu_cores=0", "hardware.cpu_cores must be an integer >= 1 or null"),
    ("plan.min_tokens_per_s=nan", "plan.min_tokens_per_s=nan must be > 0 tokens/s and finite")])
def test_model_and_hardware_values_are_checked_as_a_run_checks_them(capsys, bad, says):
    err = refusal(capsys, "model=7b", "hardware=a100_80gb_8gpu", bad)
    assert says in err


def test_model_that_fits_no_layout_names_the_smallest_cluster(capsys):
    err = refusal(capsys, "model=13b", "hardware=a100_80gb_8gpu", "hardware.devices_per_node=1", "plan.devices=1")
    assert "no layout of model=13b fits on 1 x A100-SXM4-80GB" in err
    assert "the smallest cluster that fits the model is" in err


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_smallest_cluster_is_searched_between_doublings_or_says_it_was_not(capsys):
    """Doubling 5 devices finds 10; the whole-node sizes 6-9 are searched too and 8 fits (a
    fresh-user breaker: 405B was said to need 512 GPUs where 448 fit). Where more than
    BETWEEN_MAX sizes lie between, the line says they were not searched instead of 'smallest'."""
    err = refusal(capsys, "model=70b", "hardware=a100_80gb_8gpu", "hardware.devices_per_node=1", "plan.devices=5")
    assert "the smallest cluster that fits the model is 8 devices (hardware.nodes=8 " in err
    err = refusal(capsys, "model=175b", "hardware=a100_80gb_8gpu", "hardware.devices_per_node=1", "plan.devices=2")
    assert "doubling the devices, the first cluster that fits the model is 32 devices" in err
    assert "the 15 sizes between 16 and 32 were not searched (plan.devices=<N> searches one)" in err
    assert "smallest" not in err


def test_headroom_that_fits_nothing_names_the_largest_that_works(capsys):
    err = refusal(capsys, "model=7b", "hardware=a100_80gb_8gpu", "plan.memory_headroom=0.95")
    assert "fits with plan.memory_headroom=" in err


# --- the command, its record and the reproducing line --------------------------------------

@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_plan_run_is_recorded_and_its_command_line_reproduces_the_top_layout(tmp_path, capsys):
    import mlflow

    from xpar.plan.command import run_plan
    from xpar.plan.verify import composed_spec
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    given = ("model=7b", "hardware=a100_80gb_8gpu", "plan.pp=1", f"tracking.uri={uri}")
    plan = run_plan(cfg_of(*given), tmp_path / "out", tmp_path, argv(*given))
    out = capsys.readouterr().out
    line = out.split("Reproduce the top layout:\n")[1].split("\n")[0].strip()
    spec, problem = composed_spec(line, row(plan.res, plan.best))
    assert problem is None and (spec.tp, spec.pp, spec.dp) == tuple(int(plan.res[k][plan.best]) for k in ("tp", "pp", "dp"))
    from xpar.estimate.preflight.check import (
        check_run,  # the run it reproduces passes the fit check (scalar memory model)
    )
    assert check_run(compose_line(line)).layout == spec.layout
    client = mlflow.tracking.MlflowClient(uri)
    run = client.get_run(plan.run_id)
    assert run.data.tags["xpar.mode"] == "plan" and run.info.status == "FINISHED"
    from xpar.track.report import layout_name
    assert run.data.tags["xpar.layout"] == layout_name(spec)  # the winner's, as xpar compare lists it
    params = run.data.params  # the winner's layout, resolved (not the parallel group's unused defaults)
    assert (params["parallel.tp"], params["parallel.pp"], params["parallel.dp"], params["run.mode"]) == (
        str(spec.tp), str(spec.pp), str(spec.dp), "plan")
    assert params["parallel.zero_stage"] == str(spec.layout.zero_stage) and params["parallel.dp"] != "auto"
    names = {a.path for a in client.list_artifacts(plan.run_id)}
    assert {"plan_ranked.csv", "plan_pareto.png", "plan_dropped.csv", "plan.txt"} <= names
    ranked = (tmp_path / "out" / "plan_ranked.csv").read_text().splitlines()
    assert len(ranked) == len(plan.ranked) + 1 and run.data.metrics["plan/layouts_fit"] == len(plan.ranked)
    header = ranked[0].split(",")  # each figure's unit in its column's name
    assert {"time_per_step_s", "memory_total_bytes", "memory_usable_bytes", "host_bytes"} <= set(header)
    assert all(h.endswith("_s") for h in header if h.startswith("time_")), header


def test_an_unwritable_store_is_refused_before_the_search(capsys):
    from xpar.plan.command import run_plan
    given = ("model=7b", "hardware=a100_80gb_8gpu", "tracking.uri=sqlite:////proc/nope/mlflow.db")
    with pytest.raises(SystemExit) as e:
        run_plan(cfg_of(*given), Path("."), Path("."), argv(*given))
    out, err = capsys.readouterr()
    assert e.value.code == 2 and "tracking.uri=sqlite:////proc/nope/mlflow.db cannot be written" in err
    assert "planner error" not in err and "xpar plan: top" not in out  # said before searching, nothing planned


def _raise_value_error():
    raise ValueError("from the helper")


@pytest.mark.slow
def test_side_process_runs_one_call_in_the_forked_helper_then_here():
    from xpar.track import side_process
    assert side_process.start(modules=())
    assert side_process.call(os.getpid) != os.getpid()  # ran in the helper
    assert side_process.call(os.getpid) == os.getpid()  # one call each: the next runs here
    assert side_process.start(modules=())
    with pytest.raises(ValueError, match="from the helper"):
        side_process.call(_raise_value_error)


@pytest.mark.slow
def test_the_helper_ends_when_its_parent_dies_without_calling_it():
    """A fresh-user breaker killed xpar plan's main process: the helper lived on, holding the
    stdout pipe open (a `| cat` never ended). It now sees the parent's end close and exits."""
    code = ("import os, sys\nfrom xpar.track import side_process\nside_process.start(modules=())\n"
            "print(side_process._helper[0].pid, flush=True)\nos._exit(0)\n")  # dies as if killed: no atexit
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid = int(p.stdout.split()[0])
    import time
    deadline = time.time() + 10
    while time.time() < deadline and os.path.exists(f"/proc/{pid}") and \
            open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.slow
def test_the_helper_opens_the_sqlite_store_before_the_call(tmp_path):
    """xpar plan's helper creates or opens the SQLite store while the plan is searched (a new
    store's tables take ~2 s here); only a SQLite URI is opened early."""
    from functools import partial

    from xpar.__main__ import START_DIR, sqlite_store
    from xpar.track import side_process
    from xpar.track.runs import default_uri
    assert sqlite_store([]) == default_uri(START_DIR)
    assert sqlite_store([f"tracking.uri=sqlite:///{tmp_path}/a.db"]) == f"sqlite:///{tmp_path}/a.db"
    assert sqlite_store(["tracking.uri=http://127.0.0.1:5000"]) is None
    assert sqlite_store(["-m", "plan.max_tp=1,2"]) is None and sqlite_store(["plan.execute_top=3"]) is None
    assert side_process.start(modules=(), warm=partial((tmp_path / "warm").write_text, "x"))
    assert side_process.call(os.getpid) != os.getpid() and (tmp_path / "warm").read_text() == "x"


@pytest.mark.parametrize("args, on", [([], True), (["tracking=off"], False), (["tracking.enabled=False"], False),
                                      (["tracking.enabled=0"], False), (["tracking=off", "tracking.enabled=true"], True),
                                      (["tracking.enabled=false", "tracking=default"], True)])
def test_the_helper_is_started_only_when_tracking_is_on(args, on):
    from xpar.__main__ import tracking_on
    assert tracking_on(args) is on


@pytest.mark.slow
def test_planner_path_does_not_import_torch(tmp_path):
    code = ("import sys, runpy\n"
            "sys.argv = ['xpar', 'plan', 'model=7b', 'hardware=a100_80gb_8gpu', 'tracking=off', 'plan.top_k=3']\n"
            "try:\n    runpy.run_module('xpar', run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Winner:" in p.stdout


@pytest.mark.slow
def test_a_plan_multirun_records_each_plan_under_the_sweeps_parent_run(tmp_path):
    """A fresh-user breaker: `xpar plan -m ...` left its sweep's parent run FAILED with an empty
    table, the plans beside it rather than under it."""
    import mlflow
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cmd = [sys.executable, "-m", "xpar", "plan", "-m", "model=7b", "hardware=a100_80gb_8gpu", "plan.top_k=1",
           "plan.max_tp=1,2", f"tracking.uri={uri}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    client = mlflow.tracking.MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    plans = [r for r in runs if r.data.tags.get("xpar.mode") == "plan"]
    parents = {r.data.tags.get("mlflow.parentRunId") for r in plans}
    assert len(plans) == 2 and len(parents) == 1 and None not in parents
    parent = client.get_run(parents.pop())
    assert parent.info.status == "FINISHED" and "xpar.best_run_id" in parent.data.tags


# --- the closed loop on this machine ------------------------------------------------------

@pytest.mark.slow
def test_execute_top_3_runs_three_layouts_and_compares_estimated_with_measured(tmp_path):
    import mlflow
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cmd = [sys.executable, "-m", "xpar", "plan", "model=tiny", "hardware=local", "hardware.devices_per_node=2",
           "plan.execute_top=3", "train.steps=4", "train.warmup_steps=1", "run.progress=false", f"tracking.uri={uri}",
           f"hydra.run.dir={tmp_path / 'run'}"]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    table = p.stdout.split("plan rank")[1]
    assert "Rank order:" in table
    client = mlflow.tracking.MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    children = [r for r in runs if r.data.tags.get("xpar.mode") == "execute"]
    assert len(children) == 3 and all(r.info.status == "FINISHED" for r in children)
    assert all(r.data.metrics["throughput/tokens_per_s"] > 0 for r in children)
    plan_run = next(r for r in runs if r.data.tags.get("xpar.mode") == "plan")
    assert {r.data.tags["xpar.sweep_id"] for r in children} == {plan_run.data.tags["xpar.plan_execute_sweep"]}
    for k in (1, 2, 3):
        assert plan_run.data.metrics[f"plan/execute_{k}_measured_tokens_per_s"] > 0
        assert plan_run.data.metrics[f"plan/execute_{k}_estimated_tokens_per_s"] > 0


@pytest.mark.parametrize("framework, schedules, pp_zero", [
    ("deepspeed", {"1f1b"}, {0, 1}), ("megatron", {"1f1b", "interleaved_1f1b"}, {0, 1})])
def test_a_framework_plan_holds_only_what_the_framework_runs(framework, schedules, pp_zero):
    """DeepSpeed's PipelineEngine runs 1F1B with ZeRO 0/1 only; Megatron-LM runs 1F1B and
    interleaved 1F1B and ZeRO 0/1 (its distributed optimizer): the plan offers nothing else."""
    r = plan_of("model=70b", "hardware=a100_80gb_64gpu", f"framework={framework}").res
    piped = r["pp"] > 1
    assert piped.any() and set(r["schedule"][piped]) <= schedules
    assert set(int(z) for z in r["zero"][piped]) <= pp_zero


# --- issue 11: what a fresh user found in offload and the planner -----------------------------

@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_host_memory_is_named_when_it_is_what_does_not_fit_and_the_fixes_plan(capsys):
    import re
    err = refusal(capsys, "model=70b", "hardware=a100_80gb_8gpu", "hardware.host_memory_gb=500")
    assert "plan.memory_headroom" not in err  # was: a device-memory reason and a headroom that cannot help
    assert "layouts fit device memory, all with the optimizer offloaded" in err
    assert re.search(r"needs 1,1\d\d GB per node, more than hardware.host_memory_gb=500; it fits with "
                     r"hardware.host_memory_gb=\d+, or the smallest cluster that fits the model is 16 devices "
                     r"\(hardware.nodes=2 plan.global_batch_size=\d+\)", err), err
    for fix in (re.search(r"it fits with (hardware.host_memory_gb=\d+)", err).group(1), "hardware.nodes=2"):
        plan = plan_of("model=70b", "hardware=a100_80gb_8gpu", "hardware.host_memory_gb=500", fix)
        assert len(plan.ranked) > 0, fix


def test_offload_asked_on_hardware_without_host_figures_says_why(capsys):
    err = refusal(capsys, "model=tiny", "hardware=local", "plan.offload=[true]")
    assert ("passes plan.offload=[true] (what it keeps is dropped: optimizer offload on hardware without PCIe and "
            "host-memory figures") in err and "e.g. plan.offload=[false]." in err


@pytest.mark.parametrize("devices, fix, follow", [
    (4, "e.g. plan.devices=8, or nodes of 4 devices: hardware.devices_per_node=4 plan.devices=4.",
     "hardware.devices_per_node=4 plan.devices=4"),
    (12, "e.g. plan.devices=8 or plan.devices=16.", "plan.devices=16")])
@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_plan_devices_must_be_whole_nodes_and_the_fix_plans(capsys, devices, fix, follow):
    from xpar.plan.command import reproduce
    err = refusal(capsys, "model=7b", "hardware=a100_80gb_8gpu", f"plan.devices={devices}")
    assert f"plan.devices={devices} is not a whole number of hardware=a100_80gb_8gpu's 8-device nodes" in err
    assert fix in err and "planner error" not in err  # was (4): a planner error after the search
    plan = plan_of("model=7b", "hardware=a100_80gb_8gpu", *follow.split())
    line, spec = reproduce(plan)  # the line names the node size it planned on
    assert spec.world_size == plan.devices


def test_execute_top_leaves_offload_layouts_out_and_refuses_when_only_they_are_left(tmp_path, capsys):
    from xpar.plan.command import run_plan
    from xpar.plan.execute import offloads, pick
    host = ("model=tiny", "hardware=local", "hardware.pcie_gb_per_s=10", "hardware.host_mem_gb_per_s=20",
            "hardware.host_memory_gb=16")
    plan = plan_of(*host)
    off = np.array([offloads(plan, int(i)) for i in plan.ranked])
    assert off.any() and (~off).any()
    plan.ranked = np.concatenate([plan.ranked[off], plan.ranked[~off]])  # offload layouts on top
    rows = pick(plan, 2)
    assert len(rows) == 2 and not any(offloads(plan, i) for i in rows)  # was: the top offload rows, run without it
    over = (*host, "plan.offload=[true]", "plan.execute_top=1", f"tracking.uri=sqlite:///{tmp_path / 'm.db'}")
    with pytest.raises(SystemExit) as e:
        run_plan(cfg_of(*over), tmp_path, tmp_path, argv(*over))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "plan.execute_top=1: none of the top" in err and "e.g. plan.offload=[false]" in err
    assert not (tmp_path / "execute").exists()  # nothing was run


def test_every_step_time_term_has_words_and_a_colour():
    """The plan's explanations (TERM_WORDS) and the estimate's chart (COLORS) name every term of
    the breakdown: a calibrated CPU preset's host_overhead crashed `xpar plan` with a KeyError."""
    from xpar.estimate.cost import TIME_TERMS
    from xpar.track.estimate_figures import COLORS
    from xpar.estimate.terms import AXIS_TIME_TERMS, SETTING_TIME_TERMS
    FIVE_TERMS = AXIS_TIME_TERMS + SETTING_TIME_TERMS
    from xpar.estimate.terms import TERM_WORDS
    assert set(TERM_WORDS) == set(TIME_TERMS) | set(FIVE_TERMS) and len(COLORS) >= len(TIME_TERMS)
    plan = plan_of("model=tiny", "hardware=local", "hardware.op_overhead_us=2.1", "hardware.cpu_cores=2")
    assert plan.res["time_host_overhead"][plan.best] > 0


def test_equal_estimates_rank_the_simplest_layout_first():
    """An uncalibrated hardware=local has no communication figures: every layout of the tiny model
    is estimated as its matmuls and they tie; the simplest (ZeRO-0, no pipeline, no tp, one
    micro-batch) is ranked first, not the leanest (ZeRO-3 measured 10x slower here)."""
    plan = plan_of("model=tiny", "hardware=local")
    r, i = plan.res, plan.best
    top = plan.ranked[:10]
    assert np.all(r["tokens_per_s"][top] == r["tokens_per_s"][i])  # the tie this is about
    assert (r["zero"][i], r["pp"][i], r["tp"][i], r["m"][i]) == (0, 1, 1, 1), {k: r[k][i] for k in ("zero", "pp", "tp", "m")}


def test_plans_keep_to_the_frameworks_schedule_rules():
    """framework=megatron: no interleaved 1F1B at pp < 3 or with m not divisible by pp (a fresh-user
    breaker found 210 of 468 such rows ranked for 7B on 8 A100s); framework=deepspeed_2021: no
    sequence parallelism and no selective recompute (both Korthikanti et al. 2022, after the 2021 stack)."""
    r = plan_of("model=7b", "hardware=a100_80gb_8gpu", "framework=megatron").res
    inter = (r["schedule"] == "interleaved_1f1b") & (r["pp"] > 1)
    assert inter.any() and not (inter & ((r["pp"] < 3) | (r["m"] % r["pp"] != 0))).any()
    plan = plan_of("model=70b", "hardware=a100_80gb_64gpu", "framework=deepspeed_2021")
    assert not plan.res["sp"].any() and plan.space.dropped["interleaved"] == 0
    assert set(plan.res["recompute"].tolist()) == {"none", "full"}


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_a_global_batch_range_is_named_in_the_title_and_each_rows_batch_shown(capsys):
    """plan.global_batch_size=[lo,hi] ranks layouts at several batches: the title names the range and
    a column B gives each row's (b x m x dp); a fixed batch keeps the one number in the title."""
    plan = plan_of("model=13b", "hardware=h100_80gb_16gpu", "plan.global_batch_size=[64,1024]")
    out = show(plan, capsys)
    assert "global batch 64-1024 (column B)" in out
    r = plan.res
    assert len(set((r["b"] * r["m"] * r["dp"])[plan.ranked[:50]])) > 1  # the rows this is about
    fixed = show(plan_of("model=13b", "hardware=h100_80gb_16gpu", "plan.global_batch_size=512"), capsys)
    assert "global batch 512)" in fixed and "(column B)" not in fixed


def test_plan_on_a_cpu_preset_keeps_the_default_train_a_gpu_cluster_gets_train_cluster():
    """A calibrated CPU preset is no GPU cluster: its plan keeps fp32 (a fresh-user breaker found
    ``xpar plan hardware=calibrated_*`` silently planning bf16 at micro-batch 1)."""
    from xpar.config.presets import conf_dir
    from xpar.plan.inputs import plan_argv
    cpu = conf_dir() / "hardware" / f"calibrated_pytest_plan_{os.getpid()}.yaml"
    cpu.write_text("name: local\ndevice: cpu\ndevices_per_node: auto\nnodes: 1\npeak_tflops: 0.1\n")
    try:
        assert "train=cluster" not in plan_argv([f"hardware={cpu.stem}", "model=tiny"])
    finally:
        cpu.unlink()
    assert "train=cluster" not in plan_argv(["hardware=local", "model=tiny"])
    assert "train=cluster" in plan_argv(["hardware=a100_80gb_8gpu", "model=7b"])
    assert "train=cluster" not in plan_argv(["hardware=a100_80gb_8gpu", "model=7b", "train=default"])


def test_a_plan_over_nodes_without_an_inter_node_figure_is_one_line_and_its_command_names_the_nodes(capsys):
    """A CPU preset with a measured link but no inter-node figure, planned over 2 nodes: one line with
    the figure to give (it was a traceback from inside the search: fresh-user breaker); given it, the
    reproducing command names the 2 nodes (it left hardware.nodes out for a local preset)."""
    from xpar.plan.show import override_line
    cpu = ("model=tiny", "hardware=local", "hardware.devices_per_node=2", "hardware.intra_node_gb_per_s=1.5",
           "plan.devices=4")
    err = refusal(capsys, *cpu)
    assert "at plan.devices=4: hardware.inter_node_gb_per_s=null" in err and "hardware.inter_node_gb_per_s=25" in err
    line = override_line(plan_of(*cpu, "hardware.inter_node_gb_per_s=25"))
    assert "hardware.nodes=2" in line.split(), line


# --- issue 27: the plan finds the published layouts of the corpus, one per framework -----------

CORPUS_ROWS = ["llama31_8b_fsdp8_h100", "gpt_neox_20b", "mpt_7b_h100_8gpu_s2048", "nemotron4_15b_tp2_h100_64",
               "llama2_70b_maxtext_fsdp64_h100", "bloom_176b_tr11"]
"""One known run per framework profile but megatron (Narayanan et al. Table 1 is planned above). BLOOM
176B (deepspeed_bloom) trained 70 blocks over 12 stages, 5 on each end and 6 between: the split with
lighter ends that the plan searches where pp x v does not divide the blocks (xpar.estimate.columns.stage_split)."""
PUBLISHED_SPLITS = {"bloom_176b_tr11": (5,) + (6,) * 10 + (5,)}
"""Blocks per stage of the rows whose stages do not divide the blocks (tr11-176B-ml.slurm,
--pp-partition-method 'type:transformer|embedding': embed + 5 blocks, 10 x 6, 5 blocks + embed)."""


def corpus_inputs(r: dict) -> PlanInputs:
    """The plan of a tests/data/known_runs.csv row under its own framework profile: the model and
    device memory as xpar.calibrate.known_runs.known_run_spec builds them, the row's GPU count and
    global batch fixed, what the framework runs searched."""
    from dataclasses import fields

    from xpar.calibrate.known_runs import known_run_spec
    from xpar.config.schema import FrameworkConfig
    spec = known_run_spec(r)
    model = {f: getattr(spec.model, f) for f in ("name", "n_layers", "hidden", "n_heads", "n_kv_heads", "ffn_hidden",
                                                  "vocab_size", "seq_len", "activation", "norm", "position",
                                                  "tied_embeddings", "bias")}
    hw = dict(preset("hardware", "h100_80gb_64gpu" if "H100" in r["gpu"] else "a100_80gb_1024gpu"),
              nodes=int(r["gpus"]) // 8, device_memory_gb=float(r["gpu_memory_gb"]))
    fw = preset("framework", r["framework"])
    ctx = PlanContext(model=model, hardware=hw, train=dict(dtype="bf16", seq_len=int(r["seq"])), framework=fw)
    B = int(r["global_batch"])
    fw = {**{f.name: getattr(FrameworkConfig(), f.name) for f in fields(FrameworkConfig)}, **fw}  # the schema's defaults
    c = Constraints(global_batch=(B, B), zero_stages=tuple(fw["zero_stages"]), pp_zero_stages=tuple(fw["pp_zero_stages"]),
                    schedules=tuple(fw["schedules"]), interleaved_min_pp=fw["interleaved_min_pp"],
                    interleaved_m_per_pp=fw["interleaved_m_per_pp"], recompute=tuple(fw["recompute"] or ("none",
                    "selective", "full")), sequence_parallel=tuple(fw["sequence_parallel"]))
    ctx = PlanContext(model=model, hardware=hw, train=dict(dtype="bf16", seq_len=int(r["seq"])), framework=fw)
    return PlanInputs(ctx, c, (int(r["gpus"]),), None, 10, 0)


@pytest.mark.parametrize("name", CORPUS_ROWS)
def test_the_plan_finds_each_frameworks_published_layout(name):
    """The published layout of a known run is among the plan's layouts under its framework's
    profile, and fits (issue 27: a layout that trained is never refused)."""
    from tests.estimate.test_estimate_memory import KNOWN
    r = next(row for row in KNOWN if row["id"] == name)
    plan = search(corpus_inputs(r))
    hit = find(plan.res, tp=int(r["tp"]), pp=int(r["pp"]), dp=int(r["dp"]), b=int(r["micro_batch"]),
               zero=int(r["zero"]), recompute=r["recompute"], sp=r["sequence_parallel"] == "true",
               split=(int(r["layers"]), PUBLISHED_SPLITS.get(name)))
    assert len(hit) >= 1, f"{name}: the published layout is not among the plan's layouts"
    assert plan.res["fits"][hit].any(), (name, plan.res["memory_total"][hit] / 1e9)


def test_an_uneven_winner_is_reproduced_with_its_split():
    """7B at 30 blocks over plan.pp=4 (framework=deepspeed_bloom: 1F1B): 4 stages do not divide 30
    blocks, the plan splits them 7, 8, 8, 7 (lighter ends); the reproducing line says so
    (parallel.first_stage_layers=7 parallel.last_stage_layers=7), composes to that split and
    re-estimates to the plan's figures; the layouts run for real (xpar.plan.execute) carry the same."""
    from xpar.estimate.cost import estimate
    from xpar.plan.command import reproduce
    from xpar.plan.execute import layout_overrides

    plan = plan_of("model=7b", "model.n_layers=30", "hardware=a100_80gb_64gpu", "framework=deepspeed_bloom",
                   "plan.pp=4")
    r, i = plan.res, plan.best
    line, spec = reproduce(plan)
    assert "parallel.first_stage_layers=7 parallel.last_stage_layers=7" in line, line
    assert spec.layout.layer_split == (7, 8, 8, 7)
    est = estimate(spec)
    assert est.tokens_per_s == pytest.approx(r["tokens_per_s"][i], rel=1e-9)
    assert est.memory.total == pytest.approx(r["memory_total"][i], rel=1e-9)
    par = layout_overrides(plan, i)["parallel"]
    assert (par["layer_split"], par["first_stage_layers"], par["last_stage_layers"]) == (None, 7, 7)


def test_the_plan_says_the_requests_notes_that_no_layout_changes(tmp_path, capsys):
    """A 40 GB memory on the 80 GB A100 preset (its HBM kept) and an n_heads that keeps the preset's K/V heads:
    the estimate notes both; the plan printed neither (its title names the 80 GB part)."""
    from xpar.plan.command import run_plan
    given = ("model=tiny", "model.n_heads=8", "hardware=a100_80gb_node", "hardware.device_memory_gb=40",
             "tracking=off")
    plan = run_plan(cfg_of(*given), tmp_path, tmp_path, argv(*given))
    out = capsys.readouterr().out
    notes = [x for x in out.splitlines() if x.startswith("note: ")]
    assert len(notes) == 2 and list(plan.notes) == [n[len("note: "):] for n in notes]
    assert "keeps the preset's gpu=A100-SXM4-80GB" in notes[0] and "hardware=a100_40gb_node" in notes[0]
    assert "the preset's n_kv_heads=2 is kept" in notes[1]
    run_plan(cfg_of("model=tiny", "hardware=a100_80gb_node", "tracking=off"), tmp_path, tmp_path,
             argv("model=tiny", "hardware=a100_80gb_node", "tracking=off"))
    assert "note: " not in capsys.readouterr().out


def test_the_layouts_run_for_real_keep_the_plans_cp_ep_and_dtype():
    """plan.execute_top ran the top layout without its cp (tiny at plan.cp=[2] on hardware=local ran dp1 cp1 on
    one worker, reported as the plan's cp 2): the generated config carries every searched axis, and composed
    as execute_top composes it, it validates to the plan's layout."""
    from omegaconf import OmegaConf

    from xpar.estimate.preflight.check import check_run
    from xpar.plan.execute import _base_overrides, layout_overrides

    plan = plan_of("model=tiny", "hardware=local", "plan.cp=[2]")
    i = plan.best
    over = layout_overrides(plan, i)
    assert over["parallel"]["cp"] == int(plan.res["cp"][i]) == 2
    line = "python -m xpar " + " ".join(_base_overrides(plan) + ["run.mode=execute", "tracking=off"])
    spec = check_run(OmegaConf.merge(compose_line(line), over))
    assert (spec.layout.cp, spec.dp, spec.tp) == (2, int(plan.res["dp"][i]), int(plan.res["tp"][i]))
    moe = plan_of("model=moe_tiny", "hardware=local", "plan.ep=[2]", "plan.dtype=[fp32,bf16]")
    over = layout_overrides(moe, moe.best)
    assert over["parallel"]["ep"] == 2 and over["train"]["dtype"] == str(moe.res["dtype"][moe.best])


def test_one_executed_layout_reports_no_rank_order(capsys):
    """plan.execute_top=1 printed 'Rank order: the estimates tie (within 0.5 %): the cost model does not separate
    these layouts' about a single layout; it now gives the measured/estimated ratio and how to compare orders."""
    from xpar.plan.execute import print_comparison
    row = {"plan_rank": 1, "estimated_tokens_per_s": 93625.0, "measured_tokens_per_s": 6079.0, "measured_rank": 1,
           "layout": "tp1 pp1 dp2 b4 m1 ZeRO-0 recompute=none"}
    print_comparison([row], 0)
    out = capsys.readouterr().out
    assert "tie" not in out and "Rank order" not in out, out
    assert "One layout executed: measured 0.065x its estimate" in out, out
    two = [dict(row), dict(row, plan_rank=2, estimated_tokens_per_s=50000.0, measured_tokens_per_s=7000.0)]
    two[0]["measured_rank"] = 2
    print_comparison(two, 0)
    assert "Rank order: differs, estimated against measured." in capsys.readouterr().out


def test_a_plan_on_local_hardware_says_it_is_uncalibrated_and_how_to_calibrate(tmp_path, capsys):
    """A plan on hardware=local read MFU 66.7 % and 'No overhead is estimated' with no word that the figures lack
    calibration; it now carries the estimate's UNCALIBRATED note (xpar calibrate), a cluster preset none."""
    from xpar.plan.command import run_plan
    given = ("model=tiny", "hardware=local", "tracking=off")
    plan = run_plan(cfg_of(*given), tmp_path, tmp_path, argv(*given))
    assert any("hardware=local is UNCALIBRATED" in n and "xpar calibrate hardware=local" in n for n in plan.notes)
    assert "note: hardware=local is UNCALIBRATED" in capsys.readouterr().out


def test_a_negative_execute_top_is_one_line_whose_value_works_on_the_hardware_asked():
    """xpar plan model=7b hardware=a100_80gb_8gpu plan.execute_top=-1 gave two lines, the second suggesting
    'hardware=local plan.execute_top=-1' (refused again) and the first 'e.g. plan.execute_top=3' (refused on a
    cluster preset: it executes); now one line with plan.execute_top=0 on a cluster, 3 on hardware=local."""
    _, problems = plan_inputs(cfg_of("model=7b", "hardware=a100_80gb_8gpu", "plan.execute_top=-1"),
                              argv("model=7b", "hardware=a100_80gb_8gpu", "plan.execute_top=-1"))
    assert problems == ["plan.execute_top=-1 must be >= 0; e.g. plan.execute_top=0."], problems
    _, problems = plan_inputs(cfg_of("model=tiny", "plan.execute_top=-1"), argv("model=tiny", "plan.execute_top=-1"))
    assert problems == ["plan.execute_top=-1 must be >= 0; e.g. plan.execute_top=3."], problems


def test_an_auto_batch_past_the_default_says_so(tmp_path, capsys):
    """plan.global_batch_size=auto on more devices than the 4M-token default has sequences gives one sequence per
    device: 7B on 100,000 H100s planned 410M tokens per step with 'global batch 100000' in the title only. A note
    says so; a cluster the default fills, a stated batch or a range of device counts get none."""
    from xpar.plan.command import run_plan
    from xpar.plan.inputs import auto_batch_notes

    def notes(*over):
        cfg = cfg_of(*over, "tracking=off")
        inputs, problems = plan_inputs(cfg, argv(*over, "tracking=off"))
        assert not problems, problems
        return auto_batch_notes(cfg, inputs)

    big = notes("model=7b", "hardware=h100_80gb_8gpu", "plan.devices=2048")
    assert len(big) == 1 and "gave 2,048 sequences of 4,096 tokens (8.4M tokens per step)" in big[0], big
    assert "(1,024 sequences" in big[0] and "plan.global_batch_size=" in big[0]
    for over in (("plan.devices=1024",), ("plan.devices=2048", "plan.global_batch_size=4096"),
                 ("plan.devices=2048", "train.global_batch_size=2048"),
                 ("plan.devices=[1024,4096]", "plan.min_tokens_per_s=1e5")):
        assert notes("model=7b", "hardware=h100_80gb_8gpu", *over) == [], over
    given = ("model=tiny", "hardware=h100_80gb_8gpu", "train.seq_len=65536", "plan.devices=128", "tracking=off")
    plan = run_plan(cfg_of(*given), tmp_path, tmp_path, argv(*given))  # default 64 sequences: 128 on 128 devices
    assert any(n.startswith("global batch: plan.global_batch_size=auto gave 128 sequences") for n in plan.notes)
    assert "note: global batch: plan.global_batch_size=auto gave 128" in capsys.readouterr().out


def test_a_plan_with_one_layout_that_fits_says_it_has_no_alternative():
    """deepseek_v3 on 80 H100s at batch 1024 (the smallest cluster its refusal on 8 H100s names): one layout fits,
    and 'What the next-best alternatives lose:' stood over nothing."""
    from xpar.plan.explain import explain

    plan = plan_of("model=deepseek_v3", "hardware=h100_80gb_8gpu", "hardware.nodes=10", "plan.global_batch_size=1024")
    assert len(plan.ranked) == 1
    lines = explain(plan.res, plan.ranked, plan.ranked)
    assert lines[-2:] == ["What the next-best alternatives lose:", "  none: no other layout fits."], lines


def test_a_device_range_out_of_order_is_told_the_range_that_works():
    """plan.devices=[512,8] was told 'e.g. plan.devices=1536 or plan.devices=[1024,2048]': the range, followed, was
    refused again (a range needs plan.min_tokens_per_s), and neither was the user's range in order."""
    base = ("model=7b", "hardware=h100_80gb_8gpu", "tracking=off")
    _, problems = plan_inputs(cfg_of(*base, "plan.devices=[512,8]"), argv(*base, "plan.devices=[512,8]"))
    assert len(problems) == 1 and problems[0].endswith("e.g. plan.devices=[8,512] plan.min_tokens_per_s=100000."), problems
    fix = ("plan.devices=[8,512]", "plan.min_tokens_per_s=100000")
    assert plan_inputs(cfg_of(*base, *fix), argv(*base, *fix))[1] == []
    _, problems = plan_inputs(cfg_of(*base, "plan.devices=0"), argv(*base, "plan.devices=0"))
    assert "e.g. plan.devices=2048 or plan.devices=[1024,2048] plan.min_tokens_per_s=100000." in problems[0], problems


def test_ctrl_c_in_a_plan_says_nothing_was_recorded_not_that_workers_ended(monkeypatch):
    """A plan has no workers and writes its MLflow run when done: its Ctrl-C line says so, unless it ran a layout
    for real (plan.execute), whose run ended KILLED like any other."""
    import xpar.track.runs as runs
    from xpar.__main__ import interrupted_line

    plan = argv("model=70b")
    monkeypatch.setattr(runs, "KILLED_RUNS", [])
    assert interrupted_line(plan) == "xpar: interrupted; the plan stopped before its record: nothing was written to MLflow."
    assert interrupted_line(["model=70b"]) == "xpar: interrupted; workers ended, the MLflow run (if any) ended KILLED."
    monkeypatch.setattr(runs, "KILLED_RUNS", ["MLflow run 1/abc ended KILLED with 3 steps recorded"])
    assert interrupted_line(plan).startswith("xpar: interrupted; workers ended, MLflow run 1/abc")
