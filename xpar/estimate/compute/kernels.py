"""Kernel-level compute time on one GPU: each kernel priced from its shape and dtype (issue 42).

Pure numpy: every shape argument may be an array (a scalar is a one-row column); arguments
broadcast together and each function returns seconds of the same shape.

- GEMM (M x K) @ (K x N): CTA tiles of ``tile_m x tile_n`` over the device's SMs in waves, split-K
  when the grid is under one wave, an HBM roofline, at the large-GEMM fraction of peak (MAMF).
- Attention core: FlashAttention's FLOPs (causal blocks only, a sliding window's blocks where one) at the
  device's flash-attention fraction of the BF16 peak for the framework's kernel (FlashAttention-2/3, cuDNN), by head
  dim and key length, whatever the matmul dtype (Transformer Engine and torchao keep it in BF16).
- Elementwise, normalisation, casts, MoE permutation: bytes over achievable HBM bandwidth.
- Per-kernel overhead: the device's launch gap, or the host's issue time where that is longer.
Constants and their sources: docs/concepts/kernels.md. A whole block: xpar.estimate.compute.kernel_block.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xpar.estimate.compute.fp8_recipes import MXFP8_GEMM_RATE

HBM_FRACTION = 0.9
"""Achievable fraction of datasheet HBM bandwidth for a streaming kernel (public STREAM/D2D copy
microbenchmarks: H100 SXM 3.0-3.1 of 3.35 TB/s; ~0.9 on other HBM parts)."""
FLASH_BLOCK = 128
"""FlashAttention's query/key block (Br = Bc = 128 for head_dim <= 128: FlashAttention-2/3 kernels)."""
FLASH_BWD_FLOPS = 2.5
"""Backward FLOPs over forward of the attention core: 5 matmuls (S, dP, dV, dQ, dK) against 2 (Dao 2023)."""
FP8_TILE_FIXED_S = 3.0e-6
"""Seconds an FP8 GEMM's CTA tile (or split-K slice) spends outside its main loop on Hopper
(hardware.gemm_tile_fixed_us_fp8: 3.0 on h100_80gb_node and the presets inheriting it): the pipeline's fill (the
first K stages loaded before the first MMA) and the epilogue (the accumulator converted and the C tile stored).
Fitted on DeepGEMM's README table (deepseek-ai/DeepGEMM README.md @327ec92, 'Normal GEMMs for dense models', H800
SXM5 FP8, M = 4096: 1520 TFLOP/s at K 16384, 1410 at 7168, 1168 at 2048, 1212 at 1536, 775 at 512): the rates
relative to the K = 16384 row, by median |error| over 0.5-4 us, are matched within 3.7 % (max 8.3 %) at 3 us and
within 16.6 % (max 96 % at K 512) without it. It makes FP8's gain over BF16 smaller where K is small. Not on BF16
GEMMs (no shape-resolved public BF16 table found; the BF16 published runs the H100 fit reads agree less with it,
docs/concepts/kernels.md), nor on Blackwell: the MAMF tables' best FP8 shapes there have small K (GB200
19456 x 5120 x 1536 at 0.723 of peak), which 3 us would put at 0.57 (its accumulators in tensor memory let a
tile's epilogue overlap the next tile's MMAs)."""
FP8_KEYS = ("fp8", "mxfp8")
"""The GEMM dtype keys that pay :data:`FP8_TILE_FIXED_S`."""
HALF_TILE_RATE = 0.9
"""Assumed (not fitted): a tile_m x tile_n/2 tile's mainloop rate over the full tile's (less operand reuse:
1.33x the shared-memory traffic per FLOP). Libraries pick the half tile where it quantises better."""
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "mxfp8": 1, "fp32": 4}
"""Bytes of a GEMM operand element per dtype key ('mxfp8': block-scaled FP8, its scales not counted)."""
ATTENTION_HALF_DIM = 32.0
"""Head dim at which FlashAttention's rate would be half its asymptote: rate(d) ~ d / (d + 32), taken
relative to d = 128 (the fractions' reference) and capped there. FlashAttention-3 (Shah et al. 2024,
H100 BF16 forward): head_dim 64 reaches ~0.77 of head_dim 128's rate; FlashAttention-2 (Dao 2023, A100)
~0.85; this curve gives 0.83."""
ATTENTION_HALF_SEQ = 360.0
"""Key length (tokens) at which a flash-attention kernel's rate would be half its asymptote: rate(s) ~ s / (s + 360),
taken relative to s = 16384 (the preset fractions' reference) and capped there (:func:`sequence_rate`). Fitted
(RMS 0.033) on the six causal-forward and backward curves, head_dim 128, of FlashAttention-2, cuDNN and
FlashAttention-3 on H100 SXM5 BF16 at 512-16k tokens (Shah et al. 2024, FlashAttention-3, Fig. 5-6: e.g. cuDNN
causal forward 315, 410, 484, 518, 529, 539 TFLOP/s; the curve gives 0.60, 0.76, 0.87, 0.94, 0.98, 1 of 539): each
query block's loop over the key blocks amortises its prologue (Q load, softmax state) and epilogue (O, LSE store)
over s / 128 iterations, and the causal diagonal's masked blocks are 1 / n of a row's n. The non-causal forward
saturates sooner (0.84 of its 16k rate at 512): the curve prices it conservatively at short keys.
The H100's; a device's own is ``hardware.attention_half_seq`` (:attr:`Device.attention_half_seq`). On Blackwell the
prologue and epilogue take about as long while the loop runs 2.25-2.5x faster, so the curve saturates later:
cuDNN 9.17 on GB200 (NVIDIA/cudnn-frontend benchmark/sdpa_benchmark_training/artifacts/
sdpa_bf16_benchmark_results_NVIDIA_GB200.csv @d48a60eb: 128 q / 8 kv heads, head_dim 128, causal, cudnn_fe; forward
408, 733, 1069, 1386, 1584, 1668 and backward 329, 527, 655, 1054, 1211, 1304 TFLOP/s at 512-16k) fits 1300
through :func:`attention_time`'s block count and waves (RMS 0.041 relative to 16k; 16k: 0.667 / 0.522 of 2.5 PFLOP/s);
cuDNN 9.13 through torch's SDPA on B200 (the _B200.csv @bb37575d) is slower still (0.59 / 0.48 at 16k, 0.36 at 2k)."""


