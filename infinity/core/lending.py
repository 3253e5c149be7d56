"""Device copies without copies, on a CPU device: the part of
:class:`~infinity.core.placement.Placement` that serves inference's gathers from host memory.

On a CPU device the device tier is host memory too, so a gather's copy is a memcpy on the cores
that compute. Without autograd (inference) a gather lends the host copy itself when the
parameter's shards form one range of the arena (``_after_previous`` places a parameter's shards
in adjacent slots when it can), and otherwise copies into the device tier's reusable slab
(``_stage``) rather than a fresh allocation. With autograd every gather copies: weights saved for
backward must outlive an arena slot. The state (``ParamEntry.placeholder`` and ``slab_offset``,
the counters) is set up in ``Placement``; everything runs on the training thread.
"""

from __future__ import annotations

import torch

from infinity.core.residency import OFF_THE_DEVICE as _FROM_DEVICE
from infinity.core.residency import ON_TO_DEVICE as _TO_DEVICE
from infinity.core.shards import ParamEntry, Shard, ShardKind


class HostLending:
    """Mixed into Placement: its state, tiers and transfers are Placement's."""

    def _after_previous(self, shard: Shard) -> int | None:
        """The slot right after the previous shard of the same parameter, when that one fills
        a whole slot and the next slot is free (for the first shard, a slot with free ones
        after it): the shards are then one contiguous range, which a CPU device can compute on
        without a copy (see can_lend)."""
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
        see _after_previous), and one process. Only without autograd (the caller's word,
        ``gather(lend=True)``): backward may use views of the weights saved in forward after
        their host copy was evicted and its slot reused; a copy of its own keeps them valid
        (see drop_device)."""
        return (
            not self.device.cuda
            and self.partition is None
            and entry.compute_dtype == entry.dtype
            and entry.index not in self.persistent
        )

    def _contiguous(self, entry: ParamEntry) -> bool:
        """Whether the entry's host copies form one range (checked once they are on the
        host)."""
        shards = entry.shards
        if len(shards) == 1:
            return True
        return all(
            a.arena_offset is not None and b.arena_offset == a.arena_offset + a.nbytes
            for a, b in zip(shards, shards[1:])
        )

    def _lend(self, entry: ParamEntry) -> bool:
        """The device copy becomes a view of the host copy: no bytes move. The host copies
        then stay until the device copy is dropped (``_evictable``), and eviction of one drops
        the device copy first. False (nothing lent) when the shards did not land in one range
        of the arena."""
        shards = entry.shards
        self._start_reads(entry)
        waiting = list(shards)
        for shard in shards:
            self._settled_on_host(shard, waiting)
        if not self._contiguous(entry):
            return False
        self.device.charge(entry.device_bytes)
        first = shards[0]
        view = (
            first.host
            if len(shards) == 1
            else self.host.arena_view(first.arena_offset, entry.dtype, entry.numel)
        )
        view = view.view(entry.shape)
        entry.placeholder = entry.device_tensor
        entry.device_tensor = view
        with torch._C.DisableTorchFunctionSubclass():
            entry.param.data = view
        for shard in shards:
            self.registry.set_state(shard, _TO_DEVICE[shard.state])
        entry.resident = True
        self.on_device.add(entry)
        self.lent_gathers += 1
        return True

    def _stage(self, entry: ParamEntry) -> bool:
        """Without autograd on a CPU device, where the host copy cannot be lent (its shards are
        not one range): the device copy is a range of the device tier's reusable slab, so the
        copy faults no fresh pages. False (nothing done) where the slab has no room."""
        if self.device.cuda or self.partition is not None:
            return False
        offset = self.device.slab_take(entry.device_bytes)
        if offset is None:
            return False
        flat = self.device.slab_view(offset, entry.compute_dtype, entry.numel)
        self._start_reads(entry)
        waiting = list(entry.shards)
        moved: list[Shard] = []
        try:
            for shard in entry.shards:
                self._settled_on_host(shard, waiting)
                self.device.copy_in(flat[shard.start : shard.start + shard.numel], shard.host)
                # On the device now: the next shard's read may evict this host copy.
                self.registry.set_state(shard, _TO_DEVICE[shard.state])
                moved.append(shard)
        except BaseException:
            for shard in moved:
                self.registry.set_state(shard, _FROM_DEVICE[shard.state])
            self.device.slab_give(offset, entry.device_bytes)
            raise
        view = flat.view(entry.shape)
        entry.placeholder, entry.device_tensor, entry.slab_offset = (
            entry.device_tensor,
            view,
            offset,
        )
        with torch._C.DisableTorchFunctionSubclass():
            entry.param.data = view
        entry.resident = True
        self.on_device.add(entry)
        return True

    def return_lent(self) -> None:
        """Drops every lent device copy (before the host tier's memory goes away)."""
        for entry in [e for e in self.on_device if e.placeholder is not None]:
            entry.holds = 0
            self.drop_device(entry, force=True)
