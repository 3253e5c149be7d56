"""Device copies without copies, on a CPU device: the part of the device copies
(:class:`~infinity.core.device_copies.DeviceCopies`) that serves inference's gathers from host
memory.

On a CPU device the device tier is host memory too, so a gather's copy is a memcpy on the cores
that compute. Without autograd (inference) a gather lends the host copy itself when the
parameter's shards form one range of the arena (:meth:`HostLending.after_previous` places a
parameter's shards in adjacent slots when it can), and otherwise copies into the device tier's
reusable slab (:meth:`HostLending.stage`) rather than a fresh allocation. With autograd every
gather copies: weights saved for backward must outlive an arena slot.

:class:`HostLending` keeps its own count of lent gathers; the state of a lent or staged copy is
the entry's (``ParamEntry.placeholder`` and ``slab_offset``). It is a part of the device copies
(:mod:`infinity.core.device_copies`); what it needs of them (host copies settled, the copy
helper) is :class:`CopiesToDevice`. Everything runs on the training thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch

from infinity.core.residency import ON_TO_DEVICE as _TO_DEVICE
from infinity.core.shards import ParamEntry, Shard, ShardKind, ShardRegistry
from infinity.core.tiers import DeviceTier, HostTier

if TYPE_CHECKING:
    from infinity.ranks.partition import Partition


class CopiesToDevice(Protocol):
    """What lending needs of the device copies it is a part of."""

    @property
    def on_device(self) -> set[ParamEntry]: ...

    def shards_on_host(
        self,
        entry: ParamEntry,
        before_read: Callable[[Shard], None] | None = None,
        masters: bool = False,
    ) -> Iterator[tuple[Shard, Shard]]: ...

    def copy_to_device(
        self,
        entry: ParamEntry,
        copy: Callable[[Shard, torch.Tensor], torch.cuda.Event | None],
        undo: Callable[[], None],
        *,
        prepare: Callable[[], None] | None = None,
        before_read: Callable[[Shard], None] | None = None,
        complete: Callable[[], None] | None = None,
    ) -> None: ...

    def mark_resident(self, entry: ParamEntry) -> None: ...

    def drop_device(self, entry: ParamEntry, force: bool = False) -> None: ...


class HostLending:
    """Lent and staged device copies of one placement (see the module docstring)."""

    def __init__(
        self,
        copies: CopiesToDevice,
        registry: ShardRegistry,
        device: DeviceTier,
        host: HostTier,
        *,
        partition: Partition | None,
        persistent: frozenset[int],
    ) -> None:
        self._copies = copies
        self.registry = registry
        self.device = device
        self.host = host
        self.partition = partition
        self.persistent = persistent
        #: device copies lent by the host copy instead of copied (see can_lend)
        self.lent_gathers = 0
        #: the bytes of those device copies (what copying them would have moved)
        self.lent_bytes = 0

    def after_previous(self, shard: Shard) -> int | None:
        """The slot right after the previous shard of the same parameter, when that one fills
        a whole slot and the next slot is free (for the first shard, a slot with free ones
        after it): the shards are then one contiguous range, which a CPU device can compute on
        without a copy (see can_lend). None where that does not apply or is not free."""
        if shard.kind is not ShardKind.PARAM or self.device.cuda:
            return None
        shards = shard.entry.shards
        k = shards.index(shard) if len(shards) > 1 else 0
        if k == 0:
            # The first of several: where the others can follow, if such a run is free.
            return self.host.take_arena_run(shard.nbytes, len(shards)) if len(shards) > 1 else None
        previous = shards[k - 1]
        if previous.arena_offset is None or previous.nbytes != self.host.slot_size:
            return None
        offset = previous.arena_offset + previous.nbytes
        return offset if self.host.take_arena_at(offset, shard.nbytes) else None

    def can_lend(self, entry: ParamEntry) -> bool:
        """Whether the device copy may be the host copy itself: a CPU device (both are host
        memory, so the copy would be a memcpy on the cores that compute), the parameter in its
        compute dtype in one range of host memory (one shard, or shards in adjacent arena slots:
        see after_previous), and one process. Only without autograd (the caller's word,
        ``gather(lend=True)``): backward may use views of the weights saved in forward after
        their host copy was evicted and its slot reused; a copy of its own keeps them valid
        (see drop_device)."""
        return self.can_stage(entry) and entry.compute_dtype == entry.dtype

    def can_stage(self, entry: ParamEntry) -> bool:
        """Whether the device copy may be a range of the slab (see :meth:`stage`): as
        :meth:`can_lend`, whatever the dtypes (a weight stored quantized, or in another dtype,
        is converted into it)."""
        return (
            not self.device.cuda and self.partition is None and entry.index not in self.persistent
        )

    @staticmethod
    def _contiguous(entry: ParamEntry) -> bool:
        """Whether the entry's host copies form one range (checked once they are on the
        host)."""
        shards = entry.shards
        if len(shards) == 1:
            return True
        return all(
            a.arena_offset is not None and b.arena_offset == a.arena_offset + a.nbytes
            for a, b in zip(shards, shards[1:])
        )

    def lend(self, entry: ParamEntry) -> bool:
        """The device copy becomes a view of the host copy: no bytes move. The host copies
        then stay until the device copy is dropped (``ArenaRoom.evictable``), and eviction of
        one drops the device copy first. False (nothing lent) when the shards did not land in
        one range of the arena."""
        shards = entry.shards
        for _ in self._copies.shards_on_host(entry, masters=True):
            pass  # each host copy valid and settled, in turn
        if not self._contiguous(entry):
            return False
        self.device.charge(entry.device_bytes)
        first = shards[0]
        if len(shards) == 1:
            view = first.host
        else:
            assert first.arena_offset is not None  # contiguous in the arena
            view = self.host.arena_view(first.arena_offset, entry.dtype, entry.numel)
        assert view is not None  # on the host
        view = view.view(entry.shape)
        entry.placeholder = entry.device_tensor
        entry.device_tensor = view
        with torch._C.DisableTorchFunctionSubclass():
            entry.param.data = view
        for shard in shards:
            self.registry.set_state(shard, _TO_DEVICE[shard.state])
        self._copies.mark_resident(entry)
        self.lent_gathers += 1
        self.lent_bytes += entry.device_bytes
        return True

    def stage(self, entry: ParamEntry) -> bool:
        """Without autograd on a CPU device, where the host copy cannot be lent (its shards are
        not one range): the device copy is a range of the device tier's reusable slab, so the
        copy faults no fresh pages. False (nothing done) where the slab has no room."""
        if self.device.cuda or self.partition is not None:
            return False
        offset = self.device.slab_take(entry.device_bytes)
        if offset is None:
            return False
        flat = self.device.slab_view(offset, entry.compute_dtype, entry.numel)

        def copy(shard: Shard, host: torch.Tensor) -> torch.cuda.Event | None:
            return self.device.copy_in(
                flat[shard.start : shard.start + shard.numel], host, shard.quant
            )

        self._copies.copy_to_device(
            entry, copy, undo=lambda: self.device.slab_give(offset, entry.device_bytes)
        )
        view = flat.view(entry.shape)
        entry.placeholder, entry.device_tensor, entry.slab_offset = (
            entry.device_tensor,
            view,
            offset,
        )
        with torch._C.DisableTorchFunctionSubclass():
            entry.param.data = view
        return True

    def return_lent(self) -> None:
        """Drops every lent device copy (before the host tier's memory goes away)."""
        for entry in [e for e in self._copies.on_device if e.placeholder is not None]:
            entry.holds = 0
            self._copies.drop_device(entry, force=True)