@dataclass(frozen=True)
class Device:
    """The figures of one GPU the kernel model reads (from a hardware preset: :func:`device_of`)."""

    sms: int
    """Streaming multiprocessors (each runs one GEMM tile at a time)."""
    peak_flops: dict
    """Dense tensor-core peak per dtype, FLOP/s: {'bf16': ..., 'fp8': ...}."""
    gemm_fraction: dict
    """A large GEMM's fraction of peak per dtype (maximum achievable matmul FLOPS over peak)."""
    attention_fraction: tuple
    """FlashAttention forward, backward fraction of the BF16 peak at long sequences, head_dim 128."""
    hbm_bytes_per_s: float
    """Datasheet HBM bandwidth, bytes/s."""
    tile: tuple = (128, 256, 64)
    """GEMM CTA tile (m, n, k) of the library's large-GEMM kernels (CUTLASS/cuBLAS)."""
    fp8_tile_fixed_s: float = 0.0
    """Seconds each FP8 GEMM tile spends outside its main loop (:data:`FP8_TILE_FIXED_S`)."""
    launch_s: float = 0.0
    """Device-side gap one dependent kernel adds (launch, ramp, tail), seconds."""
    attention_half_seq: float = ATTENTION_HALF_SEQ
    """Key length at which the device's flash attention runs at half its asymptote (:func:`sequence_rate`;
    hardware.attention_half_seq): H100's 360, Blackwell's cuDNN 1300 (:data:`ATTENTION_HALF_SEQ`)."""
    mx_native: bool = False
    """The tensor cores take MXFP8 and FP8 in every layout (Blackwell: hardware.mxfp8); then ``peak_flops``
    has an 'mxfp8' key (xpar.estimate.compute.fp8_recipes)."""


