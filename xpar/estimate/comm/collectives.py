"""Time of one collective on a group of devices: an alpha-beta model with the group's topology.

    time = alpha_base + (steps - inter_steps) alpha_intra + inter_steps alpha_inter + bus_bytes / bus_bw

Source: NCCL's cost model (src/graph/tuning.cc ``ncclTopoTuneModel``): ring, double binary tree
(all-reduce), 'nccl' (the faster of the two), hierarchical (intra, inter, intra node). Bus
bandwidth: the intra-node link inside a node; across nodes the NICs a node's devices share
(:func:`nic_share`), times ``link_efficiency``. A calibrated CPU preset replaces the model inside
a node by its measured ring-step curves (``hardware.ring_step_us_by_bytes``, :func:`measured_time`);
every collective also waits ``hardware.sync_wait_us`` (0 on GPU presets).

Units: seconds, bytes. Checked against tests/data/nccl_tests_busbw.csv; derivation and checks:
docs/concepts/cost-model-derivations.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from xpar.config.schema import HardwareConfig
from xpar.estimate.comm.volume import ring_factor

TREE_BUS_FACTOR = 0.9
"""NCCL tuning.cc: tree bus bandwidth = 0.9 x the ring's."""
TREE_MAX_BUS_GB_PER_S = 80.0
"""NCCL tuning.cc ``maxTreeBw`` beyond two nodes (Simple protocol), GB/s."""
ALGORITHMS = ("nccl", "ring", "tree", "hierarchical")
WHOLE_MESSAGE = ("send_recv", "broadcast")
"""Collectives whose every step carries the whole message (a point-to-point send; gloo's
broadcast, root to each other rank in turn), not 1/n of it (:func:`measured_time`)."""


@dataclass(frozen=True)
class Group:
    """A process group: ``size`` ranks, ``per_node`` of them in each node."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.size / self.per_node))


def group_of(hw: HardwareConfig, size: int, stride: int) -> Group:
    """The group of ``size`` ranks ``stride`` apart in rank order (tp innermost, then dp,
    then pp; xpar.config.layout), on nodes of ``hw.devices_per_node`` consecutive ranks."""
    dpn = int(hw.devices_per_node) if str(hw.devices_per_node).isdigit() else 1
    if size * stride <= dpn:
        return Group(size, size)
    return Group(size, max(1, min(size, dpn // stride)))


def nic_share(hw: HardwareConfig) -> float:
    """NICs per device when every device of a node crosses nodes at once: min(1, NICs per
    node / devices per node); 1 where either is unknown (module docstring)."""
    dpn = int(hw.devices_per_node) if str(hw.devices_per_node).isdigit() else 0
    if not dpn or not hw.nics_per_node:
        return 1.0
    return min(1.0, hw.nics_per_node / dpn)


def _bw(hw: HardwareConfig, group: Group) -> Optional[float]:
    """Ring bus bandwidth of ``group`` in bytes/s (module docstring); None if unknown."""
    if hw.intra_node_gb_per_s is None:
        return None
    intra = hw.intra_node_gb_per_s * 1e9 * hw.link_efficiency
    if group.nodes == 1 or hw.inter_node_gb_per_s is None:
        return intra
    return min(intra, group.per_node * nic_share(hw) * hw.inter_node_gb_per_s * 1e9 * hw.link_efficiency)


def ring_steps(collective: str, n: int) -> int:
    """Sequential steps of a ring over n ranks: 2 (n - 1) for an all-reduce, n - 1 for an
    all-gather or a reduce-scatter, 1 for a point-to-point message (``send_recv``)."""
    if collective == "send_recv":
        return 1
    return 2 * (n - 1) if collective == "allreduce" else n - 1


def ring_time(hw: HardwareConfig, collective: str, nbytes: float, group: Group) -> float:
    """Seconds of a ring ``collective`` ('allreduce', 'allgather', 'reduce_scatter') of a
    payload of ``nbytes`` (all-reduced buffer, gathered output, reduce-scattered input)."""
    n = group.size
    bw = _bw(hw, group)
    if n <= 1 or bw is None or nbytes <= 0:
        return 0.0
    steps, inter = ring_steps(collective, n), ring_steps(collective, group.nodes)
    lat = hw.collective_latency_us + (steps - inter) * hw.intra_node_latency_us + inter * hw.inter_node_latency_us
    return lat * 1e-6 + ring_factor(collective, n) * nbytes / bw


def tree_allreduce_time(hw: HardwareConfig, nbytes: float, group: Group) -> float:
    """Seconds of NCCL's tree all-reduce (module docstring)."""
    bw = _bw(hw, group)
    if group.size <= 1 or bw is None or nbytes <= 0:
        return 0.0
    bw = TREE_BUS_FACTOR * bw
    if group.nodes > 2:
        bw = min(bw, TREE_MAX_BUS_GB_PER_S * 1e9)
    lat = hw.collective_latency_us + 2 * ((group.per_node - 1) * hw.intra_node_latency_us
                                         + math.log2(group.nodes) * hw.inter_node_latency_us)
    return lat * 1e-6 + 2 * nbytes / bw


