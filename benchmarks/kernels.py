"""The kernel model's achieved fraction of peak over a GEMM-size sweep, per device (issue 42).

    python benchmarks/kernels.py [--dtype bf16|fp8] [--launch]

Prints, for each GPU node preset, the fraction of the dtype's dense peak that xpar.estimate.compute.kernels
gives square GEMMs (n x n x n) and transformer shapes (M tokens against an expert's 768-wide
projection, a 70B's tp-8 MLP, an 8192 x 8192 projection). ``--launch`` adds the device's launch gap,
as a timing loop of back-to-back calls measures it. No GPU is used: these are the model's figures,
to compare with a measured sweep (e.g. stas00/ml-engineering's mamf-finder.py) on the device.
"""
from __future__ import annotations

import argparse

import numpy as np

from xpar.config.checks.hardware import load_hardware_preset
from xpar.estimate.compute.kernels import device_of, gemm_fraction_of_peak

NODES = ["a100_80gb_node", "h100_80gb_node", "h200_141gb_node", "b200_180gb_node", "gb200_nvl72_node"]
SQUARE = [256, 512, 1024, 2048, 4096, 8192, 16384]
TOKENS = [128, 512, 2048, 8192]
BEST = {("a100_80gb_node", "bf16"): (1024, 10240, 5120), ("h100_80gb_node", "bf16"): (2048, 2048, 13312),
        ("b200_180gb_node", "bf16"): (1792, 16128, 3072), ("gb200_nvl72_node", "bf16"): (4096, 9728, 2048),
        ("h100_80gb_node", "fp8"): (1024, 9216, 14336), ("h200_141gb_node", "fp8"): (1280, 4096, 12032),
        ("b200_180gb_node", "fp8"): (15360, 4096, 3072), ("gb200_nvl72_node", "fp8"): (19456, 5120, 1536)}
"""The shape (M, N, K) at which each device reached its maximum achievable matmul FLOPS in the public MAMF
tables (stas00/ml-engineering, compute/accelerator/README.md): there the device measured gemm_efficiency."""
SHAPES = {"expert 768 (N=1536,K=2048)": (1536, 2048), "70B fc1 tp8 (N=7168,K=8192)": (7168, 8192),
          "proj 8192 (N=8192,K=8192)": (8192, 8192)}


def table(dtype: str, launch: bool) -> list[str]:
    head = f"{'device':18s}" + "".join(f"{n:>7d}" for n in SQUARE)
    lines = [f"square GEMMs n x n x n, {dtype}, fraction of peak" + (" (with the launch gap)" if launch else ""), head]
    shaped = [f"transformer GEMMs, M tokens = {TOKENS}, {dtype}"]
    for name in NODES:
        hw = load_hardware_preset(name)
        if dtype == "fp8" and hw.peak_tflops_fp8 is None:
            continue
        device = device_of(hw)
        sizes = np.array(SQUARE)
        frac = gemm_fraction_of_peak(sizes, sizes, sizes, device, dtype, launch=launch)
        lines.append(f"{hw.gpu:18s}" + "".join(f"{f:7.3f}" for f in frac))
        for label, (n, k) in SHAPES.items():
            frac = gemm_fraction_of_peak(np.array(TOKENS), n, k, device, dtype, launch=launch)
            shaped.append(f"{hw.gpu:18s} {label:28s}" + "".join(f"{f:7.3f}" for f in frac))
    return lines + [""] + shaped


def best_shapes() -> list[str]:
    """The model at each device's MAMF best shape against the measured fraction (its gemm_efficiency)."""
    lines = ["the model at the MAMF tables' best shapes (measured there: the preset's gemm_efficiency)"]
    for (name, dtype), (m, n, k) in BEST.items():
        hw = load_hardware_preset(name)
        measured = hw.gemm_efficiency if dtype == "bf16" else hw.gemm_efficiency_fp8
        model = float(gemm_fraction_of_peak(m, n, k, device_of(hw), dtype))
        lines.append(f"{hw.gpu:18s} {dtype:5s} {m:>6d} x {n:>6d} x {k:>6d}  model {model:.3f}  measured "
                     f"{measured:.3f}  model / measured {model / measured:.3f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"])
    parser.add_argument("--launch", action="store_true", help="add the device's per-kernel launch gap")
    args = parser.parse_args()
    print("\n".join(table(args.dtype, args.launch) + [""] + best_shapes()))


if __name__ == "__main__":
    main()
