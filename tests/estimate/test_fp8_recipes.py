"""FP8 scaling recipes (train.fp8_recipe; xpar.estimate.compute.fp8_recipes): each recipe's quantise passes,
kernels and GEMM rate in the kernel model, the default's figures kept, mxfp8 refused off Blackwell (issue 42)."""
import pytest

from tests.config.test_refusals import _accepted, refusal
from tests.conftest import spec_for
from xpar.config.checks.hardware import load_hardware_preset
from xpar.estimate.compute.fp8_recipes import CAST_HBM_FRACTION, MXFP8_GEMM_RATE, RECIPES, gemm_dtype, weight_copy_bytes
from xpar.estimate.compute.kernel_block import BlockShape, block_step_times, block_times, priced_cast_bytes
from xpar.estimate.compute.kernels import HBM_FRACTION, device_of, memory_time

H100 = device_of(load_hardware_preset("h100_80gb_8gpu"))
B200 = device_of(load_hardware_preset("b200_180gb_64gpu"))
LLAMA_8B = BlockShape(hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336)
B, S = 2, 8192


def _linear_inputs(sh: BlockShape, tokens: int) -> float:
    """Elements of the activation inputs of a dense block's four linears (qkv, out, up, down) at tp 1."""
    return tokens * (sh.hidden + sh.heads * sh.head_dim + sh.hidden + sh.ffn)


def test_the_default_recipe_is_one_cast_pass_of_3_bytes_an_element_as_before():
    """delayed (the default) prices what train.dtype=fp8 priced before the recipes: per linear one cast kernel
    reading BF16 and writing FP8 (3 bytes an element of its input), nothing else."""
    bf16, fp8 = (block_times(LLAMA_8B, B, S, H100, dtype=d) for d in ("bf16", "fp8"))
    assert fp8.memory - bf16.memory == pytest.approx(memory_time(3.0 * _linear_inputs(LLAMA_8B, B * S), H100))
    assert fp8.kernels - bf16.kernels == 4  # one cast kernel per linear
    default = block_times(LLAMA_8B, B, S, H100, dtype="fp8", fp8_recipe="delayed")
    assert default.total == fp8.total


def test_delayed_scaling_has_no_amax_pass_and_current_scaling_reads_the_tensor_twice():
    """Current scaling reads each BF16 input once more for its amax (2 bytes an element) and launches the amax
    and scale kernels besides the cast (TE's Float8CurrentScalingQuantizer), its passes at CAST_HBM_FRACTION of HBM
    (TE's GEMM profiling tutorial); delayed takes its scale from a history: one read, one kernel, at the block's
    memory-bound rate. Same GEMMs (both tensor-scaled FP8)."""
    assert (RECIPES["delayed"].reads, RECIPES["delayed"].kernels) == (1, 1)
    delayed, current = (block_times(LLAMA_8B, B, S, H100, dtype="fp8", fp8_recipe=r) for r in ("delayed", "current"))
    assert current.gemm == pytest.approx(delayed.gemm)
    n = _linear_inputs(LLAMA_8B, B * S)
    extra = memory_time(5.0 * HBM_FRACTION / CAST_HBM_FRACTION * n, H100) - memory_time(3.0 * n, H100)
    assert current.memory - delayed.memory == pytest.approx(extra)
    assert priced_cast_bytes(RECIPES["current"]) == pytest.approx(5.0 * 0.9 / 0.71)
    assert current.kernels - delayed.kernels == 4 * 2


def test_mxfp8_step_is_slower_than_current_scaling_on_the_same_layout_by_its_gemms_and_copies():
    """On a B200 MXFP8 quantises once into two copies with E8M0 scales (2 + 2 x (1 + 1/32) bytes, no amax
    pass: less traffic than current scaling's 5) but its block-scaled GEMMs run at MXFP8_GEMM_RATE of the
    tensor-scaled rate (TE's GEMM profiling, B300): for a Llama-8B block the GEMMs outweigh the saved read."""
    cur, mx = (block_step_times(LLAMA_8B, B, S, B200, dtype="fp8", fp8_recipe=r) for r in ("current", "mxfp8"))
    assert RECIPES["mxfp8"].cast_bytes() == pytest.approx(4.0625) and RECIPES["current"].cast_bytes() == 5.0
    assert mx.memory < cur.memory  # both at CAST_HBM_FRACTION: fewer bytes, less time
    assert 1.0 < mx.gemm / cur.gemm <= 1 / MXFP8_GEMM_RATE + 1e-9
    assert mx.total > cur.total
    assert mx.attention == pytest.approx(cur.attention)  # the attention core stays BF16 under every recipe


def test_the_estimate_and_its_step_read_the_recipe():
    """The orchestration passes train.fp8_recipe to the kernel model: the same 8-B200 layout's step under
    Megatron-Core (Transformer Engine's fused casts; compute-bound: 16 micro-batches a step) is slower under
    mxfp8 than current scaling, and current slower than delayed (its amax pass)."""
    from xpar.estimate.cost import estimate

    base = ("model=7b", "hardware=b200_180gb_node", "train=cluster", "framework=megatron_core", "train.dtype=fp8",
            "run.mode=estimate", "parallel.tp=1", "parallel.pp=1", "parallel.zero_stage=1",
            "train.micro_batch_size=2", "train.global_batch_size=128")
    step = {r: estimate(spec_for(*base, f"train.fp8_recipe={r}")).time_per_step_s for r in ("delayed", "current", "mxfp8")}
    assert step["delayed"] < step["current"] < step["mxfp8"]


