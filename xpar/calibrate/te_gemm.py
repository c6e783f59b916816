"""Transformer Engine's own GEMM benchmark at a training layer's shapes, against the kernel model (issue 42).

Source: NVIDIA/TransformerEngine docs/examples/gemm_profiling/gemm_profiling.rst @8f2e6357 ('Worked Example: 5B
Model on B300' and '... on H200'), run by benchmarks/gemm/benchmark_gemm.py in model-config mode: hidden 4096,
intermediate 16384, 15,872 tokens (31 x 512); each layer's 12 GEMMs (fprop, dgrad, wgrad of qkv, attention output,
MLP up and down) timed with CUDA events over 100 calls. ``--pre-quantize`` times the GEMM kernels alone; autocast
mode times ``te.Linear`` under ``te.autocast``, which quantises both of a GEMM's inputs on every call. The Blackwell
presets' GEMM fractions reproduce the B300 kernel times (conf/hardware/b200_180gb_node.yaml: the B300 taken at the
B200's dense BF16 / FP8 peaks), the H200 NVL rows check the Hopper fractions (MAMF, not fitted here) at the NVL
part's dense peaks, and the autocast less kernel-only time sizes the quantisation kernels' share of HBM
(xpar.estimate.compute.fp8_recipes.CAST_HBM_FRACTION). Units: seconds unless named.
"""
from __future__ import annotations

from dataclasses import replace

from xpar.estimate.compute.fp8_recipes import RECIPES
from xpar.estimate.compute.kernel_block import priced_cast_bytes
from xpar.estimate.compute.kernels import Device, gemm_time, memory_time

HIDDEN, INTERMEDIATE, TOKENS = 4096, 16384, 31 * 512
"""The tutorial's model config: hidden, MLP intermediate width, tokens per step (micro-batch 31 x 512)."""

TE_LAYER_MS = {
    "B300": {"bf16": (12.758 + 13.102) / 2, "fp8": 6.812, "mxfp8": 7.161},
    "H200_NVL": {"bf16": (32.014 + 31.968) / 2, "fp8": 16.785},
}
"""Kernel-only per-layer GEMM milliseconds of the tutorial (BF16: the mean of its autocast and pre-quantised runs,
12.758 / 13.102 on the B300, 32.014 / 31.968 on the H200 NVL, the same torch.matmul kernels)."""

TE_AUTOCAST_MS = {"B300": {"current": 9.147, "delayed": 7.802, "mxfp8": 8.984}}
"""Autocast per-layer milliseconds (GEMMs and the quantisation of both inputs of each, every call): less the kernel
times above (delayed against current scaling's: the same tensor-scaled GEMMs), the quantisation's own time."""

H200_NVL_PEAK_TFLOPS = {"bf16": 835.5, "fp8": 1670.5}
"""H200 NVL dense peaks (NVIDIA H200 datasheet, NVL column, sparse figures halved)."""


def layer_shapes() -> list[tuple[int, int, int]]:
    """(m, n, k) of the tutorial's 12 GEMMs of one layer: y = x W for qkv (n 3h), attention output (h), MLP up
    (4h) and down, then each one's dgrad (m x n @ n x k) and wgrad (k x m @ m x n, reduced over tokens)."""
    linears = [(HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)]
    fprop = [(TOKENS, n, k) for k, n in linears]
    dgrad = [(TOKENS, k, n) for k, n in linears]
    wgrad = [(k, n, TOKENS) for k, n in linears]
    return fprop + dgrad + wgrad


def model_layer_s(device: Device, dtype: str) -> float:
    """Seconds the kernel model gives the tutorial's 12 GEMMs of one layer on ``device`` in ``dtype`` (its isolated
    kernel rates: no sustained_efficiency, as the tutorial times kernels back to back)."""
    return float(sum(gemm_time(m, n, k, device, dtype) for m, n, k in layer_shapes()))


def quantised_elements() -> float:
    """Elements quantised per layer in autocast mode: both inputs of each of the 12 GEMMs, m k + k n (te.Linear
    under te.autocast quantises its input and its weight on every call)."""
    return float(sum(m * k + k * n for m, n, k in layer_shapes()))


def model_cast_s(device: Device, recipe: str) -> float:
    """Seconds the kernel model gives that quantisation under ``recipe`` (xpar.estimate.compute.fp8_recipes: its
    priced bytes at the block's memory-bound rate, and its kernels' launch gaps, 24 quantisations a layer)."""
    r = RECIPES[recipe]
    return float(memory_time(priced_cast_bytes(r) * quantised_elements(), device)) + 24 * r.kernels * device.launch_s


def at_h200_nvl(device: Device) -> Device:
    """``device`` (an H200 SXM preset's) at the H200 NVL's dense peaks (:data:`H200_NVL_PEAK_TFLOPS`)."""
    peaks = dict(device.peak_flops, **{k: v * 1e12 for k, v in H200_NVL_PEAK_TFLOPS.items()})
    return replace(device, peak_flops=peaks)
