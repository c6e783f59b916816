"""model.qk_norm in time (issue 42): Qwen3's per-head RMSNorm of q and k is memory traffic of the block
(xpar.estimate.compute.kernel_block.qk_norm_bytes), read and written once a pass, fused; 0 without QK-norm."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from xpar.estimate.compute.kernel_block import BlockShape, block_times, qk_norm_bytes
from xpar.estimate.compute.kernels import memory_time

SH = BlockShape(hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144, qk_norm=True)


def test_qk_norm_moves_q_and_k_once_each_way():
    """32 query heads and 4 key heads of 128 on 1,000 tokens: (32 + 4) x 128 x 1000 elements, 2 + 2 bytes each."""
    assert qk_norm_bytes(SH, 1000, 32, 4) == pytest.approx(4 * 36 * 128 * 1000)
    assert qk_norm_bytes(replace(SH, qk_norm=False), 1000, 32, 4) == 0.0


@pytest.mark.parametrize("backward", [False, True])
def test_block_prices_qk_norm_as_memory_and_two_kernels(backward):
    """The block's memory term grows by the QK-norm's bytes at the HBM rate (twice backward), over tp's heads; its
    GEMMs and attention are unchanged."""
    from xpar.config.presets import preset_dict
    from xpar.config.schema import HardwareConfig
    from xpar.estimate.compute.kernels import device_of

    device = device_of(HardwareConfig(**{k: v for k, v in preset_dict("hardware", "h100_80gb_8gpu").items()
                                         if k in HardwareConfig.__dataclass_fields__}))
    on, off = (block_times(sh, 2, 4096, device, tp=2, backward=backward) for sh in (SH, replace(SH, qk_norm=False)))
    moved = qk_norm_bytes(SH, 2 * 4096, 16, 2) * (2 if backward else 1)
    assert float(on.memory - off.memory) == pytest.approx(float(memory_time(moved, device)), rel=1e-9)
    assert float(on.kernels - off.kernels) == 2 and np.allclose(on.gemm, off.gemm)
