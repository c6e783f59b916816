"""From measurements to a hardware preset: the fits (matmul and block efficiency, alpha-beta of the
collectives, ring-step curves) and the preset file ``xpar calibrate`` writes."""
from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Optional

from xpar.calibrate.measure import REFERENCE_BATCH, REFERENCE_BLOCK
from xpar.config.presets import conf_dir
from xpar.config.schema import HardwareConfig, ModelConfig
from xpar.estimate.comm.collectives import ring_steps, WHOLE_MESSAGE
from xpar.estimate.comm.volume import ring_factor
from xpar.estimate.cost import Assumptions, layer_costs, GEMM_HALF_DIM
from xpar.estimate.compute.host import block_ops


def fit_matmul_efficiency(rates: dict[int, float], peak: float, half_dim: float) -> float:
    """Least-squares e in rate(n) = peak * e * n / (n + half_dim) (dimensionless)."""
    g = {n: peak * n / (n + half_dim) for n in rates}
    return sum(rates[n] * g[n] for n in rates) / sum(g[n] ** 2 for n in rates)


def fit_block_efficiency(seconds: float, peak_tflops: float, hbm_tb_per_s: float, op_overhead_us: float) -> float:
    """``hardware.matmul_efficiency`` with which the cost model's time of :data:`REFERENCE_BLOCK`
    (xpar.estimate.cost.layer_costs: its matmul FLOPs at ``peak_tflops`` x efficiency x the
    shape factor, its memory-bound passes at ``hbm_tb_per_s``, and its operators' host time at
    ``op_overhead_us``, xpar.estimate.compute.host.block_ops) equals the measured ``seconds`` forward and
    backward; within [0.2, 1] (a block measured faster than its memory-bound and host terms
    alone: 1)."""
    from types import SimpleNamespace as NS

    cfg = ModelConfig(**REFERENCE_BLOCK)
    hw = HardwareConfig(device="cpu", peak_tflops=peak_tflops, hbm_tb_per_s=hbm_tb_per_s, matmul_efficiency=1.0)
    spec = NS(model=cfg, hardware=hw, seq_len=cfg.seq_len, tp=1,  # the fields layer_costs reads
              train=NS(micro_batch_size=REFERENCE_BATCH, dtype="fp32"), layout=NS(layer_split=(cfg.n_layers,), recompute="none", sequence_parallel=False),
              parallel=NS(recompute_layers=None))
    c = layer_costs(spec, Assumptions.xpar_cpu())
    rest = c["mem_f"] + c["mem_b"] + sum(block_ops(cfg)) * op_overhead_us * 1e-6
    left = seconds - rest
    return 1.0 if left <= 0 else min(1.0, max(0.2, (c["mm_f"] + c["mm_b"]) / left))


def fit_alpha_beta(timings: dict, world: int) -> tuple[float, float]:
    """(alpha seconds per ring step, beta bytes/s) minimising the squared error of
    t = steps * alpha + ring_bytes / beta over every measured collective and size.

    Raises:
        ValueError: fewer than two measurements, or a fit without positive bandwidth.
    """
    import numpy as np

    rows, ts = [], []
    for name, by_size in timings.items():
        if "unsupported" in by_size:
            continue
        for nbytes, t in by_size.items():
            wire = nbytes if name == "send_recv" else ring_factor(name, world) * nbytes
            rows.append([ring_steps(name, world), wire])
            ts.append(t)
    if len(rows) < 2:
        raise ValueError(f"need at least two collective timings to fit alpha and beta, got {len(rows)}")
    a, t = np.array(rows, float), np.array(ts, float)
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, t, rcond=None)
    if alpha < 0:  # non-negative least squares over two unknowns: refit with the other at zero
        alpha, inv_beta = 0.0, float(a[:, 1] @ t / (a[:, 1] @ a[:, 1]))
    elif inv_beta <= 0:
        alpha, inv_beta = float(a[:, 0] @ t / (a[:, 0] @ a[:, 0])), 0.0
    if inv_beta <= 0:
        raise ValueError("the timings show no cost per byte (latency-bound at every size): "
                         "run again on a quieter machine, or without --quick (more sizes and repetitions)")
    return float(alpha), 1.0 / float(inv_beta)


