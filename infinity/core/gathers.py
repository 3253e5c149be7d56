"""One all-gather of parameter shards across data-parallel ranks into their device copies
(ZeRO stage 3), as the device copies start and complete it: :class:`BucketGather`. The
buckets and their layout are :mod:`infinity.ranks.buckets`'; the process group, the counters
and the errors are the partition's (:mod:`infinity.ranks.partition`), which the gather sees as a
:class:`GatherGroup`. The reductions of gradients are :mod:`infinity.ranks.collectives`'.

- The caller copies this rank's slice of each shard into its row of the bucket's buffer
  (:meth:`BucketGather.slot`), :meth:`BucketGather.start` gathers every rank's row in place,
  :meth:`BucketGather.wait` completes it and copies each shard's elements out of the rows into
  its device copy. A bucket of one shard whose piece has no padding gathers straight into the
  device copy: no copy out.

Without a GPU the buffers are host memory, and a buffer freshly mapped for every collective
would be faulted in page by page each time (see :mod:`infinity.core.memory`), so the buffers
of finished collectives are kept for the next ones of the same size (:class:`ScratchBuffers`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from infinity.core.shards import Shard
from infinity.core.streams import same_device


class GatherGroup(Protocol):
    """What a gather needs of the ranks' partition (:class:`infinity.ranks.partition.Partition`)."""

    #: this rank, and the ranks in the group
    rank: int
    world: int

    def all_gather_async(self, out: torch.Tensor, local: torch.Tensor) -> Any: ...

    def count_gather(self, nbytes: int) -> None: ...

    def wait_gather(self, work: Any) -> None: ...


def offsets_of(shards: Sequence[Shard]) -> tuple[tuple[int, ...], int]:
    """Each shard's first column in a row holding ``shards`` end to end, and the row's length."""
    offsets = []
    total = 0
    for shard in shards:
        offsets.append(total)
        total += shard.numel
    return tuple(offsets), total


class ScratchBuffers:
    """Buffers of finished collectives kept for the next ones of the same size, up to
    ``limit`` bytes of them. On CUDA nothing is kept: the caching allocator reuses memory
    without faulting it in, and orders the reuse after the streams that used it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: dict[tuple[int, torch.dtype, str], list[torch.Tensor]] = {}
        self._bytes = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        kept = self._free.get((numel, dtype, str(device)))
        if kept:
            buffer = kept.pop()
            self._bytes -= buffer.numel() * buffer.element_size()
            return buffer
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        nbytes = buffer.numel() * buffer.element_size()
        if buffer.device.type != "cpu" or self._bytes + nbytes > self.limit:
            return
        self._free.setdefault((buffer.numel(), buffer.dtype, str(buffer.device)), []).append(buffer)
        self._bytes += nbytes

    def clear(self) -> None:
        self._free.clear()
        self._bytes = 0


def rows_to_flat(rows: torch.Tensor, flat: torch.Tensor) -> None:
    """Copies a shard's ``rows`` (``world`` x ``per_rank``: every rank's slice, the last ones
    padded) into ``flat``, the piece's ``numel <= world * per_rank`` real elements."""
    world, per_rank = rows.shape
    full, rest = divmod(flat.numel(), per_rank)
    if full:
        flat[: full * per_rank].view(full, per_rank).copy_(rows[:full])
    if rest:
        flat[full * per_rank :].copy_(rows[full, :rest])


def flat_to_rows(flat: torch.Tensor, rows: torch.Tensor) -> None:
    """Copies the piece ``flat`` into ``rows`` (``world`` x ``per_rank``), converting to their
    dtype and writing zeros where the piece has no elements (its padding)."""
    world, per_rank = rows.shape
    full, rest = divmod(flat.numel(), per_rank)
    rows[:full].copy_(flat[: full * per_rank].view(full, per_rank))
    if rest:
        rows[full, :rest].copy_(flat[full * per_rank :])
        rows[full, rest:].zero_()
    rows[full + (1 if rest else 0) :].zero_()


class BucketGather:
    """One all-gather of ``shards`` (all or some of a bucket's) into ``outputs`` (each shard's
    whole piece in its device copy); see the module docstring."""

    def __init__(
        self,
        partition: GatherGroup,
        shards: Sequence[Shard],
        outputs: Sequence[torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        scratch: ScratchBuffers,
    ) -> None:
        self.partition = partition
        self.shards = list(shards)
        self.outputs = list(outputs)
        self.scratch = scratch
        world = partition.world
        self.offsets, self.per_rank = offsets_of(self.shards)
        out = self.outputs[0]
        #: one shard whose piece fills every rank's slice: gathered in place, no copy out
        self.direct = (
            len(self.shards) == 1
            and out.numel() == world * self.per_rank
            and out.dtype == dtype
            and same_device(out.device, device)
            and out.is_contiguous()
        )
        self.buffer = out if self.direct else scratch.take(world * self.per_rank, dtype, device)
        self.rows = self.buffer.view(world, self.per_rank)
        self._work: Any = None
        self._started = 0.0
        self.done = False

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered buffer (every rank's slices)."""
        return self.buffer.numel() * self.buffer.element_size()

    def slot(self, index: int) -> torch.Tensor:
        """Where this rank's slice of ``shards[index]`` goes before :meth:`start`."""
        offset = self.offsets[index]
        return self.rows[self.partition.rank, offset : offset + self.shards[index].numel]

    @property
    def started(self) -> bool:
        return self._work is not None

    def start(self) -> None:
        partition = self.partition
        self._started = time.perf_counter()
        own = self.rows[partition.rank]
        self._work = partition.all_gather_async(self.buffer, own)
        partition.count_gather(own.numel() * own.element_size())

    def wait(self) -> None:
        """Completes the all-gather and copies each shard out into its device copy; once."""
        if self.done:
            return
        self.done = True
        self.partition.wait_gather(self._work)
        if self.direct:
            return
        with torch.no_grad():
            for index, (shard, out) in enumerate(zip(self.shards, self.outputs)):
                offset = self.offsets[index]
                rows_to_flat(self.rows[:, offset : offset + shard.numel], out)
        self.scratch.give(self.buffer)

    def abandon(self) -> None:
        """The copies into the slots failed before :meth:`start`: nothing was issued."""
        self.done = True
        if not self.direct:
            self.scratch.give(self.buffer)
