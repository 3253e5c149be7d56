"""The device and host tiers: memory under exact byte accounting and an enforced budget.

The device tier holds the working copies modules compute with. On CUDA they are device tensors
moved with asynchronous copies on a side stream; on a machine without CUDA the "device" is
ordinary memory under its own budget and moving a shard there is a real copy, so every code path
runs in CI.

The host tier holds master copies. NVMe-backed shards live in the staging arena: one aligned
(pinned with CUDA) region that the swap engine reads into and writes from directly, carved into
4096-aligned ranges. Shards offloaded to the CPU only live in standalone host tensors.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
from torch.types import Storage

from infinity.core.arena import SlotArena
from infinity.core.streams import StreamEvent, Streams, streams_for
from infinity.errors import BudgetError
from swap import ALIGNMENT, BufferPool, HostBuffer, advise_huge_pages, align_up, release_pages
from swap.buffers import CudaHostPinner, HostPinner, PinnedRegion, pinned_tensor
from swap.files import RangeAllocator

if TYPE_CHECKING:
    from infinity.inference.quantized import WeightQuantizer

log = logging.getLogger(__name__)

#: A CPU device's working copies point their storage at the tier's slab by swapping the
#: storage's memory in and out (private torch API: without it, a fresh allocation per gather)
_CAN_SWAP_STORAGE = hasattr(torch.UntypedStorage, "_swap_data_ptr_") and hasattr(
    torch._C, "_construct_storage_from_data_pointer"
)


def _swap_memory(storage: torch.UntypedStorage, other: Storage) -> None:
    """Swaps the memory under two storage objects; private torch API (see _CAN_SWAP_STORAGE),
    which torch's stubs do not declare."""
    storage._swap_data_ptr_(other)  # type: ignore[attr-defined]


class _SlabCopy(NamedTuple):
    """A working copy whose memory is a range of the slab."""

    offset: int
    nbytes: int
    own: Storage  # holds the storage's own (empty) memory meanwhile
    storage: torch.UntypedStorage


@dataclass
class TierUsage:
    current: int = 0
    peak: int = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def sub(self, nbytes: int) -> None:
        self.current -= nbytes
        if self.current < 0:
            raise RuntimeError("tier accounting went negative")


