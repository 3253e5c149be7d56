"""Where the KV cache's layers wait between uses: host RAM or swap files on NVMe.

A tier stores one layer's keys and values as segments along the sequence: the tokens a step
adds are appended as a new segment (a decode step writes one token per row, not the whole
layer), and the cache rewrites a layer whole when its segments grow many. ``fetch`` brings a
layer's segments back onto the compute device; it returns at once with a :class:`PendingFetch`
whose ``wait`` gives them, so the next layer's read runs while this one computes. The cache
concatenates them with the step's new tokens once, so a layer is not joined twice per step.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from infinity.config import AioConfig
from infinity.errors import BudgetError
from swap import ALIGNMENT, BufferPool, Extent, HostBuffer, SwapEngine, align_up

log = logging.getLogger(__name__)

#: seconds to wait for a staging buffer before saying which transfers hold them
STAGING_TIMEOUT = 120.0

KV = tuple[torch.Tensor, torch.Tensor]
#: a layer's K/V as segments along the sequence, in order
Segments = list[KV]


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class TierCounters:
    """Bytes and transfers through a tier since it was made."""

    bytes_written: int = 0
    bytes_read: int = 0
    writes: int = 0
    reads: int = 0


class PendingFetch:
    """A layer on its way back; ``wait`` gives its segments on the compute device."""

    def __init__(self, finish: Callable[[], Segments], nbytes: int) -> None:
        """``nbytes``: the K/V bytes it brings onto the device."""
        self._finish = finish
        self._result: Segments | None = None
        self.nbytes = nbytes

    def wait(self) -> Segments:
        if self._result is None:
            self._result = self._finish()
        return self._result


class KVTier(ABC):
    """Segments of each layer's K/V away from the compute device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counters = TierCounters()

    @abstractmethod
    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores ``keys``/``values`` ([batch, heads, tokens, dim]) after the layer's tokens."""

    @abstractmethod
    def replace(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores the layer whole as one segment, dropping what it held."""

    @abstractmethod
    def fetch(self, layer: int) -> PendingFetch:
        """Starts bringing the layer back; it must hold at least one segment."""

    @abstractmethod
    def segments(self, layer: int) -> int: ...

    @abstractmethod
    def drop(self, layer: int) -> None:
        """Forgets the layer (its space is given back)."""

    @abstractmethod
    def layer_bytes(self, layer: int) -> int:
        """Bytes of the layer's K/V the tier holds (the data, without padding)."""

    @abstractmethod
    def layers(self) -> list[int]: ...

    def stored_bytes(self) -> int:
        """Bytes of K/V the tier holds now."""
        return sum(self.layer_bytes(layer) for layer in self.layers())

    def span_after_append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Bytes a fetch of the layer would stage if ``keys``/``values`` were appended."""
        return 0

    def fetch_capacity(self) -> int | None:
        """The most bytes one fetch can stage (None: no limit)."""
        return None

    def flush(self) -> None:  # noqa: B027  # a tier whose writes are synchronous
        """Waits until every write under way has landed (and raises a failed one's error)."""

    def close(self) -> None:  # noqa: B027  # a tier without resources has nothing to close
        """Gives back files and buffers."""


# ---------------------------------------------------------------------------- host


class HostKVTier(KVTier):
    """Layers in host RAM (pinned when CUDA is there, so copies to the device are async); a
    worker thread copies a layer's segments onto the device while the previous layer computes
    (on a CPU device they are handed over as they are: the cache's concatenation copies)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._layers: dict[int, list[KV]] = {}
        self._pin = torch.cuda.is_available()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-host-fetch")

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pin)
        copy.copy_(tensor)  # a copy even on a CPU device: the device's tensor is freed
        self.counters.bytes_written += tensor_bytes(tensor)
        return copy

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        segment = (self._host_copy(keys), self._host_copy(values))
        self._layers.setdefault(layer, []).append(segment)
        self.counters.writes += 1

    def replace(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._layers.pop(layer, None)
        self.append(layer, keys, values)

    def fetch(self, layer: int) -> PendingFetch:
        segments = list(self._layers[layer])  # the list may grow before the worker runs
        nbytes = sum(tensor_bytes(k) + tensor_bytes(v) for k, v in segments)
        device = self.device

        def gather() -> Segments:
            return [
                (k.to(device, non_blocking=True), v.to(device, non_blocking=True))
                for k, v in segments
            ]

        future = self._worker.submit(gather)
        self.counters.bytes_read += nbytes
        self.counters.reads += 1
        return PendingFetch(future.result, nbytes)

    def segments(self, layer: int) -> int:
        return len(self._layers.get(layer, ()))

    def drop(self, layer: int) -> None:
        self._layers.pop(layer, None)

    def layer_bytes(self, layer: int) -> int:
        return sum(tensor_bytes(k) + tensor_bytes(v) for k, v in self._layers.get(layer, ()))

    def layers(self) -> list[int]:
        return list(self._layers)

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self._layers.clear()


# ---------------------------------------------------------------------------- nvme


@dataclass
class NvmeSegment:
    """One write: keys at byte 0 of the extent, values at the next 4096-byte boundary."""

    extent: Extent
    key_shape: torch.Size
    value_shape: torch.Size
    dtype: torch.dtype
    key_bytes: int
    value_bytes: int
    written: Future[int] = field(repr=False)

    @property
    def span(self) -> int:
        return align_up(self.key_bytes) + align_up(self.value_bytes)


def segment_span(keys: torch.Tensor, values: torch.Tensor) -> int:
    """Bytes a segment of ``keys``/``values`` takes in an extent (each part 4096-aligned)."""
    return align_up(tensor_bytes(keys)) + align_up(tensor_bytes(values))


class NvmeKVTier(KVTier):
    """Layers in swap files under ``path``: each segment is one extent written from a staging
    buffer with the engine's async writes; a fetch reads every segment of a layer into one read
    buffer and copies it onto the device. Staging is two read and two write buffers of
    ``staging_bytes`` each, faulted in as used."""

    def __init__(
        self,
        device: torch.device,
        path: Path,
        staging_bytes: int,
        aio: AioConfig,
        verify_checksums: bool,
    ) -> None:
        super().__init__(device)
        self.staging_bytes = align_up(staging_bytes) + 2 * ALIGNMENT  # one whole-layer segment
        settings = aio.engine_settings(
            file_size=max(64 << 20, 4 * self.staging_bytes), verify_checksums=verify_checksums
        )
        self.engine = SwapEngine([path], settings, label="kv")
        try:
            self._read = BufferPool(2, self.staging_bytes, name="kv-read", prefault=False)
            self._write = BufferPool(2, self.staging_bytes, name="kv-write", prefault=False)
        except BaseException:
            self.engine.close()
            raise
        self._layers: dict[int, list[NvmeSegment]] = {}

    def _stage(self, buffer: HostBuffer, offset: int, tensor: torch.Tensor) -> None:
        # Copied through a view of the tensor's shape: new K/V from attention are transposed
        # (not contiguous), and flattening them first would copy each one twice.
        self._view(buffer, offset, tensor.dtype, tensor.shape).copy_(tensor)

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        key_bytes, value_bytes = tensor_bytes(keys), tensor_bytes(values)
        span = segment_span(keys, values)
        if span > self.staging_bytes:
            raise BudgetError(
                f"kv offload: a write of {span} bytes does not fit the {self.staging_bytes}-byte "
                f"staging buffers; raise the kv budget"
            )
        buffer = self._write.acquire(STAGING_TIMEOUT, holder=f"kv write of layer {layer}")
        try:
            self._stage(buffer, 0, keys)
            self._stage(buffer, align_up(key_bytes), values)
            extent = self.engine.allocate(span)
        except BaseException:
            self._write.release(buffer)
            raise
        written = self.engine.write(extent, buffer, nbytes=span, tag=f"kv{layer}")
        written.add_done_callback(lambda _: self._write.release(buffer))
        segment = NvmeSegment(
            extent, keys.shape, values.shape, keys.dtype, key_bytes, value_bytes, written
        )
        self._layers.setdefault(layer, []).append(segment)
        self.counters.bytes_written += span
        self.counters.writes += 1

    def replace(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.drop(layer)
        self.append(layer, keys, values)

    def span_after_append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> int:
        held = sum(segment.span for segment in self._layers.get(layer, ()))
        return held + segment_span(keys, values)

    def fetch_capacity(self) -> int | None:
        return self.staging_bytes

    def fetch(self, layer: int) -> PendingFetch:
        segments = list(self._layers[layer])
        total = sum(segment.span for segment in segments)
        if total > self.staging_bytes:
            raise BudgetError(
                f"kv offload: layer {layer} spans {total} bytes on disk, more than the "
                f"{self.staging_bytes}-byte read buffers; raise the kv budget"
            )
        for segment in segments:
            segment.written.result()  # a read must follow its write (and report its failure)
        buffer = self._read.acquire(STAGING_TIMEOUT, holder=f"kv read of layer {layer}")
        reads: list[Future[int]] = []
        offset = 0
        try:
            for segment in segments:
                reads.append(
                    self.engine.read(
                        segment.extent,
                        buffer,
                        nbytes=segment.span,
                        buffer_offset=offset,
                        tag=f"kv{layer}",
                    )
                )
                offset += segment.span
        except BaseException:
            self._settle_then_release(reads, buffer)
            raise
        self.counters.bytes_read += total
        self.counters.reads += len(segments)
        data = sum(segment.key_bytes + segment.value_bytes for segment in segments)
        return PendingFetch(lambda: self._assemble(segments, reads, buffer), data)

    def _settle_then_release(self, reads: Sequence[Future[int]], buffer: HostBuffer) -> None:
        try:
            for read in reads:
                read.exception()
        finally:
            self._read.release(buffer)

    def _assemble(
        self, segments: Sequence[NvmeSegment], reads: Sequence[Future[int]], buffer: HostBuffer
    ) -> Segments:
        try:
            for read in reads:
                read.result()
            keys, values, offset = [], [], 0
            for segment in segments:
                keys.append(self._view(buffer, offset, segment.dtype, segment.key_shape))
                values_at = offset + align_up(segment.key_bytes)
                values.append(self._view(buffer, values_at, segment.dtype, segment.value_shape))
                offset += segment.span
            # The concatenation copies out of the staging buffer, which is then free again.
            return [
                (
                    torch.cat(keys, dim=-2).to(self.device, non_blocking=False),
                    torch.cat(values, dim=-2).to(self.device, non_blocking=False),
                )
            ]
        finally:
            self._settle_then_release(reads, buffer)

    @staticmethod
    def _view(
        buffer: HostBuffer, offset: int, dtype: torch.dtype, shape: torch.Size
    ) -> torch.Tensor:
        return buffer.view(dtype, math.prod(shape), offset).view(shape)

    def segments(self, layer: int) -> int:
        return len(self._layers.get(layer, ()))

    def flush(self) -> None:
        for layer in self._layers.values():
            for segment in layer:
                segment.written.result()

    def drop(self, layer: int) -> None:
        for segment in self._layers.pop(layer, []):
            segment.written.exception()  # its buffer and extent are in use until it lands
            self.engine.free(segment.extent)

    def layer_bytes(self, layer: int) -> int:
        return sum(s.key_bytes + s.value_bytes for s in self._layers.get(layer, ()))

    def layers(self) -> list[int]:
        return list(self._layers)

    def close(self) -> None:
        try:
            for layer in list(self._layers):
                self.drop(layer)
        finally:
            self.engine.close()
            self._read.close()
            self._write.close()
