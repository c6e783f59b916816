"""K/V heads kept whole on every tp rank where tp exceeds them (framework.kv_heads_over_tp=replicate:
BigCode's Megatron-LM, the megatron profile), against Megatron-Core's split (megatron_core): StarCoder 15.5B's
multi-query attention at tp 4 pp 4 dp 32 on 512 A100-80GB (Li et al. 2023, arXiv 2305.06161, Sec. 5)."""
from __future__ import annotations

import numpy as np
import pytest

from xpar.config.checks import ConfigError
from xpar.config.presets import kept_kv_heads_notes, preset_dict
from xpar.estimate.columns.peak_memory import memory_columns
from xpar.estimate.columns.step_time import time_columns
from xpar.estimate.comm.volume import comm_bytes_rank
from xpar.estimate.cost import estimate
from xpar.estimate.memory.model_states import held_numel, param_numel, param_shapes
from xpar.estimate.step_parts import kv_grad_reduce_time, kv_replica_times
from xpar.plan.context import COLUMNS, PlanContext, spec_of
from xpar.plan.space import Constraints, enumerate_layouts
from tests.conftest import spec_for

STARCODER = ("run.mode=estimate", "parallel.micro_batches=auto", "hardware=a100_80gb_64gpu", "hardware.nodes=64",
             "model.name=starcoder", "model.n_layers=40", "model.hidden=6144", "model.n_heads=48", "model.n_kv_heads=1",
             "model.ffn_hidden=24576", "model.vocab_size=49152", "model.seq_len=8192", "model.activation=gelu",
             "model.norm=layernorm", "model.position=learned", "model.bias=true", "parallel.tp=4", "parallel.pp=4",
             "parallel.dp=32", "parallel.zero_stage=1", "parallel.sequence_parallel=true", "train.dtype=bf16",
             "train.micro_batch_size=1", "train.global_batch_size=512", "framework.flash_attention=true")
"""The refusal hunt's row 12 (benchmarks/refusal_hunt.md), with FlashAttention (BigCode's runs: use_flash_attn)."""


def starcoder(*more: str):
    return spec_for(*STARCODER, *more)


