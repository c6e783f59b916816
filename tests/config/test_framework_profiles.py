"""Framework profiles of issue 43: FSDP2 trainers that keep bf16 parameters and optimizer states
(framework=fsdp2_bf16) and Megatron-DeepSpeed's PipelineEngine as the 2022 runs used it
(framework=megatron_deepspeed), each with its sources in conf/framework/<name>.yaml. Pure CPU, no workers."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import compose
from xpar.calibrate import cp_fp8
from xpar.calibrate import published as cal
from xpar.config.checks import ConfigError
from xpar.config.validate import validate
from xpar.estimate.cost import Assumptions, estimate
from xpar.models.shapes import param_count

DATA = Path(__file__).parents[1] / "data"
"""tests/data (this module at tests/ or in a package folder under it)."""
CLUSTER = ("model=7b", "hardware=a100_80gb_64gpu", "train=cluster", "tracking=off")
ZERO3 = ("parallel.zero_stage=3", "parallel.recompute=full")


def _spec(*overrides: str):
    return validate(compose(*CLUSTER, *overrides))


def test_fsdp2_bf16_keeps_eight_bytes_per_parameter_sharded_and_no_master():
    """2 (bf16 parameter) + 2 (bf16 gradient) + 2 x 2 (bf16 AdamW moments) per parameter, all sharded over dp
    by fully_shard: half of torchtitan's 4 + 4 + 8 (fp32 parameters as the masters, fp32 moments)."""
    spec = _spec("framework=fsdp2_bf16", *ZERO3)
    bf16, titan = estimate(spec).memory, estimate(_spec("framework=torchtitan", *ZERO3)).memory
    assert (bf16.params, bf16.grads, bf16.optimizer) == (titan.params / 2, titan.grads / 2, titan.optimizer / 2)
    assert bf16.optimizer == 2 * bf16.params == 2 * bf16.grads > 0  # moments at the parameter's width
    per_param = (bf16.params + bf16.grads + bf16.optimizer) * spec.dp / param_count(spec.model).total
    assert per_param == pytest.approx(8.0, rel=0.01)  # the shards of 2 + 2 + 4 bytes (uneven shards: padding)
    assert bf16.total < titan.total


def test_fsdp2_bf16_time_is_torchtitans_where_the_bytes_moved_are_the_same():
    """The profile changes what is stored, not FSDP2's collectives: gathers of bf16 parameters either way
    (torchtitan's MixedPrecisionPolicy param_dtype bf16) and the same fp32 reduce-scatter."""
    bf16, titan = (estimate(_spec(f"framework={f}", *ZERO3)) for f in ("fsdp2_bf16", "torchtitan"))
    assert bf16.comm_time["dp"] == pytest.approx(titan.comm_time["dp"])
    assert bf16.comm_bytes == titan.comm_bytes


def test_bf16_optimizer_states_shorten_the_fused_optimizer_step():
    """A fused AdamW makes 2 passes over each element's parameter, gradient and states: bf16 moments
    (framework.optimizer_bytes=4) move 2 x (2 + 2 + 4) bytes per element, not the ZeRO paper's
    2 x (2 + 2 + 12); torchtitan's fp32 states keep the paper's widths."""
    bf16, titan = (estimate(_spec(f"framework={f}", *ZERO3)) for f in ("fsdp2_bf16", "torchtitan"))
    elements = bf16.memory.optimizer / 4
    hbm = _spec("framework=fsdp2_bf16", *ZERO3).hardware.hbm_tb_per_s * 1e12
    assert bf16.offload == {} and titan.time_breakdown["optimizer"] > bf16.time_breakdown["optimizer"]
    assert titan.time_breakdown["optimizer"] - bf16.time_breakdown["optimizer"] == pytest.approx(
        elements * 2 * (12 - 4) / hbm, rel=0.01)


PP = ("parallel.tp=8", "parallel.pp=4", "parallel.zero_stage=1", "parallel.recompute=full")


