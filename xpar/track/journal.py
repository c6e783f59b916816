"""Nothing logged is lost: every tracking record is first appended to a journal in the run's
output directory, and delivered to the store from there.

Two kinds of files, both JSON lines, both append-only:

- ``steps/rank<r>.jsonl``, written by each worker after every optimizer step (:class:`StepWriter`:
  step, loss or null, wall seconds, end time in ms). A file append costs microseconds: the step
  loop never waits for the tracking store.
- ``tracking_journal.jsonl``, written by the recording process (:class:`Journal`): numbered
  records (``start``, ``params``, ``tags``, ``metrics``, ``text``, ``artifact``, ``end``) and
  ``ack`` lines once the store took a record. :meth:`Journal.pending` is what the store has not
  taken; ``xpar sync <run dir>`` (:func:`xpar.track.runs.sync`) replays it.

Design notes (what each step does and why, with sources): docs/concepts/design-notes.md.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Optional

JOURNAL_FILE = "tracking_journal.jsonl"
STEPS_DIR = "steps"


_WARNED: set = set()


def disk_warning(path: Path, e: OSError, consequence: str) -> str:
    """One stderr line (once per process) for a file of a run that cannot be written (``No space
    left on device``): what stops and what to do. Returns the reason."""
    import sys

    why = f"{e.strerror or e}"
    if not _WARNED:
        _WARNED.add(path)
        print(f"xpar: warning: cannot write {path} ({why}): {consequence}; free space there, or pass "
              f"hydra.run.dir=<a folder with space> next time.", file=sys.stderr, flush=True)
    return why


class StepWriter:
    """One worker's per-step records, appended to ``<out_dir>/steps/rank<rank>.jsonl``."""

    def __init__(self, out_dir: Path, rank: int):
        d = Path(out_dir) / STEPS_DIR
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"rank{rank}.jsonl"
        try:
            self._f = open(path, "a", buffering=1)  # line-buffered: one write per step
        except OSError as e:  # a full disk: the run goes on (see __call__)
            disk_warning(path, e, "live step metrics stop; every step is logged at the end")
            self._f = None

    def __call__(self, step: int, loss: Optional[float], seconds: float, grad_norm: Optional[float] = None,
                 lr: Optional[float] = None, live: Optional[dict] = None) -> None:
        """Record that ``step`` ended now, taking ``seconds`` (wall), with this rank's ``loss``,
        the pre-clip global gradient norm and the learning rate the step used (if known), and on
        every ``train.log_every``-th step its live ``step/*`` metrics (xpar.run.worker.live_metrics)."""
        rec = {"step": step, "loss": loss, "time_s": seconds, "ts_ms": int(time.time() * 1000)}
        rec.update({k: v for k, v in (("grad_norm", grad_norm), ("lr", lr), ("live", live)) if v is not None})
        if self._f is None:
            return
        try:
            self._f.write(json.dumps(rec) + "\n")
        except OSError as e:  # the run goes on; the parent logs every step from the gathered stats at the end
            disk_warning(Path(self._f.name), e, "live step metrics stop; every step is logged at the end")
            self._f = None


def _read_lines(path: Path) -> list[dict]:
    """Complete JSON lines of ``path`` (a line being written, or one that is not UTF-8 JSON, is skipped)."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    out = []
    for line in data.splitlines():
        try:
            rec = json.loads(line.decode())
        except ValueError:  # UnicodeDecodeError too: a damaged or foreign file
            continue
        if isinstance(rec, dict):  # a line `5` or `[1]` is no record (a damaged or foreign file)
            out.append(rec)
    return out


def _is_record(r: dict) -> bool:
    return isinstance(r.get("seq"), int) and isinstance(r.get("kind"), str)


def _is_ack(r: dict) -> bool:
    return isinstance(r.get("ack"), int) and not isinstance(r.get("ack"), bool)


class StepMerger:
    """Reads the workers' step files incrementally (each line once) and merges them into the
    run's per-step metrics: loss = mean over the ranks that see one, step time = max over ranks
    (as :func:`xpar.track.report.summarize_measured`), timestamp = the last rank's end of the step."""

    def __init__(self, out_dir: Path, world: int):
        self.files = [Path(out_dir) / STEPS_DIR / f"rank{k}.jsonl" for k in range(world)]
        self.offsets = [0] * world
        self.seen: list[dict] = [{} for _ in range(world)]

    def _read(self, k: int) -> None:
        try:
            with open(self.files[k], "rb") as f:
                f.seek(self.offsets[k])
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # complete lines only; a line being written waits
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
                self.seen[k][rec["step"]] = rec
            except (ValueError, KeyError):
                pass
        self.offsets[k] += end

    def new_steps(self, start: int) -> list[tuple]:
        """(step, mean loss or None, max step time in s, end time in ms, gradient norm or None, lr
        or None, live ``step/*`` metrics or None: :func:`merge_live`) for each step >= ``start`` that every rank recorded, in order, stopping at the
        first incomplete one. The norm (pre-clip, global: equal on every rank) and the lr are
        the first rank's that recorded them."""
        for k in range(len(self.files)):
            self._read(k)
        out, step = [], start
        while self.seen and all(step in r for r in self.seen):
            recs = [r.pop(step) for r in self.seen]
            losses = [x["loss"] for x in recs if x["loss"] is not None]
            first = lambda key: next((x[key] for x in recs if x.get(key) is not None), None)  # noqa: E731
            out.append((step, sum(losses) / len(losses) if losses else None, max(x["time_s"] for x in recs),
                        max(x["ts_ms"] for x in recs), first("grad_norm"), first("lr"), merge_live(recs)))
            step += 1
        return out


