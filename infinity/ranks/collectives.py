"""The bucketed collectives: one all-gather assembles a bucket of parameter shards, one
reduce-scatter (all-reduce at ZeRO stage 1) averages a bucket of gradients. The buckets and the
layout of their buffers are :mod:`infinity.ranks.buckets`'; the process group, the counters and
the errors are the :class:`~infinity.ranks.partition.Partition`'s.

- **All-gather** (:class:`~infinity.core.gathers.BucketGather`, in core, where the device
  copies start it): the caller copies this rank's slice of each shard into
  its row of the bucket's buffer (:meth:`BucketGather.slot`), :meth:`BucketGather.start` gathers
  every rank's row in place, :meth:`BucketGather.wait` completes it and copies each shard's
  elements out of the rows into its device copy. A bucket of one shard whose piece has no
  padding gathers straight into the device copy: no copy out.
- **Reductions** (:class:`GradientBuckets`): each gradient's piece is copied into its rows of
  its bucket's buffer as it arrives; once every trained shard of the bucket has arrived (or at
  the end of backward, for what is left) one collective reduces the buffer, in the masters'
  dtype. A bucket of one shard whose piece needs no padding reduces autograd's own tensor.
  Once a reduction completes, each shard's callback gets its averaged slice, in the order the
  reductions started; reductions stay under way while compute goes on, up to ``in_flight``
  bytes of them (``overlap_comm``).

Without a GPU the buffers are host memory, and a buffer freshly mapped for every collective
would be faulted in page by page each time (see :mod:`infinity.core.memory`), so the buffers
of finished collectives are kept for the next ones of the same size (:class:`ScratchBuffers`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from infinity.core.gathers import BucketGather as BucketGather
from infinity.core.gathers import ScratchBuffers, flat_to_rows
from infinity.core.gathers import rows_to_flat as rows_to_flat
from infinity.core.shards import Shard
from infinity.core.streams import same_device
from infinity.ranks.buckets import Bucket, BucketLayout

if TYPE_CHECKING:
    from infinity.ranks.partition import Partition


@dataclass(eq=False)
class _Filling:
    """A reduction bucket's buffer while its gradients arrive."""

    bucket: Bucket
    buffer: torch.Tensor
    #: the buffer is autograd's own tensor (a bucket of one shard without padding)
    borrowed: bool = False
    #: id(shard) -> the callback of the shard's gradient, for each shard that arrived
    arrived: dict[int, Callable[[torch.Tensor], None]] = field(default_factory=dict)
    #: id(shard) of the trained shards that have not arrived yet: the bucket goes when none
    #: is left
    missing: set[int] = field(init=False)

    def __post_init__(self) -> None:
        self.missing = {id(s) for s in self.bucket.shards if s.entry.param.requires_grad}


@dataclass(eq=False)
class _Reduction:
    work: Any
    filling: _Filling
    out: torch.Tensor
    nbytes: int


class GradientBuckets:
    """The gradient reductions of one partition (see the module docstring)."""

    def __init__(
        self,
        partition: Partition,
        layout: BucketLayout,
        in_flight: int,
        scratch: ScratchBuffers,
    ) -> None:
        self.partition = partition
        self.layout = layout
        #: bytes of reductions left under way while compute goes on (overlap_comm; 0: each
        #: completes at once)
        self.in_flight = in_flight
        self.scratch = scratch
        self._filling: dict[int, _Filling] = {}
        self._reducing: deque[_Reduction] = deque()
        self._reducing_bytes = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda") if self.partition.on_device else torch.device("cpu")

    def add(self, shard: Shard, piece: torch.Tensor, done: Callable[[torch.Tensor], None]) -> None:
        """``piece``, one piece's whole gradient on this rank, joins its bucket; ``done`` gets
        this rank's averaged slice (``shard.numel`` elements in the masters' dtype) once the
        bucket's reduction completes."""
        bucket = self.layout.reduce_bucket_of(shard)
        filling = self._filling.get(bucket.index)
        if filling is not None and id(shard) in filling.arrived:
            # A second gradient of the shard in one pass (a nested backward): the bucket goes
            # as it is, and the new gradient starts it again; the same on every rank.
            self._start(filling)
            filling = None
        world = self.partition.world
        if filling is None:
            whole = world * bucket.per_rank
            if (
                len(bucket.shards) == 1
                and piece.numel() == whole
                and piece.dtype == bucket.dtype
                and same_device(piece.device, self.device)
                and piece.is_contiguous()
            ):
                filling = _Filling(bucket, piece, borrowed=True)
            else:
                buffer = self.scratch.take(whole, bucket.dtype, self.device)
                filling = _Filling(bucket, buffer)
            self._filling[bucket.index] = filling
        if not filling.borrowed:
            offset = bucket.offset_of(shard)
            rows = filling.buffer.view(world, bucket.per_rank)
            with torch.no_grad():
                flat_to_rows(piece, rows[:, offset : offset + shard.numel])
        filling.arrived[id(shard)] = done
        filling.missing.discard(id(shard))
        if not filling.missing:
            self._start(filling)

    def _start(self, filling: _Filling) -> None:
        del self._filling[filling.bucket.index]
        bucket = filling.bucket
        world = self.partition.world
        rows = filling.buffer.view(world, bucket.per_rank)
        for shard, offset in zip(bucket.shards, bucket.offsets):
            if id(shard) not in filling.arrived and not filling.borrowed:
                rows[:, offset : offset + shard.numel].zero_()  # no gradient: adds nothing
        buffer = filling.buffer
        nbytes = buffer.numel() * buffer.element_size()
        partition = self.partition
        if partition.stage == 1:
            # Stage 1 keeps whole gradients: all-reduce, then keep this rank's row.
            out = buffer
            work = partition.all_reduce_async(buffer)
        else:
            out = torch.empty(bucket.per_rank, dtype=bucket.dtype, device=buffer.device)
            work = partition.reduce_scatter_async(out, buffer)
        partition.count_reduction(nbytes)
        self._reducing.append(_Reduction(work, filling, out, nbytes))
        self._reducing_bytes += nbytes
        while self._reducing and self._reducing_bytes > self.in_flight:
            self._finish_oldest()

    def flush(self) -> None:
        """Starts the reductions of the buckets still waiting for gradients (the end of
        backward: parameters without a gradient in this pass), in bucket order."""
        for index in sorted(self._filling):
            self._start(self._filling[index])

    def finish(self) -> None:
        """Completes every reduction (end of backward, before gradients are read)."""
        self.flush()
        while self._reducing:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        reduction = self._reducing.popleft()
        self._reducing_bytes -= reduction.nbytes
        partition = self.partition
        try:
            partition.wait_reduction(reduction.work)
        except BaseException:
            self.abandon()
            raise
        filling = reduction.filling
        bucket = filling.bucket
        out = reduction.out
        if partition.stage == 1:
            out = out.view(partition.world, bucket.per_rank)[partition.rank].clone()
        if not filling.borrowed:
            self.scratch.give(filling.buffer)
        out.div_(partition.world)
        for shard, offset in zip(bucket.shards, bucket.offsets):
            done = filling.arrived.get(id(shard))
            if done is not None:
                done(out[offset : offset + shard.numel])

    def abandon(self) -> None:
        """Forgets what is under way (a collective failed: the other ranks are gone)."""
        self._reducing.clear()
        self._reducing_bytes = 0
        self._filling.clear()
