"""Which shards travel together across ranks: the buckets of the all-gathers that assemble
parameters and of the reductions that average gradients, decided once at attach, the same on
every rank (a function of the model, the world size and the config alone).

A bucket is a list of shards, each with its place in the bucket's flat buffer. Every rank's
slice of every shard has the same length (see :mod:`infinity.ranks.partition`), so the buffer
is ``world`` rows of ``per_rank`` elements, row ``r`` holding rank ``r``'s slices end to end:
an all-gather of one row per rank fills the buffer, and a reduce-scatter of the buffer leaves
each rank its row. A shard's elements are then column ``offset`` to ``offset + numel`` of every
row, which one strided copy moves in or out.

How shards are grouped:

- A shard whose bytes (whole: ``world`` slices) are at least half the bucket size travels
  alone. Its buffer can be the parameter's device copy itself (an all-gather) or autograd's
  gradient (a reduction), with no copy in or out, which is what large shards cost most.
- Smaller ones share buckets of at most the bucket size, in order: parameters in the order
  modules own them (so a module's biases and norms travel with the next modules' ones),
  gradients in reverse (the order backward completes them). Parameters of one dtype share a
  bucket; persistent parameters (``param_persistence_threshold``) only share with persistent
  ones, so that gathering one gathers only what stays on the device anyway.
- For all-gathers, a small parameter travels whole (all its shards in one bucket): gathering
  it assembles its bucket, and the device copies of the bucket's other parameters come with it.

Nothing here moves bytes: :mod:`infinity.ranks.collectives` runs the collectives.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from infinity.core.gathers import offsets_of
from infinity.core.shards import ParamEntry, Shard


@dataclass(frozen=True, eq=False)
class Bucket:
    """Shards that travel together, and where each sits in a row of the bucket's buffer."""

    index: int
    shards: tuple[Shard, ...]
    #: each shard's first column in a row (elements)
    offsets: tuple[int, ...]
    #: elements of one rank's row
    per_rank: int
    #: the dtype the bucket's buffer moves in
    dtype: torch.dtype

    @cached_property
    def _columns(self) -> dict[int, int]:
        return {id(shard): offset for shard, offset in zip(self.shards, self.offsets)}

    def offset_of(self, shard: Shard) -> int:
        """``shard``'s first column in a row (looked up once per gradient: no scan)."""
        return self._columns[id(shard)]

    @property
    def entries(self) -> tuple[ParamEntry, ...]:
        """The parameters with shards in this bucket, in bucket order."""
        return tuple(dict.fromkeys(s.entry for s in self.shards))

    def whole_bytes(self, world: int) -> int:
        """Bytes of the buffer: every rank's row."""
        return world * self.per_rank * self.dtype.itemsize


class _Packer:
    """Packs shards into buckets of at most ``limit`` bytes (whole), in the order given; a shard
    of at least half the limit (or a group that alone exceeds it) gets buckets of its own."""

    def __init__(self, world: int, limit: int, first_index: int = 0) -> None:
        self.world = world
        self.limit = limit
        self.buckets: list[Bucket] = []
        self._first_index = first_index
        #: the bucket being filled, per (dtype, family)
        self._open: dict[tuple[torch.dtype, str], list[Shard]] = {}

    def _bytes(self, shards: Iterable[Shard], dtype: torch.dtype) -> int:
        return sum(self.world * s.numel for s in shards) * dtype.itemsize

    def add(self, shards: Sequence[Shard], dtype: torch.dtype, family: str = "") -> None:
        """Adds ``shards`` (which stay together when small)."""
        size = self._bytes(shards, dtype)
        if 2 * size >= self.limit:
            # Large: shards of at least half the limit alone, the others of the group
            # packed among themselves.
            run: list[Shard] = []
            for shard in shards:
                if 2 * self._bytes([shard], dtype) >= self.limit:
                    self._close(run, dtype)
                    run = []
                    self._close([shard], dtype)
                    continue
                if run and self._bytes([*run, shard], dtype) > self.limit:
                    self._close(run, dtype)
                    run = []
                run.append(shard)
            self._close(run, dtype)
            return
        key = (dtype, family)
        open_ = self._open.setdefault(key, [])
        if open_ and self._bytes(open_, dtype) + size > self.limit:
            self._close(open_, dtype)
            open_ = self._open[key] = []
        open_.extend(shards)

    def _close(self, shards: list[Shard], dtype: torch.dtype) -> None:
        if not shards:
            return
        offsets, per_rank = offsets_of(shards)
        self.buckets.append(
            Bucket(self._first_index + len(self.buckets), tuple(shards), offsets, per_rank, dtype)
        )

    def finish(self) -> list[Bucket]:
        for (dtype, _), shards in self._open.items():
            self._close(shards, dtype)
        self._open.clear()
        return self.buckets


