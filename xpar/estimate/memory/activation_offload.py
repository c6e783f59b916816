"""Activation offload to host memory (``parallel.activation_offload_layers``, N): Megatron-Core's
--cpu-offloading --cpu-offloading-num-layers N (megatron/core/transformer/transformer_config.py,
``cpu_offloading*``; TransformerBlock hands them to Transformer Engine's ``get_cpu_offload_context``),
as Transformer Engine runs it (transformer_engine/pytorch/cpu_offload.py, the
``AsyncDoubleBufferGroupOffloadHandler`` of TE 1.x-2.x, ``cpu_offload_v1.py`` after 2.8):

- the first N of a stage's L blocks are offload groups; the tensors TE's modules mark for offload
  (their saved inputs, attention's saved tensors) are copied device -> host on a side stream, one
  group at a time, group i's copy spread over window i of the forward (``layer_window_map``: N
  windows tiling the L blocks, L mod N of them L // N + 1 blocks long, the rest L // N), and its
  device copy freed at the end of that window;
- in the backward each group is reloaded host -> device into fresh buffers one window before the
  block that needs it (``bulk_reload_group``), the main stream waiting on the copy at the window's end.

Device memory: the L - N blocks never offloaded plus one group in flight (copied out, or reloaded
and not yet consumed): ``resident_blocks`` = L - N + 1 (N > 0). What a block saves is counted whole
(an assumption: the few tensors TE does not mark, norm statistics and masks, are small beside them).

Time per micro-batch: each group's copy of ``c`` = block bytes / host link seconds hides behind its
window's compute, ``k`` blocks of forward ``t_f`` (backward ``t_b``) seconds each:
    exposed = sum over windows of max(0, c - k t_f) + max(0, c - k t_b)
Host memory per node: devices_per_node x N x block bytes (one micro-batch: pp = 1 only).

Megatron-Core's rules (transformer_config.py ``__post_init__``): 0 <= N < L; no pipeline
parallelism; no activation recompute. Not modelled: TE's double_buffering (two persistent reload
buffers, off by default), the copies' share of HBM bandwidth, Megatron-Core 0.15's
fine_grained_activation_offloading (per-module, with pp). Units: bytes, seconds.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from xpar.estimate.comm.overlap import vmax


def offload_layers(spec) -> int:
    """N: ``parallel.activation_offload_layers`` of ``spec`` (a RunSpec), 0 where null."""
    return int(getattr(spec.parallel, "activation_offload_layers", None) or 0)


def resident_blocks(blocks: int, offloaded: int) -> int:
    """Blocks' saved activations a stage of ``blocks`` blocks holds at its peak with ``offloaded``
    of them offloaded (module docstring): blocks - offloaded + 1, or ``blocks`` without offload."""
    return blocks - offloaded + 1 if offloaded > 0 else blocks


def windows(blocks: int, offloaded: int) -> tuple[tuple[int, int], ...]:
    """(window length in blocks, count) of TE's ``layer_window_map`` for ``offloaded`` groups over
    ``blocks`` blocks: L mod N windows of L // N + 1 blocks, the others L // N. () without offload."""
    if offloaded <= 0:
        return ()
    q, r = divmod(blocks, offloaded)
    return tuple((k, n) for k, n in ((q + 1, r), (q, offloaded - r)) if n)


def exposed_time(block_bytes: Any, link_gb_per_s: float, blocks: int, offloaded: int, t_forward: Any,
                 t_backward: Any) -> Any:
    """Seconds per micro-batch the offload copies add to the compute stream (module docstring):
    ``block_bytes`` one block's saved bytes, ``link_gb_per_s`` the host link per device and direction
    (hardware.pcie_gb_per_s, GB/s = 1e9 bytes/s, > 0), ``t_forward`` / ``t_backward`` one block's
    forward / backward compute seconds. Floats or numpy arrays over layouts."""
    copy = np.asarray(block_bytes, dtype=float) / (link_gb_per_s * 1e9)
    out = 0.0 * copy
    for k, n in windows(blocks, offloaded):
        out = out + n * (vmax(copy - k * t_forward, 0.0) + vmax(copy - k * t_backward, 0.0))
    return out


def host_bytes(block_bytes: Any, offloaded: int, devices_per_node: int) -> Any:
    """Host memory one node needs for its devices' offloaded activations (pinned), bytes."""
    return devices_per_node * offloaded * block_bytes


def offload_problems(spec) -> list[str]:
    """Why ``spec`` cannot offload activations as asked, one line each ([] without offload or when it
    can): the framework must run it (framework.activation_offload), Megatron-Core's rules (N below the
    blocks, pp 1, no recompute), estimate mode (xpar does not execute it) and the host link figure."""
    n = offload_layers(spec)
    if n == 0:
        return []
    lay, fw, key = spec.layout, spec.framework, f"parallel.activation_offload_layers={n}"
    if not getattr(fw, "activation_offload", False):
        return [f"{key}: framework={fw.name} runs no activation offload (framework.activation_offload=false; "
                "Megatron-Core's --cpu-offloading: framework=megatron_core); e.g. parallel.activation_offload_layers=0, "
                "or parallel.recompute=full to save the blocks' activations."]
    out = []
    if lay.pp > 1:
        out.append(f"{key} needs parallel.pp=1 (Megatron-Core: 'no support for Pipeline parallelism with CPU "
                   f"offloading'), got pp={lay.pp}; e.g. parallel.pp=1, or parallel.activation_offload_layers=0.")
    if lay.recompute != "none":
        out.append(f"{key} needs parallel.recompute=none (Megatron-Core: 'CPU offloading does not work when "
                   f"activation recomputation is enabled'), got {lay.recompute}; e.g. parallel.recompute=none.")
    if not n < spec.model.n_layers:
        out.append(f"{key}: Megatron-Core offloads fewer blocks than the model has (0 <= N < "
                   f"{spec.model.n_layers}); e.g. parallel.activation_offload_layers={spec.model.n_layers - 1}.")
    if spec.mode == "execute":
        out.append(f"{key} is estimated only: xpar does not execute activation offload (run.mode=execute); e.g. "
                   "run.mode=estimate with a cluster preset, or parallel.activation_offload_layers=0.")
    elif not (spec.hardware.pcie_gb_per_s or 0) > 0:
        out.append(f"{key} needs the host link's bandwidth the copies are timed with, and hardware="
                   f"{spec.hardware.name} has no hardware.pcie_gb_per_s (null); e.g. hardware.pcie_gb_per_s=50 "
                   "(PCIe Gen5 x16, conf/hardware/h100_80gb_node.yaml).")
    return out


def block_bytes_of(spec, o) -> float:
    """One block's saved bytes for one micro-batch under no recompute (what a group copies):
    :func:`xpar.estimate.memory.activations.layer_bytes`' ``none``."""
    from xpar.estimate.memory.activations import layer_bytes  # activations imports this module
    return float(layer_bytes(spec, o, 0.0)["none"])


def host_need(spec, o) -> Optional[dict]:
    """``host_bytes`` (per node) and ``block_bytes`` of ``spec``'s offloaded activations; None without offload."""
    n = offload_layers(spec)
    if n == 0:
        return None
    from xpar.estimate.memory.offload import devices_per_node
    b = block_bytes_of(spec, o)
    return {"block_bytes": b, "host_bytes": host_bytes(b, n, devices_per_node(spec.hardware))}
