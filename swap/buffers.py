"""Aligned, pre-faulted host buffers and the pool that lends them out.

The pool makes one allocation of ``buffer_count * buffer_size`` bytes and carves it into slots.
Each slot starts on a 4096-byte boundary (O_DIRECT needs the memory, offset and length aligned)
and every page is touched at creation, because the first submit on untouched pages pays for the
page faults inside the I/O path. With CUDA the allocation is page-locked, so device copies from
and to it are asynchronous; without CUDA it is plain anonymous memory and the pool says so.

Page-locking is done here, at the allocation's exact size: the pool maps page-aligned memory
itself and registers it with CUDA (``cudaHostRegister``; :class:`CudaHostPinner`), unregistering
it at close. ``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator,
which rounds each block up to a power of two and keeps it: a 20 GiB arena would lock 32 GiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from swap.errors import PoolExhaustedError, SwapConfigError

log = logging.getLogger(__name__)

ALIGNMENT = 4096


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


class HostBuffer:
    """One slot of a pool: ``nbytes`` aligned bytes, viewable as numpy or torch without copies."""

    __slots__ = ("index", "nbytes", "array", "tensor", "address", "pool")

    def __init__(
        self, index: int, array: np.ndarray, tensor: torch.Tensor, pool: BufferPool | None
    ) -> None:
        self.index = index
        self.array = array
        self.tensor = tensor
        self.nbytes = int(array.nbytes)
        self.address = int(array.ctypes.data)
        self.pool = pool

    def view(self, dtype: torch.dtype, numel: int, byte_offset: int = 0) -> torch.Tensor:
        """A torch tensor of ``numel`` elements of ``dtype`` over this buffer's bytes."""
        itemsize = dtype.itemsize
        end = byte_offset + numel * itemsize
        if byte_offset % itemsize:
            raise ValueError(
                f"byte_offset {byte_offset} is not a multiple of the {itemsize}-byte "
                f"size of {dtype}"
            )
        if byte_offset < 0 or numel < 0 or end > self.nbytes:
            raise ValueError(
                f"view of {numel} x {dtype} at byte {byte_offset} does not fit in a "
                f"{self.nbytes}-byte buffer"
            )
        return self.tensor[byte_offset:end].view(dtype)

    def memoryview(self, start: int = 0, stop: int | None = None) -> memoryview:
        return self.array.data[start:stop]

    def release(self) -> None:
        if self.pool is None:
            raise RuntimeError("this buffer does not belong to a pool")
        self.pool.release(self)

    def __repr__(self) -> str:
        return f"HostBuffer(index={self.index}, nbytes={self.nbytes})"


#: madvise(2) values not exported by every Python's mmap module
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20
#: libc's madvise once looked up; False where it is unavailable
_madvise: Any = None


