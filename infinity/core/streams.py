"""Streams and events: every ordering between the device's compute stream, its copy stream and
the host goes through here (see STREAMS.md beside this file for the rules).

Three implementations of one interface, :class:`Streams`:

* :class:`CudaStreams`: a CUDA device. Copies run on a side stream and return an event.
* :class:`HostStreams`: a device that is host memory (no GPU). Every copy runs at once and
  returns no event; every wait is a no-op, so the CPU path is the plain sequential one.
* :class:`RecordingStreams`: a stand-in for a GPU that the CPU suite drives. Copies are queued
  and only run when something waits for their event (as a copy engine runs them later), and
  every allocation, copy, event, wait and piece of host work is written to ``log``: a path that
  forgets a wait reads bytes that are not there yet, and the log shows which order it took.

The device identity helpers (:func:`indexed_device`, :func:`same_device`) are here too:
``cuda`` and ``cuda:0`` name the same device but compare unequal, so a device is given its
index once, at attach, and compared by type and index.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from infinity.errors import AttachError

log = logging.getLogger(__name__)

#: an event as the implementations hand it out (torch.cuda.Event, a _FakeEvent, or None for
#: work that is already done)
StreamEvent = Any


def indexed_device(device: torch.device, current_index: Callable[[], int]) -> torch.device:
    """``device`` with an index: a CUDA device named without one (``cuda``) is the current
    device, ``current_index()``, which tensors made on it report (``cuda:0``)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", current_index())
    return device


