"""Keeping the process's resident memory close to what the store accounts for.

glibc serves large allocations with mmap only below a threshold that rises after each large
free (up to 32 MiB), after which freed shard-sized blocks stay in the heap and count towards RSS
although nothing uses them. The store allocates and frees buffer-sized temporaries all the time
(gradients autograd makes, first-step optimizer state; a CPU device's working copies live in the
device tier's slab instead, see ``DeviceTier.fill``), so a run that must stay within a host
budget pins the threshold: blocks of 128 KiB and more are always mapped and returned to the
system when freed. (At 1 MiB, the activations of a 1280-wide GPT at 128 tokens, 640 KiB each,
landed in the heap, which fragmentation grew by about 85 MiB a step.) The price is a page fault
per page of every large allocation (measured: 10-20% of a CPU training step, with no difference
measured between the two thresholds), so the store only does this when the user set an
explicit ``host_budget``. The store's own large allocations (the CPU device tier's working
copies) ask for transparent huge pages before first touch (``swap.advise_huge_pages``), which
makes those faults 2 MiB each. torch's CPU allocator asks for them too on blocks of 2 MiB and
more when ``THP_MEM_ALLOC_ENABLE=1``, which it reads once, at the process's first CPU allocation:
:func:`huge_page_allocations` sets it where that has not happened yet (a store made before the
model is, a tool's child process) and says how to set it where it has. On the 100M-parameter MLP
under a 1 GiB budget this took the faults of a step from 98k to 13k, the gradients' share, and
the step from 0.44 to 0.39 s.

Letting the heap keep blocks after the first step (the allocations repeat every step) takes a
third off the attached CPU step of a 100M-parameter model, but on its own fragmentation grew the
heap by 1.3 GiB on a 500M-parameter model under a 2 GiB budget. So reuse comes with a watch
(:class:`HeapWatch`): at the points where the heap grows (module boundaries, step tiles) the
store compares the process's RSS with the line its budgets draw, and past it hands the heap's
free pages back to the system (``malloc_trim``), which fragmentation cannot stop. Bounded memory
first; reuse whenever it fits under the line. Without reuse the heap still fragments (blocks
under the mmap threshold, freed between live ones), so the watch trims there too where RSS
passes the line.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Any

import torch

from swap import huge_pages_on_request

try:
    import resource
except ImportError:  # not a POSIX platform
    resource = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
#: glibc's mmap and trim thresholds under a host budget (see the module docstring)
BOUNDED_MMAP_THRESHOLD = 128 << 10
_done = False
_THP_VARIABLE = "THP_MEM_ALLOC_ENABLE"
_huge_pages: bool | None = None


def bound_heap_retention(threshold: int = BOUNDED_MMAP_THRESHOLD) -> bool:
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
    ok = bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, threshold))
    _done = ok
    log.debug("glibc mmap/trim thresholds pinned at %d bytes: %s", threshold, ok)
    return ok


_warmed = False


def warm_runtime() -> None:
    """Initialises what torch sets up at a process's first backward and optimizer step (thread
    pools, kernels, the optimizer machinery: about 80 MiB here), once per process, so that a
    measurement of the process's own memory taken next already includes it. Its values are
    fixed, not drawn: the user's random streams stay where the user left them (a module made
    here would draw its initial weights from torch's global generator)."""
    global _warmed
    if _warmed:
        return
    _warmed = True
    # attach may run under no_grad() or inference_mode() (an inference script's), where this
    # backward would raise
    with torch.inference_mode(False), torch.enable_grad():
        weight = torch.full((64, 64), 0.01, requires_grad=True)
        inputs = torch.linspace(-1.0, 1.0, 4 * 64).reshape(4, 64)
        (inputs @ weight).sum().backward()
        for fused in (False, True):
            try:
                torch.optim.AdamW([weight], fused=fused).step()
            except RuntimeError:  # no fused kernel for this device or build
                pass


def huge_pages_advised() -> bool | None:
    """What :func:`huge_page_allocations` found, without probing: None before it ran."""
    return _huge_pages


