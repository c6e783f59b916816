"""train.compile (issue 42): a compiled block's element-wise passes at TorchInductor's fused traffic, estimate only.

Checked against torchtitan's own paired runs (benchmarks/llama3_h100_202412_torchtitan.md @31a17bfd, Table 1:
Llama 3.1 8B, FSDP 8, local batch 2, op-level SAC; the same hardware and layout eager, compiled, compiled + Float8):
tests/data/torchtitan_h100_2024.csv (eager 5,762 tokens/s/GPU), known_runs.csv llama31_8b_fsdp8_compile_h100
(compiled, 6,667) and cp_fp8_h100.csv torchtitan_llama31_8b_fp8_8_fsdp (compiled + Float8, 8,532).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from xpar.calibrate.cp_fp8 import cp_fp8_case, row_compiled
from xpar.calibrate.known_runs import known_run_spec
from xpar.calibrate.published import framework_assumptions, read_table, torchtitan_h100_row
from xpar.config.presets import preset_dict
from xpar.estimate.compute.kernel_costs import elementwise_passes, kernel_layer_costs
from xpar.estimate.cost import estimate
from xpar.estimate.memory import per_device as mem
from xpar.estimate.memory.activations import loss_bytes
from xpar.plan.context import PlanContext, spec_of
from xpar.estimate.columns.step_time import time_columns
from tests.plan.test_plan_vector import _mismatches, memory_args, random_candidates

DATA = Path(__file__).resolve().parents[1] / "data"
CP_FP8 = {r["id"]: r for r in read_table(DATA / "cp_fp8_h100.csv")}
KNOWN = {r["id"]: r for r in read_table(DATA / "known_runs.csv")}


def _compiled(spec, on: bool, dtype: str = None):
    return replace(spec, train=replace(spec.train, compile=on, dtype=dtype or spec.train.dtype))


def _table1():
    """(spec, assumptions, published eager tokens/s/GPU) of torchtitan Table 1's FSDP 8 row."""
    row = next(r for r in read_table(DATA / "torchtitan_h100_2024.csv") if r["gpus"] == "8")
    spec, assume, ref, _ = torchtitan_h100_row(row)
    return spec, assume, ref


def test_compile_counts_one_pass_and_eager_the_profiles():
    spec, assume, _ = _table1()
    assert assume.elementwise_passes == 3.0 and not spec.train.compile
    assert elementwise_passes(spec.train, assume) == 3.0
    assert elementwise_passes(_compiled(spec, True).train, assume) == 1.0


def test_compiled_block_moves_a_third_of_eager_traffic_and_the_same_gemms():
    """torchtitan's eager profile (3 passes): compiled, every memory-bound term a third; GEMMs, attention the same."""
    spec, assume, _ = _table1()
    eager, comp = (kernel_layer_costs(_compiled(spec, c), assume) for c in (False, True))
    for k in ("mem_f", "mem_b"):
        assert comp[k] == pytest.approx(eager[k] / 3, rel=1e-12) and comp[k] > 0
    for k in ("mm_f", "mm_b", "logits_mm_f", "logits_mm_b"):
        assert comp[k] == pytest.approx(eager[k], rel=1e-12)


def test_compile_gain_as_torchtitan_table1_measures_it():
    """Published: compiled 6,667 / eager 5,762 = 1.157x; the estimate's ratio within 5 % of it (1.13x)."""
    spec, assume, eager_ref = _table1()
    compiled_ref = float(KNOWN["llama31_8b_fsdp8_compile_h100"]["reported"].split()[0])
    eager, comp = (estimate(_compiled(spec, c), assume).tokens_per_s_per_device for c in (False, True))
    assert comp > eager
    assert comp / eager == pytest.approx(compiled_ref / eager_ref, rel=0.05)


