"""The files a local run's workers leave in its folder for xpar, the process that launched them:
heartbeats (:func:`xpar.run.worker.start_heartbeat`) and rank 0's gathered stats. Torch-free, so that
the launcher reads them without importing torch (:mod:`xpar.run.launch`)."""
from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

HEARTBEAT_DIR = "heartbeat"
"""Sub-folder of the run's folder with one ``rank<r>.json`` per worker."""
STATS_FILE = "ranks.json"
"""Every rank's stats, as rank 0 gathered them (:func:`xpar.run.worker.run_rank`)."""


def stats_fallback(out_dir: Path) -> Path:
    """Where rank 0 writes the stats when the run's folder cannot take them (a full disk): the
    system's temporary folder, named after the run's folder."""
    key = hashlib.sha1(str(Path(out_dir).absolute()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"xpar-ranks-{key}.json"