def huge_page_allocations() -> bool:
    """Whether torch's CPU allocator asks for transparent huge pages on its blocks of 2 MiB and
    more (cached after the first call). Sets ``THP_MEM_ALLOC_ENABLE=1`` unless the environment
    already says, which takes effect only if this process has made no CPU tensor yet; where it
    came too late, logs how to start the process instead. With the setting on, the allocator
    aligns its blocks to the page instead of to 64 bytes, which is what the probe looks at: four
    fresh 4 MiB blocks all page-aligned by chance is one in 16 million."""
    global _huge_pages
    if _huge_pages is not None:
        return _huge_pages
    if not huge_pages_on_request():
        _huge_pages = False
        return False
    asked = os.environ.get(_THP_VARIABLE)
    if asked is None:
        os.environ[_THP_VARIABLE] = "1"
    probes = [torch.empty(4 << 20, dtype=torch.uint8) for _ in range(4)]
    _huge_pages = all(t.data_ptr() % _PAGE == 0 for t in probes)
    del probes
    if not _huge_pages and asked is None:
        del os.environ[_THP_VARIABLE]  # too late here: no say over the processes it starts
        log.info(
            "large CPU temporaries (gradients, say) fault 4 KiB pages: torch's allocator "
            "had read %s before the store was made. Start the process with %s=1, or make "
            "the store before the model; under a host budget that took about a tenth off "
            "a step",
            _THP_VARIABLE,
            _THP_VARIABLE,
        )
    elif not _huge_pages:
        log.debug(
            "%s=%s in the environment: torch's large blocks are not advised", _THP_VARIABLE, asked
        )
    return _huge_pages


def _libc_function(name: str) -> Any:
    library = ctypes.util.find_library("c")
    if not library:
        return None
    try:
        return getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):
        return None


def reuse_heap_blocks(largest: int) -> bool:
    """Lets blocks up to about ``largest`` bytes be reused from the heap instead of mapped and
    faulted afresh. Only where :func:`bound_heap_retention` pinned the thresholds before."""
    if not _done:
        return False
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    threshold = min(max(2 * largest, 1 << 20), 1 << 30)  # room for alignment and headers
    ok = bool(mallopt(_M_MMAP_THRESHOLD, threshold))
    log.debug("glibc mmap threshold raised to %d bytes: %s", threshold, ok)
    return ok


def _pin_mmap_threshold(threshold: int = BOUNDED_MMAP_THRESHOLD) -> None:
    mallopt = _libc_function("mallopt")
    if mallopt is not None:
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt(_M_MMAP_THRESHOLD, threshold)


def _trim_heap() -> None:
    """Hands the heap's free pages back to the system (malloc_trim), where glibc has it."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim(0)


def minor_faults() -> int:
    """The process's minor page faults so far (every thread's), 0 where unavailable. A fault
    is a page first touched: under a host budget each large temporary faults its pages afresh
    every step, which heap reuse avoids (the module docstring). Runs at every trace event:
    one system call."""
    if resource is None:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


_fault_seconds: float | None = None


def fault_seconds(nbytes: int = 16 << 20, repeats: int = 4) -> float:
    """Wall seconds a minor fault adds to a kernel that writes fresh memory, in this process
    (cached after the first call; 0.0 where faults cannot be counted): ``repeats`` fresh
    anonymous mappings of ``nbytes``, advised huge pages where torch's allocator asks for them
    (:func:`huge_pages_advised`), each filled by torch's own threads, against refilling one
    already faulted. Measured here: 1.0-1.15 microseconds per 4 KiB fault on two cores, the
    same as the step times of one model under two budgets imply (1.3)."""
    global _fault_seconds
    if _fault_seconds is not None:
        return _fault_seconds
    import mmap
    import time

    warm = torch.empty(nbytes // 4)
    warm.fill_(1.0)
    fresh_s = warm_s = 0.0
    faults = 0
    for _ in range(repeats):
        region = mmap.mmap(-1, nbytes)
        if _huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            region.madvise(mmap.MADV_HUGEPAGE)
        fresh = torch.frombuffer(region, dtype=torch.float32)
        before, start = minor_faults(), time.perf_counter()
        fresh.fill_(2.0)
        middle = time.perf_counter()
        faults += minor_faults() - before
        warm.fill_(2.0)
        warm_s += time.perf_counter() - middle
        fresh_s += middle - start
        del fresh
        region.close()
    _fault_seconds = max(0.0, fresh_s - warm_s) / faults if faults > 0 else 0.0
    return _fault_seconds


def host_tensor_bytes(tree: Any) -> int:
    """Bytes of the distinct host storages of the tensors in ``tree`` (dicts, lists, tuples:
    an optimizer's ``state``, say); storages shared by several tensors count once."""
    seen: set[int] = set()
    total = 0
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, torch.Tensor) and item.device.type == "cpu":
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def peak_resident_bytes() -> int:
    """The process's peak RSS: VmHWM from /proc/self/status, the high-water mark of this
    process's own memory. ``getrusage``'s ``ru_maxrss`` is not that in a process started by
    a larger one: exec folds the parent's RSS at fork into it."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if resource is None:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_bytes() -> int:
    """The process's RSS from /proc/self/statm (a few microseconds); 0 where unavailable."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


