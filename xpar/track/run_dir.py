"""A run owns its folder: a run's (or a sweep's) output directory is claimed atomically, and a
folder that holds another run is never written into.

The claim is ``xpar_run.json`` in the folder, created exclusively (``O_CREAT | O_EXCL``: of two
processes, one wins) and naming its owner (host, pid, start time, torchrun id). The default
``outputs/<date>/<time>`` (``multirun/<date>/<time>`` for a sweep) is made with ``os.mkdir``, which
fails if the folder exists: a second run in the same second takes ``<time>-2`` (FACTS.md, turn 4).
A folder given by ``hydra.run.dir``, ``hydra.sweep.dir`` or ``XPAR_RUN_DIR`` that holds another
run (its claim, tracking journal, stats or checkpoints) is refused before Hydra writes into it
(:func:`refusal`), with a free folder to use instead.
"""
from __future__ import annotations

import json
import os
import socket
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

from xpar.track.journal import disk_warning

MARKER = "xpar_run.json"
RUN_FILES = (MARKER, "tracking_journal.jsonl", "ranks.json")
"""Files whose presence says a folder holds a run (beside checkpoints, :func:`held_by_another`)."""
SWEEP_GLOB = "xpar_sweep*.json"


def owner() -> dict:
    """Who claims a folder: this process, and the torchrun job it is a rank of (if any)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "claimed_at": time.time(),
            "torchrun_id": os.environ.get("TORCHELASTIC_RUN_ID")}


def read_claim(folder: Path) -> Optional[dict]:
    """The owner named by ``folder``'s claim ({} if unreadable), or None without a claim."""
    path = Path(folder) / MARKER
    if not path.exists():
        return None
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def is_mine(claim: Optional[dict]) -> bool:
    """Whether ``claim`` names this process, or the torchrun job this process is a rank of."""
    if not claim:
        return False
    me = owner()
    if claim.get("torchrun_id") and claim.get("torchrun_id") == me["torchrun_id"]:
        return True
    return claim.get("host") == me["host"] and claim.get("pid") == me["pid"]


def held_by_another(folder: Path) -> Optional[str]:
    """What in ``folder`` belongs to another run (its claim, journal, stats, a sweep's state or
    checkpoints), or None when this process may take it (missing, empty of runs, or its own)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    claim = read_claim(folder)
    if claim is not None:
        if is_mine(claim):
            return None
        return f"claimed by pid {claim.get('pid', '?')} on {claim.get('host', '?')} in its {MARKER}"
    held = [n for n in RUN_FILES if (folder / n).exists()] + [p.name for p in folder.glob(SWEEP_GLOB)]
    held += [str(p.parent.relative_to(folder)) for g in ("step_*/xpar.json", "*/step_*/xpar.json")
             for p in folder.glob(g)][:1]
    return f"it holds another run's {', '.join(held)}" if held else None


def claim(folder: Path) -> Optional[str]:
    """Create ``folder`` (and parents) and claim it for this process; None on success, else why
    it belongs to another run (nothing is written then).

    Raises:
        OSError: ``folder`` cannot be created."""
    folder = Path(folder)
    why = held_by_another(folder)
    if why is not None:
        return why
    folder.mkdir(parents=True, exist_ok=True)
    if is_mine(read_claim(folder)):
        return None
    try:
        fd = os.open(folder / MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:  # another process claimed it between the check and here
        return held_by_another(folder) or "another run claimed it at the same moment"
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(owner(), f)
    except OSError as e:  # a full disk: the run goes on unclaimed, said once
        (folder / MARKER).unlink(missing_ok=True)
        disk_warning(folder / MARKER, e, "this run's folder is not claimed")
    return None


def claim_new(base: Path, now: Optional[datetime] = None) -> Path:
    """Claim ``<base>/<date>/<time>`` (Hydra's default layout), or ``<time>-2``, ``-3``... when a
    run started in the same second has it: each name is made with ``os.mkdir`` (atomic)."""
    now = now or datetime.now()
    parent = Path(base) / now.strftime("%Y-%m-%d")
    parent.mkdir(parents=True, exist_ok=True)
    stamp, k = now.strftime("%H-%M-%S"), 1
    while True:
        folder = parent / (stamp if k == 1 else f"{stamp}-{k}")
        try:
            folder.mkdir()
        except FileExistsError:
            k += 1
            continue
        if claim(folder) is None:
            return folder
        k += 1


def free_sibling(folder: Path) -> Path:
    """``<folder>-2`` (or ``-3``...): the first name beside ``folder`` that does not exist."""
    k = 2
    while Path(f"{folder}-{k}").exists():
        k += 1
    return Path(f"{folder}-{k}")


def refusal(key: str, given: str, folder: Path, why: str) -> str:
    """The one line that refuses ``key=given`` (a folder of another run) with a folder that works."""
    fix = free_sibling(Path(given))
    tail = ", or unset XPAR_RUN_DIR for a new outputs/<date>/<time>" if key == "XPAR_RUN_DIR" else ""
    return (f"{key}={given} is another run's folder ({why}): a run never writes into another run's "
            f"records or checkpoints; give a new folder, e.g. {key}={fix}{tail}.")


INFO_FLAGS = {"--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc",
              "--resolve", "-p", "--package"}
"""Hydra flags that print and run no job: no folder is claimed for them."""


def _given(argv: list[str], key: str) -> Optional[str]:
    """The value of the last ``key=`` override (with ``+``/``++`` prefixes), or None."""
    found = None
    for a in argv:
        k, eq, v = a.lstrip("+").partition("=")
        if eq and k == key:
            found = v
    return found


def _resolve(value: str) -> Optional[str]:
    """``value`` with its ``${now:...}`` and ``${oc.env:...}`` interpolations resolved as Hydra
    will (same second), or None where it cannot be resolved here (left to the job's own claim)."""
    if "${" not in value:
        return value
    from hydra.core.utils import setup_globals
    from omegaconf import OmegaConf
    setup_globals()  # registers Hydra's ${now:} resolver (cached: Hydra then resolves the same time)
    try:
        return str(OmegaConf.create({"d": value}).d)
    except Exception:  # noqa: BLE001 (${hydra:...}, unset variables: Hydra says what is wrong)
        return None


def claim_before_hydra(argv: list[str], start_dir: Path) -> tuple[list[str], Optional[str]]:
    """Claim the folder the run (or sweep, with ``-m``) of ``argv`` will write, before Hydra
    writes into it. Returns (overrides to add: the claimed default folder, refusal line or None).
    Torchrun ranks other than 0 use the folder their rank 0 claims."""
    if INFO_FLAGS & set(argv):
        return [], None
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("RANK", "0") != "0":
        return [], None
    multirun = bool({"-m", "--multirun"} & set(argv))
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = _given(argv, key)
    if given is None and not multirun and os.environ.get("XPAR_RUN_DIR"):
        key, given = "XPAR_RUN_DIR", os.environ["XPAR_RUN_DIR"]
    try:
        if given is None:
            folder = claim_new(start_dir / ("multirun" if multirun else "outputs"))
            return [f"{key}={folder.relative_to(start_dir)}"], None
        resolved = _resolve(given)
        if resolved is None or not resolved.strip():
            return [], None
        folder = Path(resolved).expanduser()
        why = claim(folder if folder.is_absolute() else start_dir / folder)
    except OSError as e:  # a full disk, a folder removed under us
        return [], (f"the output folder cannot be created ({e.strerror or e}: {e.filename}); free space there, "
                    f"or pass {key}=<a folder with space>.")
    return [], None if why is None else refusal(key, given, folder, why)