def device_named(name: str, cuda_available: bool, current_index: Callable[[], int]) -> torch.device:
    """The device ``name`` (a config's ``device``: ``auto``, ``cpu``, ``cuda``, ``cuda:1``)
    names, with its index (see :func:`indexed_device`)."""
    if name == "auto":
        name = "cuda" if cuda_available else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not cuda_available:
        raise AttachError(
            f"device {name!r} was asked for but CUDA is not available: use device='auto' or 'cpu'"
        )
    return indexed_device(device, current_index)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are the same device, where one of them may lack its index (a
    device without one is taken as the current one, whose index is the other's)."""
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


class Streams:
    """The orderings the store needs (see the module docstring). This base is the host
    implementation: everything runs at once, in program order."""

    #: copies run later than they are issued (a GPU's copy engine, or the recording fake)
    asynchronous = False

    def allocated(self, tensor: torch.Tensor) -> None:
        """Memory for ``tensor`` was just allocated on the compute stream, and a copy on the
        copy stream is about to write it: the copy stream waits for everything queued on the
        compute stream so far. The caching allocator may hand out a block that kernels still
        queued on the compute stream read (freed when their tensor went, not when they ran);
        an event recorded now, after the allocation, comes after that block's last reader."""

    def freed(self, tensor: torch.Tensor) -> None:
        """``tensor``'s memory goes back to the allocator, which orders its reuse after the
        compute stream's queued kernels and (``keep``) the copies that used it."""

    def copy(
        self,
        work: Callable[[], None],
        keep: Iterable[torch.Tensor] = (),
        label: str = "copy",
        nbytes: int = 0,
    ) -> StreamEvent:
        """Runs ``work`` (copies) on the copy stream; ``keep``: device tensors it uses, whose
        memory the allocator must not reuse before it has run; ``nbytes``: what crosses the
        link. Returns the event that marks
        its completion, or None when it is done already."""
        work()
        return None

    def after_compute(self) -> None:
        """The copy stream waits for the compute stream (a copy of what kernels produce)."""

    def wait(self, event: StreamEvent) -> None:
        """The compute stream waits for ``event`` before its next kernel."""

    def synchronize(self, event: StreamEvent) -> None:
        """The host waits for ``event`` (before it reads or writes memory a copy uses)."""

    def done(self, event: StreamEvent) -> bool:
        """Whether the work before ``event`` has run (None: always)."""
        return True

    def host_work(self, label: str) -> None:
        """Host work that depends on a copy starts (only the recording fake notes it)."""

    def memory_figures(self) -> tuple[int, int] | None:
        """The device memory the allocator reserves for every stream, and the most it handed
        out at once (None: not a CUDA device)."""
        return None


#: the no-op implementation for a device that is host memory
HostStreams = Streams


class CudaStreams(Streams):
    """A CUDA device: copies on a side stream, ordered by events."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def allocated(self, tensor: torch.Tensor) -> None:
        self.after_compute()

    def after_compute(self) -> None:
        event = torch.cuda.Event()
        event.record(self._compute())
        self.copy_stream.wait_event(event)

    def copy(
        self,
        work: Callable[[], None],
        keep: Iterable[torch.Tensor] = (),
        label: str = "copy",
        nbytes: int = 0,
    ) -> StreamEvent:
        stream = self.copy_stream
        with torch.cuda.stream(stream):
            work()
            for tensor in keep:
                if tensor.device.type == "cuda":
                    tensor.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def wait(self, event: StreamEvent) -> None:
        if event is not None:
            self._compute().wait_event(event)

    def synchronize(self, event: StreamEvent) -> None:
        if event is not None:
            event.synchronize()

    def done(self, event: StreamEvent) -> bool:
        return event is None or bool(event.query())

    def memory_figures(self) -> tuple[int, int] | None:
        return (
            int(torch.cuda.memory_reserved(self.device)),
            int(torch.cuda.max_memory_allocated(self.device)),
        )


@dataclass(eq=False)
class _FakeEvent:
    number: int
    ran: bool = False


@dataclass
class RecordingStreams(Streams):
    """The recording fake (see the module docstring). ``log`` holds tuples: ``("alloc",
    address)``, ``("copy-waits-compute", n)``, ``("copy", label, n, nbytes, addresses)`` when
    issued (the storages it keeps) and ``("ran", label, n)`` when run, ``("wait", n)`` (the
    compute stream), ``("sync", n)`` (the host), ``("host", label)``, ``("free", address)``."""

    log: list[tuple] = field(default_factory=list)
    asynchronous = True
    _queue: deque = field(default_factory=deque)
    _numbers: Any = field(default_factory=lambda: itertools.count(1))
    _compute_marks: int = 0
    #: what memory_figures reports (reserved, most allocated); None: not a CUDA device
    figures: tuple[int, int] | None = None

    def note(self, *entry: Any) -> None:
        self.log.append(entry)

    def allocated(self, tensor: torch.Tensor) -> None:
        self.note("alloc", tensor.untyped_storage().data_ptr())
        self.after_compute()

    def freed(self, tensor: torch.Tensor) -> None:
        self.note("free", tensor.untyped_storage().data_ptr())

    def after_compute(self) -> None:
        self._compute_marks += 1
        self.note("copy-waits-compute", self._compute_marks)

    def copy(
        self,
        work: Callable[[], None],
        keep: Iterable[torch.Tensor] = (),
        label: str = "copy",
        nbytes: int = 0,
    ) -> StreamEvent:
        event = _FakeEvent(next(self._numbers))
        self._queue.append((work, label, event))
        kept = tuple(t.untyped_storage().data_ptr() for t in keep)
        self.note("copy", label, event.number, nbytes, kept)
        return event

    def _run_until(self, event: _FakeEvent | None) -> None:
        """Runs the queued copies up to ``event`` (None: all of them)."""
        while (event is None or not event.ran) and self._queue:
            work, label, queued = self._queue.popleft()
            work()
            queued.ran = True
            self.note("ran", label, queued.number)

    def wait(self, event: StreamEvent) -> None:
        if event is not None:
            self.note("wait", event.number)
            self._run_until(event)

    def synchronize(self, event: StreamEvent) -> None:
        if event is not None:
            self.note("sync", event.number)
            self._run_until(event)

    def done(self, event: StreamEvent) -> bool:
        return event is None or event.ran

    def host_work(self, label: str) -> None:
        self.note("host", label)

    def memory_figures(self) -> tuple[int, int] | None:
        return self.figures

    def run_all(self) -> None:
        """Lets the copy engine catch up (what time does on a GPU)."""
        self._run_until(None)


class CompletionQueue:
    """Host work that waits for copies: each item runs once its event has completed, in the
    order they were added (a gradient's accumulation after its device->host copy). ``poll``
    runs those whose events are done (at the next hook); ``drain`` waits for all (at a point
    where the host reads the results)."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        self._items: deque[tuple[StreamEvent, Callable[[], None], str]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, event: StreamEvent, work: Callable[[], None], label: str = "host") -> None:
        """Runs ``work`` after ``event`` (at once when nothing is queued and it is done)."""
        if not self._items and self.streams.done(event):
            self.streams.host_work(label)
            work()
            return
        self._items.append((event, work, label))

    def poll(self) -> None:
        while self._items and self.streams.done(self._items[0][0]):
            self._run_first()

    def drain(self) -> None:
        while self._items:
            self.streams.synchronize(self._items[0][0])
            self._run_first()

    def _run_first(self) -> None:
        _, work, label = self._items.popleft()
        self.streams.host_work(label)
        work()


def streams_for(device: torch.device) -> Streams:
    """The implementation for ``device``: CUDA's, else the host's."""
    if device.type == "cuda":
        return CudaStreams(device)
    return HostStreams()


__all__ = [
    "CompletionQueue",
    "CudaStreams",
    "HostStreams",
    "RecordingStreams",
    "StreamEvent",
    "device_named",
    "Streams",
    "indexed_device",
    "same_device",
    "streams_for",
]
