"""FP8 scaling recipes (``train.fp8_recipe``): what each does per quantised tensor, for the kernel model.

Every FP8 linear quantises its BF16 activation input (backward: its output gradient) before the GEMM. The
recipes differ in the BF16 reads, the FP8 copies and scale bytes written, the kernels, and the GEMM that
then runs (Transformer Engine @d0067d0, docs/features/low_precision_training/, one page a recipe):
``delayed`` (scale from an amax history: one read, one kernel), ``current`` (an amax pass, then the cast:
transformer_engine/pytorch/csrc/quantizer.cpp, Float8CurrentScalingQuantizer::quantize_impl),
``mxfp8`` (Blackwell: E8M0 scale per 32, rowwise and columnwise copies quantised independently, one kernel:
common/cast/mxfp8/quantize_mxfp8.cuh), ``blockwise`` (DeepSeek-V3 report Sec. 3.3: 1 x 128 activation
tiles, FP32 scales; rowwise and columnwise copies; on Blackwell emulated with MXFP8). Tensor-scaled recipes
write one FP8 copy (Hopper's transposed copy is not priced: the default's figures kept). Not priced: the
amax all-reduce under sequence parallelism, delayed's once-a-step history update, weight quantisation
(cached across micro-batches). Table and sources: docs/concepts/kernels.md. Units: bytes per element.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

BF16_BYTES = 2
FP8_BYTES = 1

MXFP8_GEMM_RATE = 6.812 / 7.161
"""A block-scaled MXFP8 GEMM's rate over a tensor-scaled FP8 GEMM's on Blackwell, 0.951: Transformer Engine's
GEMM profiling tutorial (docs/examples/gemm_profiling/gemm_profiling.rst @d0067d0, B300, hidden 4096,
intermediate 16384, 15,872 tokens, ``--pre-quantize``: the 12 GEMMs of a layer 6.812 ms FP8CurrentScaling,
7.161 ms MXFP8; fprop +9.6 %, dgrad +2.9 %, wgrad +3.2 %). The same page's figure of that run shows 1.94x
and 1.74x over BF16 (0.90): the smaller loss is taken."""


@dataclass(frozen=True)
class Fp8Recipe:
    """What one quantisation of a BF16 tensor costs under a recipe (module docstring)."""

    name: str
    reads: int
    """Passes reading the BF16 tensor (2 bytes an element each)."""
    copies: int
    """FP8 copies written (1 byte an element each)."""
    scale_bytes: float
    """Scale bytes an element, per copy (E8M0 per 32: 1/32; FP32 per 128: 4/128; per tensor: 0)."""
    kernels: int
    """Kernels a quantisation launches."""
    block_scaled: bool
    """The GEMM takes block scales (MXFP8 on Blackwell; Hopper's blockwise kernels)."""
    hbm_fraction: Optional[float] = None
    """Fraction of the datasheet HBM bandwidth the recipe's quantisation kernels reach (:data:`CAST_HBM_FRACTION`);
    None: the block's other memory-bound passes' (xpar.estimate.compute.kernels.HBM_FRACTION)."""

    def cast_bytes(self) -> float:
        """Bytes moved per element quantised: reads of BF16, FP8 copies and their scales written."""
        return self.reads * BF16_BYTES + self.copies * (FP8_BYTES + self.scale_bytes)


CAST_HBM_FRACTION = 0.71
"""The fraction of HBM bandwidth Transformer Engine's current-scaling and MXFP8 quantisation kernels reach, against the
block's other memory-bound passes' 0.9 (xpar.estimate.compute.kernels.HBM_FRACTION). From TE's GEMM profiling tutorial
(docs/examples/gemm_profiling/gemm_profiling.rst @8f2e6357, 'Worked Example: 5B Model on B300'; xpar.calibrate.te_gemm):
autocast minus pre-quantised per-layer time is the quantisation of both inputs of 12 GEMMs on every call, 2,483 M
elements; FP8 current scaling 9.147 - 6.812 = 2.335 ms for 5 bytes an element (less 72 kernels at 2 us): 5.67 TB/s,
0.71 of the B300's 8 TB/s; MXFP8 8.984 - 7.161 = 1.823 ms for 4.06 bytes (24 kernels): 5.68 TB/s, 0.71. Delayed
scaling's single cast, 7.802 - 6.812 = 0.99 ms for 3 bytes against the same tensor-scaled GEMMs, reaches 0.99: it keeps
0.9. On the H200 NVL (4.8 TB/s) current scaling's 20.285 - 16.785 = 3.50 ms is 0.77 without its transposed copy
(which xpar does not price on Hopper) and 0.92 with it. Blockwise (two 1-D-scaled copies, MXFP8's kernel structure; on
Blackwell TE runs it as MXFP8) takes MXFP8's figure."""

RECIPES = {
    "delayed": Fp8Recipe("delayed", reads=1, copies=1, scale_bytes=0.0, kernels=1, block_scaled=False),
    "current": Fp8Recipe("current", reads=2, copies=1, scale_bytes=0.0, kernels=3, block_scaled=False,
                         hbm_fraction=CAST_HBM_FRACTION),
    "mxfp8": Fp8Recipe("mxfp8", reads=1, copies=2, scale_bytes=1 / 32, kernels=1, block_scaled=True,
                       hbm_fraction=CAST_HBM_FRACTION),
    "blockwise": Fp8Recipe("blockwise", reads=1, copies=2, scale_bytes=4 / 128, kernels=1, block_scaled=True,
                           hbm_fraction=CAST_HBM_FRACTION),
}
"""The recipes ``train.fp8_recipe`` names; ``delayed`` (one cast pass, 3 bytes an element) is the default."""
DEFAULT = "delayed"
NEEDS_MX = ("mxfp8",)
"""Recipes whose GEMMs need MXFP8 tensor cores (hardware.mxfp8: Blackwell, SM 10.x; TE's mxfp8 page)."""


def quantiser(recipe: str, kernels: str = "te") -> Fp8Recipe:
    """The :class:`Fp8Recipe` of ``recipe`` as ``kernels`` run its casts (framework.fp8_cast_kernels): 'te' at the
    recipe's measured share of HBM, 'fused' at the block's memory-bound passes' (``hbm_fraction`` None).

    Raises:
        KeyError: an unknown ``recipe``."""
    r = RECIPES[recipe]
    return r if kernels == "te" else replace(r, hbm_fraction=None)


def gemm_dtype(recipe: str, mx_native: bool) -> str:
    """The kernel model's GEMM dtype key under FP8 ``recipe`` on a device with (``mx_native``) or without
    MXFP8 tensor cores: 'mxfp8' (block-scaled, :data:`MXFP8_GEMM_RATE`) for mxfp8, and for blockwise where
    Blackwell emulates it with MXFP8; else 'fp8' (Hopper's blockwise GEMMs priced at the FP8 rate: DeepGEMM's
    README reports up to 1550 TFLOP/s on H800 with 1 x 128 / 128 x 128 scales, at or above a tensor-scaled
    H100's MAMF 1402.6).

    Raises:
        ValueError: ``recipe`` needs MXFP8 tensor cores (:data:`NEEDS_MX`) and the device has none."""
    if recipe in NEEDS_MX and not mx_native:
        raise ValueError(f"train.fp8_recipe={recipe} needs MXFP8 tensor cores (Blackwell: hardware.mxfp8); "
                         f"recipes for this device: {[r for r in RECIPES if r not in NEEDS_MX]}")
    return "mxfp8" if RECIPES[recipe].block_scaled and mx_native else "fp8"


def weight_copy_bytes(recipe: str, mx_native: bool) -> float:
    """Bytes per linear weight element of the FP8 weight copies Transformer Engine caches (module
    docstring): tensor-scaled recipes keep the FP8 cast and, where the FP8 GEMMs take only the TN layout
    (not ``mx_native``: Hopper), its transpose; on Blackwell one copy serves both (TE's performance
    page: "a single quantized tensor serves both usages"); block-scaled recipes keep rowwise and
    columnwise copies with their scales (2-D weight blocks: one FP32 scale per 128 x 128, not counted)."""
    r = RECIPES[recipe]
    if not r.block_scaled:
        return FP8_BYTES * (1 if mx_native else 2)
    return 2 * FP8_BYTES + (2 * r.scale_bytes if recipe == "mxfp8" else 0.0)
