"""Sliding-window attention in the cost model (issue 42): which layers are local, FlashAttention's blocks within a
window (against a brute-force count of the blocks a band mask touches), the FLOP counts with and without the
window, and the kernel model's step of a gpt-oss-shaped model."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.conftest import spec_for
from xpar.config.attention import attended_keys
from xpar.config.schema import ModelConfig
from xpar.estimate.compute.flops import model_flops_per_token
from xpar.estimate.compute.kernel_block import block_times, shape_of
from xpar.estimate.compute.kernel_costs import block_kinds
from xpar.estimate.compute.kernels import FLASH_BLOCK, attention_flops, causal_block_fraction
from xpar.models.transformer import band_mask

GPT_OSS = ("hardware=h100_80gb_64gpu", "hardware.nodes=8", "framework=megatron_core", "run.mode=estimate",
           "model.n_layers=36", "model.hidden=2880", "model.n_heads=64", "model.n_kv_heads=8", "model.head_dim=64",
           "model.ffn_hidden=2880", "model.n_experts=128", "model.moe_top_k=4", "model.expert_ffn_hidden=2880",
           "model.vocab_size=201088", "model.seq_len=4096", "model.bias=true", "parallel.pp=4", "parallel.ep=8",
           "parallel.dp=16", "parallel.zero_stage=1", "parallel.micro_batches=auto", "train.dtype=bf16",
           "train.micro_batch_size=1", "train.global_batch_size=1280")
"""openai/gpt-oss-120b's shape (config.json) in Megatron-Bridge's 64-H100 layout (benchmarks/refusal_hunt.md #26)."""


def _touched_blocks(seq: int, window: int) -> float:
    """Share of the 128 x 128 (query, key) blocks holding at least one key a query sees (xpar.models.transformer's
    band), counted one by one."""
    seen = band_mask(torch.arange(seq), seq, window).numpy()
    n = -(-seq // FLASH_BLOCK)
    pad = np.zeros((n * FLASH_BLOCK, n * FLASH_BLOCK), dtype=bool)
    pad[:seq, :seq] = seen
    return pad.reshape(n, FLASH_BLOCK, n, FLASH_BLOCK).any(axis=(1, 3)).sum() / n ** 2


@pytest.mark.parametrize("seq, window", [(512, 0), (512, 129), (1024, 128), (1024, 300), (1000, 257), (640, 4096)])
def test_window_blocks_are_those_the_band_touches(seq, window):
    """The kernel model's share of FlashAttention's blocks equals the blocks the band mask touches: the causal
    triangle without a window, and at w >= s."""
    assert causal_block_fraction(seq, window) == pytest.approx(_touched_blocks(seq, window), rel=1e-12)


def test_windowed_flops_are_below_full_at_long_sequences_and_equal_at_w_ge_s():
    """At s >> w (gpt-oss: 128 of 8192) a local layer's core does ~2 key blocks a query block against ~n/2; at
    w >= s it is the causal count, as without a window."""
    full, local = (attention_flops(1, 8192, 8192, 64, 64, 64, window=w) for w in (0, 128))
    assert local < full / 15 and local == pytest.approx(full * (64 + 63) / 64 ** 2 / ((64 + 1) / 128))
    for w in (4096, 5000):
        assert attention_flops(1, 4096, 4096, 64, 64, 64, window=w) == attention_flops(1, 4096, 4096, 64, 64, 64)


@pytest.mark.parametrize("layers, pattern, local", [(36, 2, 18), (62, 6, 52), (32, 0, 32), (26, 2, 13), (7, 3, 5)])
def test_local_layers_by_pattern(layers, pattern, local):
    """Every k-th layer full, local first (gpt-oss 36 / 2, Gemma 3 27B 62 / 6, Mistral 7B every layer): the count,
    each layer's kind, and the block kinds' shares."""
    cfg = ModelConfig(n_layers=layers, sliding_window=128, sliding_window_pattern=pattern)
    kinds = [cfg.is_local_layer(i) for i in range(layers)]
    assert cfg.local_layers == sum(kinds) == local and kinds[0]
    assert all(not kinds[i] for i in range(pattern - 1, layers, pattern)) if pattern else all(kinds)
    assert block_kinds(cfg) == pytest.approx({(False, True): local / layers, (False, False): 1 - local / layers}
                                             if local < layers else {(False, True): 1.0})
    assert ModelConfig(n_layers=layers).local_layers == 0


@pytest.mark.parametrize("seq, window", [(64, 8), (100, 1), (64, 64), (50, 80)])
def test_attended_keys_is_the_mean_row_of_the_band(seq, window):
    """Causal: the mean keys per row of the band mask; not causal: min(w, s)."""
    assert attended_keys(seq, window) == pytest.approx(band_mask(torch.arange(seq), seq, window).sum().item() / seq
                                                       if window < seq else seq / 2)
    assert attended_keys(seq, window, causal=False) == min(window, seq)


def test_model_flops_count_the_window_only_when_asked():
    """xpar's model FLOPs count every layer's whole square (the Narayanan et al. count, as Megatron-Bridge's
    published gpt-oss figures): the window changes nothing; with ``window`` the local layers' causal band."""
    cfg = ModelConfig(n_layers=4, hidden=64, n_heads=4, seq_len=4096)
    local = replace(cfg, sliding_window=128, sliding_window_pattern=2)
    assert model_flops_per_token(local, 4096) == model_flops_per_token(cfg, 4096)
    assert model_flops_per_token(local, 4096, causal=True, window=True) < model_flops_per_token(cfg, 4096, causal=True)
    diff = model_flops_per_token(cfg, 4096, True) - model_flops_per_token(local, 4096, True, True)
    assert diff == pytest.approx(3 * 2 * (2 * 2 * 64) * (2048 - attended_keys(4096, 128)))  # 2 local layers, 4 s q
    wide = replace(cfg, sliding_window=8192)  # w >= s: the causal count
    assert model_flops_per_token(wide, 4096, True, True) == model_flops_per_token(cfg, 4096, True)


def test_a_local_block_runs_a_shorter_core_where_the_kernel_skips_blocks():
    """gpt-oss's local block on an H100: the core's forward and backward shorter than a full block's where the
    framework's kernel skips the window's outside blocks; every block of the square (longer) where the band is a
    dense mask (framework=xpar: SDPA's attn_mask)."""
    spec = spec_for(*GPT_OSS, local_devices=64)
    from xpar.estimate.compute.kernel_costs import training_device
    dev = training_device(spec.hardware)
    full, local = shape_of(spec.model, local=False), replace(shape_of(spec.model), window=128)
    for backward in (False, True):
        t = {k: block_times(sh, 1, 4096, dev, backward=backward, window_kernel=wk).attention
             for k, (sh, wk) in {"full": (full, True), "skip": (local, True), "dense": (local, False)}.items()}
        assert t["skip"] < t["full"] / 4 and t["dense"] > t["full"], t


def test_the_window_shortens_the_estimated_step():
    """The estimate and the planner's one layer price: gpt-oss with its window (18 of 36 layers at 128) runs
    faster than priced with full attention, by less than the attention core's share of the step."""
    from xpar.estimate.cost import estimate

    full = estimate(spec_for(*GPT_OSS, local_devices=64))
    local = estimate(spec_for(*GPT_OSS, "model.sliding_window=128", "model.sliding_window_pattern=2", local_devices=64))
    assert 0.85 < local.time_per_step_s / full.time_per_step_s < 0.99
    assert local.model_flops_per_step == full.model_flops_per_step  # the count does not change