def test_float8_gain_under_compile_as_table1_measures_it():
    """Published compiled Float8 / compiled BF16: 8,532 / 6,667 = 1.280x; the estimate's within 3 % (1.276x),
    where pricing the same runs eager gives 1.125x (torchao's amax and casts at eager traffic)."""
    spec, assume, _, fp8_ref = cp_fp8_case(CP_FP8["torchtitan_llama31_8b_fp8_8_fsdp"])
    bf16_ref = float(KNOWN["llama31_8b_fsdp8_compile_h100"]["reported"].split()[0])
    tps = {(c, d): estimate(_compiled(spec, c, d), assume).tokens_per_s_per_device
           for c in (False, True) for d in ("bf16", "fp8")}
    want = fp8_ref / bf16_ref
    assert tps[(True, "fp8")] / tps[(True, "bf16")] == pytest.approx(want, rel=0.03)
    assert abs(tps[(False, "fp8")] / tps[(False, "bf16")] / want - 1) > 0.1


def test_rows_that_state_torch_compile_carry_it():
    """cp_fp8_h100.csv's torchtitan rows state torch.compile (Tables 1, 2, 6); the eager torchtitan source does not."""
    torchtitan = [r for r in CP_FP8.values() if r["id"].startswith("torchtitan")]
    assert len(torchtitan) == 9 and all(cp_fp8_case(r)[0].train.compile for r in torchtitan)
    assert not cp_fp8_case(CP_FP8["dgxc_llama31_8b_fp8_8"])[0].train.compile
    assert not _table1()[0].train.compile
    assert not row_compiled({"source": "x", "note": "bf16, no torch.compile"})


def test_plan_columns_equal_the_estimate_under_compile():
    """The planner's vectorised step time prices train.compile as the scalar estimate does, and faster than eager."""
    ctx = PlanContext(model=preset_dict("model", "7b"), hardware=preset_dict("hardware", "h100_80gb_64gpu"),
                      train={"dtype": "bf16", "compile": True}, framework=preset_dict("framework", "torchtitan"))
    cols = random_candidates(ctx, np.random.default_rng(3), 3)
    specs = [spec_of(ctx, cols, i) for i in range(3)]
    assert all(s.train.compile for s in specs)
    ests = [estimate(s) for s in specs]
    got = time_columns(specs[0], cols, *memory_args(ests))
    assert not _mismatches(ctx, cols, got, ests)
    eager = [estimate(_compiled(s, False)).time_per_step_s for s in specs]
    assert all(e.time_per_step_s < x for e, x in zip(ests, eager))


def test_a_compiled_loss_keeps_bf16_logits_and_a_bf16_gradient():
    """Eager cross_entropy(logits.float()): 4 bytes a logit kept, 8 transient; compiled: the dtype's bytes each;
    llm-foundry's fused kernel: the logits kept, nothing transient, compiled or not."""
    assert loss_bytes("fp32", False, 2) == (4.0, 8.0)
    assert loss_bytes("fp32", True, 2) == (2.0, 2.0)
    assert loss_bytes("fused", True, 2) == loss_bytes("fused", False, 2) == (2.0, 0.0)


def test_known_runs_carry_their_compile_and_the_loss_term_shrinks_by_its_logits():
    """known_runs.csv's compile column: Dec 2024's torchtitan compiled the blocks only (no memory term moves); the
    June 2025 H200 runs compiled the loss too: the last stage's loss terms drop from 12 to 4 bytes a logit."""
    dec, june = KNOWN["llama31_8b_fsdp8_compile_h100"], KNOWN["llama31_8b_fsdp32_float8_h200"]
    s_dec, s_june = known_run_spec(dec), known_run_spec(june)
    assert s_dec.train.compile and not s_dec.train.compile_loss
    assert s_june.train.compile and s_june.train.compile_loss
    assert not known_run_spec(KNOWN["llama31_8b_fsdp8_h100"]).train.compile
    assume = framework_assumptions("torchtitan")
    eager = replace(s_june, train=replace(s_june.train, compile_loss=False))
    got, was = (mem.memory(s, assume=assume).total for s in (s_june, eager))
    logits = s_june.seq_len * s_june.train.micro_batch_size * s_june.model.vocab_size
    assert was - got == pytest.approx((12 - 4) * logits, rel=1e-9)


