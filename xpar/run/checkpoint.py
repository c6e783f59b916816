"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), and resuming from them.

A checkpoint is one directory ``<train.checkpoint_dir>/step_<k>`` (k = optimizer steps done)
holding DCP's files and ``xpar.json``, written by rank 0 last: a directory without it is
incomplete (the run died while saving) and is never resumed from.

What is saved, so that a resumed run continues exactly:

Design notes (what each step does and why, with sources): docs/concepts/design-notes.md.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from xpar.parallel.torch_internals import dcp_metadata_globals
from xpar.track.journal import merged_steps, STEPS_DIR, JOURNAL_FILE, Journal

CHECKPOINTS = "checkpoints"
"""Default checkpoint directory under a run's output directory."""
META_FILE = "xpar.json"
STEP_PREFIX = "step_"


class CheckpointError(ValueError):
    """A resume that cannot work: one line saying why and what works."""


@dataclass
class History:
    """This rank's record of the steps before a resumed run's first step (``step`` of them):
    loss (rank 0 only, else None; the journal's merged loss), step time (s), end time (ms),
    gradient norms and lrs (equal on every rank)."""

    step: int
    losses: list = field(default_factory=list)
    times: list = field(default_factory=list)
    ts_ms: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)
    lrs: list = field(default_factory=list)


# -- where checkpoints are ----------------------------------------------------------------
def step_dir(root: Path, step: int) -> Path:
    """The directory of the checkpoint after ``step`` optimizer steps."""
    return Path(root) / f"{STEP_PREFIX}{step:07d}"


def checkpoint_root(train, out_dir: Path) -> Path:
    """``train.checkpoint_dir`` or ``<out_dir>/checkpoints`` (train: a TrainConfig)."""
    return Path(train.checkpoint_dir) if train.checkpoint_dir else Path(out_dir) / CHECKPOINTS


