"""The engine's bookkeeping objects: transfers, their futures, requests (and the cutting of a
transfer into them) and quarantine records."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from pathlib import Path

from swap.backends.base import Op
from swap.buffers import ALIGNMENT, HostBuffer, align_up
from swap.files import Extent, SwapFile
from swap.integrity import Chunk, TransferCheck
from swap.settings import EngineSettings


class Transfer:
    __slots__ = (
        "op",
        "future",
        "nbytes",
        "outstanding",
        "queued",
        "error",
        "buffer",
        "done",
        "event",
        "extent",
        "check",
        "hashing",
        "chunk_left",
    )

    def __init__(
        self, op: Op, nbytes: int, buffer: HostBuffer, extent: Extent, check: TransferCheck | None
    ) -> None:
        self.op = op
        self.future = TransferFuture(self)
        self.future.set_running_or_notify_cancel()
        self.nbytes = nbytes
        self.outstanding = 0  # requests in flight (not counting ones that timed out)
        self.queued = 0  # requests waiting in a drive queue
        self.error: BaseException | None = None
        self.done = False
        self.event = threading.Event()  # set with ``done``; what TransferFuture waits on
        self.buffer = buffer  # keeps the memory alive while requests are in flight
        self.extent = extent
        self.check = check  # integrity: checksums to record (write) or verify (read)
        self.hashing = 0  # chunks queued for or being hashed: the transfer is not done yet
        self.chunk_left: dict[int, int] = {}  # reads: bytes still to arrive, per covered chunk


class TransferFuture(Future):
    """The future of one transfer. Its outcome is known as soon as the last request completes,
    before the dispatcher thread gets to run the done-callbacks: ``result``, ``exception`` and
    ``done`` answer from that, so they never wait on the dispatcher (which may be running the
    very callback that asks)."""

    def __init__(self, transfer: Transfer) -> None:
        super().__init__()
        self._transfer: Transfer | None = transfer

    def detach(self) -> None:
        """The outcome is this Future's own now (the dispatcher set it): forget the transfer.
        The transfer refers to this future, so keeping it made a cycle that only the garbage
        collector frees, and with it the transfer's buffer: a closed pool's memory stayed
        mapped until a collection ran."""
        self._transfer = None

    def done(self) -> bool:
        transfer = self._transfer
        return (transfer is not None and transfer.event.is_set()) or super().done()

    def result(self, timeout: float | None = None) -> int:
        error = self.exception(timeout)
        if error is not None:
            raise error
        transfer = self._transfer
        return transfer.nbytes if transfer is not None else int(super().result())

    def exception(self, timeout: float | None = None) -> BaseException | None:
        transfer = self._transfer
        if transfer is None:
            return super().exception()
        if not transfer.event.wait(timeout):
            # concurrent.futures' own TimeoutError: only an alias of the builtin from 3.11 on
            raise FutureTimeoutError(f"the transfer did not finish within {timeout} s")
        return transfer.error


class Chain:
    """Requests of one transfer submitted together (``IOBackend.submit_chain``): they hold one
    queue slot of their drive until the last of them completes."""

    __slots__ = ("drive", "left", "stalled", "owner", "handed")

    def __init__(self, drive: int, left: int, owner: int) -> None:
        self.drive = drive
        self.left = left  # requests not completed yet, timed out ones included
        self.stalled = False  # one of them timed out: the slot may never free up
        #: the thread that takes it from the queue and submits it
        self.owner = owner
        #: about to be given to the backend (set just before start_chain): until then a
        #: signal handler raising in the owner leaves it counted in flight and never submitted
        self.handed = False


@dataclass(slots=True, eq=False)  # identity hashing: pieces live in sets
class Piece:
    """One request: at most block_size bytes inside one integrity chunk and one stripe unit."""

    transfer: Transfer
    file: SwapFile
    offset: int
    address: int
    length: int
    chunk: Chunk | None = None  # the covered integrity chunk this request is part of
    started: float = 0.0  # monotonic time of the submit
    timed_out: bool = False
    chain: Chain | None = None  # set at the submit
    #: its outcome was applied (SwapEngine._settle applies it once, even when a signal
    #: interrupted the submit after the backend had already taken the completion callback)
    settled: bool = False

    def continued_by(self, other: Piece) -> bool:
        """Whether ``other`` starts where this ends, in the file and in memory."""
        return (
            other.transfer is self.transfer
            and other.file is self.file
            and other.offset == self.offset + self.length
            and other.address == self.address + self.length
        )


def cut_into_pieces(
    transfer: Transfer,
    extent_offset: int,
    buffer_offset: int,
    padded: int,
    block: int,
    size: int,
) -> tuple[list[Piece], list[Chunk]]:
    """The requests of ``padded`` bytes of ``transfer`` from ``extent_offset`` of its extent
    and ``buffer_offset`` of its buffer: at most ``block`` bytes each, cut on the ``block``-byte
    grid of the extent; and the integrity chunks (of ``size`` bytes) the transfer covers
    entirely. Each request is tagged with the chunk it is part of; ``transfer.chunk_left``
    counts the bytes each chunk awaits."""
    extent = transfer.extent
    base = transfer.buffer.address
    check = transfer.check
    chunks: dict[int, Chunk] = {}
    pieces = []
    for file, file_offset, ext_offset, length in extent.locate(extent_offset, padded):
        done = 0
        while done < length:
            at = ext_offset + done
            take = min(block - at % block, length - done)
            chunk = None
            index = at // size
            if check is not None and check.first <= index < check.stop:
                chunk = chunks.get(index)
                if chunk is None:  # its first byte: where a mismatch is reported
                    start = index * size
                    chunk = chunks[index] = Chunk(
                        index,
                        buffer_offset + (start - extent_offset),
                        min(size, extent.nbytes - start),
                        file.path,
                        file_offset + done - (at - start),
                    )
                    transfer.chunk_left[index] = 0
                transfer.chunk_left[index] += take
            pieces.append(
                Piece(
                    transfer,
                    file,
                    file_offset + done,
                    base + buffer_offset + (at - extent_offset),
                    take,
                    chunk,
                )
            )
            done += take
    return pieces, list(chunks.values())


@dataclass(frozen=True)
class Quarantined:
    """Memory and file space a request that timed out may still be using.

    The kernel can complete such a request at any time: a read then writes into ``buffer``
    bytes [buffer_start, buffer_end), a write stores whatever those bytes hold then into
    ``path`` at ``offset``. The engine keeps a reference to the buffer (so its memory is never
    unmapped under the kernel) and keeps the extent's space from being handed to another extent
    until the request completes; the caller must not put other data in that buffer range."""

    op: str
    path: Path
    offset: int
    length: int
    extent: int
    buffer: HostBuffer = field(repr=False)
    buffer_start: int = 0
    buffer_end: int = 0
    since: float = field(default_factory=time.monotonic)
    #: set once the request has completed and the memory and space may be reused; never set
    #: for a request the backend abandoned at close
    released: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)

    def describe(self) -> str:
        return (
            f"{self.op} of {self.length} bytes at offset {self.offset} in {self.path} "
            f"(extent #{self.extent}, buffer #{self.buffer.index} bytes "
            f"[{self.buffer_start}, {self.buffer_end}))"
        )


#: Bytes each drive's queue slots hold together once enough is queued. Requests complete on
#: Python threads, which wait for the GIL behind a training thread running Python for up to a
#: switch interval (5 ms by default) per wake-up; only requests already handed to the backend
#: move meanwhile, and a slot is refilled only once its whole chain is done. With 16 single
#: 1 MiB requests (16 MiB) the drive idled through most of each wait: next to a pure-Python
#: loop the engine kept 0.5-0.6 of its bandwidth (infinity-bench --interference, 1 MiB requests,
#: queue depth 16). Chains of 4 (64 MiB) kept 0.7-0.98 run to run, chains of 8 (this) 0.78-0.91:
#: the slots' chains tend to end together, each end costs one wait, so longer chains mean fewer.
#: The price: transfers smaller than this that are queued together share the slots instead of
#: finishing one after another. Both backends move a chain with one call, which the kernel splits
#: into requests of the device's size: the drive sees ``queue_depth`` such calls at a time.
CHAIN_BYTES = 128 << 20


def chain_length(settings: EngineSettings, max_chain: int) -> int:
    """Requests per queue slot: ``CHAIN_BYTES`` over the drive's slots, within what the backend
    takes (1 for a backend without chains)."""
    per_slot = CHAIN_BYTES // (settings.queue_depth * settings.block_size)
    return max(1, min(max_chain, per_slot))


def checked_range(
    extent: Extent, nbytes: int | None, extent_offset: int, buffer_offset: int
) -> int:
    """The bytes a transfer of ``extent`` from ``extent_offset`` moves (``nbytes``; None: to the
    extent's end), refused (ValueError) where the offsets are not aligned or the range is not
    inside the extent."""
    if nbytes is None:
        nbytes = extent.nbytes - extent_offset
    if extent_offset % ALIGNMENT or buffer_offset % ALIGNMENT or buffer_offset < 0:
        raise ValueError(
            f"extent_offset and buffer_offset must be non-negative multiples of "
            f"{ALIGNMENT}, got {extent_offset} and {buffer_offset}"
        )
    if nbytes < 0 or extent_offset < 0 or extent_offset + nbytes > extent.nbytes:
        raise ValueError(
            f"range [{extent_offset}, {extent_offset + nbytes}) is outside the "
            f"extent's {extent.nbytes} bytes"
        )
    return nbytes


def padded_in_buffer(
    op: Op, extent: Extent, buffer: HostBuffer, nbytes: int, extent_offset: int, buffer_offset: int
) -> int:
    """The transfer's bytes padded to whole blocks, refused (ValueError) where they do not fit in
    ``buffer`` or a write's padding would overwrite bytes after it; a write's padding is zeroed."""
    padded = align_up(nbytes)
    if buffer_offset + padded > buffer.nbytes:
        raise ValueError(
            f"{op.value} of {nbytes} bytes (padded to {padded}) at buffer offset "
            f"{buffer_offset} does not fit in a {buffer.nbytes}-byte buffer"
        )
    if op is Op.WRITE and padded > nbytes:
        if extent_offset + nbytes != extent.nbytes:
            raise ValueError(
                f"a write of {nbytes} bytes (not a multiple of {ALIGNMENT}) "
                f"must end at the extent's end ({extent.nbytes}), else the "
                f"block padding would overwrite the bytes after it"
            )
        # Deterministic padding: the file holds exactly what was written, then zeros.
        buffer.array[buffer_offset + nbytes : buffer_offset + padded] = 0
    return padded