def device_of(hw) -> Device:
    """The :class:`Device` of a HardwareConfig (a GPU preset).

    Raises:
        ValueError: a field the kernel model needs is missing (hardware=local, a CPU), naming it."""
    need = {"sm_count": hw.sm_count, "peak_tflops": hw.peak_tflops, "hbm_tb_per_s": hw.hbm_tb_per_s,
            "gemm_efficiency": hw.gemm_efficiency, "attention_efficiency": hw.attention_efficiency,
            "attention_bwd_efficiency": hw.attention_bwd_efficiency}
    missing = [k for k, v in need.items() if v is None]
    if missing:
        raise ValueError(f"hardware={hw.name} has no {', '.join(missing)}: the kernel model prices GPUs "
                         f"with these figures (conf/hardware/h100_80gb_node.yaml has them)")
    peak = {"bf16": hw.peak_tflops * 1e12, "fp16": hw.peak_tflops * 1e12}
    frac = {"bf16": hw.gemm_efficiency, "fp16": hw.gemm_efficiency}
    mx = bool(getattr(hw, "mxfp8", False))
    if hw.peak_tflops_fp8 is not None and hw.gemm_efficiency_fp8 is not None:
        peak["fp8"], frac["fp8"] = hw.peak_tflops_fp8 * 1e12, hw.gemm_efficiency_fp8
        if mx:  # block-scaled MXFP8 GEMMs at the FP8 peak, MXFP8_GEMM_RATE of the tensor-scaled rate
            peak["mxfp8"], frac["mxfp8"] = peak["fp8"], hw.gemm_efficiency_fp8 * MXFP8_GEMM_RATE
    if hw.peak_tflops_fp32:  # fp32 GEMMs on CUDA cores, at the BF16 sweep's fraction (assumed)
        peak["fp32"], frac["fp32"] = hw.peak_tflops_fp32 * 1e12, hw.gemm_efficiency
    return Device(sms=int(hw.sm_count), peak_flops=peak, gemm_fraction=frac,
                  attention_fraction=(hw.attention_efficiency, hw.attention_bwd_efficiency),
                  hbm_bytes_per_s=hw.hbm_tb_per_s * 1e12, tile=(hw.gemm_tile_m, hw.gemm_tile_n, 64),
                  launch_s=hw.kernel_launch_us * 1e-6, mx_native=mx, attention_half_seq=hw.attention_half_seq,
                  fp8_tile_fixed_s=hw.gemm_tile_fixed_us_fp8 * 1e-6)


def _rate(device: Device, dtype: str) -> float:
    """Sustained FLOP/s of a large GEMM in ``dtype``; ValueError where the device has no such matmuls."""
    if dtype not in device.peak_flops:
        raise ValueError(f"dtype {dtype!r} has no tensor-core peak on this device; "
                         f"dtypes priced: {', '.join(sorted(device.peak_flops))}")
    return device.peak_flops[dtype] * device.gemm_fraction[dtype]


def memory_time(nbytes, device: Device):
    """Seconds to stream ``nbytes`` (array) through HBM at :data:`HBM_FRACTION` of the datasheet figure."""
    return np.asarray(nbytes, dtype=float) / (device.hbm_bytes_per_s * HBM_FRACTION)


SPLIT_K_WAVES = (2, 3, 4)
"""Whole waves beyond one that a grid under one wave may fill by splitting K further (:func:`_tiled_compute`): split
counts floor(w x SMs / tiles), the library taking the fastest. One wave alone (floor(SMs / tiles) splits, as before)
leaves SMs idle where the tiles do not divide them: a small model's weight gradient, (h x tokens) @ (tokens x 4h) at
h 768 and 65,536 tokens, is 72 128 x 256 tiles on an A100's 108 SMs, one split each and a third of the SMs idle,
where 3 splits run 216 slices of a third of K in 2 full waves (1.5x). cuBLASLt chooses a split-K count per shape among
its algorithms (cublasLtMatmulAlgoConfigAttributes_t CUBLASLT_ALGO_CONFIG_SPLITK_NUM, the cuBLAS documentation) and
CUTLASS partitions K where M and N are too small for their threadblocks to occupy the GPU (CUTLASS
docs/efficient_gemm.md, 'Parallelized Reductions: Split K'); its stream-K divides all tiles' K iterations evenly over
the SMs (Osama et al., "Stream-K", PPoPP 2023). Only into slices at least :func:`split_k_min_depth` deep."""