@pytest.mark.slow  # compiles with TorchInductor (C++ on the CPU, compile workers)
def test_torch_compiled_cross_entropy_saves_the_bf16_input_only():
    """What :func:`loss_bytes` assumes, checked on torch itself: eager saves the fp32 log-probs (4 bytes a logit),
    the compiled graph its bf16 input and two per-row statistics (2 bytes a logit and a little)."""
    import torch
    import torch.nn.functional as F

    def ce(x, y):
        return F.cross_entropy(x.float(), y)

    n, v = 64, 1024
    x = torch.randn(n, v, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, v, (n,))
    per_logit = {}
    for name, fn in (("eager", ce), ("compiled", torch.compile(ce))):
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x, y).backward()
        per_logit[name] = sum(saved.values()) / (n * v)
    assert per_logit["eager"] == pytest.approx(loss_bytes("fp32", False, 2)[0], rel=0.01)
    assert per_logit["compiled"] == pytest.approx(loss_bytes("fp32", True, 2)[0], rel=0.02)


def test_plan_memory_columns_equal_the_estimate_under_a_compiled_loss():
    """The planner's vectorised peak memory reads train.compile_loss as the scalar estimate does; never more
    than eager, less where the peak is on the last stage (the loss's)."""
    from tests.plan.test_plan_memory import assert_equal, candidates, context
    from xpar.estimate.columns.peak_memory import memory_columns

    base = context("7b", "h100_80gb_64gpu", "torchtitan")
    ctx = replace(base, train={**base.train, "compile": True, "compile_loss": True})
    rng = np.random.default_rng(11)
    cols = candidates(rng, ctx, 12)
    assert_equal(ctx, cols, range(12))
    got, eager = (memory_columns(spec_of(c, cols, 0), cols)["memory_total"] for c in (ctx, base))
    assert (got <= eager).all() and (got < eager).sum() >= 6


def test_a_compiled_block_keeps_what_fused_kernels_keep():
    """Without recompute a compiled torchtitan block keeps one SwiGLU tensor (e f a token) fewer than eager, and an
    eager framework with composite RMSNorm (fused_rmsnorm false) its fp32 copies for the bf16 input (12 h)."""
    from xpar.estimate.memory.activations import layer_bytes
    from xpar.estimate.memory.model_states import MemoryOptions

    spec, assume, _ = _table1()
    spec = replace(spec, layout=replace(spec.layout, recompute="none"))
    tokens, h, f = spec.seq_len * spec.train.micro_batch_size, spec.model.hidden, spec.model.ffn_hidden
    for fused_norm, extra in ((True, 0), (False, 12 * h)):
        o = MemoryOptions.of(assume, fused_rmsnorm=fused_norm)
        eager, comp = (layer_bytes(_compiled(spec, c), o, 0.0)["none"] for c in (False, True))
        assert eager - comp == pytest.approx(tokens * (2 * f + extra), rel=1e-9)


@pytest.mark.slow  # compiles with TorchInductor (C++ on the CPU, compile workers)
def test_torch_compiled_llama_block_saves_no_fp32_norm_copies_and_three_swiglu_tensors():
    """What :func:`xpar.estimate.memory.activations._layer_kwargs` assumes of a compiled block, checked on torch: a
    Llama block with torchtitan's composite RMSNorm keeps an fp32 (b, s, h) copy per norm and four f-wide tensors
    eager, and none and three compiled."""
    import torch

    from tests.estimate.llama_block import Block, saved_activations

    blk = Block(hidden=256, heads=8, kv_heads=2, ffn=704).to(torch.bfloat16)
    b, s = 2, 96
    got = {name: saved_activations(fn, b, s, 256) for name, fn in (("eager", blk), ("compiled", torch.compile(blk)))}
    fp32_h = {k: sum(1 for shape, dt in v if dt == torch.float32 and shape[-1] == 256) for k, v in got.items()}
    swiglu = {k: sum(1 for shape, dt in v if shape[-1] == 704) for k, v in got.items()}
    assert fp32_h == {"eager": 2, "compiled": 0}
    assert swiglu == {"eager": 4, "compiled": 3}


