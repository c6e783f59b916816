"""Attention FLOPs by shape (xpar.config.attention): DeepSeek-V3's multi-head latent attention (MLA)
counted from its projections and head dims, not as multi-head attention at h; MLA's config checks."""
from __future__ import annotations

import pytest

from xpar.calibrate.published import preset
from xpar.config.checks.config import check_mla
from xpar.config.remat import extra_forward_flops_per_layer
from xpar.config.schema import ModelConfig
from xpar.estimate.compute.flops import forward_flops_per_token, model_flops_per_token


def _deepseek_v3(**changes) -> ModelConfig:
    return ModelConfig(**{**preset("model", "deepseek_v3"), **changes})


def test_deepseek_v3_flops_per_token_are_mla_counted_by_hand():
    """DeepSeek-V3 (DeepSeek-AI 2024, Sec. 2.1.1 and 4.2): h 7168, 128 heads, q_lora_rank 1536,
    kv_lora_rank 512, query/key 128 + 64 (rotary, one key shared by the heads), values 128; 61 layers,
    the first 3 dense (SwiGLU 18432), then 256 experts of 2048 (top 8) and 1 shared; vocabulary 129280.
    Forward FLOPs per token, 2 per multiply-add, at s = 4096 over the whole s x s square."""
    cfg, s = _deepseek_v3(), 4096
    h, n = 7168, 128
    q = h * 1536 + 1536 * n * (128 + 64)              # W^DQ, W^UQ and W^QR
    kv = h * (512 + 64) + 512 * n * 128 + 512 * n * 128  # W^DKV and W^KR, W^UK, W^UV
    o = n * 128 * h                                   # W^O
    core = s * n * (128 + 64) + s * n * 128           # Q K^T and P V
    dense_mlp, router, experts = 3 * h * 18432, h * 256, 3 * h * 2048 * (8 + 1)
    layers = 61 * (q + kv + o + core) + 3 * dense_mlp + 58 * (router + experts)
    fwd = forward_flops_per_token(cfg, s)
    assert fwd["matmul"] + fwd["attention"] == 2 * layers
    assert fwd["attention"] == 2 * 61 * core
    assert fwd["logits"] == 2 * h * 129280
    assert model_flops_per_token(cfg, s) == 3 * 2 * (layers + h * 129280)
    # counted as MHA at h (128 heads of 56) the attention was 4 h^2 projections and 4 s h of core
    mha = forward_flops_per_token(_deepseek_v3(kv_lora_rank=None, q_lora_rank=None, qk_nope_head_dim=None,
                                               qk_rope_head_dim=None, v_head_dim=None), s)
    assert mha["attention"] == 61 * 4 * s * h and fwd["attention"] / mha["attention"] == pytest.approx(2.857, abs=1e-3)
    assert fwd["matmul"] - mha["matmul"] == 61 * 2 * (q + kv + o - 4 * h * h)
    assert extra_forward_flops_per_layer(cfg, s, "full") == pytest.approx((fwd["matmul"] + fwd["attention"]) / 61,
                                                                          rel=1e-15)
    assert extra_forward_flops_per_layer(cfg, s, "attention") == 2 * core


def test_mla_without_a_q_lora_rank_projects_queries_directly():
    """DeepSeek-V2-Lite's MLA has no query compression: W^Q is h x n (nope + rope)."""
    full, lite = _deepseek_v3(), _deepseek_v3(q_lora_rank=None)
    diff = forward_flops_per_token(full, 4096)["matmul"] - forward_flops_per_token(lite, 4096)["matmul"]
    assert diff == 61 * 2 * (7168 * 1536 + 1536 * 128 * 192 - 7168 * 128 * 192)


def test_mla_fields_are_checked_together():
    """MLA needs its head dims; an MLA field without kv_lora_rank is refused naming the fix."""
    assert check_mla(_deepseek_v3()) == []
    assert check_mla(ModelConfig()) == []
    (line,) = check_mla(_deepseek_v3(v_head_dim=None))
    assert "model.v_head_dim" in line and "v_head_dim=128" in line
    (line,) = check_mla(ModelConfig(q_lora_rank=1536))
    assert "model.kv_lora_rank" in line and "model.q_lora_rank to null" in line


def test_mla_is_estimated_not_executed():
    """xpar's executed model has no MLA: a run of an MLA model is refused in one line naming the fix."""
    from tests.conftest import spec_for
    from xpar.config.checks import ConfigError
    with pytest.raises(ConfigError) as e:
        spec_for("model=tiny", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8",
                 "model.v_head_dim=16")
    assert "multi-head latent attention" in str(e.value) and "model.kv_lora_rank=null" in str(e.value)
    spec = spec_for("model=tiny", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8",
                    "model.v_head_dim=16", "run.mode=estimate")
    assert forward_flops_per_token(spec.model, 64)["attention"] == 4 * 2 * 64 * 4 * (16 + 8 + 16)
