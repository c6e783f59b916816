"""Framework behaviours of 2024-26 runs (issue 43), each with its source in the profile
(conf/framework/*.yaml): the profile's pipeline micro-batch rule. Pure CPU, no workers."""
from __future__ import annotations

import pytest

from tests.conftest import compose
from xpar.config.checks import ConfigError
from xpar.config.validate import validate
from xpar.estimate.cost import estimate
from xpar.estimate.schedule import simulated_bubble

CLUSTER = ("model=7b", "hardware=a100_80gb_64gpu", "train=cluster", "tracking=off")


def _estimate_spec(*overrides: str):
    return validate(compose(*CLUSTER, *overrides))


def test_1f1b_with_fewer_micro_batches_than_stages_is_estimated_under_megatron():
    """Megatron-LM/Core and DeepSpeed's PipelineEngine run 1F1B with m < pp (min(pp - r - 1, m) warm-up
    forwards): the step is (m + pp - 1) micro-batch slots, bubble (pp - 1) / (m + pp - 1). A slot's time
    includes its kernels' launch gaps (host_overhead, per micro-batch under the kernel model)."""
    pp, m = 4, 2
    spec = _estimate_spec("framework=megatron", "parallel.tp=8", f"parallel.pp={pp}", "parallel.schedule=1f1b",
                          f"parallel.micro_batches={m}")
    assert spec.mode == "estimate" and spec.micro_batches == m
    est = estimate(spec)
    assert est.bubble_ratio == pytest.approx((pp - 1) / (m + pp - 1))
    assert simulated_bubble("1f1b", pp, m) == pytest.approx((pp - 1) / (m + pp - 1))  # the replayed schedule
    t = est.time_breakdown
    # the slowest rank's micro-batch; host_overhead: the kernel model's launch time per micro-batch (issue 42)
    slot = sum(t[k] for k in ("matmul", "memory_bound", "tp_comm", "pp_comm", "host_overhead")) / m
    # the fill and drain: pp - 1 slots of the other ranks' micro-batches (lighter than the last, with the logits)
    assert 0.8 * (pp - 1) < t["bubble"] / slot <= pp - 1
    more = estimate(_estimate_spec("framework=megatron", "parallel.tp=8", f"parallel.pp={pp}", "parallel.schedule=1f1b",
                                   f"parallel.micro_batches={2 * pp}"))
    assert more.time_breakdown["bubble"] == pytest.approx(t["bubble"])  # (m + pp - 1) slots: the fill is m's
    assert more.time_per_step_s - est.time_per_step_s == pytest.approx((2 * pp - m) * slot)


@pytest.mark.parametrize("framework", ["deepspeed", "megatron_core"])
def test_other_pipeline_engines_run_1f1b_below_pp(framework):
    spec = _estimate_spec(f"framework={framework}", "parallel.tp=8", "parallel.pp=4", "parallel.schedule=1f1b",
                          "parallel.micro_batches=1")
    assert estimate(spec).bubble_ratio == pytest.approx(3 / 4)


def test_torchs_rule_still_holds_for_torch_trainers_and_in_execute_mode():
    with pytest.raises(ConfigError, match="Schedule1F1B"):  # xpar's own profile is torch's pipelining
        _estimate_spec("parallel.tp=8", "parallel.pp=4", "parallel.schedule=1f1b", "parallel.micro_batches=2")
    with pytest.raises(ConfigError) as e:  # executed: torch's Schedule1F1B runs it, which needs m >= pp
        validate(compose("model=tiny", "tracking=off", "framework=megatron", "run.mode=execute", "parallel.pp=2",
                         "parallel.schedule=1f1b", "parallel.micro_batches=1"), local_devices=2)
    assert "Schedule1F1B" in str(e.value) and "framework.microbatch_rule=megatron" in str(e.value)


# --- vocabulary padding (framework.make_vocab_size_divisible_by) ---------------------------------

GPT3_VOCAB = ("model=7b", "model.vocab_size=50257", "parallel.tp=4", "parallel.pp=2", "parallel.micro_batches=8")