def fit_p2p_latency(timings: dict, beta: float) -> Optional[float]:
    """Seconds of latency of one point-to-point message: the median over the measured sizes of
    send/recv time minus its bytes at the fitted bandwidth ``beta`` (bytes/s), at least 0; None
    without send/recv timings. A pipeline send pays this, not a collective's per-step latency
    (:func:`fit_alpha_beta` fits that over every collective)."""
    by_size = timings.get("send_recv") or {}
    if not by_size or "unsupported" in by_size:
        return None
    return max(0.0, statistics.median(t - nbytes / beta for nbytes, t in by_size.items()))


def ring_step_curves(timings: dict, world: int) -> dict:
    """``hardware.ring_step_us_by_bytes`` from the collectives measured on ``world`` workers
    (``timings``: seconds by collective and payload bytes): per collective, [chunk bytes,
    microseconds per ring step] pairs, chunk = payload / world (send/recv, broadcast: the
    message, xpar.estimate.comm.collectives.WHOLE_MESSAGE) and
    step = time / :func:`xpar.estimate.comm.collectives.ring_steps`; collectives the backend did not
    run are left out."""
    out = {}
    for name, by_size in timings.items():
        if "unsupported" in by_size or not by_size:
            continue
        share = 1 if name in WHOLE_MESSAGE else world
        sizes = sorted(by_size)
        steps_us = monotone([by_size[n] / ring_steps(name, world) * 1e6 for n in sizes])
        out[name] = [[int(n) // share, us] for n, us in zip(sizes, steps_us)]
    return out


def monotone(ys: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``ys`` in squared error (isotonic regression, pool
    adjacent violators): a bigger message never costs less, so a small size's slow outlier (a
    gloo thread waiting for a core on a shared machine) is averaged with its neighbours."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


def preset_values(matmul: dict, bandwidth: float, alpha: float, beta: float, device: str = "cpu",
                  host: Optional[dict] = None, block_s: Optional[float] = None, name: str = "local") -> dict:
    """Hardware fields of the measured machine (units of :class:`xpar.config.schema.HardwareConfig`:
    TFLOP/s, TB/s, GB/s, microseconds); ``host``: :func:`host_worker`'s figures (a CPU's host
    time adds to its step; a GPU's hides behind its queue: left at 0). ``matmul_efficiency``:
    on a CPU with ``block_s`` (:func:`measure_block`, seconds) fitted to the reference block
    (:func:`fit_block_efficiency`), else to the square GEMMs' curve. Only fields the schema has
    are returned. ``name``: the preset's own name (``calibrated_<--name>``: the runs on it are tagged
    with it and labelled calibrated, xpar.config.hardware.is_this_machine)."""
    from dataclasses import fields

    peak = max(matmul.values())
    values = {"name": name, "device": device, "devices_per_node": "auto", "nodes": 1,
              "peak_tflops": peak / 1e12,
              "matmul_efficiency": min(1.0, fit_matmul_efficiency(matmul, peak, GEMM_HALF_DIM)),
              "hbm_tb_per_s": bandwidth / 1e12, "intra_node_gb_per_s": beta / 1e9, "link_efficiency": 1.0,
              "intra_node_latency_us": alpha * 1e6, "collective_latency_us": 0.0}
    if device == "cpu":  # as conf/hardware/local.yaml: no CUDA context, host memory is no device limit
        values.update(framework_overhead_gb=0.0, device_memory_gb=None)
        values.update({k: v for k, v in (host or {}).items() if k.endswith("_us")})
        values["cpu_cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if block_s:
            values["matmul_efficiency"] = fit_block_efficiency(block_s, peak / 1e12, bandwidth / 1e12,
                                                               (host or {}).get("op_overhead_us", 0.0))
    known = {f.name for f in fields(HardwareConfig)}
    return {k: v for k, v in values.items() if k in known}


def write_preset(name: str, values: dict, header: list[str], conf: Optional[Path] = None) -> Path:
    """``conf/hardware/calibrated_<name>.yaml`` with ``header`` as comments; its path.

    Raises:
        OSError: the config tree is not writable.
    """
    from omegaconf import OmegaConf

    path = (conf or conf_dir()) / "hardware" / f"calibrated_{name}.yaml"
    body = OmegaConf.to_yaml(OmegaConf.create(values))
    staged = path.with_name(f".{path.name}.tmp")
    try:  # whole or not at all: a full disk leaves no half-written preset
        staged.write_text("".join(f"# {line}\n" for line in header) + body)
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)
    return path
