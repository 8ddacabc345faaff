"""glibc's malloc settings for training and serving, set where the stack starts (`megatron-id
train`, the ranks `megatron-id train --nproc N` starts, `megatron-id serve`), not in one script.

By default glibc returns large freed blocks to the OS at once, and every step maps them again:
the page faults make long sequences and 50K-wide logits look far slower than they compute
(measured: the tiny model's CPU step 1.4-1.5x slower; the README's by-hand block trained ~1.5x
slower than the quickstart, which exported the two variables). Keeping freed memory avoids it.

- A new process (the ranks of --nproc, benchmarks' cells) gets the variables in its
  environment: MALLOC_MMAP_THRESHOLD_=4 GiB, MALLOC_TRIM_THRESHOLD_=64 GiB.
- A process that is already running (a rank started by torchrun or srun, a plain
  `megatron-id train`) sets the same through mallopt(3) at its start; C's int caps both at
  2 GiB - 1, which keeps the effect (measured equal within noise).
Either variable exported by the user wins, and then nothing is changed. Not glibc (musl, macOS):
nothing is done.
"""
from __future__ import annotations

import ctypes
import os
import sys

ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
INT_MAX = 2**31 - 1


def keep_freed_memory() -> bool:
    """Apply the settings to this process (and, through the environment, to its children);
    True when mallopt took them."""
    if any(name in os.environ for name in ALLOCATOR_ENV):
        return False   # the user's (glibc read them at start)
    os.environ.update(ALLOCATOR_ENV)
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, INT_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, INT_MAX))


def release_freed_memory() -> None:
    """glibc's malloc_trim: freed heap handed back to the system (glibc keeps it otherwise, many
    small blocks above all). Not glibc: nothing to do."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resident_bytes() -> int | None:
    """This process's resident memory (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
