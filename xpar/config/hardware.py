"""Hardware presets and detection of the local machine."""
from __future__ import annotations

import functools
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from xpar.config.schema import HardwareConfig


CALIBRATED_PREFIX = "calibrated_"
"""Presets ``xpar calibrate --name N`` writes: conf/hardware/calibrated_N.yaml, ``name: calibrated_N``."""


def is_this_machine(hw) -> bool:
    """True for the presets of the machine xpar runs on: ``local`` (detected) and the presets
    ``xpar calibrate`` wrote for it (``calibrated_*``): executed, not estimated, by default.
    ``hw``: a HardwareConfig or its dict."""
    name = hw["name"] if isinstance(hw, dict) else hw.name
    return name == "local" or name.startswith(CALIBRATED_PREFIX)


def host_memory_bytes() -> int:
    """Physical memory of this host in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@functools.lru_cache(maxsize=None)
def measure_cpu_peak_flops(n: int = 384, seconds: float = 0.3, threads: int = 1) -> float:
    """Dense fp32 matmul FLOP/s of one CPU worker (``threads`` torch threads).

    The best of repeated n x n matmuls (2 n^3 FLOPs each) for about ``seconds``. This is
    the denominator of MFU on CPU: a measured achievable peak, not a datasheet figure.
    Measured once per process (a sweep's pre-flight validates every job).
    """
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best, t_end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        return 2 * n ** 3 / best
    finally:
        torch.set_num_threads(old)


def cache_dir() -> Path:
    """xpar's cache folder: ``$XDG_CACHE_HOME/xpar``, or ``~/.cache/xpar`` where it is unset, empty or
    relative (the XDG Base Directory spec: a relative path there is invalid and ignored)."""
    root = os.environ.get("XDG_CACHE_HOME", "")
    return Path(root if os.path.isabs(root) else os.path.join(os.path.expanduser("~"), ".cache")) / "xpar"


def peak_cache_path() -> Path:
    """``cache_dir() / 'peak.json'`` (default ``~/.cache/xpar/peak.json``)."""
    return cache_dir() / "peak.json"


@functools.lru_cache(maxsize=None)
def cached_cpu_peak_flops(threads: int = 1) -> float:
    """:func:`measure_cpu_peak_flops` with ``threads``, measured once per machine: the value
    is kept in :func:`peak_cache_path` under the key ``host|torch version|threads`` and
    reused by later runs (delete the file, or its entry, to measure again). A reading for
    several threads below the cached one-thread peak (taken under load) is raised to it. An
    unreadable or unwritable cache falls back to measuring in this process."""
    import json
    import socket

    import torch

    key = f"{socket.gethostname()}|torch {torch.__version__}|threads {threads}"
    path = peak_cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if isinstance(cache.get(key), (int, float)):
        return float(cache[key])
    flops = measure_cpu_peak_flops(threads=threads)
    one = cache.get(f"{socket.gethostname()}|torch {torch.__version__}|threads 1")
    if threads > 1 and isinstance(one, (int, float)) and flops < one:
        flops = float(one)  # more threads never lower the peak: a lower reading was taken under load
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**cache, key: flops}, indent=1))
        tmp.replace(path)  # atomic: concurrent sweeps' pre-flights never read half a file
    except OSError:
        pass
    return flops


def resolve_hardware(hw: HardwareConfig, local_devices: Optional[int] = None,
                     threads: int = 1) -> HardwareConfig:
    """Fill in what 'local' leaves to detection: device kind, device count, memory, peak.

    On CPU, the device count is the number of cores (workers), memory is host RAM, and the
    peak is the fp32 matmul rate of one worker with ``threads`` torch threads
    (``train.threads_per_worker``), measured once per machine (:func:`cached_cpu_peak_flops`). On CUDA, the device count and memory
    come from torch.cuda; a missing peak is an error-free None (MFU then reported as 0).
    Presets other than this machine's (:func:`is_this_machine`) are returned unchanged.
    """
    if not is_this_machine(hw):
        return replace(hw)
    import torch

    device = hw.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    n = hw.devices_per_node
    if n == "auto":
        n = local_devices or (torch.cuda.device_count() if device == "cuda" else (os.cpu_count() or 1))
    mem = hw.device_memory_gb
    if mem is None:
        mem = (torch.cuda.get_device_properties(0).total_memory if device == "cuda"
               else host_memory_bytes()) / 1e9
    peak = hw.peak_tflops
    if peak is None and device == "cpu":
        peak = cached_cpu_peak_flops(threads) / 1e12
    return replace(hw, device=device, devices_per_node=int(n), device_memory_gb=float(mem), peak_tflops=peak)
