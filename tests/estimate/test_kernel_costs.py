"""The kernel model inside the cost model (xpar.estimate.compute.kernel_costs; issue 42): where it prices compute,
what its terms are, and the step-level properties the issue asks of it."""
from dataclasses import replace

import pytest

from tests.conftest import spec_for
from xpar.calibrate.published import make_spec, preset
from xpar.config.remat import POLICIES
from xpar.estimate.cost import Assumptions, assumptions_for, estimate, layer_costs
from xpar.estimate.compute.kernel_costs import fitted_field, kernel_layer_costs, kernel_priced, rerun_shares

GPU = ("hardware=h100_80gb_64gpu", "train=cluster", "run.mode=estimate", "parallel.zero_stage=3")


def _spec(model, hardware="h100_80gb_64gpu", train=None, **parallel):
    par = dict(name="t", dp="auto", tp=1, pp=1, zero_stage=1, micro_batches=1, schedule="1f1b")
    par.update(parallel)
    tr = dict(micro_batch_size=1, global_batch_size="auto", dtype="bf16")
    tr.update(train or {})
    return make_spec(model if isinstance(model, dict) else preset("model", model), par, preset("hardware", hardware), tr)


def test_gpu_presets_price_compute_by_kernels_and_the_cpu_by_flops():
    gpu = spec_for("model=7b", *GPU)
    assert kernel_priced(gpu.hardware, "bf16") and kernel_priced(gpu.hardware, "fp8")
    assert layer_costs(gpu, assumptions_for(gpu)) == kernel_layer_costs(gpu, assumptions_for(gpu))
    assert fitted_field(gpu.hardware, "bf16") == "sustained_efficiency"
    cpu = spec_for("hardware=local", "hardware.peak_tflops=0.1")
    assert not kernel_priced(cpu.hardware, "fp32") and fitted_field(cpu.hardware, "fp32") == "matmul_efficiency"
    assert layer_costs(cpu, assumptions_for(cpu))["ovh_f"] == 0.0
    a100 = spec_for("model=7b", "hardware=a100_80gb_64gpu", "train=cluster", "run.mode=estimate", "parallel.zero_stage=3")
    assert not kernel_priced(a100.hardware, "fp8")  # no FP8 tensor cores: refused before the model is asked


def test_sustained_efficiency_scales_the_compute_kernels_only():
    spec = _spec("7b")
    a = assumptions_for(spec)
    full = layer_costs(spec, a)
    half = layer_costs(replace(spec, hardware=replace(spec.hardware, sustained_efficiency=0.5)), a)
    slower = spec.hardware.sustained_efficiency / 0.5  # 7B at 4096 tokens: every GEMM and the core compute-bound
    assert half["mm_f"] == pytest.approx(slower * full["mm_f"], rel=1e-9) and half["mem_f"] == full["mem_f"]


def test_recompute_reruns_its_policys_share_of_the_forward_kernels():
    """full: the whole forward (element-wise passes and launches too); selective (xpar's 'op'): the
    attention core; save_dot_except_mlp: the core and w1, w3 (2 of the MLP's 3 GEMMs)."""
    assert rerun_shares("full", False) == {"projections": 1.0, "mlp": 1.0, "attention": 1.0, "memory": 1.0}
    assert rerun_shares("op", False) == {"projections": 0.0, "mlp": 0.0, "attention": 1.0, "memory": 0.0}
    assert rerun_shares("save_dot_except_mlp", False)["mlp"] == pytest.approx(2 / 3)
    assert rerun_shares("full", True)["mlp"] == pytest.approx(2 / 3)  # torch's early stop: never w2
    assert set(POLICIES) >= {"none", "full", "moe"}
    none, full = (layer_costs(_spec("7b", recompute=r), Assumptions(name="megatron")) for r in ("none", "full"))
    assert full["mm_b"] == pytest.approx(none["mm_b"] + none["mm_f"], rel=1e-9)
    assert full["mem_b"] == pytest.approx(none["mem_b"] + none["mem_f"], rel=1e-9)


def test_moe_recompute_reruns_the_experts_at_their_width():
    """recompute=moe (Megatron-Core --recompute-modules moe) reruns the experts' w1 and w3: 2/3 of the
    routed experts' forward GEMM time, at the width a token goes through (top k experts), not the dense FFN."""
    none, moe = (_spec("mixtral_8x7b", recompute=r, ep=8) for r in ("none", "moe"))
    a = Assumptions(name="megatron_core")
    extra = layer_costs(moe, a)["mm_b"] - layer_costs(none, a)["mm_b"]
    assert extra > 0.3 * layer_costs(none, a)["mm_f"]  # the experts are most of a Mixtral block's GEMMs


def test_a_small_models_step_has_its_overhead_term():
    """A ~100M-parameter model at a short micro-batch: its kernels are short, and the launches (or the
    host issuing them) are a visible share of the step (host_overhead in the breakdown)."""
    small = dict(name="gpt_125m", n_layers=12, hidden=768, n_heads=12, ffn_hidden=3072, vocab_size=50257,
                 seq_len=1024, activation="gelu", norm="layernorm", position="learned", tied_embeddings=True)
    e = estimate(_spec(small, "h100_80gb_8gpu", micro_batches=1, zero_stage=0))
    assert e.time_breakdown["host_overhead"] > 0.05 * e.time_per_step_s, e.time_breakdown
    big = estimate(_spec("70b", tp=8, micro_batches=1))
    assert big.time_breakdown["host_overhead"] < 0.02 * big.time_per_step_s


def test_a_narrow_moes_micro_batch_changes_its_time_per_token_as_the_kernel_shapes_say():
    """A 30B-A3B-like MoE (128 experts of width 768, top 8) with 8 experts per rank: at micro-batch 1 each
    local expert gets 1/4 of the tokens it gets at micro-batch 4, its GEMMs quantise worse and the per-kernel
    costs are paid on fewer tokens: time per token falls with the micro-batch, by more than a dense 8B's."""
    moe = dict(name="moe30b", n_layers=48, hidden=2048, n_heads=32, n_kv_heads=4, head_dim=128, ffn_hidden=6144,
               vocab_size=151936, seq_len=4096, activation="swiglu", norm="rmsnorm", position="rope",
               tied_embeddings=False, n_experts=128, moe_top_k=8, expert_ffn_hidden=768)
    per_token = {}
    for name, model, ep in (("moe", moe, 8), ("dense", "7b", 1)):
        for b in (1, 4):
            spec = _spec(model, "h100_80gb_8gpu", ep=ep, dp=8, train=dict(micro_batch_size=b, seq_len=4096))
            c = layer_costs(spec, assumptions_for(spec))
            per_token[name, b] = (c["mm_f"] + c["mm_b"] + c["mem_f"] + c["mem_b"] + c["ovh_f"] + c["ovh_b"]) / b
    gain = {n: per_token[n, 1] / per_token[n, 4] for n in ("moe", "dense")}
    assert gain["moe"] > gain["dense"] > 1.0, gain
