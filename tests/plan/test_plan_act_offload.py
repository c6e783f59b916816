"""Activation offload in the plan (xpar.plan.offload_fit): a layout that does not fit without it is searched with the
fewest blocks offloaded that fit, where the framework runs it; its figures equal the estimate of its command line;
published runs that offloaded are in the space (benchmarks/refusal_hunt4.md row 7). Pure CPU."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import compose
from tests.estimate.test_activation_offload import ROW7
from xpar.config.validate import validate
from xpar.estimate.cost import estimate, peak_memory
from xpar.estimate.terms import time_key
from xpar.plan.command import search
from xpar.plan.context import spec_of
from xpar.plan.inputs import plan_inputs
from xpar.plan.offload_fit import offload_rows
from xpar.plan.show import override_line
from xpar.plan.verify import compose_line

SMALL = ("model=7b", "hardware=h100_80gb_8gpu", "train.micro_batch_size=2", "plan.global_batch_size=64",
         "plan.pp=1", "plan.recompute=[none]")
"""Llama 2 7B on 8 H100 without pp or recompute: only offload makes b > 1 fit (tests/estimate/test_activation_offload.py)."""


def plan_of(*overrides):
    inputs, problems = plan_inputs(compose("train=cluster", "run.mode=plan", "tracking=off", *overrides),
                                   ["train=cluster", "tracking=off", *overrides])  # the command line's
    assert not problems, problems
    return search(inputs)


@pytest.mark.parametrize("framework", ["megatron_core", "xpar"])
def test_offloaded_rows_are_the_fewest_blocks_that_fit_and_equal_the_estimate(framework):
    plan = plan_of(*SMALL, f"framework={framework}")
    r = plan.res
    off = np.flatnonzero(r["act_offload"] > 0)
    assert len(off) and r["fits"][off].all() and (r["pp"][off] == 1).all()
    for i in off[:3]:
        spec = spec_of(plan.ctx, r, int(i))
        est = estimate(spec)
        assert spec.parallel.activation_offload_layers == r["act_offload"][i]
        assert est.time_per_step_s == pytest.approx(r["time_per_step_s"][i], rel=1e-9)
        assert est.time_breakdown["act_offload"] == pytest.approx(r[time_key("act_offload")][i], rel=1e-9, abs=1e-12)
        assert est.memory.total == pytest.approx(r["memory_total"][i], rel=1e-9)
        fewer = spec_of(plan.ctx, dict(r, act_offload=r["act_offload"] - 1), int(i))
        assert not peak_memory(fewer).fits  # the fewest
    assert (r[time_key("act_offload")][r["act_offload"] == 0] == 0).all()


def test_save_on_cpu_offload_is_priced_exposed_and_te_offload_hidden():
    """xpar's save_on_cpu copies on the compute stream; Megatron-Core's hide behind the blocks' compute."""
    xp, core = plan_of(*SMALL, "framework=xpar").res, plan_of(*SMALL, "framework=megatron_core").res
    assert (xp[time_key("act_offload")][xp["act_offload"] > 0] > 0).all()
    assert core[time_key("act_offload")][core["act_offload"] > 0].max() < xp[time_key("act_offload")].max()


def test_no_offload_where_the_framework_or_the_hardware_does_not_run_it():
    plan = plan_of(*SMALL, "framework=torchtitan", "plan.zero_stages=[2]", "plan.max_micro_batch_size=1")
    assert "act_offload" not in plan.res and not len(offload_rows(plan.ctx, plan.res))
    plan = plan_of(*SMALL, "framework=megatron_core", "hardware.pcie_gb_per_s=null", "plan.max_micro_batch_size=1")
    assert "act_offload" not in plan.res


def test_the_offloaded_winner_reproduces_as_a_command_line():
    """At 16K tokens a sequence, tp 1, ZeRO-1, no cp, pp or recompute, 7B fits 8 H100 only with offload."""
    plan = plan_of(*SMALL, "framework=megatron_core", "plan.max_tp=1", "plan.zero_stages=[1]", "plan.cp=[1]",
                   "plan.max_micro_batch_size=1", "train.seq_len=16384")
    i = plan.best
    assert plan.res["act_offload"][i] > 0 and plan.res["time_act_offload"][i] > 0
    line = override_line(plan)
    assert f"parallel.activation_offload_layers={plan.res['act_offload'][i]}" in line
    spec = validate(compose_line(line))
    assert estimate(spec).time_per_step_s == pytest.approx(plan.res["time_per_step_s"][i], rel=1e-9)


def test_the_megatron_bridge_405b_run_is_in_the_plan_and_wins_it():
    """hunt4 row 7 (Megatron-FSDP tp 2 on 128 GB200, cpu_offloading_num_layers 95): on main the plan's best was full
    recompute at tp 4; with offload its own degree group (tp 2, dp 64, ZeRO-3, no recompute) is the winner, at the
    fewest blocks that fit (64 of 126: the recipe's 95 leaves room)."""
    spec = validate(compose_line("python -m xpar " + " ".join(ROW7) + " parallel.activation_offload_layers=95"))
    from benchmarks.plan_published import plan_of as published_plan
    from xpar.estimate.step_parts import assumptions_for

    plan = published_plan(spec, assumptions_for(spec))
    r, i = plan.res, plan.best
    assert (r["tp"][i], r["dp"][i], r["zero"][i], r["recompute"][i]) == (2, 64, 3, "none")
    assert 0 < r["act_offload"][i] < 95


def test_a_stated_layout_without_offload_is_placed_at_the_plans_offload(tmp_path, capsys):
    """7B on 8 H100, ZeRO-3, tp 1, micro-batch 8, no recompute: 192.7 GB as stated; the plan's row offloads the
    fewest blocks that fit, and the line says both."""
    from tests.plan.test_plan import argv, cfg_of
    from xpar.plan.command import run_plan

    given = ("model=7b", "hardware=h100_80gb_node", "tracking=off", "plan.global_batch_size=64", "parallel.tp=1",
             "parallel.dp=8", "parallel.zero_stage=3", "train.micro_batch_size=8", "parallel.recompute=none")
    run_plan(cfg_of(*given), tmp_path, tmp_path, argv(*given))
    first = capsys.readouterr().out.split("\nYour layout")[1].splitlines()[0]
    assert "as stated 192.7 GB per device does not fit 85.0 GB usable; with parallel.activation_offload_layers=" in first
    assert "(the plan's: the fewest blocks that fit, stated 0)" in first