def test_gpt3_vocabulary_is_padded_to_128_x_tp_under_megatron():
    """Megatron-LM pads the tokenizer's 50,257 rows to the next multiple of 128 x tp = 512: 50,688
    (megatron/training/tokenizer/tokenizer.py _vocab_size_with_padding); the padded rows are in the
    logits' FLOPs and the parameters' memory, as an explicit 50,688-row model's."""
    from xpar.estimate.compute.flops import forward_flops_per_token
    spec = _estimate_spec("framework=megatron", *GPT3_VOCAB[:1], *GPT3_VOCAB[2:], GPT3_VOCAB[1])
    assert spec.model.vocab_size == 50688 and any("padded to 50688" in n for n in spec.notes)
    assert forward_flops_per_token(spec.model, spec.seq_len)["logits"] == 2 * 4096 * 50688
    explicit = _estimate_spec("framework=megatron", *GPT3_VOCAB[:1], *GPT3_VOCAB[2:], "model.vocab_size=50688")
    smaller = _estimate_spec("framework=megatron", *GPT3_VOCAB[:1], *GPT3_VOCAB[2:], "model.vocab_size=50176")
    padded, same, less = estimate(spec), estimate(explicit), estimate(smaller)
    assert padded.memory.total == same.memory.total and padded.time_per_step_s == same.time_per_step_s
    assert padded.memory.params > less.memory.params and padded.tflops_per_device != less.tflops_per_device


def test_a_vocabulary_tp_does_not_divide_suggests_the_padding_and_the_suggestion_works():
    with pytest.raises(ConfigError) as e:  # xpar (torch trainers) pads nothing
        _estimate_spec(*GPT3_VOCAB)
    msg = str(e.value)
    assert "framework.make_vocab_size_divisible_by=128" in msg and "50688" in msg and "tp values" not in msg
    spec = _estimate_spec(*GPT3_VOCAB, "framework.make_vocab_size_divisible_by=128")
    assert spec.model.vocab_size == 50688


def test_torch_trainers_do_not_pad():
    spec = _estimate_spec("model.vocab_size=50304", "parallel.tp=4")
    assert spec.model.vocab_size == 50304


def test_the_planner_prices_the_padded_vocabulary_and_megatrons_m_below_pp_as_the_estimate():
    """xpar plan (vectorised) equals the scalar estimate where the vocabulary is padded per tp and 1F1B
    runs fewer micro-batches than stages (framework=megatron)."""
    import numpy as np
    from omegaconf import OmegaConf
    from xpar.plan.context import COLUMNS, PlanContext, spec_of
    from xpar.plan.evaluate import evaluate

    cfg = OmegaConf.to_container(compose(*CLUSTER, "framework=megatron", "model.vocab_size=50257"), resolve=True)
    ctx = PlanContext(model=cfg["model"], hardware=cfg["hardware"], train={"dtype": "bf16"}, framework=cfg["framework"])
    rows = [(1, 4, 16, 1, 2, 1, "1f1b", 1, False, "full"), (4, 2, 8, 1, 1, 1, "1f1b", 0, True, "selective"),
            (8, 1, 8, 2, 4, 1, "1f1b", 1, True, "none"), (2, 4, 8, 1, 8, 1, "1f1b", 1, False, "full")]
    cols = {k: np.array([r[i] for r in rows]) for i, k in enumerate(COLUMNS)}
    got = evaluate(ctx, cols)
    for i in range(len(rows)):
        e = estimate(spec_of(ctx, cols, i))
        assert got["time_per_step_s"][i] == pytest.approx(e.time_per_step_s, rel=1e-9)
        assert got["memory_total"][i] == pytest.approx(e.memory.total, rel=1e-9)
        assert got["tflops_per_device"][i] == pytest.approx(e.tflops_per_device, rel=1e-9)


# --- model.head_dim ---------------------------------------------------------------------------------

WIDE_HEADS = ("model.hidden=2880", "model.n_heads=64", "model.n_kv_heads=8", "model.head_dim=64",
              "model.ffn_hidden=2880", "model.n_layers=24", "model.vocab_size=201088")  # gpt-oss-20b's attention


