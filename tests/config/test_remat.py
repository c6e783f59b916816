"""Rematerialisation policies (xpar.config.remat): each policy's memory and extra FLOPs in the
estimate, parallel.recompute_layers, the config's refusals, and the MaxText policies executed by
selective activation checkpointing: the losses and gradients of no recompute, exactly, with the
bytes kept and the matmul FLOPs rerun that the estimate says."""
from __future__ import annotations

import pytest

from tests.conftest import spec_for
from xpar.config.checks import ConfigError
from xpar.config.remat import (MODULE_POLICIES, POLICIES, RECOMPUTE, extra_forward_flops_per_layer, policy_name,
                                stage_share)
from xpar.estimate.memory import activations
from xpar.estimate.cost import estimate
from xpar.estimate.compute.flops import forward_flops_per_token, hardware_flops_per_token, model_flops_per_token


def _spec(*overrides: str):
    """A validated RunSpec, fitting memory or not (the estimate of a layout that does not fit)."""
    from tests.conftest import compose
    from xpar.config.validate import validate

    return validate(compose("tracking=off", "run.progress=false", *overrides), local_devices=2)


def _70b(recompute: str, *more: str):
    """The 70B 3D preset (tp8 x pp4 x dp2, sequence parallelism, interleaved 1F1B) under ``recompute``."""
    return estimate(_spec("parallel=3d", "model=70b", f"parallel.recompute={recompute}", *more))


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_memory_per_policy_ordered_on_70b():
    """Activations per device of the 70B layout. xpar's profile (flash attention):
    none > save_dot_except_mlp > save_qkv_proj > full, and xpar's op-level selective keeps more
    than none (full-length partial sums under sp). Megatron's (no flash, dropout): its selective
    (the attention core) drops the s x s scores but keeps the rest, so the MaxText policies keep
    less: none > attention > save_dot_except_mlp > full."""
    act = {p: _70b(p).memory.activations for p in RECOMPUTE if p not in MODULE_POLICIES}  # those need MLA
    assert act["none"] > act["save_dot_except_mlp"] > act["save_qkv_proj"] > act["full"] > 0
    assert act["op"] == act["selective"] > act["none"]
    assert act["attention"] == pytest.approx(act["none"], rel=1e-3)  # flash: only the lse is dropped
    meg = {p: _70b(p, "framework=megatron", "parallel.zero_stage=1").memory.activations
           for p in ("none", "attention", "save_dot_except_mlp", "full")}
    assert meg["none"] > meg["attention"] > meg["save_dot_except_mlp"] > meg["full"]
    assert _70b("selective", "framework=megatron", "parallel.zero_stage=1").memory.activations == meg["attention"]


def test_kept_bytes_per_block_term_by_term():
    """save_dot_except_mlp keeps the input, q, k, v (/t) and wo's output (a partial sum, h);
    save_qkv_proj the input, q, k, v; neither keeps a tp collective's output."""
    s, b, h, a, f, kv, t = 4096, 1, 8192, 64, 28672, 1024, 8
    kw = dict(kv=h, kv_matmul=kv, ffn=f, swiglu=True, dropout=False, flash=True, elem=2)
    lab = activations.layer_activation_bytes
    assert lab(s, b, h, a, t, True, "save_dot_except_mlp", **kw) == s * b * (2 * h / t + 2 * (h + 2 * kv) / t + 2 * h)
    assert lab(s, b, h, a, t, False, "save_qkv_proj", **kw) == s * b * (2 * h + 2 * (h + 2 * kv) / t)
    assert lab(s, b, h, a, 1, False, "selective", selective="op", **kw) == lab(s, b, h, a, 1, False, "op", **kw)


def test_extra_flops_per_policy():
    """Forward FLOPs one block's backward reruns (Narayanan et al. convention): full = the block's
    forward; save_dot_except_mlp = the attention core + w1 and w3 (the MLP's matmuls whose outputs
    a backward needs; w2's is needed by none); save_qkv_proj adds wo; Megatron's selective = the
    attention core; torchtitan's op = wk, wo, w3; none = 0."""
    cfg = _spec("parallel=3d", "model=70b").model
    s, h, f, kv = 4096, cfg.hidden, cfg.ffn_hidden, cfg.kv_heads * cfg.head_dim
    fwd = forward_flops_per_token(cfg, s)
    core = fwd["attention"] / cfg.n_layers
    x = {p: extra_forward_flops_per_layer(cfg, s, p) for p in RECOMPUTE}
    assert x["none"] == 0
    assert x["full"] == (fwd["matmul"] + fwd["attention"]) / cfg.n_layers
    assert x["save_dot_except_mlp"] == core + 2 * 2 * h * f
    assert x["save_qkv_proj"] == x["save_dot_except_mlp"] + 2 * h * h
    assert x["attention"] == x["op"] == x["selective"] == core == 4 * s * h
    assert x["torchtitan_op"] == 2 * (h * kv + h * h + h * f)
    assert hardware_flops_per_token(cfg, s, "full") == model_flops_per_token(cfg, s) + fwd["matmul"] + fwd["attention"]
    assert hardware_flops_per_token(cfg, s, "full", share=0.25) == pytest.approx(
        model_flops_per_token(cfg, s) + 0.25 * (fwd["matmul"] + fwd["attention"]), rel=1e-15)