def hierarchical_time(hw: HardwareConfig, collective: str, nbytes: float, group: Group) -> float:
    """Seconds of a two-level collective: intra-node phase(s) over ``per_node`` ranks, one
    inter-node phase over ``nodes`` ranks on 1/per_node of the payload (module docstring)."""
    k, n_nodes = group.per_node, group.nodes
    if n_nodes == 1 or k == 1:
        return ring_time(hw, collective, nbytes, group)
    intra, inter = Group(k, k), Group(n_nodes, 1)
    # the k inter-node rings run in parallel, and with them those of the node's other groups: a
    # NIC's share per ring (nic_share)
    share = nic_share(hw)
    t_inter = ring_time(hw, collective, nbytes / k, inter)
    lat_inter = ring_time(hw, collective, 0.0, inter)
    t_inter = lat_inter + (t_inter - lat_inter) / share if t_inter else 0.0
    if collective == "allreduce":
        return ring_time(hw, "reduce_scatter", nbytes, intra) + t_inter + ring_time(hw, "allgather", nbytes, intra)
    return ring_time(hw, collective, nbytes, intra) + t_inter


def curve_at(points: list, x: float) -> float:
    """A measured curve ``points`` ([x, y] pairs, any order) at ``x``: linear between the
    neighbouring points, the smallest x's y below it (a fixed latency), the last segment's line
    extended above the largest (at least the largest y)."""
    pts = sorted((float(a), float(b)) for a, b in points)
    if len(pts) == 1 or x <= pts[0][0]:
        return pts[0][1]
    i = next((k for k in range(1, len(pts)) if x <= pts[k][0]), len(pts) - 1)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, pts[-1][1]) if x > pts[-1][0] else y


def measured_time(hw: HardwareConfig, collective: str, nbytes: float, group: Group) -> Optional[float]:
    """Seconds of ``collective`` on ``group`` from the machine's measured ring-step curve
    (``hardware.ring_step_us_by_bytes``, written by ``xpar calibrate``): :func:`ring_steps` x
    the curve at the chunk one step carries (``nbytes`` / group size; the message itself for
    'send_recv' and 'broadcast': gloo's root sends it whole to each of the n - 1 others). None
    where the curve does not apply: no curve for this collective, or a group
    across nodes (the curve is measured inside one)."""
    curve = (hw.ring_step_us_by_bytes or {}).get(collective)
    if not curve or group.nodes > 1:
        return None
    chunk = nbytes if collective in WHOLE_MESSAGE else nbytes / group.size
    return ring_steps(collective, group.size) * curve_at(curve, chunk) * 1e-6