def test_starcoders_layout_is_priced_under_megatron_with_the_whole_kv_projection_on_every_tp_rank():
    spec = starcoder("framework=megatron")
    shapes = dict(param_shapes(spec, 1))
    assert shapes["1:layers.10.attention.wk.weight"] == (128, 6144)  # the one K/V head (head dim 128), not 128 / 4 rows
    assert shapes["1:layers.10.attention.wv.weight"] == (128, 6144) and shapes["1:layers.10.attention.wk.bias"] == (128,)
    assert shapes["1:layers.10.attention.wq.weight"] == (1536, 6144)  # 48 query heads / 4
    # one block on a tp rank, by hand: 2 LayerNorms 2 x 12,288; wq 1536 x 6144 + 1536; wk and wv 128 x 6144 + 128 each;
    # wo 6144 x 1536 + 6144; w1 6144 x 6144 + 6144; w2 6144 x 6144 + 6144 (its bias whole) = 95,989,504; 10 blocks
    assert param_numel(spec, 1) == 10 * 95_989_504 == 959_895_040
    held = held_numel(spec, 1, 0, "distributed_optimizer", False)
    assert held["grads"] == 959_895_040  # the replicated K/V gradients held whole too
    assert held["optimizer"] == -(-959_895_040 // 32)  # the distributed optimizer's shard of them over dp 32
    e = estimate(spec)
    assert e.memory.fits and e.time_per_step_s > 0
    assert not spec.dry_run and any("kv_heads_over_tp=replicate" in n and "no dry run" in n for n in spec.notes)


def test_a_replicated_head_prices_each_rank_as_a_split_model_with_one_kv_head_per_rank():
    """Without sequence parallelism each rank projects its K/V head over all its tokens: parameters, activations and
    GEMMs as StarCoder with 4 K/V heads split over tp 4; only the model FLOPs (MFU) and the tp collectives differ."""
    rep = estimate(starcoder("framework=megatron", "parallel.sequence_parallel=false"))
    four = estimate(starcoder("framework=megatron", "parallel.sequence_parallel=false", "model.n_kv_heads=4"))
    for k in ("params", "grads", "optimizer", "activations"):
        assert getattr(rep.memory, k) == pytest.approx(getattr(four.memory, k), rel=1e-12), k
    assert rep.time_breakdown["matmul"] == pytest.approx(four.time_breakdown["matmul"], rel=1e-12)
    assert rep.time_breakdown["tp_comm"] > four.time_breakdown["tp_comm"]  # the K/V output gradient all-reduced
    assert rep.tflops_per_device < four.tflops_per_device  # one K/V head's model FLOPs, not four


def test_with_sequence_parallelism_the_kv_projection_runs_on_the_shard_and_its_weight_gradients_are_reduced():
    sp = starcoder("framework=megatron")
    nosp = starcoder("framework=megatron", "parallel.sequence_parallel=false")
    assert kv_grad_reduce_time(sp, 2) > 0 and kv_grad_reduce_time(nosp, 2) == 0.0
    assert kv_replica_times(sp)[0] > 0 and kv_replica_times(nosp)[0] == 0.0  # the forward all-gather of K/V
    # 10 blocks x a ring all-reduce over 4 of 2 x (128 x 6144 + 128) elements at 2 bytes: 10 x 1.5 x 3,146,240
    assert comm_bytes_rank(sp, 1, grad_bytes=2)["tp_allreduce"] == pytest.approx(47_193_600)
    four = estimate(starcoder("framework=megatron", "model.n_kv_heads=4"))
    assert estimate(sp).time_breakdown["matmul"] < four.time_breakdown["matmul"]  # K/V on s / 4 tokens, not s


def test_under_megatron_core_the_refusal_names_the_setting_and_following_it_prices_the_run():
    with pytest.raises(ConfigError) as e:
        starcoder("framework=megatron_core")
    line = next(p for p in e.value.problems if "n_kv_heads" in p)
    assert "parallel.tp=4 must divide model.n_kv_heads=1" in line and "framework.kv_heads_over_tp=replicate" in line
    followed = starcoder("framework=megatron_core", "framework.kv_heads_over_tp=replicate")
    assert param_numel(followed, 1) == 959_895_040


def test_replicated_kv_heads_are_refused_in_execute_mode_with_one_line():
    with pytest.raises(ConfigError) as e:
        spec_for("framework=megatron", "model.n_kv_heads=1", "parallel.tp=2", "parallel.dp=1", local_devices=2)
    lines = [p for p in e.value.problems if "kv_heads_over_tp" in p]
    assert len(lines) == 1 and "estimated, not executed" in lines[0] and "run.mode=estimate" in lines[0]


def _mqa_context(framework: str) -> PlanContext:
    model = dict(preset_dict("model", "7b"), name="mqa", n_layers=8, n_kv_heads=1)
    return PlanContext(model=model, hardware=preset_dict("hardware", "a100_80gb_8gpu"), train={"dtype": "bf16"},
                       framework={k: v for k, v in preset_dict("framework", framework).items() if k != "terms"})


def test_plan_columns_equal_the_estimate_for_replicated_layouts():
    ctx = _mqa_context("megatron")
    rows = [(4, 2, 1, 1, 4, 1, "1f1b", 1, True, "full"), (4, 1, 2, 1, 4, 1, "1f1b", 0, False, "selective"),
            (8, 1, 1, 2, 2, 1, "1f1b", 0, True, "none"), (1, 2, 4, 1, 4, 1, "1f1b", 1, False, "none")]
    cols = {k: np.array([r[i] for r in rows]) for i, k in enumerate(COLUMNS)}
    specs = [spec_of(ctx, cols, i) for i in range(len(rows))]
    ests = [estimate(s) for s in specs]
    assert any(kv_grad_reduce_time(s, 2) > 0 for s in specs)  # a layout with the per-step reduction is compared
    mem = memory_columns(specs[0], cols)
    got = time_columns(specs[0], cols, mem["memory_optimizer"], None, mem["memory_grads"])
    for i, e in enumerate(ests):
        assert got["time_per_step_s"][i] == pytest.approx(e.time_per_step_s, rel=1e-9), rows[i]
        assert got["time_tp_comm"][i] == pytest.approx(e.time_breakdown["tp_comm"], rel=1e-9), rows[i]
        assert got["tp_comm_issued_s"][i] == pytest.approx(e.comm_time["tp"], rel=1e-9), rows[i]
        assert mem["memory_total"][i] == pytest.approx(e.memory.total, rel=1e-9), rows[i]


def test_the_plan_space_holds_tp_above_the_kv_heads_only_where_the_framework_replicates_them():
    model = dict(preset_dict("model", "7b"), n_kv_heads=1)
    spaces = {rep: enumerate_layouts(model, 8, 8, 2048, Constraints(global_batch=(8, 8), kv_replicate=rep))
              for rep in (False, True)}
    assert set(spaces[False].cols["tp"].tolist()) == {1}
    assert {2, 4, 8} <= set(spaces[True].cols["tp"].tolist())


def test_a_changed_n_heads_that_keeps_the_presets_kv_heads_is_noted():
    note = kept_kv_heads_notes(48, 2, "tiny", ["model.n_heads=48"])
    assert len(note) == 1 and "model=tiny's 4" in note[0] and "n_kv_heads=2 is kept" in note[0]
    assert "24 query heads share each K/V head" in note[0] and "model.n_kv_heads=48" in note[0]
    assert kept_kv_heads_notes(48, 48, "tiny", ["model.n_heads=48", "model.n_kv_heads=48"]) == []  # given
    assert kept_kv_heads_notes(4, 2, "tiny", []) == []  # the preset's own heads
    assert kept_kv_heads_notes(64, 64, "175b", ["model.n_heads=64"]) == []  # a preset without K/V heads: MHA follows


def test_a_run_reads_the_note_from_hydras_model_choice_and_overrides():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from xpar.config.presets import conf_dir
    from xpar.run.job import model_preset_notes

    spec = spec_for("run.mode=estimate", "model.n_heads=8")
    assert model_preset_notes(spec) == []  # outside a Hydra app
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose("config", return_hydra_config=True, overrides=["run.mode=estimate", "model.n_heads=8"])
    HydraConfig.instance().set_config(cfg)
    try:
        notes = model_preset_notes(spec)
    finally:
        HydraConfig.instance().cfg = None
        GlobalHydra.instance().clear()
    assert len(notes) == 1 and "model=tiny's 4" in notes[0] and "4 query heads share each K/V head" in notes[0]


def test_the_tp_refusal_says_which_of_its_values_work_on_the_devices_given():
    """Replication lets tp be a multiple of the K/V heads (3 of 12 heads: 1, 3, 6, 12 split the model), but on one
    8-GPU node only tp 1 divides the devices: the refusal said [1, 3, 6, 12], whose 3, 6 and 12 were refused next."""
    shape = ("run.mode=estimate", "model.hidden=96", "model.n_heads=12", "model.n_kv_heads=3", "model.ffn_hidden=192",
             "framework=megatron", "hardware=h100_80gb_node")
    with pytest.raises(ConfigError) as e:
        spec_for(*shape, "parallel.tp=8", "parallel.dp=1")
    line = next(p for p in e.value.problems if "must divide model.n_heads=12" in p)
    assert ": [1, 3, 6, 12] ([1] on the 8 devices, with parallel.dp=auto)." in line
    assert spec_for(*shape, "parallel.tp=1", "parallel.dp=auto").dp == 8  # followed
    with pytest.raises(ConfigError) as e:  # every value fits the devices: the list alone
        spec_for(*shape, "hardware.devices_per_node=12", "parallel.tp=8", "parallel.dp=1")
    assert "on the 12 devices" not in str(e.value) and ": [1, 3, 6, 12]." in str(e.value)


def test_moe_fields_set_on_a_dense_model_are_noted_as_changing_nothing():
    """model.moe_top_k or capacity_factor on model=tiny (no experts) price nothing: the note says so and names
    model.n_experts; on a MoE model, or without such overrides, nothing is said. The plan says it too."""
    from xpar.config.presets import dense_moe_notes
    from xpar.plan.command import request_notes

    note = dense_moe_notes(0, ["model.moe_top_k=4", "model.capacity_factor=1.0", "parallel.tp=2"])
    assert note == ["model.moe_top_k=4, model.capacity_factor=1.0 change nothing: model.n_experts=0 (a dense "
                    "model); set model.n_experts=<E> for a mixture of experts (e.g. model=moe_tiny)"]
    assert "changes nothing" in dense_moe_notes(0, ["+model.moe_router_groups=2"])[0]
    assert dense_moe_notes(8, ["model.moe_top_k=4"]) == [] and dense_moe_notes(0, ["model.n_heads=8"]) == []
    spec = spec_for("run.mode=estimate")
    assert any("model.moe_top_k=1 changes nothing" in n for n in request_notes(spec, ["model.moe_top_k=1"]))


def test_an_fp8_recipe_on_a_run_that_is_not_fp8_says_it_changes_nothing():
    """train.fp8_recipe=mxfp8 on the default fp32 run (or a bf16 plan) was accepted without a word: the recipe
    scales FP8 matmuls only. A note names it and the override that makes the run FP8; none where fp8 is run or
    searched, or where the recipe is not on the command line."""
    from xpar.config.presets import fp8_recipe_notes

    note = fp8_recipe_notes(["fp32"], ["train.fp8_recipe=mxfp8", "parallel.tp=2"])
    assert len(note) == 1 and note[0].startswith("train.fp8_recipe=mxfp8 changes nothing"), note
    assert "train.dtype=fp32" in note[0] and "add train.dtype=fp8" in note[0], note
    assert fp8_recipe_notes(["bf16", "fp8"], ["train.fp8_recipe=current"]) == []  # a plan searching fp8
    assert fp8_recipe_notes(["fp8"], ["train.fp8_recipe=current"]) == []
    assert fp8_recipe_notes(["bf16"], ["train.dtype=bf16"]) == []
    from xpar.plan.command import request_notes
    spec = spec_for("run.mode=estimate")
    assert any("train.fp8_recipe=current changes nothing" in n for n in request_notes(spec, ["train.fp8_recipe=current"]))
    assert not any("fp8_recipe" in n for n in request_notes(spec, ["train.fp8_recipe=current", "plan.dtype=[bf16,fp8]"]))
