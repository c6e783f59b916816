"""glibc's malloc on CPU workers: large tensors served from the heap, not from a fresh mmap each.

glibc serves an allocation above its mmap threshold (dynamic, at most 32 MiB on 64-bit Linux)
with ``mmap`` and gives it back with ``munmap`` when it is freed, so every large temporary of a
CPU step (AdamW's ``sqrt``/``div`` results over an embedding, a big logits tensor) pays a page
fault per 4 KiB page on first touch: torch's single-tensor AdamW (xpar's) steps GPT-2 small's
parameters about twice as fast with :func:`keep_large_tensors_on_the_heap` (benchmarks/README.md,
benchmarks/host_memory.py). PyTorch's CPU
performance tuning guide recommends a caching allocator (jemalloc, tcmalloc) for the same
reason; this is the same effect with the C library at hand. Nothing changes where the C library
is not glibc (macOS, musl) or on CUDA devices (the caching allocator already keeps blocks).
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
"""glibc's mallopt parameters (malloc.h)."""


def keep_large_tensors_on_the_heap() -> bool:
    """Tell glibc never to mmap an allocation (``M_MMAP_MAX`` = 0), to give freed heap back to
    the system only past 2 GiB free at its top (``M_TRIM_THRESHOLD``), and to serve every thread
    from that one heap (``M_ARENA_MAX`` = 1), for this process from now on. Returns True where
    glibc took all three, False elsewhere (no glibc: nothing changed).

    The third matters because a thread other than the first allocates from an arena of its own,
    built of 64 MiB heaps, where the other two settings do not hold: glibc serves a larger request
    there from a fresh mmap whatever M_MMAP_MAX says, and maps and unmaps whole heaps as they
    fill and empty (under ZeRO-2, a worker mapped and unmapped its all-gather buffer every step:
    benchmarks/README.md). Threads that allocated before the call keep
    their arenas: call it before the process group starts its threads."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all([mallopt(M_MMAP_MAX, 0), mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1), mallopt(M_ARENA_MAX, 1)])
