"""Checks of checkpointing and resuming (``train.checkpoint_every``, ``train.checkpoint_dir``,
``train.resume``) on the resolved spec, before any worker starts: each problem one line with
the constraint, the values given and values that work."""
from __future__ import annotations

import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

from xpar.config.checks import ConfigError
from xpar.config.overrides import unwritable
from xpar.run.checkpoint import (CheckpointError, complete_checkpoints, find_checkpoint, read_meta, run_meta,
                                  verify_metadata)

MODEL_FIELDS_IGNORED = ("name",)
"""Model fields a checkpoint may differ in (a label; every other field is a shape)."""


def checkpointing(spec, start_dir: Path):
    """``spec`` with ``train.resume`` resolved to the checkpoint directory it names
    (:func:`xpar.run.checkpoint.find_checkpoint`), and that checkpoint's ``xpar.json`` (or None).

    Raises:
        ConfigError: every problem of checkpointing or resuming this run.
    """
    t = spec.train
    problems = check_interval(t.checkpoint_every) + check_dir(t.checkpoint_dir) + check_reuse(t)
    if t.checkpoint_keep is not None and t.checkpoint_keep < 1:
        problems.append(f"train.checkpoint_keep must be >= 1 (checkpoints kept), or null to keep all, "
                        f"got {t.checkpoint_keep}; e.g. 3.")
    if (t.checkpoint_every or t.resume) and spec.layout.zero_stage == 1 and spec.mode == "execute":
        problems.append(ZERO1_REFUSAL)
    meta = None
    if t.resume:
        if spec.mode != "execute":
            problems.append(f"train.resume={t.resume} needs run.mode=execute (mode {spec.mode} trains nothing); "
                            f"drop train.resume, or run where the layout's devices exist.")
        else:
            path, meta, found = _resume_problems(spec, start_dir)
            problems += found
            if not found:
                resumed = f"resumed from {path} at step {meta['step']} (its earlier steps are the checkpointed run's)"
                spec = replace(spec, train=replace(t, resume=str(path)),
                               notes=spec.notes + [resumed] + data_notes(spec, meta))
    if problems:
        raise ConfigError(problems)
    return spec, meta


ZERO1_REFUSAL = ("checkpoints (train.checkpoint_every, train.resume) are not available with "
                 "parallel.zero_stage=1: torch's ZeroRedundancyOptimizer has no per-rank state dict "
                 "(torch.distributed.checkpoint's get_optimizer_state_dict raises 'Optimizer state has not "
                 "been consolidated', torch 2.13); values that work: parallel.zero_stage=0, 2 or 3.")


def check_interval(every) -> list[str]:
    """train.checkpoint_every: null, 0 (none) or a positive number of steps."""
    if every is not None and int(every) < 0:
        return [f"train.checkpoint_every must be >= 1 (steps), or 0/null for no checkpoints, got {every}; e.g. 100."]
    return []


def check_reuse(t) -> list[str]:
    """A run that checkpoints into a ``train.checkpoint_dir`` already holding checkpoints, and is
    not resuming, would overwrite another run's steps: refused (nothing a user saved is lost)."""
    if not (t.checkpoint_every and t.checkpoint_dir) or t.resume:
        return []
    held = complete_checkpoints(Path(t.checkpoint_dir).expanduser())
    if not held:
        return []
    return [f"train.checkpoint_dir={t.checkpoint_dir} already holds {len(held)} checkpoint(s) of another run "
            f"({', '.join(p.name for p in held[-3:])}): this run would overwrite them; give another "
            f"train.checkpoint_dir, or continue that run with train.resume=latest."]


def check_dir(path: Optional[str]) -> list[str]:
    """train.checkpoint_dir, when given: its nearest existing folder is writable."""
    if not path or not str(path).strip():  # empty: refused by xpar.config.checks.environment.check_empty_paths
        return []
    why = unwritable(Path(path))
    if why:
        return [f"train.checkpoint_dir={path} is not writable here ({why}); give a writable folder, e.g. "
                f"train.checkpoint_dir={Path(os.path.expanduser('~')) / 'xpar_checkpoints'}, or null for "
                f"<run output dir>/checkpoints."]
    return []


def _resume_problems(spec, start_dir: Path) -> tuple[Optional[Path], Optional[dict], list[str]]:
    """(checkpoint directory, its xpar.json, problems) of ``train.resume``."""
    try:
        path = find_checkpoint(spec.train.resume, spec.train.checkpoint_dir, Path(start_dir),
                               accept=lambda meta: not model_problems(meta, spec.model, Path()))
        meta = read_meta(path)
        verify_metadata(path)
    except CheckpointError as e:
        return None, None, [str(e)]
    problems = model_problems(meta, spec.model, path)
    if spec.train.steps <= meta["step"]:
        problems.append(f"train.steps={spec.train.steps} must exceed the checkpoint's step {meta['step']} "
                        f"({path}); e.g. train.steps={meta['step'] + max(1, spec.train.steps)}.")
    return path, meta, problems


def model_problems(meta: dict, model, path: Path) -> list[str]:
    """The model of the checkpoint and of this run differ in a shape field."""
    mine = asdict(model)
    diff = [k for k, v in meta["model"].items() if k not in MODEL_FIELDS_IGNORED and mine.get(k) != v]
    if not diff:
        return []
    given = ", ".join(f"model.{k}={mine.get(k)}" for k in diff)
    saved = " ".join(f"model.{k}={meta['model'][k]}" for k in diff)
    return [f"train.resume: the checkpoint {path} holds another model ({given} given; the checkpoint's: "
            f"{saved}); values that work: {saved} (model={meta['model'].get('name')}), or a checkpoint of this model."]


def data_notes(spec, meta: dict) -> list[str]:
    """A note (not a refusal) when this run's data differs from the checkpointed run's (seed,
    global batch, sequence length, data source): its steps after the checkpoint then see
    other batches than the checkpointed run's would have (a step's batch is a function of
    seed and step, xpar.run.data)."""
    saved, mine = meta.get("data", {}), run_meta(spec, Path("."))["data"]
    diff = [f"{k} {saved.get(k)} -> {v}" for k, v in mine.items() if saved.get(k) != v]
    if not diff:
        return []
    return [f"resumed with other data than the checkpointed run ({', '.join(diff)}): the steps from "
            f"{meta['step']} on see other batches than it would have."]
