"""What an offloaded activation is while it is away (:mod:`infinity.training.activations`): the
storage's record (:class:`Stored`, with what it holds outside the device, :class:`Resources`),
autograd's handle of each view of it (:class:`Packed`), and the staging buffers moving its
chunks between the device and the swap engine (:class:`WriteUse`, :class:`ReadUse`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from swap import Extent, HostBuffer, SwapEngine


class StagingOwner(Protocol):
    """What a staging use needs of the activation offload that made it."""

    #: bytes written to and read from the swap engine so far
    bytes_written: int
    bytes_read: int

    @property
    def swap_engine(self) -> SwapEngine: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Copies ``src`` into ``dst`` (asynchronously on CUDA); returns the copy's event."""
        ...


@dataclass(eq=False)
class Resources:
    """What a stored activation holds outside the device; freed once nothing refers to it."""

    nbytes: int
    group: int = 0
    host: torch.Tensor | None = None  # cpu: the host copy
    extent: Extent | None = None  # nvme: where its bytes are
    uses: list[Any] = field(default_factory=list)  # staging uses still moving its bytes
    device_bytes: int = 0  # counted as held on the device right now


class Stored:
    """One offloaded storage. Autograd holds it through the ``Packed`` handles of its views."""

    __slots__ = (
        "res",
        "group",
        "module",
        "source",
        "version",
        "back",
        "event",
        "loading",
        "chunks_left",
        "error",
        "__weakref__",
    )

    def __init__(self, source: torch.Tensor, version: int, group: int, module: str) -> None:
        self.res = Resources(source.untyped_storage().nbytes(), group)
        self.group = group
        self.module = module
        #: the whole storage as flat bytes, until its copy out is issued
        self.source: torch.Tensor | None = source
        self.version = version
        #: the restored storage as flat bytes on the device (after a fetch)
        self.back: torch.Tensor | None = None
        #: CUDA: marks the copy into ``back`` (from host memory) or into host memory (cpu out)
        self.event: Any = None
        self.loading = False
        self.chunks_left: list[tuple[int, int]] = []  # nvme: chunk reads not yet issued
        self.error: BaseException | None = None

    @property
    def nbytes(self) -> int:
        return self.res.nbytes

    def describe(self) -> str:
        return f"a saved tensor of {self.nbytes} bytes from the forward of module '{self.module}'"


class Packed:
    """What autograd keeps for one saved tensor: its storage's ``Stored`` and its view."""

    __slots__ = ("stored", "dtype", "size", "stride", "offset")

    def __init__(self, stored: Stored, tensor: torch.Tensor) -> None:
        self.stored = stored
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()


class StagingUse:
    """A staging buffer while it moves one chunk. ``poll`` advances it; True once finished,
    and from then on without doing anything again (a read's copy into the restored storage
    happens once, though a caller that waited for the use may poll it again)."""

    def __init__(
        self, owner: StagingOwner, buf: HostBuffer, stored: Stored, offset: int, nbytes: int
    ) -> None:
        self.owner, self.buf, self.stored = owner, buf, stored
        self.offset, self.nbytes = offset, nbytes
        self.future: Any = None
        self.event: Any = None
        self.finished = False

    def poll(self, wait: bool) -> bool:
        if not self.finished:
            self.finished = self._advance(wait)
        return self.finished

    def _advance(self, wait: bool) -> bool:
        raise NotImplementedError

    def _event_done(self, wait: bool) -> bool:
        if self.event is None:
            return True
        if wait:
            self.event.synchronize()
        return self.event.query()


class WriteUse(StagingUse):
    """device bytes -> staging buffer (copy, an event on CUDA) -> extent (an engine write)."""

    def _advance(self, wait: bool) -> bool:
        if self.future is None:
            if not self._event_done(wait):
                return False
            self.event = None
            extent = self.stored.res.extent
            assert extent is not None  # allocated before the first chunk's copy
            self.future = self.owner.swap_engine.write(
                extent, self.buf, nbytes=self.nbytes, extent_offset=self.offset
            )
            self.owner.bytes_written += self.nbytes
        if not wait and not self.future.done():
            return False
        error = self.future.exception()
        if error is not None and self.stored.error is None:
            self.stored.error = error
        return True


class ReadUse(StagingUse):
    """extent -> staging buffer (an engine read) -> the restored storage (copy, an event)."""

    def _advance(self, wait: bool) -> bool:
        if self.event is None:
            if not wait and not self.future.done():
                return False
            error = self.future.exception()
            if error is not None:
                if self.stored.error is None:
                    self.stored.error = error
                return True
            back = self.stored.back
            if back is None:  # nobody waits for it any more
                return True
            self.owner.bytes_read += self.nbytes
            self.event = self.owner.copy(
                back[self.offset : self.offset + self.nbytes], self.buf.tensor[: self.nbytes]
            )
        return self._event_done(wait)
