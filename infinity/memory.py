"""Keeping the process's resident memory close to what the store accounts for, without paying
for it in page faults.

glibc serves large allocations with mmap only below a threshold that rises after each large
free (up to 32 MiB), after which freed blocks stay in the heap and count towards RSS although
nothing uses them. While a store attaches and runs its first step it allocates one-off
temporaries of every size (the model's own parameters being moved out, the optimizer state
being created), so a run that must stay within a host budget pins the threshold low: blocks of
1 MiB and more are mapped and returned to the system when freed (:func:`bound_heap_retention`).

That has a price on every later step: each device copy on a machine without a GPU and each
gradient is a fresh mapping, faulted page by page (measured: a third of a CPU training step).
From the second step on the allocations repeat the same sizes every step, so the store raises
the threshold above its largest parameter (:func:`reuse_heap_blocks`): freed blocks are reused
by the next step without faults, and the heap stays at the size one step needs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False
_mallopt = None


def _set_thresholds(threshold: int) -> bool:
    global _mallopt
    if _mallopt is None:
        name = ctypes.util.find_library("c")
        try:
            _mallopt = ctypes.CDLL(name).mallopt if name else False
        except (OSError, AttributeError):
            _mallopt = False
        if _mallopt:
            _mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not _mallopt:
        return False
    return bool(_mallopt(_M_MMAP_THRESHOLD, threshold)) and \
        bool(_mallopt(_M_TRIM_THRESHOLD, threshold))


def bound_heap_retention(threshold: int = 1 << 20) -> bool:
    """Pins glibc's mmap and trim thresholds (once per process). False where not glibc."""
    global _done
    if _done:
        return True
    _done = _set_thresholds(threshold)
    log.debug("glibc mmap/trim thresholds pinned at %d bytes: %s", threshold, _done)
    return _done


def reuse_heap_blocks(largest: int) -> bool:
    """Lets blocks up to ``largest`` bytes be reused from the heap (after the first step).
    Only where :func:`bound_heap_retention` pinned the thresholds before."""
    if not _done:
        return False
    threshold = min(max(2 * largest, 1 << 20), 1 << 30)  # room for alignment and headers
    ok = _set_thresholds(threshold)
    log.debug("glibc mmap/trim thresholds raised to %d bytes: %s", threshold, ok)
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
