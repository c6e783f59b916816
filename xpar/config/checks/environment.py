"""Checks of the config against this machine and against silent no-ops, run before any
worker starts (:func:`xpar.config.validate.validate` calls :func:`check_environment` first).

Each returns problem lines: the constraint, the values given, values that work. What they
catch would otherwise end in a traceback (``hardware.device=cuda`` on a CPU build, an
unwritable store), a wrong run without a word (``data.path`` without ``data=text``,
``sequence_parallel`` at tp=1, a zero bandwidth treated as infinitely fast, ``hardware.*``
overrides dropped under a cluster preset), or a long hang (an unwritable SQLite store).
Torch is imported only inside :func:`check_device`.
"""
from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import Optional

from xpar.config.checks.hardware import (  # noqa: F401  (re-exported)
    POSITIVE_OR_NULL,
    check_hardware_values,
    hardware_value_problems,
    load_hardware_preset,
)
from xpar.config.hardware import is_this_machine
from xpar.config.resolve import torchrun_world
from xpar.config.overrides import unwritable


def check_environment(c) -> list[str]:
    """Every check of this module."""
    return (check_hardware_values(c) + check_hardware_overrides(c) + check_device(c) + check_data_path(c)
            + check_sequence_parallel(c) + check_empty_paths(c) + check_tracking_paths(c) + check_timeouts(c))


def check_empty_paths(c) -> list[str]:
    """A path key given but empty (``train.checkpoint_dir=``, ``tracking.uri=``,
    ``tracking.artifact_location=``) would silently mean the start directory or the default:
    refused (omegaconf#1179 makes an empty environment variable do the same)."""
    keys = {"train.checkpoint_dir": c.train.checkpoint_dir, "tracking.uri": c.tracking.uri,
            "tracking.artifact_location": c.tracking.artifact_location, "data.path": c.data.path}
    out = [f"{key} is set but empty; give a path (or null for the default), e.g. {key}=null."
           for key, value in keys.items() if value is not None and not str(value).strip()]
    if not str(c.tracking.experiment).strip():
        out.append("tracking.experiment is set but empty (MLflow needs a name); e.g. tracking.experiment=xpar.")
    return out



def check_timeouts(c) -> list[str]:
    """Collective timeout > 0; heartbeat timeout >= 5 s (workers beat every second)."""
    out = []
    if not c.run.collective_timeout_s > 0:
        out.append(f"run.collective_timeout_s must be > 0 seconds, got {c.run.collective_timeout_s}; e.g. 300.")
    if not c.run.heartbeat_timeout_s >= 5:
        out.append(f"run.heartbeat_timeout_s must be >= 5 seconds (workers beat every second), got "
                   f"{c.run.heartbeat_timeout_s}; e.g. 30.")
    return out


def check_hardware_overrides(c) -> list[str]:
    """``hardware.*`` changed on hardware=local while a cluster preset's reference hardware is
    assumed instead (:func:`xpar.config.resolve.reference_hardware`): the change would be dropped. A change
    that :func:`~xpar.config.checks.hardware.hardware_value_problems` refuses is left to its own line (the
    line here would suggest the refused value again)."""
    ref = c.parallel.reference_hardware
    if not (is_this_machine(c.hardware) and ref and c.run.mode != "execute" and not torchrun_world()):
        return []
    base, refused = load_hardware_preset(c.hardware.name), hardware_value_problems(c.hardware)  # said on their own lines
    changed = [f"hardware.{f.name}={_text(getattr(c.hardware, f.name))}" for f in fields(base)
               if getattr(c.hardware, f.name) != getattr(base, f.name) and f.name not in refused]
    if not changed:
        return []
    return [f"{' '.join(changed)} would not apply: parallel={c.parallel.name} assumes its reference cluster "
            f"hardware={ref}; pass it explicitly to change it: hardware={ref} {' '.join(changed)}."]


def _text(v) -> str:
    return str(v).lower() if isinstance(v, bool) else ("null" if v is None else str(v))


def check_device(c) -> list[str]:
    """hardware.device=cuda on hardware=local needs a CUDA device visible to this torch build."""
    if not is_this_machine(c.hardware) or c.hardware.device != "cuda":
        return []
    import torch

    if torch.cuda.is_available():
        return []
    why = "is a CPU build" if torch.version.cuda is None else "sees no CUDA device"
    return [f"hardware.device=cuda, but this torch ({torch.__version__}) {why}; use hardware.device=cpu "
            f"(or auto), or estimate a GPU cluster: hardware=h100_80gb_8gpu."]


def check_data_path(c) -> list[str]:
    """data.path is read only by data=text: given with synthetic data it would be ignored.
    A text file must be readable (the size is checked in :func:`xpar.config.checks.config.check_data`)."""
    path = c.data.path
    if path and c.data.kind != "text":
        return [f"data.path={path} is set but data.kind={c.data.kind} ignores it; train on the file with "
                f"data=text data.path={path}, or drop data.path."]
    if c.data.kind == "text" and path and Path(path).expanduser().is_file():
        try:
            with open(Path(path).expanduser(), "rb") as f:
                f.read(1)
        except OSError as e:
            return [f"data.path={path} cannot be read ({e.strerror or e}); give a readable text file."]
    return []


def check_sequence_parallel(c) -> list[str]:
    """Sequence parallelism shards along the tp axis: at tp=1 it would do nothing."""
    if c.parallel.sequence_parallel and c.parallel.tp == 1:
        return ["parallel.sequence_parallel=true needs parallel.tp > 1 (it shards norm and dropout regions "
                "over the tp ranks), got tp=1; set parallel.sequence_parallel=false, or parallel=tp "
                "parallel.sequence_parallel=true."]
    return []


def sqlite_path(uri: str) -> Optional[Path]:
    """The database file of a ``sqlite:///`` URI, else None."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///"):])


def check_tracking_paths(c, start_dir: Optional[Path] = None) -> list[str]:
    """The SQLite store (file and folder, for its journal) and a local artifact root must be
    writable: an unwritable store otherwise fails only after SQLite's lock retries."""
    tr = c.tracking
    if not tr.enabled:
        return []
    start = Path(start_dir or os.getcwd())
    uri = tr.uri or f"sqlite:///{(start / 'mlflow.db').absolute()}"
    out = []
    db = sqlite_path(uri)
    if db is not None:
        why = unwritable(db.parent) or (_unwritable_file(db) if db.exists() else None)
        if why:
            out.append(f"tracking.uri={uri} cannot be written ({why}); use a writable location, e.g. "
                       f"tracking.uri=sqlite:///{Path(os.path.expanduser('~')) / 'mlflow.db'}, or tracking=off.")
    local_artifacts = tr.artifact_location or (None if uri.startswith(("http://", "https://")) else str(start / "mlartifacts"))
    if local_artifacts and "://" not in local_artifacts.replace("file://", "", 1):
        folder = Path(local_artifacts.replace("file://", "", 1))
        why = unwritable(folder)
        if why:
            out.append(f"artifact directory {folder} cannot be written ({why}); pass tracking.artifact_location="
                       f"<writable folder>, e.g. {Path(os.path.expanduser('~')) / 'mlartifacts'}, or tracking=off.")
    return out


def _unwritable_file(path: Path) -> Optional[str]:
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    return None