def test_head_dim_other_than_hidden_over_heads_is_estimated_with_its_widths():
    """64 heads of 64 in a 2880-wide model (hidden / heads = 45, odd: refused for rope without
    model.head_dim): q and the context are 64 x 64 = 4096 wide, k and v 8 x 64 = 512."""
    from xpar.estimate.compute.flops import forward_flops_per_token
    from xpar.models.shapes import param_count
    with pytest.raises(ConfigError, match="rope needs an even head dim"):
        _estimate_spec(*WIDE_HEADS[:3], *WIDE_HEADS[4:])
    spec = _estimate_spec(*WIDE_HEADS, "parallel.tp=8")
    cfg = spec.model
    assert (cfg.head_dim, cfg.q_dim) == (64, 4096)
    h, s = 2880, spec.seq_len
    per_block = 2 * (2 * h * 4096 + 2 * h * 512 + 3 * h * 2880)  # wq, wo h x 4096; wk, wv h x 512; SwiGLU
    flops = forward_flops_per_token(cfg, s)
    assert flops["matmul"] == 24 * per_block and flops["attention"] == 24 * 4 * s * 4096
    assert param_count(cfg).per_layer == 2 * h * 4096 + 2 * h * 512 + 3 * h * 2880 + 2 * h
    e = estimate(spec)
    narrow = estimate(_estimate_spec(*WIDE_HEADS[:3], "model.head_dim=32", *WIDE_HEADS[4:], "parallel.tp=8"))
    assert e.memory.params > narrow.memory.params and e.memory.activations > narrow.memory.activations


def test_the_memory_models_parameter_list_is_the_models_with_head_dim():
    import torch
    from xpar.config.schema import ModelConfig
    from xpar.estimate.memory.model_states import _meta_shapes, _model_key
    from xpar.models.transformer import Transformer
    cfg = ModelConfig(hidden=36, n_heads=4, n_kv_heads=2, head_dim=8, ffn_hidden=64, n_layers=2, bias=True,
                      norm="layernorm")
    with torch.device("meta"):
        model = Transformer(cfg)
    assert _meta_shapes(_model_key(cfg), 2, True, True) == tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
    assert model.layers["0"].attention.wq.weight.shape == (32, 36)


def _losses(spec_dicts: list[dict]) -> list:
    """Worker: every rank's losses of each spec."""
    import tempfile
    from pathlib import Path

    from xpar.config.spec import RunSpec
    from xpar.run.worker import run_rank

    out = []
    for d in spec_dicts:
        with tempfile.TemporaryDirectory() as tmp:
            stats = run_rank(RunSpec.from_dict(d), Path(tmp))
        if stats is not None:
            out.append([s["losses"] for s in stats])
    return out


@pytest.mark.slow
def test_head_dim_model_runs_under_tp_and_equals_the_reference():
    """The tiny analogue of 64 heads of 64 in 2880: 4 heads of 8 in a 36-wide model (36 / 4 = 9, odd),
    executed over tp 2 (2 heads per rank) equals the single-process reference."""
    from tests.conftest import reference_losses, spawn, spec_for
    spec = spec_for("model.hidden=36", "model.head_dim=8", "parallel.tp=2", "parallel.dp=1", "train.steps=3",
                    "train.warmup_steps=0", local_devices=2)
    assert spec.mode == "execute" and spec.model.q_dim == 32
    (per_rank,) = spawn(_losses, 2, [spec.to_dict()])
    assert per_rank[0] == pytest.approx(reference_losses(spec), rel=1e-4)


# --- DeepSpeed ZeRO-1/2's fp32 gradient partition --------------------------------------------------

@pytest.mark.parametrize("zero", [1, 2])
def test_deepspeed_zero12_breakdown_counts_the_fp32_gradient_partition(zero):
    """DeepSpeedZeroOptimizer.step casts the rank's gradient partition to fp32: +4 bytes per element of
    its optimizer partition (12 bytes per element: fp32 master and moments) in comm_buffers."""
    spec = _estimate_spec("framework=deepspeed", f"parallel.zero_stage={zero}")
    mem = estimate(spec).memory
    part = mem.detail["comm_buffers"]["fp32_grad_partition"]
    assert part == pytest.approx(4 / 12 * mem.optimizer) and part > 0
    off = estimate(_estimate_spec("framework=deepspeed", f"parallel.zero_stage={zero}",
                                  "framework.fp32_grad_partition=false")).memory
    assert mem.total - off.total == pytest.approx(part)


# --- megatron_core: Megatron-FSDP, interleaving at pp 2 -------------------------------------------------