def split_k_min_depth(rate: float, device: Device):
    """The shallowest K slice (elements) worth a split beyond one wave: each slice writes an fp32 partial of its output
    tile that the reduction reads back, 8 bytes an element, against 2 x depth FLOPs an element of its main loop; the
    partials' HBM time (at :data:`HBM_FRACTION`) stays under the slices' compute where depth >= 4 x the ridge point
    ``rate`` / bandwidth (A100 BF16 at its MAMF fraction: ~590; H100: ~1050). A roofline bound, no fitted constant."""
    return 4.0 * rate / (device.hbm_bytes_per_s * HBM_FRACTION)


def _tiled_compute(m, n, k, g, tile, device: Device, rate: float, fixed: float = 0.0):
    """Seconds of the tiles of ``tile`` (m, n, k) over the SMs: waves of one tile or split-K slice per SM,
    each its main loop at ``rate`` / SMs plus ``fixed`` seconds (:data:`FP8_TILE_FIXED_S`). A grid under one wave
    splits K to fill the SMs (floor(SMs / tiles) slices a tile), or into more slices that fill 2-4 whole waves
    (:data:`SPLIT_K_WAVES`) where each stays :func:`split_k_min_depth` deep, whichever is faster."""
    tm, tn, tk = tile
    tiles = g * np.ceil(m / tm) * np.ceil(n / tn)
    per, k_steps = np.maximum(tiles, 1), np.maximum(np.ceil(k / tk), 1)
    deepest = np.maximum(np.floor(k / split_k_min_depth(rate, device)), 1)

    def seconds(splits):
        s = np.clip(splits, 1, k_steps)
        k_slice = np.ceil(k / s / tk) * tk  # each slice pads K to the tile's depth
        return np.ceil(tiles * s / device.sms) * (2 * tm * tn * k_slice / (rate / device.sms) + fixed)

    best = seconds(np.floor(device.sms / per))
    for w in SPLIT_K_WAVES:
        more = seconds(np.minimum(np.floor(w * device.sms / per), deepest))
        best = np.where(tiles < device.sms, np.minimum(best, more), best)
    return best


EXPERT_GEMM_KERNELS = ("dense", "torch_grouped_mm")
"""How a framework runs its routed experts' GEMMs (framework.expert_gemm_kernel): 'dense', at the device's dense GEMM
rate (Transformer Engine's cuBLAS GEMM per expert, DeepGEMM's grouped kernels), or 'torch_grouped_mm', torch's
``torch._grouped_mm`` (CUTLASS grouped kernels on sm90 and, from pytorch/pytorch PR 156203, in torch 2.9, sm100:
aten/src/ATen/native/cuda/GroupedBlas.cpp ``_grouped_mm_cuda``; no per-expert loop), at :data:`TORCH_GROUPED_MM_RATE`
of it."""

TORCH_GROUPED_MM_RATE = {"blackwell": (0.83, 0.67)}
"""(forward, backward) rate of ``torch._grouped_mm`` in BF16 over the dense GEMM rate, per GPU family. Blackwell
(SM 10.x, hardware.mxfp8): torchao PR 3271 (pytorch/ao, 2025-10, Benchmarks table, B200, bf16 columns) times
(16384, 8192, 5120) grouped into G = 1, 2, 4, 8 experts at 1.12-1.26 ms forward (0.48-0.55 of the 2.25 PFLOP/s peak,
median 0.525) and 3.98-4.09 ms forward + backward, the backward's dgrad and K-grouped wgrad 2.82-2.92 ms (0.42-0.43,
median 0.424); torchao PR 2427 (2025-06, bench_matmul.py, B200) times torch.mm in BF16 at 0.627, 0.646 and 0.631 of
peak for 4096, 6144 and 8192 cubes (median 0.631): 0.525 / 0.631 = 0.83 and 0.424 / 0.631 = 0.67. Other families:
no public figure at hand, priced at the dense rate (1, 1)."""