def merge_live(recs: list[dict]) -> Optional[dict]:
    """The live ``step/*`` metrics of one step over the ranks that logged them: memory the most
    loaded rank's, throughput the slowest rank's (the step ends with it). None if none logged."""
    lives = [x["live"] for x in recs if x.get("live")]
    if not lives:
        return None
    keys = {k for live in lives for k in live}
    return {k: (max if "memory" in k else min)(live[k] for live in lives if k in live) for k in sorted(keys)}


def merged_steps(out_dir: Path, world: int, start: int = 0) -> list[tuple]:
    """:meth:`StepMerger.new_steps` of the whole files, from ``start``."""
    return StepMerger(out_dir, world).new_steps(start)


def step_points(steps: list[tuple]) -> list[list]:
    """Metric points ``[key, value, timestamp ms, step]`` of merged steps (:meth:`StepMerger.new_steps`):
    train/loss, train/step_time_s, train/grad_norm (pre-clip global norm), train/lr (used by the step)."""
    points = []
    for step, loss, seconds, ts, *rest in steps:
        values = {"train/loss": loss, "train/step_time_s": seconds}
        values.update(zip(("train/grad_norm", "train/lr"), rest[:2]))
        values.update(rest[2] if len(rest) > 2 and rest[2] else {})
        points += [[k, v, ts, step] for k, v in values.items() if v is not None]
    return points


class Journal:
    """The run's tracking records, in ``<out_dir>/tracking_journal.jsonl``; thread-safe."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / JOURNAL_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.disk_error: Optional[str] = None
        """Why the journal file stopped being written (a full disk), or None."""
        lines = _read_lines(self.path)
        self._records = [r for r in lines if _is_record(r)]
        self._acked = {r["ack"] for r in lines if _is_ack(r)}
        self._steps = 0
        for r in self._records:
            self._count_steps(r)

    def _count_steps(self, rec: dict) -> None:
        if rec["kind"] == "metrics" and isinstance(rec.get("points"), list):
            steps = [p[3] + 1 for p in rec["points"] if isinstance(p, list) and len(p) == 4
                     and p[0] == "train/step_time_s" and isinstance(p[3], int)]
            self._steps = max([self._steps] + steps)

    def _write(self, obj: dict) -> None:
        """Append ``obj``; on a full or failing disk, warn once and keep it in memory only (the
        store can still take it; ``xpar sync`` then cannot)."""
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(obj) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            self.disk_error = disk_warning(self.path, e, "the tracking journal keeps records in memory only")

    def append(self, kind: str, **data) -> dict:
        """Append a record of ``kind`` (with ``data``); return it (its ``seq`` numbers it)."""
        with self._lock:
            rec = {"seq": len(self._records), "kind": kind, **data}
            self._write(rec)
            self._records.append(rec)
            self._count_steps(rec)
            return rec

    def ack(self, rec: dict) -> None:
        """The store took ``rec``."""
        with self._lock:
            if rec["seq"] not in self._acked:
                self._write({"ack": rec["seq"]})
                self._acked.add(rec["seq"])

    def pending(self) -> list[dict]:
        """Records the store has not taken, in order."""
        with self._lock:
            return [r for r in self._records if r["seq"] not in self._acked]

    def records(self, kind: Optional[str] = None) -> list[dict]:
        with self._lock:
            return [r for r in self._records if kind is None or r["kind"] == kind]

    def steps_journaled(self) -> int:
        """One past the last step whose metrics are journaled (0 if none)."""
        return self._steps


def unacknowledged(out_dir: Path) -> int:
    """How many records of the run in ``out_dir`` its store has not acknowledged: pending journal
    records and steps every worker finished that are not journaled yet (0 without a journal)."""
    out_dir = Path(out_dir)
    if not (out_dir / JOURNAL_FILE).is_file():
        return 0
    journal = Journal(out_dir)
    start = journal.records("start")
    world = start[0].get("world", 0) if start and isinstance(start[0].get("world"), int) else 0
    steps = merged_steps(out_dir, world, journal.steps_journaled()) if world else []
    return len(journal.pending()) + len(steps)
