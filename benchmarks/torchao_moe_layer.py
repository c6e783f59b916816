"""torchtitan's MoE layer on one B200, as the kernel model prices it, against torchao's published bench of it (issue 42).

torchao's ``benchmarks/prototype/moe_training/bench_moe_layer.py`` times torchtitan's ``MoE`` module (8 experts,
``MoEArgs`` defaults: top-1 and one shared expert, forced balance, compiled with fullgraph false) forward + backward
on 16 x 8192 tokens; its README (torchao/prototype/moe_training/README.md, 'Benchmark: single MoE layer forward +
backward pass', B200, bf16 column) gives 92.032 ms for DeepSeek-V3's shapes (dim 7168, hidden 2048) and 275.270 ms
for Llama 4's (5120, 8192). Not a tests/data row, not read by a fit; which torchtitan the bench ran (its combine a
``scatter_add`` or not) is not stated, so both profiles are printed: the old pricing (fused scatter, dense-rate
experts) and torchtitan's (framework.moe_scatter atomic, framework.expert_gemm_kernel torch_grouped_mm).

The same bench in MXFP8 (pytorch/ao PR 3126, its printed output: 80.182 and 192.420 ms beside the same bf16 figures)
converts the modules whose name holds 'experts' with torchao's MXFP8 grouped-GEMM config: the routed experts' grouped
GEMMs at least; whether the shared expert's nn.Linear layers follow is not stated, so both are printed, each with
torchtitan's kernels and the mxfp8 recipe's casts (xpar.estimate.compute.fp8_recipes, 'fused' cast kernels).

    python benchmarks/torchao_moe_layer.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from xpar.config.checks.hardware import load_hardware_preset  # noqa: E402
from xpar.estimate.compute.fp8_recipes import gemm_dtype, quantiser  # noqa: E402
from xpar.estimate.compute.kernel_block import BlockShape, _mlp, _moe  # noqa: E402
from xpar.estimate.compute.kernel_costs import training_device  # noqa: E402
from xpar.estimate.compute.kernels import memory_time  # noqa: E402

TOKENS = 16 * 8192
PUBLISHED_MS = {"DeepSeek-V3 (7168, 2048)": (7168, 2048, 92.032, 80.182),
                "Llama 4 (5120, 8192)": (5120, 8192, 275.270, 192.420)}
"""torchao's bench of torchtitan's MoE layer on one B200, forward + backward, ms: (dim, hidden, bf16, mxfp8); bf16 from
its README, mxfp8 from pytorch/ao PR 3126."""


def _seconds(part, backward: bool, device) -> float:
    """Seconds of a MoE pass (gemm s, expert s, kernels, bytes, aten s: kernel_block._moe) or a dense MLP pass (gemm
    s, kernels, bytes: kernel_block._mlp): its GEMMs, its bytes at the HBM rate (twice in the backward, as the block
    prices them) and its aten kernels."""
    if len(part) == 3:
        gemm, experts, moved, aten = part[0], 0.0, part[2], 0.0
    else:
        gemm, experts, _, moved, aten = part
    return float(gemm + experts + memory_time(moved * (2 if backward else 1), device) + aten)


def moe_layer_seconds(dim: int, hidden: int, device, scatter: str, kernel: str, routed: str = "bf16",
                      shared: str = "bf16") -> float:
    """Forward + backward seconds of the MoE part of a block (router, routed and shared experts, permutation and
    combine) of ``TOKENS`` tokens, 8 experts, top-1, one shared expert, on ``device`` at ep 1; ``routed``, ``shared``:
    'bf16' or 'mxfp8' (the GEMMs at the MXFP8 rate, their inputs quantised by the mxfp8 recipe)."""
    def dtype_quant(kind):
        return (gemm_dtype("mxfp8", device.mx_native), quantiser("mxfp8", "fused")) if kind == "mxfp8" else ("bf16", None)
    sh = BlockShape(hidden=dim, heads=1, kv_heads=1, head_dim=128, ffn=hidden, experts=8, top_k=1, expert_ffn=hidden)
    total, t = 0.0, np.array(float(TOKENS))
    for backward in (False, True):
        r_dtype, r_quant = dtype_quant(routed)
        s_dtype, s_quant = dtype_quant(shared)
        total += _seconds(_moe(sh, t, 1, 1, device, r_dtype, backward, True, False, r_quant, scatter, kernel),
                          backward, device)
        total += _seconds(_mlp(t, hidden, dim, True, 1, device, s_dtype, backward, s_quant), backward, device)
    return total


def main() -> None:
    device = training_device(load_hardware_preset("b200_180gb_node"), "fa3")
    print("| shapes | published bf16 ms | fused scatter, dense-rate experts | torchtitan's kernels "
          "| published mxfp8 ms | routed experts mxfp8 | routed and shared mxfp8 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (dim, hidden, ms, mx_ms) in PUBLISHED_MS.items():
        old = moe_layer_seconds(dim, hidden, device, "fused", "dense") * 1e3
        new = moe_layer_seconds(dim, hidden, device, "atomic", "torch_grouped_mm") * 1e3
        mx = moe_layer_seconds(dim, hidden, device, "atomic", "torch_grouped_mm", routed="mxfp8") * 1e3
        mx_all = moe_layer_seconds(dim, hidden, device, "atomic", "torch_grouped_mm", "mxfp8", "mxfp8") * 1e3
        print(f"| {name} | {ms:.1f} | {old:.1f} ({old / ms - 1:+.0%}) | {new:.1f} ({new / ms - 1:+.0%}) | {mx_ms:.1f} "
              f"| {mx:.1f} ({mx / mx_ms - 1:+.0%}) | {mx_all:.1f} ({mx_all / mx_ms - 1:+.0%}) |")


if __name__ == "__main__":
    main()