def test_megatron_deepspeed_runs_1f1b_without_interleaving_and_below_pp():
    """TrainSchedule: 1F1B only (no virtual stages), any micro-batch count (min(pp - s - 1, m) warm-up
    forwards): m = 2 < pp = 4 is estimated with the bubble (pp - 1) / (m + pp - 1); interleaving is refused
    with the values that work, where Megatron-LM runs it."""
    spec = _spec("framework=megatron_deepspeed", *PP, "parallel.schedule=1f1b", "parallel.micro_batches=2")
    assert estimate(spec).bubble_ratio == pytest.approx(3 / 5)
    interleaved = (*PP, "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2", "parallel.micro_batches=8")
    with pytest.raises(ConfigError, match="framework=megatron_deepspeed does not run"):
        _spec("framework=megatron_deepspeed", *interleaved)
    assert _spec("framework=megatron", *interleaved).layout.virtual_stages == 2


def test_megatron_deepspeed_overlaps_no_transfer_and_reduces_after_the_flush():
    """Blocking p2p between the compute instructions and ReduceGrads after the last backward: every send
    and every dp collective is on the step's critical path; turning either overlap on shortens the step."""
    base = ("framework=megatron_deepspeed", *PP, "parallel.schedule=1f1b", "parallel.micro_batches=8")
    est = estimate(_spec(*base))
    assert est.time_breakdown["pp_comm"] > 0 and est.time_breakdown["dp_comm_exposed"] > 0
    p2p = estimate(_spec(*base, "framework.pp_overlap=1.0"))
    assert p2p.time_breakdown["pp_comm"] < 0.2 * est.time_breakdown["pp_comm"]
    dp = estimate(_spec(*base, "framework.dp_overlap=true"))
    assert dp.time_breakdown["dp_comm_exposed"] < est.time_breakdown["dp_comm_exposed"]
    mem = est.memory  # ZeRO-1: DeepSpeed's fp32 copy of the gradient partition at the step
    assert mem.detail["comm_buffers"]["fp32_grad_partition"] == pytest.approx(4 / 12 * mem.optimizer)


def test_megatron_deepspeed_prices_mtnlg_as_its_engine_ran_it_where_megatron_is_20_percent_fast():
    """MT-NLG 530B (Smith et al. 2022; tests/data/smith_2022_mtnlg.csv, never fitted), tp 8 pp 35 ZeRO-1 on
    2240-3360 A100s: the 2021 Megatron-LM profile over-predicts its throughput by 21-26 %, Megatron-DeepSpeed's
    by 8-13 % (its per-layer cost, owner-by-owner ZeRO-1 reduction, blocking p2p): the profile the calibration's
    mtnlg_row estimates it with."""
    rows = cal.read_table(DATA / "smith_2022_mtnlg.csv")
    a100 = cal.preset("hardware", "a100_80gb_node")["sustained_efficiency"]
    for row in rows:
        spec, calibrated, ref, metric = cal.mtnlg_row(row)
        profiles = {"megatron": Assumptions.megatron_2021(), "calibration": calibrated,
                    "megatron_deepspeed": cal.framework_assumptions("megatron_deepspeed")}
        err = {name: cal.errors([("A100", spec, a, ref, metric)], a100)[0] for name, a in profiles.items()}
        assert 0.20 < err["megatron"] < 0.27 and 0.07 < err["megatron_deepspeed"] < 0.13, (row["dp"], err)
        assert calibrated.name == "megatron_deepspeed" and err["calibration"] == err["megatron_deepspeed"]