class BucketLayout:
    """The buckets of one attached model across ``world`` ranks (see the module docstring)."""

    def __init__(
        self,
        entries: Sequence[ParamEntry],
        module_entries: Sequence[Sequence[ParamEntry]],
        persistent: frozenset[int],
        world: int,
        gather_bytes: int,
        reduce_bytes: int,
    ) -> None:
        """``module_entries``: each module's own parameters, in module order; ``persistent``:
        the indices of entries whose device copy stays; ``gather_bytes``/``reduce_bytes``:
        the largest bucket (whole bytes) of all-gathers and of reductions."""
        self.world = world
        self.gather_bytes = gather_bytes
        self.reduce_bytes = reduce_bytes
        seen: set[int] = set()
        ordered: list[ParamEntry] = []
        for own in module_entries:
            for entry in own:
                if entry.index not in seen:
                    seen.add(entry.index)
                    ordered.append(entry)
        ordered += [e for e in entries if e.index not in seen]
        gathers = _Packer(world, gather_bytes)
        for entry in ordered:
            family = "persistent" if entry.index in persistent else ""
            gathers.add(entry.shards, entry.compute_dtype, family)
        #: the all-gather buckets
        self.gather_buckets: list[Bucket] = gathers.finish()
        self._gather_of: dict[int, list[Bucket]] = {}
        for bucket in self.gather_buckets:
            for entry in bucket.entries:
                self._gather_of.setdefault(entry.index, []).append(bucket)
        # Gradients: in reverse (backward completes the last modules first), of parameters
        # that are trained now; one unfrozen later gets buckets of its own when its first
        # gradient arrives (reduce_buckets_of).
        reductions = _Packer(world, reduce_bytes)
        for entry in reversed(list(entries)):
            if entry.requires_grad:
                for shard in entry.shards:
                    reductions.add([shard], shard.dtype)
        #: the reduction buckets
        self.reduce_buckets: list[Bucket] = reductions.finish()
        self._reduce_of: dict[int, Bucket] = {}
        for bucket in self.reduce_buckets:
            for shard in bucket.shards:
                self._reduce_of[id(shard)] = bucket

    def gather_buckets_of(self, entry: ParamEntry) -> list[Bucket]:
        """The all-gather buckets with ``entry``'s shards (one unless it is large)."""
        return self._gather_of[entry.index]

    def reduce_bucket_of(self, shard: Shard) -> Bucket:
        """The reduction bucket of ``shard``'s gradient; a parameter that was frozen at attach
        gets a bucket of its own per shard on its first gradient."""
        bucket = self._reduce_of.get(id(shard))
        if bucket is None:
            bucket = Bucket(len(self.reduce_buckets), (shard,), (0,), shard.numel, shard.dtype)
            self.reduce_buckets.append(bucket)
            self._reduce_of[id(shard)] = bucket
        return bucket

    def describe(self) -> str:
        """One line: how many buckets of each kind, and how many shards travel alone."""

        def alone(buckets: list[Bucket]) -> int:
            return sum(1 for b in buckets if len(b.shards) == 1)

        return (
            f"{len(self.gather_buckets)} all-gather buckets ({alone(self.gather_buckets)} of one "
            f"shard) of at most {self.gather_bytes} bytes, {len(self.reduce_buckets)} gradient "
            f"buckets ({alone(self.reduce_buckets)} of one shard) of at most "
            f"{self.reduce_bytes} bytes"
        )
