"""torchtitan's MoE layer on one B200, as the kernel model prices it, against torchao's published bench of it (issue 42).

torchao's ``benchmarks/prototype/moe_training/bench_moe_layer.py`` times torchtitan's ``MoE`` module (8 experts,
``MoEArgs`` defaults: top-1 and one shared expert, forced balance, compiled with fullgraph false) forward + backward
on 16 x 8192 tokens; its README (torchao/prototype/moe_training/README.md, 'Benchmark: single MoE layer forward +
backward pass', B200, bf16 column) gives 92.032 ms for DeepSeek-V3's shapes (dim 7168, hidden 2048) and 275.270 ms
for Llama 4's (5120, 8192). Not a tests/data row, not read by a fit; which torchtitan the bench ran (its combine a
``scatter_add`` or not) is not stated, so both profiles are printed: the old pricing (fused scatter, dense-rate
experts) and torchtitan's (framework.moe_scatter atomic, framework.expert_gemm_kernel torch_grouped_mm).

    python benchmarks/torchao_moe_layer.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from xpar.config.checks.hardware import load_hardware_preset  # noqa: E402
from xpar.estimate.compute.kernel_block import BlockShape, _moe  # noqa: E402
from xpar.estimate.compute.kernel_costs import training_device  # noqa: E402
from xpar.estimate.compute.kernels import memory_time  # noqa: E402

TOKENS = 16 * 8192
PUBLISHED_MS = {"DeepSeek-V3 (7168, 2048)": (7168, 2048, 92.032), "Llama 4 (5120, 8192)": (5120, 8192, 275.270)}
"""torchao's README: the bf16 forward + backward of torchtitan's MoE layer on one B200, ms."""


def moe_layer_seconds(dim: int, hidden: int, device, scatter: str, kernel: str) -> float:
    """Forward + backward seconds of the MoE part of a block (router, routed and shared experts, permutation and
    combine) of ``TOKENS`` tokens, 8 experts, top-1, one shared expert, on ``device`` at ep 1."""
    sh = BlockShape(hidden=dim, heads=1, kv_heads=1, head_dim=128, ffn=hidden, experts=8, top_k=1, expert_ffn=hidden,
                    shared_experts=1)
    total = 0.0
    for backward in (False, True):
        gemm, experts, _, moved, atomic = _moe(sh, np.array(float(TOKENS)), 1, 1, device, "bf16", backward, True,
                                                False, None, scatter, kernel)
        total += float(gemm + experts + memory_time(moved * (2 if backward else 1), device) + atomic)
    return total


def main() -> None:
    device = training_device(load_hardware_preset("b200_180gb_node"), "fa3")
    print("| shapes | published ms | fused scatter, dense-rate experts | torchtitan's kernels |")
    print("|---|---:|---:|---:|")
    for name, (dim, hidden, ms) in PUBLISHED_MS.items():
        old = moe_layer_seconds(dim, hidden, device, "fused", "dense") * 1e3
        new = moe_layer_seconds(dim, hidden, device, "atomic", "torch_grouped_mm") * 1e3
        print(f"| {name} | {ms:.1f} | {old:.1f} ({old / ms - 1:+.0%}) | {new:.1f} ({new / ms - 1:+.0%}) |")


if __name__ == "__main__":
    main()
