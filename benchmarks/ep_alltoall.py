"""xpar's expert-parallel all-to-all prices against DeepEP's published microbenchmarks (issues 42, 44): check only.

    python benchmarks/ep_alltoall.py [--hardware h800_80gb_2048gpu]

Each row of tests/data/deepep_h800.csv (DeepEP's V1 tables on H800, docs/legacy.md) is priced with the cost model's
own functions (xpar.estimate.expert_parallel: ``ep_shares`` and ``alltoall_time``, as ``ep_layer_times`` calls them)
on the hardware preset, and xpar's seconds are turned into GB/s the way DeepEP's tests count them:

- normal kernels, one node (EP 8): bytes a rank receives, one copy per rank holding one of a token's experts, its own
  included ('NVL'); across nodes (EP 16-64): one copy per node a token reaches, the sender's node included ('RDMA').
  Dispatch in FP8 (hidden x (1 + 4/128) bytes a token: values and per-128 scales), combine in BF16; the expert groups
  of the test are the nodes, min(nodes, 4) of them open per token (tests/legacy/test_internode.py).
- low-latency kernels (128 tokens): every routed copy's bytes / time; xpar has no low-latency dispatcher, so they are
  priced as the plain all-to-all (every copy sent, NVLink inside the node, NICs across), microseconds beside.

- V2 normal kernels (README, SM90 with CX7, the GPU not named, 8K tokens, no group limit): priced on the preset and
  on the H100 preset, as the GPU could be either.

Columns: DeepEP's GB/s, xpar's with the one-copy-per-rank NVLink leg (now), xpar's with every copy on NVLink
((k - 1)/n, the plain all-to-all's NVLink share: the price before issue 44's fix), errors signed (+: xpar faster).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from xpar.calibrate.published import preset, read_table
from xpar.config.schema import HardwareConfig
from xpar.estimate.comm.collectives import group_of
from xpar.estimate.expert_parallel import alltoall_time, ep_shares, expert_hit

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "deepep_h800.csv"
FP8_TOKEN = 1 + 4 / 128
"""Bytes per hidden element of an FP8 token with its per-128 float scales (DeepEP tests: fp8_factor x 2)."""


def hardware(name: str) -> HardwareConfig:
    """The hardware preset ``name`` as the estimate reads it."""
    return HardwareConfig(**preset("hardware", name))


def normal_row(hw: HardwareConfig, row: dict, phase: str) -> dict:
    """xpar's seconds and GB/s (DeepEP's count) for one normal-kernel ``phase`` ('dispatch' or 'combine') of
    ``row``: {'published', 'now', 'every_copy'} GB/s and the bytes DeepEP counts, 'counted'. V1 rows route with
    the nodes as expert groups, min(nodes, 4) open; V2 rows (kernel 'v2_normal') without a group limit."""
    ep, tokens, hidden, k = (int(row[c]) for c in ("ep", "tokens", "hidden", "top_k"))
    group = group_of(hw, ep, 1)
    nodes = group.nodes
    limited = nodes > 1 and row["kernel"] == "normal"
    groups, open_groups = (nodes, min(nodes, 4)) if limited else (0, 0)
    elem = FP8_TOKEN if phase == "dispatch" else 2.0
    payload = tokens * k * hidden * elem  # T k h bytes: every routed copy, as ep_payload_bytes counts it
    intra, inter = ep_shares("deepep", k, group, groups, open_groups)
    now = alltoall_time(hw, payload, group, inter, intra)
    before = alltoall_time(hw, payload, group, inter)
    if nodes == 1:
        counted = tokens * ep * expert_hit(ep, k) * hidden * elem
    else:
        counted = tokens * nodes * expert_hit(nodes, k, groups, open_groups) * hidden * elem
    return dict(published=float(row[f"{phase}_gb_s"]), now=counted / now / 1e9, every_copy=counted / before / 1e9,
                counted=counted, seconds=now)


def low_latency_row(hw: HardwareConfig, row: dict, phase: str) -> dict:
    """The plain all-to-all's price of one low-latency ``phase`` of ``row``: {'published', 'now'} GB/s of every
    routed copy (DeepEP's count) and {'published_us', 'us'}."""
    ep, tokens, hidden, k = (int(row[c]) for c in ("ep", "tokens", "hidden", "top_k"))
    per_copy = hidden + hidden / 128 * 4 + 16 if phase == "dispatch" else 2 * hidden
    nbytes = tokens * k * per_copy
    seconds = alltoall_time(hw, nbytes, group_of(hw, ep, 1))
    return dict(published=float(row[f"{phase}_gb_s"]), now=nbytes / seconds / 1e9,
                published_us=float(row[f"{phase}_us"]), us=seconds * 1e6)


def error(got: float, published: float) -> float:
    """Signed relative error of a bandwidth (+: xpar faster)."""
    return got / published - 1


def normal_table(hw_name: str, kernel: str) -> list[float]:
    """Print the ``kernel`` rows ('normal' or 'v2_normal') priced on ``hw_name``; their errors (now)."""
    hw = hardware(hw_name)
    print(f"{'EP':>4} {'phase':8} {'counted':>10} {'DeepEP':>7} {'xpar':>7} {'err':>7} {'every copy on NVLink':>21}")
    errors = []
    for row in (r for r in read_table(DATA) if r["kernel"] == kernel):
        for phase in ("dispatch", "combine"):
            r = normal_row(hw, row, phase)
            errors.append(error(r["now"], r["published"]))
            link = "NVL" if int(row["ep"]) <= 8 else "RDMA"
            print(f"{row['ep']:>4} {phase:8} {link:>10} {r['published']:7.1f} {r['now']:7.1f} "
                  f"{errors[-1]:+7.1%} {r['every_copy']:9.1f} ({error(r['every_copy'], r['published']):+7.1%})")
    print(f"median |error| {statistics.median(abs(e) for e in errors):.1%}, max |error| {max(abs(e) for e in errors):.1%}")
    return errors


def low_latency_table(hw_name: str) -> list[float]:
    """Print the low-latency rows priced as the plain all-to-all on ``hw_name``; their GB/s errors."""
    hw = hardware(hw_name)
    print(f"{'EP':>4} {'phase':8} {'DeepEP us':>9} {'xpar us':>8} {'DeepEP GB/s':>11} {'xpar GB/s':>9} {'err':>7}")
    errors = []
    for row in (r for r in read_table(DATA) if r["kernel"] == "low_latency"):
        for phase in ("dispatch", "combine"):
            r = low_latency_row(hw, row, phase)
            errors.append(error(r["now"], r["published"]))
            print(f"{row['ep']:>4} {phase:8} {r['published_us']:9.0f} {r['us']:8.0f} {r['published']:11.1f} "
                  f"{r['now']:9.1f} {errors[-1]:+7.1%}")
    print(f"median |error| {statistics.median(abs(e) for e in errors):.1%}, max |error| {max(abs(e) for e in errors):.1%}")
    return errors


def report(hw_name: str) -> None:
    """Print the V1 normal, V1 low-latency and V2 normal tables (V2 also on the H100 preset: its GPU is unnamed)."""
    print(f"DeepEP V1 normal kernels (H800, docs/legacy.md) against xpar on {hw_name}: GB/s as DeepEP counts them")
    normal_table(hw_name, "normal")
    print(f"\nDeepEP V1 low-latency kernels (H800, 128 tokens) against xpar's plain all-to-all on {hw_name}")
    low_latency_table(hw_name)
    for name in dict.fromkeys((hw_name, "h100_80gb_64gpu")):
        print(f"\nDeepEP V2 normal kernels (SM90, GPU unnamed; README) against xpar on {name}")
        normal_table(name, "v2_normal")


def main(argv: list[str] | None = None) -> int:
    """Print the check; 0, or 2 with one line for an unknown hardware preset."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="h800_80gb_2048gpu", help="hardware preset (default: the H800 cluster)")
    args = ap.parse_args(argv)
    try:
        hardware(args.hardware)
    except Exception as exc:  # an unknown or malformed preset name
        print(f"ep_alltoall: hardware {args.hardware!r}: {exc}", file=sys.stderr)
        return 2
    report(args.hardware)
    return 0


if __name__ == "__main__":
    sys.exit(main())