def test_nemo_automodels_published_70b_row_is_estimated_under_fsdp2_bf16():
    """NeMo AutoModel's Llama 3.1 70B on 64 H100s (FSDP 32 x CP 2, its performance summary; tests/data/cp_fp8_h100.csv):
    estimated under fsdp2_bf16 with its recipe's FusedAdam (fp32 moments over bf16 parameters, no master: 2 + 2 + 8
    bytes, three quarters of torchtitan's 16), its published tokens/s per GPU within 10 % (-7.6 %: torchtitan's
    time, whose collectives and kernels the profile keeps but its attention (Transformer Engine's, not SDPA's
    FlashAttention-2), less the fused optimizer's passes over 8-byte moments
    instead of 12 bytes of master and moments)."""
    row = next(r for r in cal.read_table(DATA / "cp_fp8_h100.csv")
               if r["id"] == "automodel_llama31_70b_bf16_64_cp2")
    spec, assume, metric, published = cp_fp8.cp_fp8_case(row)
    assert assume.name == "fsdp2_bf16" and assume.optimizer_bytes == 8 and spec.layout.zero_stage == 3
    est = estimate(spec, assume)
    titan_spec, titan, _, _ = cp_fp8.cp_fp8_case(dict(row, id="torchtitan_as_automodel"))
    # AutoModel's attention is TE's, not SDPA's FA2; its fully_shard per block + root keeps the head in the root unit
    ref = estimate(titan_spec, replace(titan, attention_kernel="cudnn", head_unit_last=False))
    states = [m.params + m.grads + m.optimizer for m in (est.memory, ref.memory)]
    assert states[0] == pytest.approx(0.75 * states[1]) and est.memory.fits
    error = cp_fp8.published_figure(est, spec, metric) / published - 1
    fewer_bytes = est.memory.optimizer / 8 * 2 * (12 - 8) / (spec.hardware.hbm_tb_per_s * 1e12)
    assert -0.10 < error < 0 and ref.time_per_step_s - est.time_per_step_s == pytest.approx(fewer_bytes, rel=0.01)


DEEPSEEK_V2 = ("framework=hai_llm", "hardware=h800_80gb_2048gpu", "hardware.nodes=128", "model=deepseek_v3",
               "model.n_layers=60", "model.hidden=5120", "model.ffn_hidden=12288", "model.vocab_size=102400",
               "model.n_experts=160", "model.moe_top_k=6", "model.n_shared_experts=2", "model.expert_ffn_hidden=1536",
               "model.first_dense_layers=1", "parallel.pp=16", "parallel.ep=8", "parallel.dp=64",
               "parallel.zero_stage=1", "parallel.micro_batches=auto", "train=cluster", "train.global_batch_size=9216",
               "tracking=off", "run.mode=estimate")
"""DeepSeek-V2 as its paper trained it (arXiv:2405.04434 Sec. 3.1.3: HAI-LLM, 16-way zero-bubble pp, 8-way ep,
ZeRO-1; 60 layers, MLA as DeepSeek-V3's, 160 routed experts of 1536 (top 6) and 2 shared; batch 9216); the GPU
count is not published (1024 here)."""


def test_hai_llm_estimates_deepseek_v2_zero_bubble_and_plans_without_it_by_default():
    """hai_llm runs ZB-H1 (refused before: framework.schedules had DualPipe and the 1F1B family only), with less
    bubble than its 1F1B; xpar plan leaves the zero-bubble schedules out unless plan.schedules names them
    (framework.plan_schedules), and a plan_schedules outside the framework's schedules is refused."""
    from xpar.plan.inputs import plan_inputs

    zb, f1b = (estimate(validate(compose(*DEEPSEEK_V2, f"parallel.schedule={s}"))) for s in ("zb_h1", "1f1b"))
    assert 0 < zb.bubble_ratio < f1b.bubble_ratio and zb.time_per_step_s < f1b.time_per_step_s
    plan = ("framework=hai_llm", "model=deepseek_v3", "hardware=h800_80gb_2048gpu", "tracking=off", "run.mode=plan")
    inputs, problems = plan_inputs(compose(*plan), [])
    assert not problems and "zb_h1" not in inputs.constraints.schedules
    inputs, problems = plan_inputs(compose(*plan, "plan.schedules=[dualpipev,zb_h1]"), [])
    assert not problems and inputs.constraints.schedules == ("dualpipev", "zb_h1")
    with pytest.raises(ConfigError, match=r"framework.plan_schedules=\[zbv\]: \[zbv\] not in framework.schedules"):
        validate(compose(*DEEPSEEK_V2, "parallel.schedule=zb_h1", "framework.plan_schedules=[zbv]"))
