"""Measured collectives of an executed run: per kind and mesh axis, calls, payload bytes and seconds.

:class:`CollectiveLog` wraps, for the time of each step, the ``torch.distributed`` functions the dp
axis's wrappers (FSDP2, ZeroRedundancyOptimizer, xpar's zero-bubble reduction) and expert
parallelism's dispatch call from Python, and records each call unchanged (same arguments, same
result). DDP's gradient all-reduce comes from torch's DDP logger (:func:`ddp_comm`), tp's from
:class:`xpar.parallel.tensor.TPCommCounter`. Units: bytes, seconds.

Design notes (what each step does and why, with sources): docs/concepts/design-notes.md.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

WORK = dist.distributed_c10d.Work
"""torch's collective handle class, whose ``wait`` :class:`CollectiveLog` times."""
KINDS = {"all_gather_single": "allgather", "all_gather_into_tensor": "allgather",
         "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
         "all_reduce": "allreduce", "broadcast": "broadcast", "all_to_all_single": "all_to_all"}
"""torch.distributed functions wrapped, and the collective kind each issues."""
SCALAR = "scalar"
"""The kind under which one-element collectives are recorded (the global gradient norm's square
sums, the non-finite check): control, not the wrappers' traffic that the estimate counts."""
_PAYLOAD_ARG = {"allgather": ("output_tensor", 0), "reduce_scatter": ("input", 1), "allreduce": ("tensor", 0),
                "broadcast": ("tensor", 0), "all_to_all": ("input", 1)}
_GROUP_ARG = {"all_gather_single": 2, "all_gather_into_tensor": 2, "reduce_scatter_single": 3,
              "reduce_scatter_tensor": 3, "all_reduce": 2, "broadcast": 2, "all_to_all_single": 4}