def test_compiled_torchtitan_op_sac_keeps_no_w2_output():
    """torchtitan's op-level SAC under train.compile keeps what its backward reads: w2's output (a partial sum, h) and,
    with sequence parallelism, its reduce-scatter's (h / t) fewer per token than eager; no recompute, full AC and
    xpar's own op policy as eager (xpar.estimate.memory.activations.compiled_drops)."""
    from xpar.estimate.memory.activations import layer_activation_bytes as lab, layer_bytes
    from xpar.estimate.memory.model_states import MemoryOptions

    s, b, h, a, f, kv = 8192, 1, 4096, 32, 14336, 1024
    kw = dict(kv=kv, kv_matmul=kv, ffn=f, swiglu=True, dropout=False, flash=True, elem=2, fused_swiglu=True)
    for t, sp, less in ((1, False, 2 * h), (4, True, 2 * h + 2 * h / 4)):
        eager, comp = (lab(s, b, h, a, t, sp, "selective", selective="torchtitan_op", compiled=c, **kw)
                       for c in (False, True))
        assert eager - comp == s * b * less
    for rc, sel in (("none", "torchtitan_op"), ("full", "torchtitan_op"), ("selective", "op")):
        assert lab(s, b, h, a, 4, True, rc, selective=sel, compiled=True, **kw) == lab(
            s, b, h, a, 4, True, rc, selective=sel, **kw)
    spec, assume, _ = _table1()  # Llama 3.1 8B, FSDP 8, op-level SAC
    o = MemoryOptions.of(assume)
    eager, comp = (layer_bytes(_compiled(spec, c), o, 1.0)["kept"] for c in (False, True))
    assert eager - comp == spec.seq_len * spec.train.micro_batch_size * 2 * spec.model.hidden


@pytest.mark.slow  # traces with torch.compile (AOTAutograd's partitioner)
def test_torch_keeps_w2_output_under_eager_op_sac_but_not_compiled():
    """What :func:`xpar.estimate.memory.activations.compiled_drops` assumes, checked on torch: a Llama block under
    torchtitan's op-level SAC policy (every other mm and SDPA saved) holds one (b, s, h) bf16 tensor per token more
    after its forward in eager (the cached w2 output) than compiled."""
    import gc
    from collections import defaultdict

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from tests.estimate.llama_block import Block

    save = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}

    def context():
        count = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):  # torchtitan's _custom_policy (activation_checkpoint.py @022f885f)
            key = "recompute" if ctx.is_recompute else "forward"
            count[key] += func == torch.ops.aten.mm.default
            keep = func in save and not (func == torch.ops.aten.mm.default and count[key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)

    def held(fn, x, freqs) -> int:
        def live():
            tensors = [t for t in gc.get_objects() if type(t) is torch.Tensor]  # activations; not parameters, not proxies
            return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
        gc.collect()
        before = live()
        out = fn(x, freqs)
        gc.collect()
        got = live() - before - out.untyped_storage().nbytes()
        out.float().sum().backward()
        return got

    torch.manual_seed(0)
    h, b, s = 256, 2, 128
    blk = Block(hidden=h, heads=8, kv_heads=2, ffn=704).to(torch.bfloat16)
    freqs = torch.polar(torch.ones(s, 16), torch.randn(s, 16))[None, :, None, :]
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    eager = lambda y, fr: checkpoint(blk, y, fr, use_reentrant=False, context_fn=context)  # noqa: E731
    compiled = torch.compile(eager, backend="aot_eager")
    got = {k: [held(fn, x, freqs) for _ in range(2)][-1] for k, fn in (("eager", eager), ("compiled", compiled))}
    assert got["eager"] - got["compiled"] == pytest.approx(b * s * h * 2, rel=0.1)
