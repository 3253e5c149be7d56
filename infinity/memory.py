"""Keeping the process's resident memory close to what the store accounts for.

glibc serves large allocations with mmap only below a threshold that rises after each large
free (up to 32 MiB), after which freed shard-sized blocks stay in the heap and count towards RSS
although nothing uses them. The store allocates and frees buffer-sized temporaries all the time
(device copies on a CPU device, gradient pieces, first-step optimizer state), so a run that must
stay within a host budget pins the threshold: blocks of 1 MiB and more are always mapped and
returned to the system when freed. The price is a page fault per page of every large allocation
(measured: 10-20% of a CPU training step), so the store only does this when the user set an
explicit ``host_budget``. The store's own large allocations (the CPU device tier's working
copies) ask for transparent huge pages before first touch (``swap.advise_huge_pages``), which
makes those faults 2 MiB each.

Letting the heap keep blocks after the first step instead (the allocations repeat every step)
took a third off the attached CPU step of a 100M-parameter model, but fragmentation grew the
heap by 1.3 GiB on a 500M-parameter model under a 2 GiB budget: bounded memory comes first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_done = False


def bound_heap_retention(threshold: int = 1 << 20) -> bool:
    """Pins glibc's mmap and trim thresholds (once per process). False where not glibc."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                      threshold))
    _done = ok
    log.debug("glibc mmap/trim thresholds pinned at %d bytes: %s", threshold, ok)
    return ok