def test_moe_blocks_rerun_the_width_a_token_goes_through():
    """Mixtral 8x7B (h 4096, 32 heads of 128, 8 KV heads, 8 experts of 14336, top 2; s 4096): a
    block's forward is q, k, v, o (2 h (2 h + 2 x 1024)), the router (2 h 8), two SwiGLU experts
    (2 x 3 x 2 h 14336) and the attention core (4 s h): 855.7 MFLOP per token, all of which full
    recompute reruns (503.3 when the MLP was counted once, at the dense width); recompute=moe reruns
    the two experts' w1 and w3, 469.8 MFLOP (234.9 at the dense width)."""
    cfg = _spec("model=mixtral_8x7b").model
    s, h, f = 4096, 4096, 14336
    attn, router, expert = 2 * h * (2 * h + 2 * 1024), 2 * h * 8, 3 * 2 * h * f
    block = attn + router + 2 * expert + 4 * s * h
    assert block / 1e6 == pytest.approx(855.7, abs=0.05)
    assert extra_forward_flops_per_layer(cfg, s, "full") == block
    fwd = forward_flops_per_token(cfg, s)
    assert extra_forward_flops_per_layer(cfg, s, "full") == (fwd["matmul"] + fwd["attention"]) / cfg.n_layers
    assert extra_forward_flops_per_layer(cfg, s, "moe") == 2 * 2 * (2 * h * f) == pytest.approx(469.8e6, rel=1e-4)
    est = estimate(_spec("model=mixtral_8x7b", "parallel.recompute=full", "train.seq_len=4096"))
    tokens = est.model_flops_per_step / model_flops_per_token(cfg, 4096)
    assert est.hardware_flops_per_step - est.model_flops_per_step == pytest.approx(32 * block * tokens, rel=1e-12)


def test_step_time_and_hfu_follow_the_policy():
    """On the 70B layout: each policy's step is slower than none by its rerun work, and the hardware
    FLOPs per step grow by the policy's extra FLOPs (HFU counts them, MFU does not)."""
    est = {p: _70b(p) for p in ("none", "save_qkv_proj", "save_dot_except_mlp", "full")}
    t = {p: e.time_per_step_s for p, e in est.items()}
    assert t["none"] < t["save_dot_except_mlp"] < t["save_qkv_proj"] < t["full"]
    spec = _spec("parallel=3d", "model=70b")
    tokens, cfg = spec.tokens_per_step, spec.model
    for p, e in est.items():
        extra = cfg.n_layers * extra_forward_flops_per_layer(cfg, spec.seq_len, p) * tokens
        assert e.hardware_flops_per_step - e.model_flops_per_step == pytest.approx(extra, rel=1e-12)


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_recompute_layers_per_stage():
    """parallel.recompute_layers = k: the first k blocks of each stage recomputed (Megatron's
    --recompute-num-layers, block method), the rest keep everything; memory and FLOPs in between."""
    assert stage_share("full", 5, 2, 1.0) == 2 / 5 and stage_share("full", 1, 2, 1.0) == 1.0
    assert stage_share("full", 5, None, 0.5) == 0.5 and stage_share("none", 5, 2, 1.0) == 0.0
    base = ("parallel=3d", "model=70b", "parallel.recompute=full")  # 80 layers over 8 stages: 10 per stage
    act = {k: _70b("full", f"parallel.recompute_layers={k}").memory.activations for k in (0, 5, 10)}
    assert act[0] == pytest.approx(_70b("none").memory.activations, rel=1e-12)
    assert act[10] == _70b("full").memory.activations
    assert act[0] > act[5] > act[10]
    e5 = estimate(_spec(*base, "parallel.recompute_layers=5"))
    full, none = _70b("full"), _70b("none")
    assert e5.hardware_flops_per_step - none.hardware_flops_per_step == pytest.approx(
        0.5 * (full.hardware_flops_per_step - none.hardware_flops_per_step), rel=1e-12)
    assert none.time_per_step_s < e5.time_per_step_s < full.time_per_step_s


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        spec_for(*overrides)
    return str(e.value)


