"""Nothing logged is lost: every tracking record is first appended to a journal in the run's
output directory, and delivered to the store from there.

Two kinds of files, both JSON lines, both append-only:

- ``steps/rank<r>.jsonl``, written by each worker after every optimizer step (:class:`StepWriter`:
  step, loss or null, wall seconds, end time in ms). A file append costs microseconds: the step
  loop never waits for the tracking store.
- ``tracking_journal.jsonl``, written by the recording process (:class:`Journal`): numbered
  records (``start``, ``params``, ``tags``, ``metrics``, ``text``, ``artifact``, ``end``) and
  ``ack`` lines once the store took a record. :meth:`Journal.pending` is what the store has not
  taken; ``xpar sync <run dir>`` (:func:`xpar.tracking.sync`) replays it.

:func:`merged_steps` turns the per-rank step files into the run's per-step metrics the same way
:func:`xpar.report.summarize_measured` does at the end (loss: mean over the ranks that see one;
step time: max over ranks), for the steps every rank finished.
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


class StepWriter:
    """One worker's per-step records, appended to ``<out_dir>/steps/rank<rank>.jsonl``."""

    def __init__(self, out_dir: Path, rank: int):
        d = Path(out_dir) / STEPS_DIR
        d.mkdir(parents=True, exist_ok=True)
        self._f = open(d / f"rank{rank}.jsonl", "a", buffering=1)  # line-buffered: one write per step

    def __call__(self, step: int, loss: Optional[float], seconds: float) -> None:
        """Record that ``step`` ended now, taking ``seconds`` (wall), with this rank's ``loss``."""
        self._f.write(json.dumps({"step": step, "loss": loss, "time_s": seconds,
                                  "ts_ms": int(time.time() * 1000)}) + "\n")


def _read_lines(path: Path) -> list[dict]:
    """Complete JSON lines of ``path`` (a line being written is skipped)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def merged_steps(out_dir: Path, world: int, start: int = 0) -> list[tuple[int, Optional[float], float, int]]:
    """(step, mean loss or None, max step time in s, end time in ms) for each step >= ``start``
    that all ``world`` ranks recorded, in order, stopping at the first incomplete step."""
    ranks = [{r["step"]: r for r in _read_lines(Path(out_dir) / STEPS_DIR / f"rank{k}.jsonl")}
             for k in range(world)]
    out = []
    step = start
    while ranks and all(step in r for r in ranks):
        recs = [r[step] for r in ranks]
        losses = [x["loss"] for x in recs if x["loss"] is not None]
        out.append((step, sum(losses) / len(losses) if losses else None, max(x["time_s"] for x in recs),
                    max(x["ts_ms"] for x in recs)))
        step += 1
    return out


def step_points(steps: list[tuple[int, Optional[float], float, int]]) -> list[list]:
    """Metric points ``[key, value, timestamp ms, step]`` of merged steps."""
    points = []
    for step, loss, seconds, ts in steps:
        if loss is not None:
            points.append(["train/loss", loss, ts, step])
        points.append(["train/step_time_s", seconds, ts, step])
    return points


class Journal:
    """The run's tracking records, in ``<out_dir>/tracking_journal.jsonl``; thread-safe."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / JOURNAL_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        lines = _read_lines(self.path)
        self._records = [r for r in lines if "seq" in r and "kind" in r]
        self._acked = {r["ack"] for r in lines if "ack" in r}

    def _write(self, obj: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(obj) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def append(self, kind: str, **data) -> dict:
        """Append a record of ``kind`` (with ``data``); return it (its ``seq`` numbers it)."""
        with self._lock:
            rec = {"seq": len(self._records), "kind": kind, **data}
            self._write(rec)
            self._records.append(rec)
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
        steps = [p[3] for r in self.records("metrics") for p in r["points"] if p[0] == "train/step_time_s"]
        return max(steps) + 1 if steps else 0