def read_meta(path: Path) -> dict:
    """``xpar.json`` of the checkpoint directory ``path``.

    Raises:
        CheckpointError: not there or unreadable (an incomplete checkpoint), or not xpar's.
    """
    try:
        meta = json.loads((Path(path) / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a complete checkpoint ({META_FILE}: {type(e).__name__})") from None
    if not (isinstance(meta, dict) and isinstance(meta.get("step"), int) and not isinstance(meta["step"], bool)
            and meta["step"] >= 0 and isinstance(meta.get("model"), dict)):
        raise CheckpointError(f"{path}/{META_FILE} is not one xpar wrote (it needs an integer 'step' >= 0 and a "
                              f"'model' mapping); resume from a checkpoint xpar saved, e.g. train.resume=latest.")
    return meta


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories directly in ``root`` (or ``root/checkpoints``), oldest first."""
    found = []
    for d in (Path(root), Path(root) / CHECKPOINTS):
        if d.is_dir():
            found += [p for p in d.glob(f"{STEP_PREFIX}*") if (p / META_FILE).is_file()]
    return sorted(found, key=_saved_at)


def _saved_at(p: Path) -> float:
    try:
        return float(json.loads((p / META_FILE).read_text()).get("saved_at", 0.0))
    except (OSError, ValueError):
        return 0.0


def find_checkpoint(resume: str, checkpoint_dir: Optional[str], start_dir: Path, accept=None) -> Path:
    """The checkpoint directory ``train.resume`` names: a ``step_<k>`` directory itself, the
    newest in a checkpoints or run output directory, or for ``latest`` the newest under
    ``checkpoint_dir`` (if set), else under ``<start_dir>/outputs`` and ``<start_dir>/multirun``
    -- the newest whose ``xpar.json`` ``accept(meta)`` takes (this run's model), if any.

    Raises:
        CheckpointError: no such directory, or no complete checkpoint there.
    """
    if resume == "latest":
        roots = [Path(checkpoint_dir)] if checkpoint_dir else [start_dir / "outputs", start_dir / "multirun"]
        found = [p.parent for r in roots if r.is_dir() for p in r.rglob(f"{STEP_PREFIX}*/{META_FILE}")]
        if not found:
            raise CheckpointError(
                f"train.resume=latest: no complete checkpoint under {' or '.join(str(r) for r in roots)}; "
                f"save some first with train.checkpoint_every=<steps>, or give train.resume=<checkpoint dir>.")
        found.sort(key=_saved_at, reverse=True)
        return next((p for p in found if accept is None or accept(read_meta(p))), found[0])
    path = Path(resume).expanduser()
    if not path.is_absolute():
        path = start_dir / path
    if not path.is_dir():
        raise CheckpointError(f"train.resume={resume}: no such directory; give a step_<k> checkpoint "
                              f"directory, a run output directory, or train.resume=latest.")
    if (path / META_FILE).is_file():
        return path
    found = complete_checkpoints(path)
    if not found:
        raise CheckpointError(f"train.resume={resume}: no complete checkpoint in {path} (no "
                              f"{STEP_PREFIX}<k>/{META_FILE}); give a run saved with train.checkpoint_every=<steps>, "
                              f"or train.resume=latest.")
    return found[-1]


def verify_metadata(path: Path) -> None:
    """Unpickle DCP's ``.metadata`` of the checkpoint ``path`` admitting only the globals DCP
    writes there (:func:`xpar.parallel.torch_internals.dcp_metadata_globals`, torch dtypes): DCP's own
    reader then unpickles it without restriction, so anything else (a crafted file's
    ``os.system``) is refused before it can run. DCP reads the tensors with
    ``torch.load(weights_only=True)``.

    Raises:
        CheckpointError: the file is missing, unreadable or names another global.
    """
    import pickle

    import torch

    allowed = dcp_metadata_globals()

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in allowed:
                return allowed[(module, name)]
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            raise pickle.UnpicklingError(f"global {module}.{name} is not DCP metadata")

    try:
        with open(Path(path) / ".metadata", "rb") as f:
            metadata = Restricted(f).load()
    except Exception as e:  # missing, truncated, or a global outside the list
        raise CheckpointError(f"{path}/.metadata cannot be loaded safely ({type(e).__name__}: "
                              f"{str(e)[:200]}); resume from a checkpoint xpar wrote.") from None
    verify_files(Path(path), metadata)


def verify_files(path: Path, metadata) -> None:
    """Every byte range DCP's metadata points at (``storage_data``: file, offset, length) lies
    inside a file that exists: a deleted or truncated shard is refused before any worker starts.

    Raises:
        CheckpointError: naming the first missing or short file.
    """
    need: dict[str, int] = {}
    for info in getattr(metadata, "storage_data", {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        f = path / name
        have = f.stat().st_size if f.is_file() else None
        if have is None or have < size:
            state = "is missing" if have is None else f"has {have} bytes of the {size} its metadata names"
            raise CheckpointError(f"{f} {state}: the checkpoint is damaged; resume from another one "
                                  f"(train.resume=<step dir>) or from the start (drop train.resume).")


# -- state dicts ---------------------------------------------------------------------------
def _container(chunks):
    from torch import nn
    return nn.ModuleDict({str(i): c for i, c in enumerate(chunks)})


def _canonical(fqn: str) -> str:
    """``<chunk index>.<name>`` (the container's name) -> ``<name>`` (the model's)."""
    return fqn.split(".", 1)[1]


def _state(engine) -> tuple[list[dict], dict, dict]:
    """(model state by name per chunk, the optimizer state dict as DCP's API returns it, the optimizer
    tensors by ``<name>.<state>``). Initializes an empty optimizer state first (DCP's
    zero-gradient step at lr 0, which leaves the parameters unchanged)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = [get_model_state_dict(chunk) for chunk in engine.chunks]
    optim = get_optimizer_state_dict(_container(engine.chunks), engine.optimizer)
    tensors = {f"{_canonical(fqn)}.{k}": v for fqn, states in optim["state"].items() for k, v in states.items()}
    return model, optim, tensors


def _merged(per_chunk: list[dict]) -> dict:
    return {k: v for sd in per_chunk for k, v in sd.items()}


def save(engine, root: Path, step: int, meta) -> Path:
    """Save the checkpoint after ``step`` optimizer steps into ``step_dir(root, step)``.
    Collective: every rank calls it. ``meta()`` (called on rank 0 once every rank's files are
    written, so every rank has recorded the step): the history and run fields of
    ``xpar.json``. Returns the directory."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = step_dir(root, step)
    model, _, tensors = _state(engine)
    dcp.save({"model": _merged(model), "optim": tensors}, checkpoint_id=str(path))
    if dist.get_rank() == 0:  # dcp.save returns after every rank's files are written
        meta = dict(meta(), step=step, saved_at=time.time())
        tmp = path / f".{META_FILE}.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.replace(path / META_FILE)
    return path


def load(engine, path: Path) -> dict:
    """Load the checkpoint in ``path`` into ``engine`` (model, optimizer states, the lr schedule
    at its step, gradient norms so far); DCP reshards when the layout differs. Collective. Returns its ``xpar.json``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    meta = read_meta(path)
    verify_metadata(path)
    model, optim, tensors = _state(engine)
    dcp.load({"model": _merged(model), "optim": tensors}, checkpoint_id=str(path))  # in place
    for chunk, state in zip(engine.chunks, model):
        set_model_state_dict(chunk, state)
    optim["state"] = {fqn: {k: tensors[f"{_canonical(fqn)}.{k}"] for k in states}
                      for fqn, states in optim["state"].items()}
    set_optimizer_state_dict(_container(engine.chunks), engine.optimizer, optim)
    if engine.scheduler is not None:
        from xpar.parallel.optim import restore_lr_scheduler  # lazy: torch (xpar.LAZY_IMPORTS)
        restore_lr_scheduler(engine.scheduler, engine.optimizer, engine.spec.train, meta["step"])
    engine.grad_norms[:] = list(meta["history"]["grad_norms"])
    return meta


def history_of(meta: dict, rank: int) -> History:
    """This rank's :class:`History` from a checkpoint's ``xpar.json``: rank 0 carries the
    merged losses, every rank the merged step times (so that merging again gives them back)."""
    h, k = meta["history"], meta["step"]
    losses = list(h["losses"]) if rank == 0 else [None] * k
    return History(step=k, losses=losses, times=list(h["times"]), ts_ms=list(h["ts_ms"]),
                   grad_norms=list(h["grad_norms"]), lrs=list(h["lrs"]))


def run_meta(spec, out_dir: Path) -> dict:
    """The run fields of ``xpar.json``: output directory, model shape, layout, data shape."""
    lay = spec.layout
    return {"out_dir": str(Path(out_dir).resolve()), "world_size": spec.world_size, "model": asdict(spec.model),
            "layout": {"dp": spec.dp, "tp": spec.tp, "pp": spec.pp, "cp": spec.cp, "zero_stage": lay.zero_stage,
                       "virtual_stages": lay.virtual_stages, "schedule": lay.schedule},
            "data": {"seed": spec.train.seed, "global_batch_size": spec.train.global_batch_size,
                     "seq_len": spec.train.seq_len, "kind": spec.data.kind, "path": spec.data.path}}


def checkpoint_env() -> dict:
    """Environment fields recorded with a checkpoint (torch version, host)."""
    import socket

    import torch
    return {"torch": torch.__version__, "host": socket.gethostname(), "pid": os.getpid()}


# -- the step loop's side -------------------------------------------------------------------
class Saver:
    """Called by the step loop after each optimizer step (:func:`xpar.run.train.train`'s
    ``after_step``); saves a checkpoint every ``train.checkpoint_every`` steps and after the last."""

    def __init__(self, engine, out_dir: Path):
        self.engine, self.out_dir = engine, Path(out_dir)
        self.every = engine.spec.train.checkpoint_every or 0
        self.root = checkpoint_root(engine.spec.train, out_dir)
        self.saved: list[Path] = []

    def __call__(self, step: int, losses: list, times: list, lrs: list) -> Optional[Path]:
        """After 0-based ``step``: save if ``step + 1`` is a multiple of the interval or the last step.
        ``losses``, ``times``, ``lrs``: this rank's lists of every step so far."""
        done = step + 1
        if not self.every or (done % self.every and done != self.engine.spec.train.steps):
            return None  # every `every` steps, and the last step
        path = save(self.engine, self.root, done, lambda: self._meta(done, losses, times, lrs))
        self.saved.append(path)
        keep = self.engine.spec.train.checkpoint_keep
        if keep and len(self.saved) > keep:
            self._drop(self.saved[:-keep])
            self.saved = self.saved[-keep:]
        return path

    @staticmethod
    def _drop(paths: list[Path]) -> None:
        """Rank 0 deletes this run's older checkpoints (a newer one is complete): ``xpar.json``
        first, so a directory half deleted is never taken for a checkpoint."""
        import shutil

        import torch.distributed as dist
        if dist.get_rank() != 0:
            return
        for p in paths:
            (p / META_FILE).unlink(missing_ok=True)
            shutil.rmtree(p, ignore_errors=True)

    def _meta(self, done: int, losses: list, times: list, lrs: list) -> dict:
        """Rank 0's ``xpar.json`` fields: the run's merged per-step loss and step time from
        the workers' step files (:func:`xpar.track.journal.merged_steps`, the tracking journal's own
        merge), falling back to rank 0's own where a rank's file is not readable here
        (ranks on other hosts)."""
        spec = self.engine.spec
        merged = merged_steps(self.out_dir, spec.world_size)[:done]
        if len(merged) == done:
            hist = {"losses": [m[1] for m in merged], "times": [m[2] for m in merged], "ts_ms": [m[3] for m in merged]}
        else:
            now = int(time.time() * 1000)
            hist = {"losses": losses[:done], "times": times[:done], "ts_ms": [now] * done}
        hist.update(grad_norms=list(self.engine.grad_norms[:done]), lrs=list(lrs[:done]))
        return dict(run_meta(spec, self.out_dir), history=hist, env=checkpoint_env())


def replay_history(out_dir: Path, rank: int, history: History) -> None:
    """Write a resumed run's history to this rank's step file before its first step, in the
    line format of :class:`xpar.track.journal.StepWriter` with the original end times: the tracking
    journal then merges and delivers steps 0..k-1 as the checkpointed run logged them (a store
    that has them already keeps one copy of each identical point)."""
    d = Path(out_dir) / STEPS_DIR
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"rank{rank}.jsonl", "a") as f:
        for i in range(history.step):
            f.write(json.dumps({"step": i, "loss": history.losses[i], "time_s": history.times[i],
                                "ts_ms": history.ts_ms[i]}) + "\n")


# -- the tracking side ----------------------------------------------------------------------
@dataclass
class TrackingLink:
    """How a resumed run is recorded: ``run_id`` of the MLflow run to continue (None: a new
    run), ``tags`` for the run, and ``note``, a line saying why a new run was started."""

    run_id: Optional[str]
    tags: dict
    note: Optional[str] = None


def tracking_link(spec, meta: dict, params: dict, uri: str) -> TrackingLink:
    """Continue the checkpointed run's MLflow run when this run's params (``params``, flattened
    as logged) and tracking store ``uri`` equal those its tracking journal recorded; otherwise
    a new run linked to it by the tag ``xpar.resumed_from_run`` (MLflow refuses a param logged
    again with another value, so a run never holds two values of one param)."""
    tags = {"xpar.resumed_from": spec.train.resume, "xpar.resumed_step": str(meta["step"])}
    old = Path(meta["out_dir"])
    if not (old / JOURNAL_FILE).is_file():  # the checkpointed run was not tracked
        return TrackingLink(None, tags)
    journal = Journal(old)
    start, logged = journal.records("start"), journal.records("params")
    if not start:
        return TrackingLink(None, tags)
    run_id = start[0]["run_id"]
    old_params = logged[0]["params"] if logged else {}
    diff = sorted(k for k in set(params) | set(old_params) if params.get(k) != old_params.get(k))
    if start[0]["uri"] != uri:
        diff = [f"tracking store {start[0]['uri']} -> {uri}"]
    if not diff:
        return TrackingLink(run_id, tags)
    tags["xpar.resumed_from_run"] = run_id
    shown = ", ".join(f"{k}: {old_params.get(k)} -> {params.get(k)}" if k in params or k in old_params else k
                      for k in diff[:4]) + (f" and {len(diff) - 4} more" if len(diff) > 4 else "")
    return TrackingLink(None, tags, f"xpar: resuming in a new MLflow run linked to run {run_id} "
                                    f"(tag xpar.resumed_from_run): its params differ ({shown}).")
