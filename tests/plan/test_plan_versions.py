"""Framework profiles per version (issue 44 item 7): framework=megatron_2021 (Narayanan et al. 2021) and
megatron_2022 (Korthikanti et al. 2022) price as the megatron profile and offer only the layouts that
Megatron-LM version ran (conf/framework/megatron_2021.yaml, megatron_2022.yaml: each with its source). Pure CPU."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from tests.conftest import compose
from xpar.calibrate.published import framework_assumptions, gpt_2021_model, read_table
from xpar.config.checks import ConfigError
from xpar.config.validate import validate
from xpar.estimate.cost import Assumptions
from xpar.plan.command import search
from xpar.plan.groups import group_ranks
from xpar.plan.inputs import plan_inputs

DATA = Path(__file__).parents[1] / "data"
TABLE1 = {r["params_b"]: r for r in read_table(DATA / "megatron_2021_table1.csv")}


def table1_plan(params_b: str, framework: str):
    """The plan of a Table 1 row (its GPT, GPUs and global batch) under ``framework``, plan.* at their defaults."""
    r = TABLE1[params_b]
    cfg = compose("hardware=a100_80gb_1024gpu", "train=cluster", f"framework={framework}", "run.mode=plan",
                  "tracking=off")
    model = dict(gpt_2021_model(r), seq_len=2048)
    cfg = OmegaConf.merge(cfg, {"model": model, "hardware": {"nodes": int(r["gpus"]) // 8},
                                "train": {"seq_len": 2048}, "plan": {"global_batch_size": int(r["global_batch"])}})
    inputs, problems = plan_inputs(cfg, [])
    assert not problems, problems
    return search(inputs)


def group_rank(plan, **degrees) -> int:
    """Rank of the degree group holding ``degrees`` among the plan's groups (0: not among them)."""
    r, mine = plan.res, np.ones(len(plan.res["tp"]), dtype=bool)
    for k, v in degrees.items():
        mine &= np.asarray(r[k]) == v
    hit = np.flatnonzero(mine[plan.ranked])
    return int(group_ranks(r, plan.ranked)[hit[0]]) if len(hit) else 0


def test_version_profiles_price_as_the_calibrated_megatron_profile():
    """The version profiles change what is searched, not the cost model: 2021 = Assumptions.megatron_2021 (the
    Table 1 calibration), 2022 = the same with Korthikanti et al.'s asynchronous tp backward."""
    assert framework_assumptions("megatron_2021") == replace(Assumptions.megatron_2021(), name="megatron_2021")
    assert framework_assumptions("megatron_2022") == replace(Assumptions.megatron_2021(), name="megatron_2022",
                                                             tp_async_backward=True)


def test_a_2021_plan_offers_no_2022_technique_and_keeps_the_published_layout_near_its_top():
    """GPT 76.1B on 1024 A100 (Table 1: tp 8, pp 4, dp 32, interleaved, full recompute): under megatron_2021 no
    layout has sequence parallelism, selective recompute, ZeRO-1, a zero-bubble schedule, an interleaved schedule
    at pp < 3 or an uneven layer split, and the published degree group is among its top 3 groups; the
    unversioned megatron profile offers all of them and ranks the published group lower (8th of 39 groups, behind
    sp, selective and ZeRO-1 layouts, when written)."""
    plan_2021, plan_any = table1_plan("76.1", "megatron_2021"), table1_plan("76.1", "megatron")
    old, new = plan_2021.res, plan_any.res
    assert not old["sp"].any() and set(old["recompute"]) <= {"none", "full"} and set(old["zero"]) == {0}
    assert set(old["schedule"][old["pp"] > 1]) <= {"1f1b", "interleaved_1f1b"}
    assert (old["pp"][old["schedule"] == "interleaved_1f1b"] >= 3).all() and (60 % (old["pp"] * old["v"]) == 0).all()
    assert new["sp"].any() and "selective" in set(new["recompute"]) and 1 in set(new["zero"])
    assert (60 % (new["pp"] * new["v"]) != 0).any()
    published = dict(tp=8, pp=4, dp=32, zero=0)
    assert 1 <= group_rank(plan_2021, **published) <= 3 < group_rank(plan_any, **published)


def test_the_2022_profile_offers_sequence_parallelism_and_selective_but_no_distributed_optimizer():
    """megatron_2022 (Korthikanti et al. 2022, before Megatron-LM's distributed optimizer): sp and selective
    recompute searched, ZeRO stage 0 only."""
    res = table1_plan("18.4", "megatron_2022").res
    assert res["sp"].any() and "selective" in set(res["recompute"]) and set(res["zero"]) == {0}


@pytest.mark.parametrize("overrides, words", [
    (("parallel.cp=2",), "framework=megatron_2021 does not run parallel.cp=2 (framework.max_cp=1"),
    (("parallel.pp=4", "parallel.layer_split=[7,8,8,7]"), "framework=megatron_2021 splits the layers evenly"),
    (("parallel.sequence_parallel=true", "parallel.tp=2"), "does not run parallel.sequence_parallel=true"),
    (("parallel.zero_stage=1",), "does not run parallel.zero_stage=1"),
])
def test_a_layout_the_2021_version_cannot_run_is_refused_in_one_line(overrides, words):
    """Validation reads the same profile fields: cp above framework.max_cp, an uneven split under
    framework.even_layer_split, sequence parallelism, ZeRO-1: one line naming the profile."""
    cfg = compose("model=7b", "hardware=a100_80gb_64gpu", "train=cluster", "tracking=off", "run.mode=estimate",
                  "framework=megatron_2021", "model.n_layers=30", *overrides)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
        validate(cfg)


def test_plan_cp_the_version_does_not_run_is_one_line_with_the_values_that_work(capsys):
    """plan.cp=[2] under megatron_2021 (framework.max_cp 1): exit 2, one line naming the framework's rule and the
    cp that works."""
    from tests.plan.test_plan import refusal
    err = refusal(capsys, "model=7b", "hardware=a100_80gb_8gpu", "framework=megatron_2021", "plan.cp=[2]")
    assert "passes plan.cp=[2]" in err and "framework.max_cp" in err and "e.g. plan.cp=[1]." in err


def test_megatron_core_plans_moe_recompute_for_models_with_experts_only():
    """--recompute-modules moe (Megatron-Core 0.13+; the ModelZoo's long-context Qwen3-235B runs): in megatron_core's
    recompute list, searched by xpar plan for a MoE model, not for a dense one (it reruns MoE layers only)."""
    def policies(*overrides):
        cfg = compose("hardware=h100_80gb_64gpu", "framework=megatron_core", "run.mode=plan", "tracking=off", *overrides)
        inputs, problems = plan_inputs(cfg, [])
        assert not problems, problems
        return inputs.constraints.recompute
    assert "moe" in policies("model=mixtral_8x7b") and "moe" not in policies("model=7b")
    assert policies("model=7b") == ("none", "selective", "full")
