"""The entries' device copies: gathers (copies of the host masters, assembled from every
rank's slices across ranks, or lent by the host copy), holds, drops, and room on the device.

A part of :class:`~infinity.core.placement.Placement` (``placement.copies``) with its own
state: the entries resident on the device, when each was last used, the all-gathers a
look-ahead left under way. Lent and staged copies are its own part, :mod:`lending`. What it
needs of the placement (host copies to copy from) is :class:`HostCopies`. Everything runs on the
training thread.

Across ranks a device copy is assembled by the all-gathers of its buckets
(:mod:`infinity.ranks.buckets`): gathering a small parameter assembles the other parameters of
its bucket that are not on the device too, in the same collective. Every decision that starts
a collective here (which entries, when, how far ahead) is a function of the trace, the holds
and the device budget, which are the same on every rank, never of the host tier or the disk,
which are not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from infinity.core.gathers import BucketGather
from infinity.core.lending import HostLending
from infinity.core.policies import EvictionPolicy
from infinity.core.reshard import KeptForBackward
from infinity.core.residency import OFF_THE_DEVICE as _FROM_DEVICE
from infinity.core.residency import ON_TO_DEVICE as _TO_DEVICE
from infinity.core.residency import Residency as R
from infinity.core.shards import ParamEntry, Shard, ShardRegistry
from infinity.core.tiers import DeviceTier, HostTier
from infinity.core.trace import TraceFollower
from infinity.errors import BudgetError

if TYPE_CHECKING:
    from infinity.ranks.buckets import Bucket
    from infinity.ranks.partition import Partition

log = logging.getLogger(__name__)


class HostCopies(Protocol):
    """What device copies need of the placement: the host copies they are made from."""

    @property
    def nvme(self) -> bool: ...

    @property
    def uninitialised(self) -> set[int]: ...

    def reap(self, shard: Shard, wait: bool = False) -> BaseException | None: ...

    def load_async(
        self,
        shard: Shard,
        protect: Iterable[Shard] = (),
        horizon: float = 0.0,
        prefetch: bool = False,
        read_ahead: bool = False,
        strict: bool = False,
    ) -> bool: ...

    def ensure_host(self, shard: Shard, protect: Iterable[Shard] = ()) -> None: ...

    def gather_source(self, shard: Shard, backward: bool | None = None) -> Shard: ...


@dataclass(eq=False)
class _Assembled:
    """Entries whose device copies one all-gather assembled, and the indices of those that no
    hold has used since."""

    members: list[ParamEntry]
    unused: set[int]


class DeviceCopies:
    """The device copies of one placement's entries (see the module docstring)."""

    def __init__(
        self,
        host_copies: HostCopies,
        registry: ShardRegistry,
        device: DeviceTier,
        host: HostTier,
        follower: TraceFollower,
        eviction: EvictionPolicy,
        *,
        partition: Partition | None,
        persistent: frozenset[int],
        assemble_ahead_bytes: int = 64 << 20,
        reshard_after_forward: bool | str = True,
        device_ahead: int = 0,
    ) -> None:
        self._host = host_copies
        self.host_tier = host
        self.registry = registry
        self.device = device
        self.follower = follower
        self.eviction = eviction
        #: this rank's place among data-parallel ranks (infinity.ranks.partition); None: one process
        self.partition = partition
        #: entries whose device copy is never evicted (param_persistence_threshold)
        self.persistent = persistent
        #: bytes of all-gathers started ahead of the modules that need them, while the current
        #: one computes (stage 3 across ranks; 0: none)
        self.assemble_ahead_bytes = assemble_ahead_bytes
        #: stage 3 across ranks, unless every forward reshards: the modules that keep their
        #: gathered copies for backward, and the copies kept now
        self.kept_for_backward: KeptForBackward | None = None
        if partition is not None and partition.stage == 3 and reshard_after_forward is not True:
            self.kept_for_backward = KeptForBackward(
                registry.entries,
                budget=device.budget,
                persistent=persistent,
                every=reshard_after_forward is False,
            )
        #: entries whose device copy holds values
        self.on_device: set[ParamEntry] = set()
        #: entry index -> the gather count when it was last gathered (least recently used)
        self.last_used: dict[int, int] = {}
        self.clock = 0
        #: entry index -> all-gathers a look-ahead left under way for its device copy
        self.assembling: dict[int, list] = {}
        #: across ranks: entry index -> the entries one all-gather assembled with it, and those
        #: of them not used since (see release)
        self._assembled_with: dict[int, _Assembled] = {}
        self.assembled_ahead = 0
        #: one process with asynchronous copies (CUDA): host->device copies of the next
        #: ``device_ahead`` modules' parameters are issued on the copy stream while the current
        #: one computes (see gather_ahead)
        self.device_ahead = device_ahead
        #: entry index -> the events of its copies issued ahead, which the compute stream waits
        #: for at the entry's gather (settle), not before
        self.copied_ahead: dict[int, list] = {}
        #: device copies issued ahead (counted once each)
        self.gathered_ahead = 0
        #: device copies that are the host copy itself, or a range of the device slab (a CPU
        #: device, without autograd)
        self.lending = HostLending(
            self, registry, device, host, partition=partition, persistent=persistent
        )

    def gather(self, entry: ParamEntry, hold: bool = True, lend: bool = False) -> None:
        """Makes the parameter's device copy resident (filling its storage from the host
        masters) and takes a hold on it. ``lend`` (the caller runs without autograd): where the
        host copy can serve as the device copy (see :meth:`HostLending.can_lend`), use it
        instead of copying."""
        self.clock += 1
        self.last_used[entry.index] = self.clock
        self.settle(entry)
        lending = self.lending
        # A quantized weight is never lent (its host copy is codes), but may be staged.
        stage = lend and (lending.can_lend(entry) or entry.quantized and lending.can_stage(entry))
        lend = lend and lending.can_lend(entry)
        if entry.placeholder is not None and not stage:
            self.drop_device(entry)  # every other use gets a copy of its own (see can_lend)
        if not entry.resident:
            if self.partition is not None:
                members = self._bucket_members(entry)
                self._make_device_room(members)
                self._assemble(members, defer=False)
            else:
                self._make_device_room([entry])
                if not ((lend and lending.lend(entry)) or (stage and lending.stage(entry))):
                    self._fill_device(entry)
        if hold:
            entry.holds += 1
            together = self._assembled_with.get(entry.index)
            if together is not None:
                together.unused.discard(entry.index)

    def settle(self, entry: ParamEntry) -> None:
        """Completes the all-gathers a look-ahead started for ``entry``'s device copy (across
        ranks), or orders the compute stream after the copies issued ahead for it (one
        process); before that its bytes are not all there."""
        for event in self.copied_ahead.pop(entry.index, ()):
            self.device.wait(event)
        pending = self.assembling.pop(entry.index, None)
        if pending:
            for handle in pending:
                handle.wait()

    def assemble_ahead(self) -> None:
        """ZeRO stage 3 across ranks, after a module's gathers: starts the all-gathers of the
        next modules' parameters in the trace's order, so they run while this module computes,
        while those under way stay within ``assemble_ahead_bytes`` (the first always). Only
        into free device room, never evicting, and stopping at the first that does not fit:
        every rank then decides the same, which a collective needs. Their slices are read from
        NVMe first where they are not on the host yet (the trace-driven prefetch started
        those reads further ahead)."""
        partition = self.partition
        trace = self.follower.trace
        if partition is None:
            self.gather_ahead()
            return
        if partition.stage < 3 or not self.assemble_ahead_bytes or trace is None:
            return
        entries = self.registry.entries
        under_way = sum(entries[index].device_bytes for index in self.assembling)
        # The copies on the device take at most its budget, so past that many bytes of distinct
        # entries the walk has met more than prefetch_bucket_size of absent ones, and returned:
        # stopping there keeps a model whose copies are all on the device (kept for backward,
        # or a budget that holds every one) from walking the rest of the trace at every module.
        walked: set[int] = set()
        walk_limit = self.device.budget + self.assemble_ahead_bytes
        walked_bytes = 0
        for event in self.follower.upcoming(len(trace)):
            for index in event.entries:
                if index in walked:
                    continue
                walked.add(index)
                entry = entries[index]
                walked_bytes += entry.device_bytes
                if walked_bytes > walk_limit:
                    return
                if entry.resident or index in self._host.uninitialised:
                    continue
                members = self._bucket_members(entry)
                need = sum(e.device_bytes for e in members)
                if not self.device.fits(need):
                    members = [entry]  # its bucket's others wait for their own turn
                    need = entry.device_bytes
                if under_way and under_way + need > self.assemble_ahead_bytes:
                    return
                if not self.device.fits(need):
                    return
                self._assemble(members, defer=True)
                under_way += need
                self.assembled_ahead += len(members)

    def gather_ahead(self) -> None:
        """One process with asynchronous copies, after a module's gathers: issues the
        host->device copies of the parameters of the next ``device_ahead`` modules in the
        trace's order on the copy stream, so the link works while this module computes; the
        compute stream waits for them only at their own module's gather (``settle``). Only
        copies whose host copies are settled on the host already (never waiting for a read or
        a write) and that fit in free device room (never evicting)."""
        trace = self.follower.trace
        if not self.device.asynchronous or self.device_ahead <= 0 or trace is None:
            return
        entries = self.registry.entries
        for event in self.follower.upcoming(self.device_ahead):
            for index in event.entries:
                entry = entries[index]
                if (
                    entry.resident
                    or entry.placeholder is not None
                    or index in self._host.uninitialised
                    or not self.device.has_room(entry.device_bytes)
                    or not all(
                        source.state.on_host and not source.state.in_flight
                        for source in (self._host.gather_source(s) for s in entry.shards)
                    )
                ):
                    continue
                self._fill_device(entry, ahead=True)
                self.gathered_ahead += 1

    def _bucket_members(self, entry: ParamEntry) -> list[ParamEntry]:
        """The entries the all-gathers of ``entry``'s buckets assemble: ``entry``, and for a
        small one the others of its bucket that are not on the device and have values, unless
        the device cannot make room for them all (then ``entry`` alone)."""
        partition = self.partition
        assert partition is not None and partition.layout is not None  # planned at attach
        members = [entry]
        for bucket in partition.layout.gather_buckets_of(entry):
            for other in bucket.entries:
                if (
                    other not in members
                    and not other.resident
                    and other.index not in self._host.uninitialised
                ):
                    members.append(other)
        if len(members) > 1:
            need = sum(e.device_bytes for e in members)
            evictable = sum(
                e.device_bytes
                for e in self.on_device
                if e.holds == 0 and e.index not in self.persistent
            )
            if self.device.usage.current - evictable + need > self.device.budget:
                return [entry]
        return members

    def _start_reads(self, sources: list[Shard]) -> None:
        """Starts the reads of ``sources`` the arena allows at once, in order, so they overlap.
        The first that finds no slot ends it: a later source's read taking the slot an earlier
        one could not get would leave the earlier one no room when its turn comes, every slot
        held by the protected reads behind it (an arena smaller than the parameter)."""
        host = self._host
        if host.nvme:
            for source in sources:
                host.reap(source)
                if source.state is R.NVME and not host.load_async(
                    source, protect=sources, horizon=0.5
                ):
                    break

    def _read_window(self, sources: list[Shard], first: int) -> list[Shard]:
        """``sources[first]`` and the ones after it whose slots fit in half the arena."""
        window = [sources[first]]
        room = self.host_tier.arena_bytes // 2 - self.host_tier.slot_cost(sources[first].nbytes)
        for source in sources[first + 1 :]:
            room -= self.host_tier.slot_cost(source.nbytes)
            if room < 0:
                break
            window.append(source)
        return window

    def shards_on_host(
        self,
        entry: ParamEntry,
        before_read: Callable[[Shard], None] | None = None,
        masters: bool = False,
    ) -> Iterator[tuple[Shard, Shard]]:
        """Starts the reads of what the entry's shards are gathered from now (each master, or
        its compute copy: see ``Placement.gather_source``) so they overlap, and overlap what
        the caller does before taking the first, then yields each (shard, source) in turn once
        the source's host copy is valid and settled (no write under way), protecting those
        still to come. ``before_read(shard)`` runs first for a source not on the host yet;
        ``masters``: the masters themselves (a copy lent by the host copy)."""
        host = self._host
        sources = [shard if masters else host.gather_source(shard) for shard in entry.shards]
        self._start_reads(sources)
        return self._settled_in_turn(entry, sources, before_read)

    def _settled_in_turn(
        self,
        entry: ParamEntry,
        sources: list[Shard],
        before_read: Callable[[Shard], None] | None,
    ) -> Iterator[tuple[Shard, Shard]]:
        host = self._host
        waiting = list(sources)
        for shard, source in zip(entry.shards, sources):
            if before_read is not None and not source.state.on_host:
                before_read(shard)
            try:
                host.ensure_host(source, protect=waiting)
            except BudgetError:
                # An arena smaller than the parameter can be full of this parameter's own reads
                # ahead (clean, not used yet): they give way to the one needed now.
                host.ensure_host(source)
            waiting.remove(source)
            if source.state is R.HOST_STORING:
                host.reap(source, wait=True)
            yield shard, source

    def copy_to_device(
        self,
        entry: ParamEntry,
        copy: Callable[[Shard, torch.Tensor], torch.cuda.Event | None],
        undo: Callable[[], None],
        *,
        prepare: Callable[[], None] | None = None,
        before_read: Callable[[Shard], None] | None = None,
        complete: Callable[[], None] | None = None,
        ahead: bool = False,
    ) -> None:
        """Makes ``entry``'s device copy from its host copies: starts their reads, runs
        ``prepare`` (the destination's bytes), then, shard by shard as each host copy is
        settled (see :meth:`shards_on_host`), ``copy(shard, host)`` from the host copy of what
        it is gathered from (which returns the copy's event or None) and marks the shard on the
        device (the next shard's read may evict its host copy);
        ``complete`` runs once all are copied. If anything fails the device copy is incomplete
        and none of it counts: the shards copied so far go back to their host/NVMe states, the
        copies are waited for and ``undo`` frees the destination. Otherwise the entry is
        resident once its copies are ordered before the compute stream's next use (``ahead``:
        at the entry's next gather, see :meth:`settle`)."""
        shards = self.shards_on_host(entry, before_read)
        if prepare is not None:
            prepare()
        events: list[torch.cuda.Event | None] = []
        moved: list[Shard] = []
        try:
            with torch.no_grad():
                for shard, source in shards:
                    event = copy(shard, source.host_copy())
                    source.copy_event = event  # its slot is busy until the copy is done
                    events.append(event)
                    # Gathered from its compute copy, the master stays on NVMe (DEVICE_NVME).
                    self.registry.set_state(shard, _TO_DEVICE[shard.state])
                    moved.append(shard)
                if complete is not None:
                    complete()
        except BaseException:
            for shard in moved:
                self.registry.set_state(shard, _FROM_DEVICE[shard.state])
            for event in events:
                if event is not None:
                    event.synchronize()
            undo()
            raise
        if ahead:
            self.copied_ahead[entry.index] = [e for e in events if e is not None]
        else:
            for event in events:
                self.device.wait(event)
        self.mark_resident(entry)

    def mark_resident(self, entry: ParamEntry) -> None:
        """``entry``'s device copy holds its values."""
        entry.resident = True
        self.on_device.add(entry)

    def _fill_device(self, entry: ParamEntry, ahead: bool = False) -> None:
        """Fills the entry's device copy from the host copies of what it is gathered from (one
        process; across ranks see :meth:`_assemble`); ``ahead``: see :meth:`gather_ahead`."""
        tensor = entry.device_tensor
        assert tensor is not None  # given at attach (adopt)
        flat = tensor.view(-1)  # the storage that fill() gives its bytes

        def copy(shard: Shard, host: torch.Tensor) -> torch.cuda.Event | None:
            return self.device.copy_in(
                flat[shard.start : shard.start + shard.numel], host, shard.quant
            )

        self.copy_to_device(
            entry,
            copy,
            undo=lambda: self.device.empty(tensor),
            prepare=lambda: self.device.fill(tensor),
            ahead=ahead,
        )

    def _assemble(self, members: list[ParamEntry], defer: bool) -> None:
        """Fills the device copies of ``members`` (room made) with one all-gather per bucket of
        their shards: the host copy of what each shard is gathered from (its master, or its
        compute copy; read from NVMe where needed) is copied into this rank's row of its
        bucket, then the bucket is gathered. ``defer``: the all-gathers are left under way
        (``settle``). If anything fails before they are all started, none of it counts: the
        shards go back to their host/NVMe states and the copies are freed."""
        partition = self.partition
        assert partition is not None and partition.layout is not None  # planned at attach
        layout = partition.layout
        chosen = set(members)
        plans: list[tuple[Bucket, list[Shard]]] = []
        planned: set[int] = set()
        for entry in members:
            for bucket in layout.gather_buckets_of(entry):
                if bucket.index not in planned:
                    planned.add(bucket.index)
                    plans.append((bucket, [s for s in bucket.shards if s.entry in chosen]))
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "all-gather%s of %s (%d bucket(s))",
                " ahead" if defer else "",
                ", ".join(e.name for e in members),
                len(plans),
            )
        buffers_on = self.device.device if partition.on_device else torch.device("cpu")
        host = self._host
        filled: list[ParamEntry] = []
        gathers: list[BucketGather] = []
        try:
            for entry in members:
                assert entry.device_tensor is not None  # given at attach (adopt)
                self.device.fill(entry.device_tensor)
                filled.append(entry)
            for bucket, shards in plans:
                # This bucket's reads at once (the next bucket's wait: a bucket's shards may
                # be more than the arena holds); a shard copied into its slot may go.
                outputs = []
                for shard in shards:
                    assert shard.piece is not None and shard.entry.device_tensor is not None
                    start, numel = shard.piece
                    outputs.append(shard.entry.device_tensor.view(-1)[start : start + numel])
                gather = BucketGather(
                    partition, shards, outputs, bucket.dtype, buffers_on, partition.scratch
                )
                gathers.append(gather)
                # The slots may be a block that queued kernels still read: copies after them.
                self.device.streams.allocated(gather.buffer)
                # What each shard is gathered from: its master, or its compute copy (see
                # Placement.gather_source), in the bucket's dtype either way.
                sources = [host.gather_source(shard) for shard in shards]
                events = []
                with torch.no_grad():
                    for slot, source in enumerate(sources):
                        # Reads of the next sources overlap, as many as half the arena holds:
                        # a bucket may have more than the arena, and reads of later sources
                        # holding it all would leave none for this one.
                        window = self._read_window(sources, slot)
                        self._start_reads(window)
                        host.ensure_host(source, protect=window[1:])
                        if source.state is R.HOST_STORING:
                            host.reap(source, wait=True)
                        # The shard's state does not change: the device copy is every
                        # rank's slices, which a rank's own residency cannot describe (the
                        # entry's is that), and the host copy may go once copied (after
                        # copy_event), as the arena of this rank alone needs.
                        event = self.device.copy_in(gather.slot(slot), source.host_copy())
                        source.copy_event = event
                        events.append(event)
                for event in events:
                    self.device.wait(event)  # the collective reads the copies
                gather.start()
        except BaseException:
            for gather in gathers:
                if gather.started:
                    try:
                        gather.wait()  # the collective may still write into the copies
                    except BaseException:
                        pass
                else:
                    gather.abandon()
            for entry in filled:
                assert entry.device_tensor is not None
                self.device.empty(entry.device_tensor)
            raise
        together = _Assembled(members, {e.index for e in members})
        for entry in members:
            self.mark_resident(entry)
            self._assembled_with[entry.index] = together
        if defer:
            for entry in members:
                self.assembling[entry.index] = list(gathers)
        else:
            for gather in gathers:
                gather.wait()

    def wait_host_reads(self, shards: Iterable[Shard]) -> None:
        """The host waits for the device copies still reading ``shards``' host copies, before
        it writes them (a master's update, its compute copy's refresh): a copy issued ahead
        (or any copy on a GPU) runs after the host moved on."""
        for shard in shards:
            event = shard.copy_event
            if event is not None:
                self.device.streams.synchronize(event)
                shard.copy_event = None

    def release(self, entry: ParamEntry) -> None:
        """Drops a hold. The device copy stays cached until eviction needs its bytes."""
        if entry.holds <= 0:
            raise RuntimeError(f"release of {entry.name} without a matching gather")
        entry.holds -= 1
        if self.partition is not None and not entry.holds:
            # Across ranks a gather is a collective, so whether a copy is cached must be the
            # same on every rank; eviction under arena pressure is not (it follows each rank's
            # I/O). So the gathered copy goes when its last use does (ZeRO-3's reshard after
            # forward: backward gathers again), unless it is persistent. The parameters one
            # all-gather assembled go together, once each was used: dropped one by one, the
            # next all-gather of their bucket would assemble only the ones gone.
            together = self._assembled_with.get(entry.index)
            if together is None:
                self.drop_device(entry)
            elif not together.unused:
                for member in together.members:
                    if member.holds == 0 and self._assembled_with.get(member.index) is together:
                        self.drop_device(member)

    def drop_device(self, entry: ParamEntry, force: bool = False) -> None:
        """Frees the device copy's bytes. The parameter keeps its tensor and storage object,
        with the storage shrunk to zero bytes: views of it that autograd saved in forward
        (``weight.t()`` in a linear layer) see the values again once the next gather refills
        the same storage, instead of keeping a stale copy alive."""
        if not entry.resident or (entry.index in self.persistent and not force):
            return
        self.settle(entry)
        if entry.holds:
            raise RuntimeError(f"{entry.name} is in use on the device")
        together = self._assembled_with.pop(entry.index, None)
        if together is not None:
            together.unused.discard(entry.index)
        placeholder = entry.placeholder
        if placeholder is not None:  # lent, or staged: give the parameter its own back
            entry.device_tensor, entry.placeholder = placeholder, None
            with torch._C.DisableTorchFunctionSubclass():
                entry.param.data = placeholder
            if entry.slab_offset is not None:
                self.device.slab_give(entry.slab_offset, entry.device_bytes)
                entry.slab_offset = None
            else:
                self.device.usage.sub(entry.device_bytes)
        else:
            assert entry.device_tensor is not None  # given at attach (adopt)
            self.device.empty(entry.device_tensor)
        entry.resident = False
        self.on_device.discard(entry)
        for shard in entry.shards:
            if shard.state.on_device:  # across ranks it never is (see _assemble)
                self.registry.set_state(shard, _FROM_DEVICE[shard.state])

    def adopt(self, entry: ParamEntry, device: torch.device) -> None:
        """Gives the parameter its device tensor (real shape, compute dtype, empty storage).
        The parameter shares that storage: gathers fill it, drops empty it."""
        tensor = torch.empty(entry.shape, dtype=entry.compute_dtype, device=device)
        tensor.untyped_storage().resize_(0)
        entry.device_tensor = tensor
        with torch._C.DisableTorchFunctionSubclass():
            entry.param.data = tensor

    def _make_device_room(self, wanted: list[ParamEntry]) -> None:
        """Evicts unheld device copies, furthest-needed first, until ``wanted`` have room: on
        a CPU device a free range of the slab each, not only free bytes (see
        DeviceTier.has_room)."""
        sizes = [e.device_bytes for e in wanted]
        need = sum(sizes)
        if self.device.has_room(*sizes):
            return
        entry = wanted[0]
        trace = self.follower.trace
        position = self.follower.position
        next_use = (lambda e: trace.next_use(e.index, position)) if trace is not None else None
        candidates = sorted(
            (
                e
                for e in self.on_device
                if e.holds == 0 and e not in wanted and e.index not in self.persistent
            ),
            key=lambda e: e.index,
        )
        for victim in self.eviction.order(
            candidates, next_use, lambda e: self.last_used.get(e.index, -1)
        ):
            self.drop_device(victim)
            if self.device.has_room(*sizes):
                return
        if self.device.fits(need):
            return  # the bytes are free but scattered between copies in use: fresh memory
        held = sorted((e for e in self.on_device if e.holds), key=lambda e: -e.nbytes)
        raise BudgetError(
            f"device budget of {self.device.budget} bytes cannot hold {entry.name} "
            f"({need} bytes) next to the {len(held)} parameters in use "
            f"({self.device.usage.current} bytes, largest: "
            f"{', '.join(e.name for e in held[:3]) or 'none'}): raise device_budget"
        )