def test_megatron_core_runs_megatron_fsdp_and_interleaves_at_pp_2():
    spec = _estimate_spec("framework=megatron_core", "parallel.zero_stage=3")  # --use-megatron-fsdp optim_grads_params
    assert spec.layout.zero_stage == 3 and estimate(spec).memory.params > 0
    spec = _estimate_spec("framework=megatron_core", "parallel.tp=8", "parallel.pp=2", "parallel.schedule=interleaved_1f1b",
                          "parallel.virtual_stages=4", "parallel.micro_batches=8")
    assert spec.layout.virtual_stages == 4
    with pytest.raises(ConfigError, match="interleaved_1f1b only at pp >= 3"):  # the 2021 Megatron-LM's rule stays
        _estimate_spec("framework=megatron", "parallel.tp=8", "parallel.pp=2", "parallel.schedule=interleaved_1f1b",
                       "parallel.virtual_stages=4", "parallel.micro_batches=8")
    with pytest.raises(ConfigError, match="does not run parallel.zero_stage=3 with pp > 1"):  # Megatron-FSDP: no pp
        _estimate_spec("framework=megatron_core", "parallel.tp=8", "parallel.pp=2", "parallel.zero_stage=3",
                       "parallel.micro_batches=8")



def test_megatron_fsdp_gathers_into_its_parameters_without_copies():
    """Megatron-FSDP keeps parameters and main grads as views of its communication buffers (its README: zero copy
    communication, ParamAndGradBuffer): no FSDP2 copy-in/out on the compute stream, so less dp time exposed than
    the same layout with FSDP2's copies."""
    zero3 = ("framework=megatron_core", "parallel.zero_stage=3", "parallel.tp=1", "parallel.pp=1", "parallel.dp=auto")
    mcore = estimate(_estimate_spec(*zero3)).time_breakdown["dp_comm_exposed"]
    copies = estimate(_estimate_spec(*zero3, "framework.fsdp_copies=fsdp2")).time_breakdown["dp_comm_exposed"]
    assert 0 < mcore < copies


def test_torchtitan_gathers_the_embedding_and_the_head_as_units_of_their_own():
    """torchtitan's apply_fsdp shards tok_embeddings and [norm, output] apart (framework.fsdp_head_units): an untied
    model's largest root unit is the larger of the two, not their sum, in the all-gather and reduce buffers."""
    tt = ("framework=torchtitan", "parallel.zero_stage=3", "parallel.tp=1", "parallel.pp=1", "parallel.dp=auto")
    split = estimate(_estimate_spec(*tt)).memory.detail["comm_buffers"]
    one = estimate(_estimate_spec(*tt, "framework.fsdp_head_units=false")).memory.detail["comm_buffers"]
    block = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096  # Llama 2 7B: attention, SwiGLU, two norms
    embedding, head = 32000 * 4096, 32000 * 4096 + 4096  # the head with the final norm
    assert split["fsdp_reduce"] / one["fsdp_reduce"] == pytest.approx(block / (embedding + head))  # a block is larger
    assert one["fsdp_allgather"] - split["fsdp_allgather"] == pytest.approx(2 * embedding)  # bf16: the embedding

# --- DeepSpeed BF16_Optimizer's gradient casts (Megatron-DeepSpeed as BLOOM ran it) ----------------------------

def test_deepspeed_bloom_counts_the_bf16_optimizers_gradient_casts():
    """BLOOM's final run (tr11: tp 4, pp 12, dp 8, ZeRO 0, BF16_Optimizer) on its first stage: the fp32 buffer
    all-reduced through a bf16 copy (2 bytes per held gradient element: grads / 3 at 6 bytes) and the largest
    gradient, the tp-local embedding (250,880 / 4 x 14,336), cast to fp32 before its accumulation (4 bytes per
    element), both in comm_buffers; the published nvidia-smi peak (60 GiB) within 5 % (19-25 % below without them,
    benchmarks/memory_published.py)."""
    from dataclasses import replace
    from pathlib import Path
    from xpar.calibrate.known_runs import known_run_spec
    from xpar.calibrate.published import framework_assumptions, read_table
    from xpar.estimate.memory import per_device as mem
    row = next(r for r in read_table(Path(__file__).parents[1] / "data" / "known_runs.csv") if r["id"] == "bloom_176b_tr11")
    spec, assume = known_run_spec(row), framework_assumptions("deepspeed_bloom")
    est = mem.memory(spec, assume=assume)
    casts = est.detail["comm_buffers"]
    assert casts["grad_reduce_cast"] == pytest.approx(est.grads / 3)
    assert casts["grad_accum_cast"] == pytest.approx(4 * 250880 // 4 * 14336)
    off = mem.memory(spec, assume=replace(assume, grad_reduce_cast_bytes=0, grad_accum_cast_bytes=0))
    assert est.total - off.total == pytest.approx(casts["grad_reduce_cast"] + casts["grad_accum_cast"])
    published = float(row["peak_gib"]) * 2 ** 30
    assert -0.05 < est.total / published - 1 < 0 and off.total / published - 1 < -0.19