#: outside reuse, RSS past the line trims the heap again only once it grew this much more
TRIM_GROWTH = 64 << 20


class HeapWatch:
    """Heap reuse while it fits: :meth:`start` lets freed blocks be reused; :meth:`check`, called
    where the heap grows, goes back to bounded mode for good (blocks mapped and returned again,
    the heap's free pages handed back) the first time the process's RSS passes ``limit``; and
    without reuse, hands the heap's free pages back where RSS passes ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = False
        self.decided = False  # start() was called: samples matter only while reuse runs
        self.seen_peak = 0  # the highest RSS a check saw
        self.gave_up_at: int | None = None  # the RSS that ended reuse, if it ended
        self.started = False  # reuse ran at some point (the process's peak may hold its blocks)
        #: the RSS after the last trim outside reuse, and how many there were
        self.trimmed_at = 0
        self.trims = 0

    def start(self, largest: int, extra: int, outside: int = 0) -> bool:
        """Starts reuse if the line leaves ``extra`` bytes above the RSS seen so far: what
        keeping one step's large temporaries in the heap is expected to add. ``outside``:
        host memory outside the budgets that the first step created and later steps keep
        (optimizer state and gradients the user keeps in host RAM); it raises the line."""
        self.decided = True
        self.limit += outside
        if self.gave_up_at is not None or self.limit - self.seen_peak < extra:
            log.debug(
                "heap reuse not started: %d bytes under the line, %d wanted",
                self.limit - self.seen_peak,
                extra,
            )
            return False
        self.active = reuse_heap_blocks(largest)
        self.started = self.started or self.active
        return self.active

    def stop(self) -> None:
        """Ends reuse (the store closes): large blocks are mapped and returned again, and the
        heap's free pages go back to the system."""
        if self.active:
            self.active = False
            _pin_mmap_threshold()
            _trim_heap()

    def make_room(self, nbytes: int) -> None:
        """``nbytes`` are about to be allocated outside the hooks' sight (a checkpoint save's
        write buffers): where RSS would pass the line with them, the heap's free pages go back
        to the system first (blocks kept for reuse, or left behind when reuse ended)."""
        if resident_bytes() + nbytes > self.limit:
            _trim_heap()

    def check(self) -> None:
        rss = resident_bytes()
        if not (self.decided and not self.active):
            self.seen_peak = max(self.seen_peak, rss)
        if rss <= self.limit:
            return
        if not self.active:
            # No reuse, yet past the line: the heap keeps freed small blocks (under the mmap
            # threshold), which fragment it, and the trim threshold returns only its top. An
            # 8 B full fine-tune's heap grew to 1.1 GB that way in some runs and not in others,
            # and its peak passed the bound by 0.8 GiB. Hand the free pages back, once per
            # TRIM_GROWTH of growth since the last time (a process rightly past the line, its
            # transients there, would otherwise trim at every hook).
            if rss >= self.trimmed_at + TRIM_GROWTH:
                _trim_heap()
                self.trimmed_at = resident_bytes()
                self.trims += 1
            return
        self.active = False
        self.gave_up_at = rss
        _pin_mmap_threshold()
        _trim_heap()
        log.info(
            "heap reuse off: RSS %d bytes passed the line of %d (process + budgets); large "
            "blocks are mapped and returned again, now %d bytes",
            rss,
            self.limit,
            resident_bytes(),
        )