def expert_gemm_rate(kernel: str, device, dtype: str = "bf16") -> tuple:
    """(forward, backward) rate of the routed experts' GEMMs over the dense GEMM rate for framework.expert_gemm_kernel
    ``kernel`` (:data:`EXPERT_GEMM_KERNELS`) on ``device`` (a :class:`Device`; Blackwell where ``mx_native``) in the
    GEMM dtype key ``dtype``: (1, 1) but for torch._grouped_mm in BF16/FP16 (FP8 grouped GEMMs run torchao's
    scaled kernels, not this one: torchao's README times its MXFP8 2D-3D grouped GEMM at 74.6 % of peak on B200).

    Raises:
        ValueError: an unknown ``kernel``."""
    if kernel not in EXPERT_GEMM_KERNELS:
        raise ValueError(f"framework.expert_gemm_kernel={kernel!r} is not one of {', '.join(EXPERT_GEMM_KERNELS)}")
    if kernel == "dense" or dtype not in ("bf16", "fp16"):
        return 1.0, 1.0
    return TORCH_GROUPED_MM_RATE.get("blackwell" if device.mx_native else "other", (1.0, 1.0))


def tile_choices(tm: int, tn: int) -> tuple:
    """(tile_m, tile_n, rate factor) of the tiles a GEMM library picks among: the large tile both ways
    round, and the half-width one (:data:`HALF_TILE_RATE`) both ways round."""
    return ((tm, tn, 1.0), (tn, tm, 1.0), (tm, tn // 2, HALF_TILE_RATE), (tn // 2, tm, HALF_TILE_RATE))


def gemm_terms(m, n, k, device: Device, dtype: str = "bf16", groups=1, out_bytes: int = 2):
    """(compute, memory) seconds of one GEMM kernel computing ``groups`` products (m x k) @ (k x n).

    Compute: ``groups * ceil(m/tile_m) * ceil(n/tile_n)`` tiles; a grid under one wave splits K
    (split-K) to fill the SMs, at most into k/tile_k slices; each wave runs one tile (or slice, K
    rounded up to tile_k) per SM at the large-GEMM rate / SMs, an FP8 tile plus :data:`FP8_TILE_FIXED_S`; the
    better of the device's tile and a half-width one (:data:`HALF_TILE_RATE`). Memory: A and B read, C written once (split-K's fp32
    partials reduce in L2, not counted). No stream-K: a partial last wave of a multi-wave grid idles.

    Raises:
        ValueError: ``dtype`` has no tensor-core peak on the device (fp8 on an A100)."""
    m, n, k, g = (np.asarray(x, dtype=float) for x in np.broadcast_arrays(m, n, k, groups))
    tm, tn, tk = device.tile
    rate = _rate(device, dtype)
    fixed = device.fp8_tile_fixed_s if dtype in FP8_KEYS else 0.0
    compute = np.minimum.reduce([_tiled_compute(m, n, k, g, (a, b, tk), device, rate * r, fixed)
                                 for a, b, r in tile_choices(tm, tn)])  # the library's heuristic
    traffic = g * ((m * k + k * n) * DTYPE_BYTES[dtype] + m * n * out_bytes)  # A, B in, C out
    return compute, memory_time(traffic, device)


def gemm_time(m, n, k, device: Device, dtype: str = "bf16", groups=1, out_bytes: int = 2):
    """Seconds of one GEMM kernel (a grouped GEMM: ``groups`` experts of ``m`` tokens each; m = 0 costs
    nothing): the larger of :func:`gemm_terms` (a roofline: compute-bound or HBM-bound). Arrays broadcast.

    Raises:
        ValueError: ``dtype`` has no tensor-core peak on the device (fp8 on an A100)."""
    compute, memory = gemm_terms(m, n, k, device, dtype, groups, out_bytes)
    return np.where(np.asarray(m) * np.asarray(groups) > 0, np.maximum(compute, memory), 0.0)


def gemm_fraction_of_peak(m, n, k, device: Device, dtype: str = "bf16", groups=1, launch: bool = False):
    """Achieved FLOP/s of :func:`gemm_time` (plus the launch gap with ``launch``: what a timing loop of
    back-to-back calls measures) over the dtype's peak, 0..1."""
    t = gemm_time(m, n, k, device, dtype, groups) + (device.launch_s if launch else 0.0)
    m, n, k, g = (np.asarray(x, dtype=float) for x in np.broadcast_arrays(m, n, k, groups))
    t = np.broadcast_to(t, m.shape)
    return np.divide(2.0 * g * m * n * k, t * device.peak_flops[dtype], out=np.zeros(m.shape), where=t > 0)


def causal_block_fraction(seq, window=0):
    """Fraction of FlashAttention's (query, key) blocks a causal mask computes over a sequence of ``seq``
    tokens: with n = ceil(seq / 128) blocks a side, the n (n + 1) / 2 on or below the diagonal. With a sliding
    ``window`` of w keys (> 0; 0: none) query block i computes key blocks i - c .. i only, c = ceil((w - 1) / 128)
    (the blocks that hold a key of its band; FlashAttention-2's ``window_size``: flash_fwd_kernel.h starts
    ``n_block_min`` at the window's first key block, and the backward the same; FlashAttention-3 and cuDNN
    likewise): n + c (c + 1) / 2 + c (n - 1 - c) blocks, at w >= seq the causal count. Arrays broadcast."""
    n = np.maximum(np.ceil(np.asarray(seq, dtype=float) / FLASH_BLOCK), 1)
    w = np.asarray(window, dtype=float)
    c = np.where(w > 0, np.minimum(np.ceil((w - 1) / FLASH_BLOCK), n - 1), n - 1)  # key blocks before the diagonal
    return (n + c * (c + 1) / 2 + c * (n - 1 - c)) / (n * n)


def attention_flops(batch, s_q, s_kv, heads, qk_dim, v_dim, causal: bool = True, window=0):
    """Forward FLOPs of the attention core as FlashAttention executes it: 2 b h s_q s_kv (d_qk + d_v), times
    the causal blocks' share of the whole ``s_kv`` sequence (under context parallelism a rank's s_q = s_kv / cp
    queries in load-balanced chunks do 1/cp of the causal work), within a sliding ``window`` of keys where > 0
    (:func:`causal_block_fraction`: ~ 4 b h s (w + 128) d at s >> w, against 2 b h s^2 d causal). A matmul count,
    not a model's MFU count (xpar.estimate.compute.flops)."""
    full = 2.0 * np.asarray(batch, dtype=float) * heads * s_q * s_kv * (np.asarray(qk_dim) + v_dim)
    return full * (causal_block_fraction(s_kv, window) if causal else 1.0)


def head_dim_rate(head_dim):
    """FlashAttention's rate at ``head_dim`` over its rate at 128 (:data:`ATTENTION_HALF_DIM`), at most 1."""
    d = np.asarray(head_dim, dtype=float)
    return np.minimum(1.0, d / (d + ATTENTION_HALF_DIM) * (128 + ATTENTION_HALF_DIM) / 128)


UNMASKED_HALF_SEQ = 115.0
"""The same for an unmasked (non-causal) forward, which saturates sooner: fitted (RMS 0.039) on the three non-causal
forward curves of the same figure (FlashAttention-2 309-370, cuDNN 497-595, FlashAttention-3 467-648 TFLOP/s)."""
UNMASKED_GAIN = 1.08
"""An unmasked forward's rate over a causal one's at 16k keys, head_dim 128 (Shah et al. 2024, Fig. 5: FlashAttention-2
370 / 335 = 1.10, cuDNN 595 / 539 = 1.10, FlashAttention-3 648 / 616 = 1.05): no masked diagonal blocks, every
query block's loop equally long. The preset fractions are the causal forward's (the backward figure, Fig. 6, is
unmasked: no gain)."""
SEQUENCE_RATE_FLOOR = 512.0
"""The shortest key length the curve is read at (the figures' shortest); shorter ones (a 128-key sliding window)
are priced at its rate there, not extrapolated."""


def sequence_rate(s_kv, half: float = None):
    """A flash-attention kernel's rate over ``s_kv`` keys per query row (a sliding window's keys where one) relative
    to its rate at 16384, at most 1, read at :data:`SEQUENCE_RATE_FLOOR` keys or more; ``half``: the curve's
    half-rate length (default :data:`ATTENTION_HALF_SEQ`). Arrays broadcast."""
    h = ATTENTION_HALF_SEQ if half is None else half
    s = np.maximum(np.asarray(s_kv, dtype=float), SEQUENCE_RATE_FLOOR)
    return np.minimum(1.0, s / (s + h) * (16384.0 + h) / 16384.0)


def attention_time(batch, s_q, s_kv, heads, qk_dim, v_dim, device: Device, causal: bool = True,
                   kv_heads=None, backward: bool = False, window=0, unmasked: bool = False):
    """Seconds of the attention core (FlashAttention forward, or backward at 2.5x its FLOPs) on one rank.

    Runs in BF16 at the device's flash-attention fraction whatever the GEMM dtype (FP8 recipes keep
    the core in BF16), times :func:`head_dim_rate` and :func:`sequence_rate` of ``s_kv``; ``unmasked`` (with
    ``causal`` False: a kernel without any mask, a cp ring's off-diagonal step) forward at the unmasked curve and
    :data:`UNMASKED_GAIN`. The grid is b x heads x ceil(s_q/128) query blocks in waves over the SMs;
    memory: Q, K, V read and O written once (x2 backward, with dO, dQ, dK, dV). Larger of the two.
    A sliding ``window`` (> 0) cuts the FLOPs to its blocks (:func:`attention_flops`), not the traffic (each
    tensor still read or written once): a narrow window (gpt-oss: 128) brings the core near its HBM bound."""
    b, sq, skv, h = (np.asarray(x, dtype=float) for x in np.broadcast_arrays(batch, s_q, s_kv, heads))
    hk = h if kv_heads is None else np.asarray(kv_heads, dtype=float)
    flops = attention_flops(b, sq, skv, h, qk_dim, v_dim, causal, window) * (FLASH_BWD_FLOPS if backward else 1.0)
    keys = np.where(np.asarray(window) > 0, np.minimum(skv, window), skv)
    fast = unmasked and not causal and not backward  # an unmasked forward (:data:`UNMASKED_GAIN`)
    half = device.attention_half_seq  # the unmasked curve's half length scaled with it (:data:`ATTENTION_HALF_SEQ`)
    rate = (device.peak_flops["bf16"] * device.attention_fraction[1 if backward else 0] * head_dim_rate(qk_dim)
            * (UNMASKED_GAIN * sequence_rate(keys, UNMASKED_HALF_SEQ * half / ATTENTION_HALF_SEQ) if fast
               else sequence_rate(keys, half)))
    units = b * h * np.ceil(sq / FLASH_BLOCK)
    waves = np.ceil(units / device.sms)
    compute = flops / rate * np.divide(waves * device.sms, units, out=np.ones_like(units), where=units > 0)
    traffic = 2 * b * (sq * h * (np.asarray(qk_dim) + v_dim) + skv * hk * (np.asarray(qk_dim) + v_dim))
    return np.maximum(compute, memory_time(traffic * (2 if backward else 1), device))


def kernel_overhead(n_kernels, busy_s, device: Device, host_s_per_kernel: float = 0.0):
    """Seconds ``n_kernels`` kernels that keep the GPU busy ``busy_s`` in all add beyond ``busy_s``: the
    device's launch gap per kernel, or, where the host issues kernels slower than they run (eager
    PyTorch: tens of microseconds an operator), the host's time. Arrays broadcast."""
    n, busy = (np.asarray(x, dtype=float) for x in np.broadcast_arrays(n_kernels, busy_s))
    return np.maximum(n * device.launch_s, n * host_s_per_kernel - busy)
