"""Which process of a torchrun (torchelastic) launch this is, for the console: a refusal is said once,
by rank 0; the other ranks refusing the same input exit with its code without a word."""
from __future__ import annotations

import os
import time

FOLLOWER_WAIT_S = 15.0
"""Seconds a torchrun rank other than 0 waits before exiting on a refusal, so that rank 0 (refusing the same
input) prints it before torchrun ends the other ranks on the first exit."""


def under_torchrun() -> bool:
    """Whether a torchrun (or another launcher setting RANK, WORLD_SIZE and MASTER_ADDR) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def torchrun_follower() -> bool:
    """Whether this process is a torchrun rank other than 0: it keeps a refusal to itself, rank 0 says it once."""
    return under_torchrun() and os.environ.get("RANK", "0") != "0"


def quiet_exit(code: int) -> None:
    """Exit ``code`` without a word after :data:`FOLLOWER_WAIT_S` (torchrun ends this rank sooner once rank 0 exits)."""
    time.sleep(FOLLOWER_WAIT_S)
    raise SystemExit(code)