def _payload(fn: str, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(payload bytes, elements) of one call of ``torch.distributed.<fn>``."""
    name, pos = _PAYLOAD_ARG[KINDS[fn]]
    t = kwargs.get(name, args[pos] if len(args) > pos else None)
    return (t.numel() * t.element_size(), t.numel()) if isinstance(t, torch.Tensor) else (0, 0)


class CollectiveLog:
    """``with CollectiveLog({'dp': group}) as log:`` ... ``log.end_step()`` after each step; then
    :meth:`per_step` (means over the steps from ``first``). Records only collectives on the
    groups given (by mesh axis name); other groups' calls pass through unrecorded."""

    def __init__(self, groups: dict[str, Any], core_clock: Optional[Callable[[], tuple[float, float]]] = None):
        self.axes = {id(g): a for a, g in groups.items() if g is not None}
        self.core_clock = core_clock
        """() -> (seconds this thread ran on a core, seconds it waited for one): read around each
        logged call, so that the step's own split does not count them twice (:attr:`inside`)."""
        self.inside = [0.0, 0.0]
        """Of this step so far, core and core-wait seconds spent inside logged calls and waits."""
        self.steps: list[dict[tuple[str, str], list[float]]] = []
        self._current: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0])
        self._intervals: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
        self._saved: dict[str, Any] = {}
        self._pending: dict[int, tuple[Any, list, tuple[str, str], float]] = {}
        """id(work) -> (work, its record, its key, issue time) of async calls not yet waited."""

    def __enter__(self) -> "CollectiveLog":
        for fn in KINDS:
            if hasattr(dist, fn):
                self._saved[fn] = getattr(dist, fn)
                setattr(dist, fn, self._wrap(fn, self._saved[fn]))
        self._saved["Work.wait"] = WORK.wait
        WORK.wait = self._timed_wait(WORK.wait)  # FSDP2 checks isinstance(work, Work): time the class's wait
        return self

    def __exit__(self, *exc) -> None:
        WORK.wait = self._saved.pop("Work.wait", WORK.wait)
        for fn, original in self._saved.items():
            setattr(dist, fn, original)
        self._saved.clear()

    def _timed_wait(self, original):
        def wait(work, *args, **kwargs):
            entry = self._pending.pop(id(work), None)
            if entry is None:
                return original(work, *args, **kwargs)
            c0 = self.core_clock() if self.core_clock else None
            w0 = time.perf_counter()
            try:
                return original(work, *args, **kwargs)
            finally:
                w1 = time.perf_counter()
                self._add_inside(c0)
                entry[1][2] += w1 - w0
                self._intervals[entry[2]].append((entry[3], w1))
        return wait

    def _axis(self, fn: str, args: tuple, kwargs: dict) -> Optional[str]:
        group = kwargs.get("group", args[_GROUP_ARG[fn]] if len(args) > _GROUP_ARG[fn] else None)
        return self.axes.get(id(group))

    def _wrap(self, fn: str, original):
        kind = KINDS[fn]

        def wrapped(*args, **kwargs):
            axis = self._axis(fn, args, kwargs)
            if axis is None:
                return original(*args, **kwargs)
            nbytes, numel = _payload(fn, args, kwargs)
            key = (kind if numel > 1 else SCALAR, axis)
            rec = self._current[key]
            rec[0] += 1
            rec[1] += nbytes
            c0 = self.core_clock() if self.core_clock else None
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            t1 = time.perf_counter()
            self._add_inside(c0)
            rec[2] += t1 - t0
            if out is None or not kwargs.get("async_op", False):
                self._intervals[key].append((t0, t1))
            else:  # timed when waited (:meth:`_timed_wait`)
                self._pending[id(out)] = (out, rec, key, t0)
            return out
        return wrapped

    def _add_inside(self, before: Optional[tuple[float, float]]) -> None:
        if before is not None:
            after = self.core_clock()
            self.inside[0] += after[0] - before[0]
            self.inside[1] += after[1] - before[1]

    def end_step(self) -> tuple[float, float]:
        """Close the step: its records, with the issued seconds of each kind (union of intervals).
        Returns the step's :attr:`inside` (core seconds, core-wait seconds) and resets it."""
        for key, rec in self._current.items():
            rec[3] = _union(self._intervals.get(key, []))
        self.steps.append(dict(self._current))
        self._current = defaultdict(lambda: [0, 0, 0.0, 0.0])
        self._intervals.clear()
        self._pending.clear()
        inside, self.inside = tuple(self.inside), [0.0, 0.0]
        return inside

    def exposed_per_step(self) -> list[float]:
        """Exposed seconds of every logged collective, per closed step."""
        return [sum(rec[2] for rec in step.values()) for step in self.steps]

    def per_step(self, first: int = 0) -> dict[str, float]:
        """Medians over steps ``first``.. of ``comm/<axis>_<kind>_calls`` and ``_bytes`` (payload per
        step per device) and ``time/comm_<axis>_<kind>_exposed_s`` / ``_issued_s``: the statistic of
        the reported step time (xpar.track.report.summarize_measured), robust to an odd slow step."""
        steps = self.steps[first:] or self.steps[-1:]
        keys = sorted({k for s in steps for k in s})
        out: dict[str, float] = {}
        for kind, axis in keys:
            recs = [s.get((kind, axis), [0, 0, 0.0, 0.0]) for s in steps]
            for i, name in enumerate(("comm/{a}_{k}_calls", "comm/{a}_{k}_bytes", "time/comm_{a}_{k}_exposed_s",
                                      "time/comm_{a}_{k}_issued_s")):
                out[name.format(a=axis, k=kind)] = float(statistics.median(r[i] for r in recs))
        return out


def _union(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``intervals`` ((start, end) pairs)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def ddp_comm(chunks: list) -> dict[str, float]:
    """The gradient all-reduce of DDP-wrapped ``chunks`` (ZeRO-0/1), which :class:`CollectiveLog`
    cannot see, from torch's DDP logger (``DistributedDataParallel._get_ddp_logging_data``:
    ``bucket_sizes`` in bytes, ``avg_backward_comm_time`` and
    ``avg_backward_compute_comm_overlap_time`` in ns, averaged over the iterations it samples):
    one all-reduce per bucket per step (xpar syncs the last micro-batch only), under the same
    names as :meth:`CollectiveLog.per_step` (axis ``dp``); exposed = issued - overlapped. Empty
    without a DDP chunk."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    out = {"comm/dp_allreduce_calls": 0.0, "comm/dp_allreduce_bytes": 0.0,
           "time/comm_dp_allreduce_exposed_s": 0.0, "time/comm_dp_allreduce_issued_s": 0.0}
    found = False
    for chunk in chunks:
        if not isinstance(chunk, DDP):
            continue
        found, data = True, chunk._get_ddp_logging_data()
        sizes = [int(x) for x in str(data.get("bucket_sizes", "")).split(",") if x.strip()]
        issued = data.get("avg_backward_comm_time", 0) / 1e9
        out["comm/dp_allreduce_calls"] += len(sizes)
        out["comm/dp_allreduce_bytes"] += sum(sizes)
        out["time/comm_dp_allreduce_issued_s"] += issued
        out["time/comm_dp_allreduce_exposed_s"] += max(0.0, issued - data.get("avg_backward_compute_comm_overlap_time", 0) / 1e9)
    return out if found else {}