def test_blockwise_runs_on_mxfp8_gemms_on_blackwell_and_fp8_ones_on_hopper():
    assert gemm_dtype("blockwise", mx_native=True) == "mxfp8" and gemm_dtype("blockwise", mx_native=False) == "fp8"
    assert gemm_dtype("current", mx_native=True) == "fp8"
    with pytest.raises(ValueError, match="train.fp8_recipe=mxfp8 needs MXFP8 tensor cores"):
        gemm_dtype("mxfp8", mx_native=False)


def test_fp8_weight_copies_by_recipe_and_device():
    """TE keeps the FP8 weight and (Hopper, TN-only GEMMs) its transpose; on Blackwell one tensor-scaled copy
    serves both layouts; MXFP8 keeps rowwise and columnwise copies and their E8M0 scales."""
    assert weight_copy_bytes("delayed", mx_native=False) == 2  # as before on H100
    assert weight_copy_bytes("current", mx_native=True) == 1
    assert weight_copy_bytes("mxfp8", mx_native=True) == pytest.approx(2 + 2 / 32)


def test_mxfp8_off_blackwell_is_refused_in_one_line_with_values_that_work(tmp_path, monkeypatch, capsys):
    argv = ["model=70b", "hardware=h100_80gb_64gpu", "train=cluster", "train.dtype=fp8", "run.mode=estimate",
            "parallel.tp=8", "parallel.zero_stage=2", "train.fp8_recipe=mxfp8"]
    code, err = refusal(argv, tmp_path, monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err, err
    line = next(x for x in err.splitlines() if "fp8_recipe" in x)
    assert "needs MXFP8 tensor cores" in line and "hardware=h100_80gb_64gpu" in line, err
    for fix in ("train.fp8_recipe=current", "train.fp8_recipe=blockwise", "hardware=b200_180gb_64gpu"):
        assert fix.split("=")[1] in line, line
        assert _accepted([a for a in argv if a.split("=")[0] != fix.split("=")[0]] + [fix])
    assert _accepted([*argv[:-1], "train.dtype=bf16", "train.fp8_recipe=mxfp8"])  # unused under bf16


def test_the_memory_breakdown_holds_each_recipes_weight_copies_on_blackwell():
    """Megatron-Core (framework.fp8_weight_copies) on B200: one tensor-scaled FP8 copy per linear weight element
    (it serves both GEMM layouts), two MXFP8 copies and their E8M0 scales: +1 1/16 bytes an element."""
    from xpar.estimate.cost import peak_memory
    from xpar.estimate.frameworks.fp8_weights import block_linear_numel
    from xpar.estimate.memory.model_states import param_shapes

    mc70 = ("model=70b", "hardware=b200_180gb_64gpu", "train=cluster", "framework=megatron_core", "parallel.tp=8",
            "parallel.pp=4", "parallel.dp=auto", "parallel.zero_stage=1", "parallel.recompute=full",
            "parallel.micro_batches=auto", "train.global_batch_size=64", "train.dtype=fp8")
    spec = spec_for(*mc70, "train.fp8_recipe=current")
    cur, mx = peak_memory(spec), peak_memory(spec_for(*mc70, "train.fp8_recipe=mxfp8"))
    plain = peak_memory(spec_for(*mc70, "train.fp8_recipe=current", "framework.fp8_weight_copies=false"))
    linear = block_linear_numel(tuple(param_shapes(spec, cur.pp_rank)))
    assert cur.params - plain.params == linear
    assert mx.params - cur.params == round((2 + 2 / 32) * linear) - linear


def test_te_quantises_current_scaling_slower_than_the_blocks_fused_passes_and_delayed_alike():
    """framework.fp8_cast_kernels: Transformer Engine's current-scaling and MXFP8 casts at CAST_HBM_FRACTION of HBM
    (TE's GEMM profiling tutorial), torchao's ('fused') at the block's memory-bound share; delayed the same under both."""
    from xpar.estimate.compute.fp8_recipes import quantiser
    te, fused = (block_times(LLAMA_8B, B, S, H100, dtype="fp8", fp8_recipe="current", fp8_casts=k) for k in ("te", "fused"))
    assert te.gemm == pytest.approx(fused.gemm) and te.memory > fused.memory
    assert priced_cast_bytes(quantiser("current", "fused")) == 5.0 and quantiser("mxfp8", "te").hbm_fraction == 0.71
    d_te, d_fused = (block_times(LLAMA_8B, B, S, H100, dtype="fp8", fp8_recipe="delayed", fp8_casts=k) for k in ("te", "fused"))
    assert d_te.memory == pytest.approx(d_fused.memory)
    assert spec_for("framework=megatron_core").framework.fp8_cast_kernels == "te"
    assert spec_for("framework=torchtitan").framework.fp8_cast_kernels == "fused"
    assert spec_for("framework=hai_llm").framework.fp8_cast_kernels == "fused"