def huge_pages_on_request() -> bool:
    """Whether the kernel gives transparent huge pages to regions that ask for them."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def advise_huge_pages(address: int, length: int) -> bool:
    """Asks for transparent huge pages on the 2 MiB-aligned part of ``[address, address +
    length)``, before it is first touched: each fault then maps 2 MiB instead of 4 KiB, and
    copies in and out of the region miss the TLB less. Best effort: False where unsupported."""
    global _madvise
    if _madvise is None:
        name = ctypes.util.find_library("c")
        if not name or not huge_pages_on_request():
            _madvise = False
        else:
            function = ctypes.CDLL(name, use_errno=True).madvise
            function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            function.restype = ctypes.c_int
            _madvise = function
    if _madvise is False:
        return False
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    stop = (address + length) // HUGE_PAGE * HUGE_PAGE
    if stop <= start:
        return False
    return _madvise(start, stop - start, _MADV_HUGEPAGE) == 0


_MADV_DONTNEED = 4
_release: Any = None


def release_pages(address: int, length: int) -> bool:
    """Hands the whole pages of ``[address, address + length)`` back to the system (madvise
    MADV_DONTNEED): they stop counting in the process's RSS and read as zeros when touched
    again. For private anonymous memory only (not page-locked). False where unsupported."""
    global _release
    if _release is None:
        name = ctypes.util.find_library("c")
        if not name:
            _release = False
        else:
            function = ctypes.CDLL(name, use_errno=True).madvise
            function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            function.restype = ctypes.c_int
            _release = function
    if _release is False:
        return False
    start = -(-address // ALIGNMENT) * ALIGNMENT
    stop = (address + length) // ALIGNMENT * ALIGNMENT
    if stop <= start:
        return False
    return _release(start, stop - start, _MADV_DONTNEED) == 0


class HostPinner(Protocol):
    """Page-locks memory the pool allocated (and unlocks it before it is unmapped)."""

    def register(self, address: int, nbytes: int) -> None: ...

    def unregister(self, address: int) -> None: ...


class CudaHostPinner:
    """Page-locks with ``cudaHostRegister``: exactly the bytes given, which the pool mapped."""

    def register(self, address: int, nbytes: int) -> None:
        error = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
        if int(error):
            raise RuntimeError(
                f"cudaHostRegister of {nbytes} bytes failed (CUDA error {int(error)}): the "
                f"system's limit on locked memory (ulimit -l) may be below it; lower "
                f"buffer_count or buffer_size, or set pin_memory=False"
            )

    def unregister(self, address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)


class PinnedRegion:
    """A mapping registered with a pinner: unregistered, then unmapped, at close (unmapped
    later, by the last view of it, where views are still alive then)."""

    def __init__(self, region: mmap.mmap, pinner: HostPinner, address: int) -> None:
        self.region = region
        self.pinner = pinner
        self.address = address
        self.nbytes = len(region)
        self.pinned = True

    def close(self) -> None:
        if self.pinned:
            self.pinned = False
            self.pinner.unregister(self.address)
        self.region.close()


def pinned_tensor(nbytes: int, pinner: HostPinner) -> tuple[torch.Tensor, PinnedRegion]:
    """``nbytes`` of page-locked memory as a uint8 tensor, locked at its page-aligned size (not
    rounded to a power of two), and the region to close once nothing uses it any more."""
    _, tensor, region = _allocate(align_up(max(nbytes, 1)), pinner, prefault=False)
    assert isinstance(region, PinnedRegion)  # a pinner was given
    return tensor[:nbytes], region


def _allocate(
    total: int, pinner: HostPinner | None, prefault: bool = True
) -> tuple[np.ndarray, torch.Tensor, object]:
    """Returns (uint8 array, uint8 tensor, owner) over ``total`` page-aligned bytes, faulted in
    unless ``prefault`` is False (then each page is faulted by its first use); page-locked by
    ``pinner`` at exactly ``total`` bytes when one is given (locking faults every page)."""
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
    region = mmap.mmap(-1, total, flags=flags)
    array = np.frombuffer(region, dtype=np.uint8)
    # The advice must come before the first touch, which is why MAP_POPULATE is not used.
    advise_huge_pages(array.ctypes.data, total)
    if prefault:
        try:
            region.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            array.fill(0)  # older kernels: touch every page
    tensor = torch.from_numpy(array)
    if pinner is None:
        return array, tensor, region
    address = int(array.ctypes.data)
    pinner.register(address, total)
    return array, tensor, PinnedRegion(region, pinner, address)


class BufferPool:
    """``buffer_count`` aligned buffers of ``buffer_size`` bytes.

    ``acquire`` waits at most ``timeout`` seconds for a free buffer and then raises
    :class:`PoolExhaustedError` naming who holds the buffers, instead of hanging.
    ``prefault=False`` leaves pages to be faulted by their first use: for a region that is filled
    gradually (a cache), where touching it all up front would only raise the peak RSS.
    """

    def __init__(
        self,
        buffer_count: int,
        buffer_size: int,
        *,
        pin_memory: bool | None = None,
        name: str = "swap",
        prefault: bool = True,
        pinner: HostPinner | None = None,
    ) -> None:
        """``pinner``: how memory is page-locked where it is pinned (default: CUDA's
        cudaHostRegister; given, it pins without CUDA, for tests of the sizing)."""
        if not isinstance(buffer_count, int) or isinstance(buffer_count, bool) or buffer_count < 1:
            raise SwapConfigError(f"buffer_count must be a positive integer, got {buffer_count!r}")
        if not isinstance(buffer_size, int) or isinstance(buffer_size, bool) or buffer_size < 1:
            raise SwapConfigError(f"buffer_size must be a positive integer, got {buffer_size!r}")
        self.name = name
        self.buffer_size = align_up(buffer_size)
        self.buffer_count = buffer_count
        cuda = torch.cuda.is_available() or pinner is not None
        if pin_memory is None:
            pin_memory = cuda
        self.pinned = bool(pin_memory and cuda)
        if self.pinned and pinner is None:
            pinner = CudaHostPinner()
        if pin_memory and not cuda:
            log.info(
                "%s pool: CUDA is not available, buffers are plain aligned memory (not pinned)",
                name,
            )
        total = self.buffer_size * buffer_count
        # The buffers' views keep the memory alive; ``_owner`` frees it at close.
        array, tensor, self._owner = _allocate(total, pinner if self.pinned else None, prefault)
        if array.ctypes.data % ALIGNMENT:
            raise RuntimeError("pool allocation is not page aligned")
        self._buffers = [
            HostBuffer(
                i,
                array[i * self.buffer_size : (i + 1) * self.buffer_size],
                tensor[i * self.buffer_size : (i + 1) * self.buffer_size],
                self,
            )
            for i in range(buffer_count)
        ]
        self._free: list[int] = list(range(buffer_count - 1, -1, -1))
        self._holders: dict[int, str] = {}
        self._cond = threading.Condition()
        self._closed = False
        log.debug(
            "%s pool: %d x %d bytes (%s)",
            name,
            buffer_count,
            self.buffer_size,
            "pinned" if self.pinned else "pageable",
        )

    @property
    def nbytes(self) -> int:
        return self.buffer_size * self.buffer_count

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked: every byte of the pool when pinned (no rounding), else none."""
        return self.nbytes if self.pinned else 0

    @property
    def free_count(self) -> int:
        with self._cond:
            return len(self._free)

    @property
    def buffers(self) -> tuple[HostBuffer, ...]:
        return tuple(self._buffers)

    def try_acquire(self, holder: str = "") -> HostBuffer | None:
        with self._cond:
            self._check_open()
            return self._take(holder) if self._free else None

    def acquire(self, timeout: float = 0.0, holder: str = "") -> HostBuffer:
        """A free buffer; waits up to ``timeout`` seconds for one to come back."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._check_open()
                if self._free:
                    return self._take(holder)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    held = ", ".join(f"#{i}: {h or '?'}" for i, h in sorted(self._holders.items()))
                    raise PoolExhaustedError(
                        f"all {self.buffer_count} buffers of the {self.name} pool "
                        f"({self.buffer_size} bytes each) are in use and none was released within "
                        f"{timeout:g} s (held by {held}). Raise buffer_count, or release buffers "
                        f"before acquiring more."
                    )
                self._cond.wait(remaining)

    def release(self, buffer: HostBuffer) -> None:
        with self._cond:
            if (
                buffer.pool is not self
                or buffer.index in self._free
                or buffer.index not in self._holders
            ):
                raise ValueError(f"{buffer!r} is not held from this pool")
            del self._holders[buffer.index]
            self._free.append(buffer.index)
            self._cond.notify()

    @contextmanager
    def borrow(self, timeout: float = 0.0, holder: str = "") -> Iterator[HostBuffer]:
        buffer = self.acquire(timeout, holder)
        try:
            yield buffer
        finally:
            self.release(buffer)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._buffers.clear()
        owner, self._owner = self._owner, None
        if isinstance(owner, (mmap.mmap, PinnedRegion)):
            try:
                owner.close()
            except BufferError:
                # A caller still holds a view of the memory: it is freed when that view goes.
                log.debug("%s pool: memory still referenced, freed later", self.name)

    def _take(self, holder: str) -> HostBuffer:
        index = self._free.pop()
        self._holders[index] = holder
        return self._buffers[index]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the {self.name} pool is closed")

    def __enter__(self) -> BufferPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