def collective_time(hw: HardwareConfig, collective: str, nbytes: float, group: Group,
                    algorithm: str = "nccl") -> float:
    """Seconds of one ``collective`` of ``nbytes`` payload on ``group`` with ``algorithm``
    (one of :data:`ALGORITHMS`; see the module docstring); the machine's measured curve where it
    has one (:func:`measured_time`, whatever the algorithm: it is the backend's own).

    Raises:
        ValueError: an unknown ``algorithm``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown collective algorithm {algorithm!r}; one of {ALGORITHMS}")
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    return _unwaited_time(hw, collective, nbytes, group, algorithm) + hw.sync_wait_us * 1e-6


def _unwaited_time(hw: HardwareConfig, collective: str, nbytes: float, group: Group, algorithm: str) -> float:
    """:func:`collective_time` without the wait for the peers (``hardware.sync_wait_us``)."""
    measured = measured_time(hw, collective, nbytes, group)
    if measured is not None:
        return measured
    if getattr(hw, "sharp", False) and collective in SHARP_COLLECTIVES:  # in-network reduction where faster
        return min(_switched_time(hw, collective, nbytes, group, algorithm), sharp_time(hw, collective, nbytes, group))
    return _switched_time(hw, collective, nbytes, group, algorithm)


def _switched_time(hw: HardwareConfig, collective: str, nbytes: float, group: Group, algorithm: str) -> float:
    """Seconds of ``collective`` by ``algorithm`` over the links (rings, trees, two levels)."""
    if algorithm == "hierarchical":
        return hierarchical_time(hw, collective, nbytes, group)
    ring = ring_time(hw, collective, nbytes, group)
    if collective != "allreduce" or algorithm == "ring":
        return ring
    tree = tree_allreduce_time(hw, nbytes, group)
    return tree if algorithm == "tree" else min(ring, tree)


SHARP_COLLECTIVES = ("allreduce", "reduce_scatter")
"""Collectives a SHARP switch reduces in the network (hardware.sharp)."""


def sharp_time(hw: HardwareConfig, collective: str, nbytes: float, group: Group) -> float:
    """Seconds of an all-reduce or reduce-scatter reduced in the network (``hardware.sharp``: NVLink
    SHARP / InfiniBand SHARP, NCCL's NVLS and CollNet algorithms): each rank sends its buffer to the
    switch once and reads its reduced part back (all-reduce: ``nbytes`` over the ring's bus bandwidth,
    not 2 (n - 1) / n of it; reduce-scatter: (n - 1) / n as the ring, its data already crossing once),
    one hop up and one down (the inter-node latency across nodes) instead of the ring's steps."""
    bw = _bw(hw, group)
    if group.size <= 1 or bw is None or nbytes <= 0:
        return 0.0
    hop = hw.inter_node_latency_us if group.nodes > 1 else hw.intra_node_latency_us
    share = 1.0 if collective == "allreduce" else ring_factor(collective, group.size)
    return (hw.collective_latency_us + 2 * hop) * 1e-6 + share * nbytes / bw


def p2p_time(hw: HardwareConfig, nbytes: float, across_nodes: bool) -> float:
    """Seconds of one point-to-point send of ``nbytes`` between neighbouring pipeline stages:
    one step's latency (``hardware.p2p_latency_us`` where measured) plus bytes over one device's
    link (its share of the node's NICs when ``across_nodes``: :func:`nic_share`); inside a node,
    the measured send/recv curve where the machine has one (:func:`measured_time`)."""
    if nbytes <= 0:
        return 0.0
    wait = hw.sync_wait_us * 1e-6
    measured = None if across_nodes else measured_time(hw, "send_recv", nbytes, Group(2, 2))
    if measured is not None:
        return measured + wait
    if hw.intra_node_gb_per_s is None:
        return 0.0
    if across_nodes and hw.inter_node_gb_per_s is not None:  # every device of the node sends at once
        bw, lat = hw.inter_node_gb_per_s * nic_share(hw), hw.inter_node_latency_us
    else:
        bw, lat = hw.intra_node_gb_per_s, hw.intra_node_latency_us
    lat = hw.collective_latency_us + lat if hw.p2p_latency_us is None else hw.p2p_latency_us
    return lat * 1e-6 + nbytes / (bw * 1e9 * hw.link_efficiency) + wait