def test_config_refusals():
    """One line each: an unknown policy, recompute_layers out of range or without a policy, an
    estimate-only policy in execute mode, an op-level policy with a split-backward schedule."""
    assert "parallel.recompute must be one of" in _problems("parallel.recompute=save_dots")
    msg = _problems("parallel=3d", "model=70b", "parallel.recompute=full", "parallel.recompute_layers=11")
    assert "parallel.recompute_layers must be 0..10" in msg and "e.g. parallel.recompute_layers=5" in msg
    msg = _problems("parallel=3d", "model=70b", "parallel.recompute_layers=2")
    assert "parallel.recompute_layers=2 needs a recompute policy" in msg
    msg = _problems("parallel.recompute=attention", "run.mode=execute")
    assert "is estimated, not executed" in msg and "save_dot_except_mlp" in msg
    msg = _problems("parallel=pp", "model=tiny", "parallel.schedule=zbv", "parallel.recompute=save_dot_except_mlp")
    assert "parallel.recompute=save_dot_except_mlp cannot run with schedule zbv" in msg
    assert policy_name("selective", "attention") == "attention" and policy_name("full") == "full"
    assert {p for p in POLICIES if not POLICIES[p].executes} == {"attention", "torchtitan_op", "moe", *MODULE_POLICIES}


def _run(mode: str, layers=None):
    """One fp32 forward + backward of the tiny model under ``mode``, single process: (loss,
    gradients, peak saved bytes (xpar's tracker), matmul FLOPs (torch's FlopCounterMode))."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from xpar.models.transformer import Transformer
    from xpar.parallel.memory_accounting import ActivationTracker
    from xpar.parallel.recompute import apply_recompute
    from xpar.run.data import TokenSource

    spec = spec_for("train.steps=1", "train.warmup_steps=0")
    rows = TokenSource(spec).global_batch(0)[:, :-1]
    model = apply_recompute(Transformer(spec.model), mode, layers)
    model.init_weights(0)
    with ActivationTracker(list(model.parameters())) as tracker, FlopCounterMode(display=False) as fc:
        loss = model(rows).sum()
        loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], tracker.peak, fc.get_total_flops(), rows.numel(), spec


@pytest.fixture(scope="module")
def runs():
    modes = ("none", "full", "save_dot_except_mlp", "save_qkv_proj")
    out = {m: _run(m) for m in modes}
    out["full_k1"] = _run("full", 1)
    return out


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_maxtext_policies_execute_exactly(runs):
    """save_dot_except_mlp and save_qkv_proj (and full on one block per stage) give the loss and
    every gradient of no recompute, bit for bit (the same ops in the same order)."""
    import torch

    loss, grads = runs["none"][:2]
    for mode in ("full", "save_dot_except_mlp", "save_qkv_proj", "full_k1"):
        assert torch.equal(runs[mode][0], loss), mode
        assert all(torch.equal(g, g0) for g, g0 in zip(runs[mode][1], grads)), mode


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_executed_memory_and_flops_are_the_estimates(runs):
    """Measured on CPU: each policy keeps, beyond full recompute's block inputs, exactly the
    outputs the estimate counts (fp32: q, k, v and wo, or q, k, v), and reruns exactly the matmul
    FLOPs it counts (torch's FlopCounterMode; the CPU attention kernel is not counted, so the
    attention core is left out). full reruns all but w2: torch's checkpoint stops recomputing at
    the last saved tensor, w2's input (Megatron's full recompute reruns w2 too: the estimate
    counts the whole forward). recompute_layers=1 reruns one block of the four."""
    _, _, none_peak, none_flops, tokens, spec = runs["none"]
    c = spec.model
    kv, n = c.kv_heads * c.head_dim, c.n_layers
    proj = {"wq": 2 * c.hidden ** 2, "wk": 2 * c.hidden * kv, "wv": 2 * c.hidden * kv, "wo": 2 * c.hidden ** 2,
            "w1": 2 * c.hidden * c.ffn_hidden, "w3": 2 * c.hidden * c.ffn_hidden}
    full_peak = runs["full"][2]
    for mode, kept in (("save_dot_except_mlp", c.hidden + 2 * kv + c.hidden), ("save_qkv_proj", c.hidden + 2 * kv)):
        assert runs[mode][2] - full_peak == n * tokens * kept * 4, mode
        rerun = POLICIES[mode].reruns
        assert runs[mode][3] - none_flops == n * tokens * sum(proj[k] for k in rerun if k in proj), mode
        per_token = extra_forward_flops_per_layer(c, spec.seq_len, mode) - 4 * spec.seq_len * c.hidden
        assert runs[mode][3] - none_flops == n * tokens * per_token, mode
    assert runs["full"][3] - none_flops == n * tokens * sum(proj.values())
    assert runs["full_k1"][3] - none_flops == tokens * sum(proj.values())
    assert none_peak > runs["full_k1"][2] > full_peak