class DeviceTier:
    """Working copies on ``device`` under ``budget`` bytes."""

    def __init__(
        self, device: torch.device, budget: int, copies: int = 0, streams: Streams | None = None
    ) -> None:
        """``copies``: how many working copies there may be (the parameters), each of which
        takes a 4096-aligned range of the slab: its alignment is room beside the budget's bytes,
        so that a budget of every parameter's bytes holds every copy. ``streams``: how copies
        are ordered (infinity.core.streams; default: the device's own)."""
        self.device = device
        self.budget = budget
        self.slab_bytes = align_up(max(budget, 1)) + ALIGNMENT * copies
        self.usage = TierUsage()
        self.cuda = device.type == "cuda"
        #: every stream/event ordering of the tier's copies (infinity.core.streams)
        self.streams = streams if streams is not None else streams_for(device)
        #: copies run after they are issued, ordered by events (CUDA, or the recording fake)
        self.asynchronous = self.streams.asynchronous
        #: whether working copies are host memory (a CPU device): a gradient computed there
        #: is already a host tensor (the planner's meta tier says what it simulates)
        self.host_memory = device.type == "cpu" and not self.asynchronous
        #: the device memory the allocator reserved beyond what it handed out, at its most,
        #: on top of the tier's peak (see check_reserved)
        self.reserved_excess = 0
        self._warned_reserved = False
        # Traffic between the tiers, for stats(). Seconds count only copies the training
        # thread performs itself: without a GPU every copy is a memcpy on the cores that also
        # compute, which is the part of an attached step that a GPU's copy engine would take.
        self.bytes_in = 0
        self.bytes_out = 0
        self.copy_seconds = 0.0
        #: reusable memory for the device copies on a CPU device (fill, slab_take)
        self._slab: HostBuffer | None = None
        self._slab_pool: BufferPool | None = None
        self._slab_ranges: RangeAllocator | None = None
        #: storage (its StorageImpl address) -> the slab range under it
        self._in_slab: dict[int, _SlabCopy] = {}
        #: fills that found no free range in the slab and took fresh memory
        self.slab_misses = 0

    def fits(self, nbytes: int) -> bool:
        return self.usage.current + nbytes <= self.budget

    def has_room(self, *sizes: int) -> bool:
        """Whether copies of ``sizes`` bytes fit the budget together and, on a CPU device, a
        free range of the slab each (taken in this order, as fills take them): with the bytes
        free but scattered a copy would take fresh memory beyond the slab (a miss), which the
        budget then no longer bounds."""
        if not self.fits(sum(sizes)):
            return False
        if self._slab_ranges is None or not self.uses_slab:
            return True
        return self._slab_ranges.can_take([align_up(n) for n in sizes if n])

    @property
    def uses_slab(self) -> bool:
        """Whether working copies are ranges of the slab (a CPU device)."""
        return self.device.type == "cpu" and _CAN_SWAP_STORAGE and not self.asynchronous

    def holds_address(self, address: int) -> bool:
        """Whether ``address`` lies in the slab (a CPU device's working copies)."""
        slab = self._slab
        return slab is not None and slab.address <= address < slab.address + slab.nbytes

    def fill(self, tensor: torch.Tensor) -> None:
        """Gives ``tensor``'s (empty) storage its bytes, within the budget. On a CPU device the
        bytes are a range of the tier's slab, faulted in once and reused: a fresh mapping per
        gather (see infinity.core.memory) faulted every page again, which cost about as much as the
        copy itself. The storage object stays the same (views autograd saved in forward see
        the values of the next gather); only the memory under it changes."""
        nbytes = tensor.numel() * tensor.element_size()
        self.charge(nbytes)
        storage = tensor.untyped_storage()
        if self._fill_from_slab(storage, nbytes):
            return
        try:
            storage.resize_(nbytes)
        except BaseException:
            self.usage.sub(nbytes)
            raise
        # The copy that fills it must come after the block's last reader (streams.allocated).
        self.streams.allocated(tensor)
        if self.device.type == "cpu" and not self.asynchronous:
            # A fresh mapping for every gather (see infinity.core.memory): with 4 KiB pages, filling
            # it costs about as much in page faults as in copying.
            advise_huge_pages(storage.data_ptr(), nbytes)

    def _slab_range(self, nbytes: int) -> int | None:
        """A free range of the slab (made on first use: the budget's bytes), or None."""
        if self._slab is None:
            self._slab_pool = BufferPool(
                1,
                self.slab_bytes,
                pin_memory=False,
                name="device slab",
                prefault=False,
            )
            self._slab = self._slab_pool.acquire(holder="device tier")
            self._slab_ranges = RangeAllocator(self._slab.nbytes)
        assert self._slab_ranges is not None  # made with the slab
        return self._slab_ranges.take(align_up(nbytes))

    def _fill_from_slab(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        if not self.uses_slab or not nbytes:
            return False
        offset = self._slab_range(nbytes)
        if offset is None:
            # The free bytes are there (the budget was charged) but not in one range.
            self.slab_misses += 1
            return False
        assert self._slab is not None  # a range of it was taken
        piece = torch._C._construct_storage_from_data_pointer(
            self._slab.address + offset, self.device, nbytes
        )
        _swap_memory(storage, piece)  # piece now holds the storage's own (empty) memory
        self._in_slab[storage._cdata] = _SlabCopy(offset, nbytes, piece, storage)
        return True

    def slab_take(self, nbytes: int) -> int | None:
        """A range of ``nbytes`` in a region of host memory the tier keeps (a CPU device only),
        charged to the budget; None when it does not fit. The region is faulted in once and
        reused, where a fresh allocation per gather faults every page again (0.24-0.28 s
        instead of 0.04 s for a 131 MB copy here, with huge pages not always at hand)."""
        if self.device.type != "cpu" or not self.fits(nbytes):
            return None
        offset = self._slab_range(nbytes)
        if offset is not None:
            self.usage.add(nbytes)
        return offset

    def slab_view(self, offset: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        assert self._slab is not None  # a range of it was taken
        return self._slab.view(dtype, numel, offset)

    def slab_give(self, offset: int, nbytes: int) -> None:
        assert self._slab_ranges is not None  # a range of it was taken
        self._slab_ranges.give(offset, align_up(nbytes))
        self.usage.sub(nbytes)

    def close(self) -> None:
        # Storages still pointing into the slab get their own empty memory back before it goes.
        for copy in self._in_slab.values():
            _swap_memory(copy.storage, copy.own)
        self._in_slab.clear()
        if self._slab is not None:
            assert self._slab_pool is not None  # made with the slab
            self._slab_pool.release(self._slab)
            self._slab_pool.close()
            self._slab = self._slab_pool = None

    def charge(self, nbytes: int) -> None:
        """Counts ``nbytes`` of working copies against the budget (``fill``'s, and those of a
        copy lent by the host tier, which takes no new memory: the working set is bounded the
        same way with or without copies)."""
        if not self.fits(nbytes):
            raise BudgetError(
                f"device tier: {nbytes} bytes do not fit ({self.usage.current} of "
                f"{self.budget} in use)"
            )
        self.usage.add(nbytes)

    def empty(self, tensor: torch.Tensor) -> None:
        """Frees ``tensor``'s bytes, keeping the storage object (see Placement.drop_device).
        On CUDA the caching allocator orders the reuse after the compute stream's pending
        kernels; copies on the side stream are recorded against it in ``copy_in``."""
        storage = tensor.untyped_storage()
        copy = self._in_slab.pop(storage._cdata, None)
        if copy is not None:
            _swap_memory(storage, copy.own)  # its own empty memory back; the range is free
            assert self._slab_ranges is not None  # made with the slab
            self._slab_ranges.give(copy.offset, align_up(copy.nbytes))
        else:
            self.streams.freed(tensor)
            storage.resize_(0)
        self.usage.sub(tensor.numel() * tensor.element_size())

    def copy_in(
        self, dst: torch.Tensor, src: torch.Tensor, quant: WeightQuantizer | None = None
    ) -> StreamEvent:
        """Copies host ``src`` into device ``dst``; on CUDA asynchronously on the copy stream,
        after ``dst``'s allocation (``fill``). With ``quant``, ``src`` is a quantized shard's
        stored bytes, decoded into ``dst`` (on CUDA moved as they are and decoded on the
        device). A master in another dtype than ``dst`` (fp32 for a bf16 copy) is converted on
        the host first, so the link carries the compute dtype's bytes rather than the master's
        and no device temporary of the master's size is made. ``bytes_in`` counts the bytes
        that cross. Returns the event that marks completion (None when the copy is done)."""
        if not self.asynchronous:
            self.bytes_in += (src if quant is not None else dst).nbytes
            started = time.perf_counter()
            if quant is None:
                dst.copy_(src)
            else:
                quant.decode(src, dst)
            self.copy_seconds += time.perf_counter() - started
            return None
        if quant is None and src.dtype != dst.dtype:
            # Pinned where CUDA is: torch's host allocator keeps the block until the copy ran.
            staged = torch.empty(src.shape, dtype=dst.dtype, pin_memory=self.cuda)
            staged.copy_(src)
            src = staged
        self.bytes_in += src.nbytes

        def work() -> None:
            if quant is None:
                dst.copy_(src, non_blocking=True)
            else:
                # Made on the copy stream, used there only: its reuse is ordered on it.
                quant.decode(src.to(dst.device, non_blocking=True), dst)

        return self.streams.copy(work, keep=(dst,), label="h2d", nbytes=src.nbytes)

    def copy_out_async(self, dst: torch.Tensor, src: torch.Tensor) -> StreamEvent:
        """Starts copying device ``src`` (what the compute stream just produced: a gradient)
        into host ``dst`` on the copy stream; returns its event (None: done already). ``dst``
        must stay untouched by the host until the event completes (``streams.synchronize``,
        or a :class:`~infinity.core.streams.CompletionQueue`)."""
        self.bytes_out += src.nbytes
        if not self.asynchronous:
            started = time.perf_counter()
            dst.copy_(src)
            self.copy_seconds += time.perf_counter() - started
            return None
        self.streams.after_compute()

        def work() -> None:
            dst.copy_(src, non_blocking=True)

        return self.streams.copy(work, keep=(src,), label="d2h", nbytes=src.nbytes)

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copies device ``src`` into host ``dst``, blocking."""
        self.streams.synchronize(self.copy_out_async(dst, src))

    def wait(self, event: StreamEvent) -> None:
        """Makes the compute stream wait for a copy before using its destination."""
        self.streams.wait(event)

    def check_reserved(self) -> int:
        """Compares the device memory the allocator reserved (every stream's pool: the copy
        stream's, conversion temporaries, fragmentation) with the budget, which counts the
        working copies' logical bytes only. Logs once when the memory reserved beyond what was
        ever allocated, added to the tier's peak, passes the budget; returns that excess
        (0 without CUDA)."""
        figures = self.streams.memory_figures()
        if figures is None:
            return 0
        reserved, max_allocated = figures
        excess = reserved_over_budget(reserved, max_allocated, self.usage.peak, self.budget)
        self.reserved_excess = max(self.reserved_excess, excess)
        if excess > 0 and not self._warned_reserved:
            self._warned_reserved = True
            log.warning(
                "device memory: the allocator reserves %d bytes (at most %d of them allocated "
                "at once), so the device tier's %d-byte peak takes %d bytes more than "
                "device_budget=%d allows (the copy stream's pool, conversion temporaries and "
                "fragmentation are outside its logical accounting): lower device_budget by "
                "that much, or set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                reserved,
                max_allocated,
                self.usage.peak,
                excess,
                self.budget,
            )
        return excess


def reserved_over_budget(reserved: int, max_allocated: int, tier_peak: int, budget: int) -> int:
    """Bytes by which the device tier's real footprint passes ``budget``: its logical peak plus
    what the allocator reserves beyond the most it ever handed out (cached blocks of other
    streams' pools, fragmentation), which the tier's working copies cause as much as anything.
    0 when within the budget."""
    overhead = max(0, reserved - max_allocated)
    return max(0, tier_peak + overhead - budget)


#: standalone host tensors of at least this many bytes are page-locked at their own size
EXACT_PIN_BYTES = 1 << 20


class HostTier:
    """Master copies on the host: the staging arena plus standalone tensors, under one budget."""

    def __init__(
        self,
        budget: int,
        arena_bytes: int,
        pin: bool,
        slot_size: int = 0,
        meta: bool = False,
        pinner: HostPinner | None = None,
    ) -> None:
        """``meta``: hold no bytes (every tensor on the meta device), for the planner's
        simulation of the same placement decisions. ``pinner``: how memory is page-locked
        (default: cudaHostRegister with CUDA; given, it pins without CUDA, for tests)."""
        self.meta = meta
        self.budget = budget
        self.usage = TierUsage()
        self.pin = pin and (torch.cuda.is_available() or pinner is not None)
        self._pinner = pinner if pinner is not None else CudaHostPinner()
        #: standalone host tensors page-locked at their own size (see allocate)
        self._pinned: list[PinnedRegion] = []
        self.pinned_standalone = 0
        self.lock = threading.Lock()
        self._pool: BufferPool | None = None
        self.arena: HostBuffer | None = None
        self._ranges: SlotArena | None = None
        self.arena_bytes = 0
        #: slots that become free hand their pages back (release_free_pages: at close)
        self.releasing = False
        if arena_bytes:
            slot = min(align_up(slot_size or arena_bytes), align_up(arena_bytes))
            self._ranges = SlotArena(slot, max(1, arena_bytes // slot))
            self.arena_bytes = self._ranges.nbytes
            if meta:
                # A stand-in with HostBuffer's view(), for the planner's simulation (whose
                # swap engine is simulated too).
                self.arena = cast(HostBuffer, _MetaBuffer(self.arena_bytes))
                return
            # Not pre-faulted: the arena fills while attach frees the model's own parameter
            # memory, so faulting it all first would count both at once in the peak RSS.
            self._pool = BufferPool(
                1,
                self.arena_bytes,
                pin_memory=self.pin,
                name="staging arena",
                prefault=False,
                pinner=pinner,
            )
            self.arena = self._pool.acquire(holder="host tier")

    # -- arena (NVMe-backed shards) -----------------------------------------------------------
    def take_arena(self, nbytes: int) -> int | None:
        """An aligned offset of ``nbytes`` in the arena, or None when no range is free."""
        size = align_up(max(nbytes, 1))
        with self.lock:
            if self._ranges is None or self.usage.current + size > self.budget:
                return None
            offset = self._ranges.take(size)
            if offset is not None:
                self.usage.add(size)
            return offset

    def take_arena_run(self, nbytes: int, count: int) -> int | None:
        """A whole slot for a range of ``nbytes`` with ``count - 1`` free slots after it."""
        size = align_up(max(nbytes, 1))
        with self.lock:
            if (
                self._ranges is None
                or not self._ranges.whole(size)
                or self.usage.current + size > self.budget
            ):
                return None
            offset = self._ranges.take_run(count)
            if offset is not None:
                self.usage.add(size)
            return offset

    def take_arena_at(self, offset: int, nbytes: int) -> bool:
        """The whole slot at ``offset`` for a range of ``nbytes``, if it is free."""
        size = align_up(max(nbytes, 1))
        with self.lock:
            if (
                self._ranges is None
                or not self._ranges.whole(size)
                or self.usage.current + size > self.budget
                or not self._ranges.take_slot_at(offset)
            ):
                return False
            self.usage.add(size)
            return True

    def give_arena(self, offset: int, nbytes: int) -> None:
        size = align_up(max(nbytes, 1))
        with self.lock:
            assert self._ranges is not None
            freed = self._ranges.give(offset, size)
            self.usage.sub(size)
            if freed is not None and self.releasing and isinstance(self.arena, HostBuffer):
                release_pages(self.arena.address + freed, self._ranges.slot_size)

    def arena_view(self, offset: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        assert self.arena is not None
        return self.arena.view(dtype, numel, offset)

    def holds_address(self, address: int) -> bool:
        """Whether ``address`` lies in the arena."""
        arena = self.arena
        return (
            isinstance(arena, HostBuffer)
            and arena.address <= address < arena.address + arena.nbytes
        )

    def release_free_pages(self) -> int:
        """Hands the pages of every free slot back to the system, and from now on those of each
        slot as it becomes free (they are faulted again by their next use), so that the arena's
        RSS is what it holds: for close, which gives the parameters back while the arena
        empties. Not for page-locked memory. Returns the bytes released now."""
        arena = self.arena
        if self.pin or self._ranges is None or not isinstance(arena, HostBuffer):
            return 0
        released = 0
        with self.lock:
            self.releasing = True
            for offset in self._ranges.free_slot_offsets():
                if release_pages(arena.address + offset, self._ranges.slot_size):
                    released += self._ranges.slot_size
        return released

    # -- standalone host tensors (CPU-offloaded shards) ---------------------------------------
    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        with self.lock:
            if self.usage.current + nbytes > self.budget:
                raise BudgetError(
                    f"host tier: {nbytes} more bytes exceed the host budget of "
                    f"{self.budget} ({self.usage.current} in use)"
                )
            self.usage.add(nbytes)
        if self.meta:
            return torch.empty(numel, dtype=dtype, device="meta")
        if self.pin and nbytes >= EXACT_PIN_BYTES:
            # torch's pinned allocator would round it up to a power of two and keep that: a
            # 40 MiB master would lock 64 MiB, outside the budget. Locked here at its own
            # (page-aligned) size, until close.
            flat, region = pinned_tensor(nbytes, self._pinner)
            self._pinned.append(region)
            self.pinned_standalone += region.nbytes
            return flat.view(dtype)
        return torch.empty(numel, dtype=dtype, pin_memory=self.pin and torch.cuda.is_available())

    def scratch(self, shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor outside the budget's accounting (a gradient the caller accounts for),
        pinned with CUDA; a meta tensor in the planner's simulation."""
        if self.meta:
            return torch.empty(shape, dtype=dtype, device="meta")
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin)

    def free(self, tensor: torch.Tensor) -> None:
        with self.lock:
            self.usage.sub(tensor.numel() * tensor.element_size())

    def slot_cost(self, nbytes: int) -> int:
        """Arena bytes a range of ``nbytes`` occupies (a whole slot when over half of one)."""
        size = align_up(max(nbytes, 1))
        if self._ranges is not None and self._ranges.whole(size):
            return self._ranges.slot_size
        return size

    @property
    def slot_size(self) -> int:
        return self._ranges.slot_size if self._ranges is not None else 0

    @property
    def pinned_bytes(self) -> int:
        """Host memory page-locked at its exact size: the arena, and the standalone tensors of
        at least EXACT_PIN_BYTES (smaller ones and gradient buffers come from torch's pinned
        allocator, which rounds them up)."""
        arena = self.arena_bytes if self.pin and self._pool is not None else 0
        return arena + self.pinned_standalone

    def close(self) -> None:
        for region in self._pinned:
            try:
                region.close()
            except BufferError:
                pass  # still viewed (a parameter handed back): unmapped with its last view
        self._pinned.clear()
        self.pinned_standalone = 0
        if self._pool is not None:
            if self.arena is not None:
                self._pool.release(self.arena)
            self.arena = None
            self._pool.close()
            self._pool = None


class _MetaBuffer:
    """An arena that holds no bytes: views of it are meta tensors (see HostTier's ``meta``)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def view(self, dtype: torch.dtype, numel: int, offset: int = 0) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device="meta")


__all__ = ["DeviceTier", "HostTier", "TierUsage", "reserved_over_budget"]
