"""Activation offload to host memory (``parallel.activation_offload_layers``, N): Megatron-Core's
--cpu-offloading --cpu-offloading-num-layers N (megatron/core/transformer/transformer_config.py) as Transformer
Engine runs it (transformer_engine/pytorch/cpu_offload.py, ``AsyncDoubleBufferGroupOffloadHandler``): the saved
tensors of the first N of a stage's L blocks go device -> host on a side stream, group i during window i of TE's
``layer_window_map`` (N windows tiling the L blocks: L mod N of L // N + 1 blocks, the rest L // N), and come back
one window ahead of their backward. The device holds L - N + 1 blocks (those never offloaded, one group in flight);
a copy of c seconds behind a window of k blocks of t_f (forward) / t_b (backward) seconds exposes
max(0, c - k t_f) + max(0, c - k t_b); the host holds devices_per_node x N blocks per node. Megatron-Core's rules:
0 <= N < L, pp 1, no recompute. Under ``framework.activation_offload_overlap=false`` (xpar, which runs torch's
``save_on_cpu``, torch/autograd/graph.py) each saved tensor is copied on the compute stream when it is saved and
back when its backward reads it: the device holds L - N blocks and every copy is exposed, 2 N c per micro-batch.
Without a host link figure (hardware.pcie_gb_per_s null: a CPU, where save_on_cpu copies nothing) they cost 0 s.
Not modelled: TE's double_buffering (off by default), the copies' share of HBM bandwidth, Megatron-Core 0.15's
fine_grained_activation_offloading. Units: bytes, seconds. Derivation: docs/concepts/cost-model.md.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from xpar.estimate.comm.overlap import vmax


def offload_layers(spec) -> int:
    """N: ``parallel.activation_offload_layers`` of ``spec`` (a RunSpec), 0 where null."""
    return int(getattr(spec.parallel, "activation_offload_layers", None) or 0)


def resident_blocks(blocks: Any, offloaded: Any, overlap: bool = True) -> Any:
    """Blocks' saved activations a stage of ``blocks`` blocks holds at its peak with ``offloaded``
    of them offloaded (module docstring): blocks - offloaded + 1 with TE's group in flight (``overlap``),
    blocks - offloaded under save_on_cpu, ``blocks`` without offload. Ints or numpy arrays."""
    n = np.asarray(offloaded)
    out = np.where(n > 0, blocks - n + int(bool(overlap)), blocks)
    return int(out) if out.ndim == 0 else out


def windows(blocks: int, offloaded: int) -> tuple[tuple[int, int], ...]:
    """(window length in blocks, count) of TE's ``layer_window_map`` for ``offloaded`` groups over
    ``blocks`` blocks: L mod N windows of L // N + 1 blocks, the others L // N. () without offload."""
    if offloaded <= 0:
        return ()
    q, r = divmod(blocks, offloaded)
    return tuple((k, n) for k, n in ((q + 1, r), (q, offloaded - r)) if n)


def exposed_time(block_bytes: Any, link_gb_per_s: float, blocks: int, offloaded: Any, t_forward: Any,
                 t_backward: Any, overlap: bool = True) -> Any:
    """Seconds per micro-batch the offload copies add to the compute stream (module docstring):
    ``block_bytes`` one block's saved bytes, ``link_gb_per_s`` the host link per device and direction
    (hardware.pcie_gb_per_s, GB/s = 1e9 bytes/s, > 0), ``t_forward`` / ``t_backward`` one block's
    forward / backward compute seconds, ``offloaded`` N (an int, or an array over layouts); ``overlap``:
    TE's side stream (copies behind their windows), else save_on_cpu's (2 N copies, all exposed).
    Floats or numpy arrays over layouts."""
    copy = np.asarray(block_bytes, dtype=float) / (link_gb_per_s * 1e9)
    n = np.asarray(offloaded)
    if not overlap:
        return 2.0 * n * copy
    if n.ndim == 0:
        out = 0.0 * copy
        for k, count in windows(blocks, int(n)):
            out = out + count * (vmax(copy - k * t_forward, 0.0) + vmax(copy - k * t_backward, 0.0))
        return out
    q, r = np.divmod(blocks, np.maximum(n, 1))  # TE's windows per layout: r of q + 1 blocks, n - r of q
    side = lambda k: vmax(copy - k * t_forward, 0.0) + vmax(copy - k * t_backward, 0.0)  # noqa: E731
    return np.where(n > 0, r * side(q + 1) + (n - r) * side(q), 0.0)


def host_bytes(block_bytes: Any, offloaded: int, devices_per_node: int) -> Any:
    """Host memory one node needs for its devices' offloaded activations (pinned), bytes."""
    return devices_per_node * offloaded * block_bytes


def offload_problems(spec) -> list[str]:
    """Why ``spec`` cannot offload activations as asked, one line each ([] without offload or when it
    can): the framework must run it (framework.activation_offload; an executed run is xpar's engine, which runs
    it), Megatron-Core's rules (N below the blocks, pp 1, no recompute), which xpar's engine keeps: the estimate
    prices the offload at pp 1 without recompute, and a recomputed block saves only its input, nothing to offload),
    and, estimated, the host link figure."""
    n = offload_layers(spec)
    if n == 0:
        return []
    lay, fw, key = spec.layout, spec.framework, f"parallel.activation_offload_layers={n}"
    if spec.mode != "execute" and not getattr(fw, "activation_offload", False):  # executed: xpar's engine runs it
        return [f"{key}: framework={fw.name} runs no activation offload (framework.activation_offload=false; "
                "Megatron-Core's --cpu-offloading: framework=megatron_core); e.g. parallel.activation_offload_layers=0, "
                "or parallel.recompute=full to save the blocks' activations."]
    out = []
    if lay.pp > 1:
        out.append(f"{key} needs parallel.pp=1 (Megatron-Core: 'no support for Pipeline parallelism with CPU "
                   f"offloading'; xpar runs and prices it as Megatron-Core does, the first N blocks of the one stage), got "
                   f"pp={lay.pp}; e.g. parallel.pp=1, or parallel.activation_offload_layers=0.")
    if lay.recompute != "none":
        out.append(f"{key} needs parallel.recompute=none (Megatron-Core: 'CPU offloading does not work when "
                   f"activation recomputation is enabled'; a recomputed block keeps only its input, nothing to offload), got "
                   f"{lay.recompute}; e.g. parallel.recompute=none.")
    if not n < spec.model.n_layers:
        out.append(f"{key}: Megatron-Core offloads fewer blocks than the model has (0 <= N < "
                   f"{spec.model.n_layers}); e.g. parallel.activation_offload_layers={spec.model.n_layers - 1}.")
    if spec.mode != "execute" and not (spec.hardware.pcie_gb_per_s or 0) > 0:  # executed on a CPU: no link
        out.append(f"{key} needs the host link's bandwidth the copies are timed with, and hardware="
                   f"{spec.hardware.name} has no hardware.pcie_gb_per_s (null); e.g. hardware.pcie_gb_per_s=50 "
                   "(PCIe Gen5 x16, conf/hardware/h100_80gb_node.yaml).")
    return out
