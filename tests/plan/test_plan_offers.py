"""What each framework profile offers the plan (issue 44 item 7): the space holds the recompute policies, ZeRO stages
and degrees the framework's code runs (conf/framework/*.yaml, each with its source), and validation refuses the same
layouts. Pure CPU."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import compose
from xpar.config.checks import ConfigError
from xpar.config.validate import validate
from xpar.plan.command import search
from xpar.plan.inputs import plan_inputs


def inputs_of(*overrides):
    """The checked plan request of ``overrides`` (plan.* at their defaults)."""
    cfg = compose("train=cluster", "run.mode=plan", "tracking=off", *overrides)
    inputs, problems = plan_inputs(cfg, [])
    assert not problems, problems
    return inputs


@pytest.mark.parametrize("framework", ["fsdp2_bf16", "llmfoundry", "deepspeed"])
def test_frameworks_without_selective_recompute_are_offered_whole_blocks_or_none(framework):
    """NeMo AutoModel (2025-10), llm-foundry and DeepSpeed checkpoint whole blocks (torch's checkpoint_wrapper,
    DeepSpeed's CheckpointFunction): the plan searches none and full, not an op-level selective policy."""
    c = inputs_of("model=7b", "hardware=h100_80gb_8gpu", f"framework={framework}").constraints
    assert c.recompute == ("none", "full")


def test_automodel_moe_plan_has_tp_1_and_fsdp_only():
    """fsdp2_bf16 (NeMo AutoModel's MoE parallelizer): a MoE model's layouts keep tp 1 (framework.moe_max_tp), no
    selective recompute, ZeRO-3 without pp and ZeRO-2/3 with it wherever dp > 1; a dense model still gets tp > 1."""
    plan = search(inputs_of("model=qwen3_30b_a3b", "hardware=h100_80gb_8gpu", "framework=fsdp2_bf16",
                            "plan.global_batch_size=64"))
    r = plan.res
    assert len(r["tp"]) and (r["tp"] == 1).all() and "selective" not in set(r["recompute"])
    sharded = r["dp"] > 1
    assert set(r["zero"][sharded & (r["pp"] == 1)]) == {3}
    assert set(r["zero"][sharded & (r["pp"] > 1)]) <= {2, 3} and (r["zero"][~sharded] == 0).all()
    assert inputs_of("model=7b", "hardware=h100_80gb_8gpu", "framework=fsdp2_bf16").constraints.max_tp is None


def test_a_moe_layout_with_tp_under_automodel_is_refused_in_one_line():
    """Validation reads framework.moe_max_tp: tp 2 for Mixtral under fsdp2_bf16 is one line naming it and the tp that
    works; the same tp for a dense model passes."""
    base = ("hardware=h100_80gb_8gpu", "train=cluster", "tracking=off", "run.mode=estimate", "framework=fsdp2_bf16",
            "parallel.tp=2", "parallel.zero_stage=3")
    with pytest.raises(ConfigError, match=r"framework.moe_max_tp=1 for a model with experts.*e\.g\. parallel\.tp=1"):
        validate(compose("model=mixtral_8x7b", *base))
    assert validate(compose("model=7b", *base)).layout.tp == 2


def test_the_zero_stage_is_not_checked_at_dp_1():
    """At dp 1 nothing is sharded: fsdp2_bf16 (FSDP2 only, framework.zero_stages [3]) takes zero_stage 0 at dp 1 and
    refuses it at dp 8; the plan keeps dp-1 layouts (stage 0) under the same profile."""
    base = ("model=7b", "hardware=h100_80gb_8gpu", "train=cluster", "tracking=off", "run.mode=estimate",
            "framework=fsdp2_bf16", "parallel.zero_stage=0")
    assert validate(compose(*base, "parallel.tp=8")).layout.dp == 1
    with pytest.raises(ConfigError, match="does not run parallel.zero_stage=0"):
        validate(compose(*base))
    r = search(inputs_of("model=7b", "hardware=h100_80gb_8gpu", "framework=fsdp2_bf16", "plan.global_batch_size=64",
                         "plan.recompute=[none]")).res
    assert np.any(r["dp"] == 1) and (r["zero"][r["dp"] == 1] == 0).all() and (r["zero"][r["dp"] > 1] == 3).all()


def test_torchtitan_runs_ddp_only_without_other_parallelism():
    """torchtitan's DDP runs on a 1-D device mesh (framework.ddp_alone): the plan has no ZeRO-0 layout at dp > 1 with
    tp, pp or cp > 1, keeps ZeRO-0 at tp = pp = cp = 1, and validation refuses tp 2 with ZeRO-0 in one line; MaxText
    (JAX meshes) keeps it."""
    r = search(inputs_of("model=7b", "hardware=h100_80gb_8gpu", "framework=torchtitan", "plan.global_batch_size=64",
                         "plan.recompute=[none]")).res
    ddp = (r["zero"] == 0) & (r["dp"] > 1)
    assert ddp.any() and (r["tp"][ddp] * r["pp"][ddp] * r["cp"][ddp] == 1).all()
    base = ("model=7b", "hardware=h100_80gb_8gpu", "train=cluster", "tracking=off", "run.mode=estimate",
            "parallel.zero_stage=0", "parallel.tp=2")
    with pytest.raises(ConfigError, match=r"does not run parallel.zero_stage=0 \(DDP\).*got tp=2 pp=1 cp=1 ep=1; e\.g\. parallel\.zero_stage=2"):
        validate(compose(*base, "framework=torchtitan"))
    assert validate(compose(*base, "framework=maxtext")).layout.dp == 4


def test_torchtitan_tp_always_carries_sequence_parallelism():
    """torchtitan's apply_tp puts SequenceParallel on the norms whenever tp > 1 (framework.sequence_parallel [true]):
    every plan layout with tp > 1 has sp, tp-1 layouts none; validation refuses tp 2 without sp and takes tp 1."""
    r = search(inputs_of("model=7b", "hardware=h100_80gb_8gpu", "framework=torchtitan", "plan.global_batch_size=64",
                         "plan.recompute=[none]")).res
    assert (r["tp"] > 1).any() and r["sp"][r["tp"] > 1].all() and not r["sp"][r["tp"] == 1].any()
    base = ("model=7b", "hardware=h100_80gb_8gpu", "train=cluster", "tracking=off", "run.mode=estimate",
            "framework=torchtitan", "parallel.zero_stage=3")
    with pytest.raises(ConfigError, match=r"does not run parallel.sequence_parallel=false"):
        validate(compose(*base, "parallel.tp=2"))
    assert validate(compose(*base)).layout.tp == 1


def test_megatron_core_runs_tp_with_ep_only_with_sequence_parallelism():
    """Megatron-Core's TransformerConfig refuses tp > 1 with ep > 1 without sp (framework.tp_ep_needs_sp): no such
    plan layout for Qwen3-30B-A3B on 8 H100, tp > 1 without sp kept at ep 1; validation refuses tp 2 ep 2 without sp."""
    r = search(inputs_of("model=qwen3_30b_a3b", "hardware=h100_80gb_8gpu", "framework=megatron_core",
                         "plan.global_batch_size=64", "plan.recompute=[full]")).res
    both = (r["tp"] > 1) & (r["ep"] > 1)
    assert both.any() and r["sp"][both].all() and (~r["sp"][(r["tp"] > 1) & (r["ep"] == 1)]).any()
    base = ("model=qwen3_30b_a3b", "hardware=h100_80gb_8gpu", "train=cluster", "tracking=off", "run.mode=estimate",
            "framework=megatron_core", "parallel.tp=2", "parallel.ep=2", "parallel.recompute=full")
    with pytest.raises(ConfigError, match=r"does not run parallel.tp=2 with parallel.ep=2 without sequence parallelism"):
        validate(compose(*base))
    assert validate(compose(*base, "parallel.sequence_parallel=true")).layout.ep == 2
