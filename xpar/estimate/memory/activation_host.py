"""The bytes an activation offload moves and holds (``parallel.activation_offload_layers``,
:mod:`xpar.estimate.memory.activation_offload`): one block's saved bytes (what a group copies) and the host
memory a node needs for them. Units: bytes.
"""
from __future__ import annotations

from typing import Optional

from xpar.estimate.memory.activation_offload import host_bytes, offload_layers
from xpar.estimate.memory.activations import layer_bytes
from xpar.estimate.memory.offload import devices_per_node


def block_bytes_of(spec, o) -> float:
    """One block's saved bytes for one micro-batch under no recompute (what a group copies) of ``spec``
    (a RunSpec) under ``o`` (MemoryOptions): :func:`xpar.estimate.memory.activations.layer_bytes`' ``none``."""
    return float(layer_bytes(spec, o, 0.0)["none"])


def host_need(spec, o) -> Optional[dict]:
    """``host_bytes`` (per node) and ``block_bytes`` of ``spec``'s offloaded activations; None without offload."""
    n = offload_layers(spec)
    if n == 0:
        return None
    b = block_bytes_of(spec, o)
    return {"block_bytes": b, "host_bytes": host_bytes(b, n, devices_per_node(spec.hardware))}
