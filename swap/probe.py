"""Chooses an I/O backend for a directory by trying what works there.

The answer depends on the file system (O_DIRECT support) and the kernel (io_uring), both fixed
per device, so it is probed once per device and cached for the life of the process.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import uuid
from pathlib import Path

import numpy as np

from swap.backends.base import IOBackend, IORequest, Op
from swap.backends.threads import BufferedBackend, ThreadBackend
from swap.backends.uring import UringBackend, uring_unavailable_reason
from swap.buffers import ALIGNMENT
from swap.errors import NvmePathError, SwapConfigError

log = logging.getLogger(__name__)

BACKENDS = ("auto", "uring", "threads", "buffered")

_cache: dict[int, str] = {}
_cache_lock = threading.Lock()


def probe_direct_io(directory: Path) -> str | None:
    """None when an aligned O_DIRECT write and read-back work in ``directory``, else why not."""
    path = Path(directory) / f".infinity-probe-{uuid.uuid4().hex}"
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return "the file system refuses O_DIRECT"
        raise NvmePathError(f"cannot create a file in {directory}: {exc}") from exc
    region = mmap.mmap(-1, ALIGNMENT)
    try:
        region.write(b"\xa5" * ALIGNMENT)
        try:
            os.pwritev(fd, [region], 0)
            region.seek(0)
            region.write(b"\0" * ALIGNMENT)
            if os.preadv(fd, [region], 0) != ALIGNMENT or region[:4] != b"\xa5" * 4:
                return "an O_DIRECT read did not return what was written"
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return f"O_DIRECT transfers fail: {exc}"
            raise NvmePathError(f"a test write in {directory} failed: {exc}") from exc
        return None
    finally:
        region.close()
        os.close(fd)
        path.unlink(missing_ok=True)


def _uring_works(directory: Path) -> str | None:
    """None when an io_uring write and read on an O_DIRECT file in ``directory`` succeed."""
    reason = uring_unavailable_reason()
    if reason:
        return reason
    path = Path(directory) / f".infinity-probe-{uuid.uuid4().hex}"
    try:
        fd = os.open(
            path,
            os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT,
            0o600,
        )
    except OSError as exc:
        return f"cannot create a probe file: {exc}"
    region = mmap.mmap(-1, ALIGNMENT)
    array = np.frombuffer(region, dtype=np.uint8)
    backend = None
    try:
        # A short close timeout: if a probe request hangs, the probe must answer, not wait.
        backend = UringBackend(2, close_timeout=1.0)
        address = int(array.ctypes.data)
        array[:] = 0x5A
        backend.submit(IORequest(Op.WRITE, fd, 0, address, ALIGNMENT)).result(timeout=10)
        array[:] = 0
        backend.submit(IORequest(Op.READ, fd, 0, address, ALIGNMENT)).result(timeout=10)
        if int(array[0]) != 0x5A:
            return "an io_uring read did not return what was written"
        return None
    except Exception as exc:  # any failure means: do not use it here
        return f"io_uring transfers fail: {exc}"
    finally:
        if backend is not None:
            backend.close()
        del array
        try:
            region.close()
        except BufferError:
            pass
        os.close(fd)
        path.unlink(missing_ok=True)


def choose_backend(name: str, directory: Path) -> str:
    """Resolves ``name`` (``auto`` or a backend) to a backend that works on ``directory``."""
    if name not in BACKENDS:
        raise SwapConfigError(f"unknown aio backend {name!r}; choose one of {', '.join(BACKENDS)}")
    directory = Path(directory)
    if name == "buffered":
        return name
    cached = _probe(directory)
    if name == "auto":
        return cached
    if cached == "buffered":
        raise NvmePathError(
            f"aio backend {name!r} needs O_DIRECT, which the file system of "
            f"{directory} refuses: use backend 'auto' or 'buffered', or a "
            f"directory on a local NVMe file system (ext4, xfs)"
        )
    if name == "uring" and cached != "uring":
        raise SwapConfigError(
            f"aio backend 'uring' does not work in {directory} "
            f"({_uring_works(directory)}); use 'auto' or 'threads'"
        )
    return name


def choose_backend_for(name: str, directories: list[Path]) -> str:
    """One backend for several directories: all files of an engine share one backend, so
    ``auto`` settles on the most capable backend every directory supports (a single directory
    without O_DIRECT makes them all buffered), and an explicit one must work in each."""
    choices = [choose_backend(name, d) for d in directories]
    chosen = max(choices, key=_RANK.index)
    if len(set(choices)) > 1:
        log.warning(
            "swap directories support different backends (%s); using %r for all",
            ", ".join(f"{d}: {c}" for d, c in zip(directories, choices)),
            chosen,
        )
    return chosen


#: most capable first
_RANK = ["uring", "threads", "buffered"]


def _probe(directory: Path) -> str:
    """The best backend for ``directory``'s device, probed once per device and cached."""
    device = os.stat(directory).st_dev
    with _cache_lock:
        cached = _cache.get(device)
    if cached is not None:
        return cached
    why_not_direct = probe_direct_io(directory)
    if why_not_direct:
        cached = "buffered"
        log.warning(
            "%s: %s; swapping through the page cache (backend 'buffered'), which is "
            "slower and uses host memory for cached copies",
            directory,
            why_not_direct,
        )
    else:
        why_not_uring = _uring_works(directory)
        if why_not_uring:
            log.info(
                "%s: io_uring unavailable (%s); using the thread-pool backend",
                directory,
                why_not_uring,
            )
            cached = "threads"
        else:
            cached = "uring"
    with _cache_lock:
        _cache[device] = cached
    return cached


def make_backend(
    name: str, queue_depth: int, thread_count: int | None = None, close_timeout: float = 30.0
) -> IOBackend:
    if name == "uring":
        return UringBackend(queue_depth, close_timeout)
    if name == "threads":
        return ThreadBackend(queue_depth, thread_count, close_timeout)
    if name == "buffered":
        return BufferedBackend(queue_depth, thread_count, close_timeout)
    raise SwapConfigError(f"unknown aio backend {name!r}; choose one of {', '.join(BACKENDS[1:])}")


def clear_probe_cache() -> None:
    """Forgets every probe result (tests, or a directory remounted with other options)."""
    with _cache_lock:
        _cache.clear()
