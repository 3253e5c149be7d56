"""Keeping the process's resident memory close to what the store accounts for.

glibc serves large allocations with mmap only below a threshold that rises after each large
free (up to 32 MiB), after which freed shard-sized blocks stay in the heap and count towards RSS
although nothing uses them. The store allocates and frees buffer-sized temporaries all the time
(device copies on a CPU device, gradient pieces, first-step optimizer state), so a run that must
stay within a host budget pins the threshold: blocks of 1 MiB and more are always mapped and
returned to the system when freed. The price is a page fault per page of every large allocation
(measured: 10-20% of a CPU training step), so the store only does this when the user set an
explicit ``host_budget``. The store's own large allocations (the CPU device tier's working
copies) ask for transparent huge pages before first touch, which makes those faults 2 MiB each.

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


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_madvise = None


def _thp_on_request() -> bool:
    """Whether the kernel gives transparent huge pages to regions that ask for them."""
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def advise_huge_pages(address: int, length: int) -> bool:
    """Asks for transparent huge pages on the 2 MiB-aligned part of ``[address, address +
    length)`` before it is first touched: each fault then maps 2 MiB instead of 4 KiB.

    On a machine without a GPU the device tier's working copies are freshly mapped memory for
    every gather (see :func:`bound_heap_retention`); with 4 KiB pages filling them costs about
    as much in page faults as in copying. Best effort: False where unsupported."""
    global _madvise
    if _madvise is None:
        name = ctypes.util.find_library("c")
        if not name or not _thp_on_request():
            _madvise = False
        else:
            function = ctypes.CDLL(name, use_errno=True).madvise
            function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            function.restype = ctypes.c_int
            _madvise = function
    if _madvise is False:
        return False
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    stop = (address + length) // _HUGE_PAGE * _HUGE_PAGE
    if stop <= start:
        return False
    return _madvise(start, stop - start, _MADV_HUGEPAGE) == 0
