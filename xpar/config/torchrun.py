"""Where a torchrun launch puts this process: its rank and world from torchelastic's environment,
and how a rank other than 0 keeps a refusal to itself (rank 0 says it once)."""
from __future__ import annotations

import os
import time
from typing import Optional


def torchrun_world() -> Optional[dict[str, int]]:
    """Rank/world of a torchrun (torchelastic) launch, or None when xpar launches itself."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                               and "MASTER_ADDR" in os.environ):
        return {k: int(os.environ[k.upper()]) for k in ("rank", "world_size", "local_rank")
                if k.upper() in os.environ}
    return None


def torchrun_follower() -> bool:
    """Whether this process is a torchrun rank other than 0: it keeps a refusal to itself, rank 0 says it once."""
    world = torchrun_world()
    return world is not None and world.get("rank", 0) != 0


FOLLOWER_WAIT_S = 15.0
"""Seconds a torchrun rank other than 0 waits before exiting on a refusal, so that rank 0 (refusing the same
input) prints it before torchrun ends the other ranks on the first exit."""


def quiet_exit(code: int) -> None:
    """Exit ``code`` without a word after :data:`FOLLOWER_WAIT_S` (torchrun ends this rank sooner once rank 0 exits)."""
    time.sleep(FOLLOWER_WAIT_S)
    raise SystemExit(code)
