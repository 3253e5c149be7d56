"""The entries' device copies: gathers (copies of the host masters, assembled from every
rank's slices across ranks, or lent by the host copy), holds, drops, and room on the device.

A part of :class:`~infinity.core.placement.Placement` (``placement.copies``) with its own
state: the entries resident on the device, when each was last used, the all-gathers a
look-ahead left under way. Lent and staged copies are its own part, :mod:`lending`. What it
needs of the placement (host copies to copy from) is :class:`HostCopies`. Everything runs on the
training thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from infinity.core.lending import HostLending
from infinity.core.policies import EvictionPolicy
from infinity.core.residency import OFF_THE_DEVICE as _FROM_DEVICE
from infinity.core.residency import ON_TO_DEVICE as _TO_DEVICE
from infinity.core.residency import Residency as R
from infinity.core.shards import ParamEntry, Shard, ShardRegistry
from infinity.core.tiers import DeviceTier, HostTier
from infinity.core.trace import TraceFollower
from infinity.errors import BudgetError

if TYPE_CHECKING:
    from infinity.ranks.partition import Partition


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
        assemble_ahead: bool = True,
    ) -> None:
        self._host = host_copies
        self.registry = registry
        self.device = device
        self.follower = follower
        self.eviction = eviction
        #: this rank's place among data-parallel ranks (infinity.ranks.partition); None: one process
        self.partition = partition
        #: entries whose device copy is never evicted (param_persistence_threshold)
        self.persistent = persistent
        #: start the next module's all-gathers while this one computes (stage 3 across ranks)
        self.assemble_ahead_enabled = assemble_ahead
        #: entries whose device copy holds values
        self.on_device: set[ParamEntry] = set()
        #: entry index -> the gather count when it was last gathered (least recently used)
        self.last_used: dict[int, int] = {}
        self.clock = 0
        #: entry index -> all-gathers a look-ahead left under way for its device copy
        self.assembling: dict[int, list] = {}
        self.assembled_ahead = 0
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
        lend = lend and lending.can_lend(entry)
        if entry.placeholder is not None and not lend:
            self.drop_device(entry)  # every other use gets a copy of its own (see can_lend)
        if not entry.resident:
            self._make_device_room(entry)
            if not (lend and (lending.lend(entry) or lending.stage(entry))):
                self._fill_device(entry)
        if hold:
            entry.holds += 1

    def settle(self, entry: ParamEntry) -> None:
        """Completes the all-gathers a look-ahead started for ``entry``'s device copy (across
        ranks); before that its bytes are not all there."""
        pending = self.assembling.pop(entry.index, None)
        if pending:
            for handle in pending:
                handle.wait()

    def assemble_ahead(self) -> None:
        """ZeRO stage 3 across ranks, after a module's gathers: starts the all-gathers of the
        next module's parameters (the trace's next event), so they run while this module
        computes. Only into free device room, never evicting: every rank then decides the same,
        which a collective needs. Its slices are read from NVMe first where they are not on the
        host yet (the trace-driven prefetch started those reads further ahead)."""
        partition = self.partition
        if (
            partition is None
            or partition.stage < 3
            or not self.assemble_ahead_enabled
            or self.follower.trace is None
        ):
            return
        upcoming = self.follower.upcoming(1)
        if not upcoming:
            return
        for index in upcoming[0].entries:
            entry = self.registry.entries[index]
            if entry.resident or index in self._host.uninitialised:
                continue
            if not self.device.fits(entry.device_bytes):
                return
            self._fill_device(entry, defer=True)
            self.assembled_ahead += 1

    def _start_reads(self, sources: list[Shard]) -> None:
        """Starts every read of ``sources`` the arena allows at once, so they overlap."""
        host = self._host
        if host.nvme:
            for source in sources:
                host.reap(source)
                if source.state is R.NVME:
                    host.load_async(source, protect=sources, horizon=0.5)

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
            host.ensure_host(source, protect=waiting)
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
    ) -> None:
        """Makes ``entry``'s device copy from its host copies: starts their reads, runs
        ``prepare`` (the destination's bytes), then, shard by shard as each host copy is
        settled (see :meth:`shards_on_host`), ``copy(shard, host)`` from the host copy of what
        it is gathered from (which returns the copy's event or None) and marks the shard on the
        device (the next shard's read may evict its host copy);
        ``complete`` runs once all are copied. If anything fails the device copy is incomplete
        and none of it counts: the shards copied so far go back to their host/NVMe states, the
        copies are waited for and ``undo`` frees the destination. Otherwise the entry is
        resident once its copies are ordered before the compute stream's next use."""
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
        for event in events:
            self.device.wait(event)
        self.mark_resident(entry)

    def mark_resident(self, entry: ParamEntry) -> None:
        """``entry``'s device copy holds its values."""
        entry.resident = True
        self.on_device.add(entry)

    def _fill_device(self, entry: ParamEntry, defer: bool = False) -> None:
        """Fills the entry's device copy from its host masters (across ranks: assembled from
        every rank's slices). ``defer``: the all-gathers are left under way (``settle``)."""
        tensor = entry.device_tensor
        assert tensor is not None  # given at attach (adopt)
        flat = tensor.view(-1)  # the storage that fill() gives its bytes
        assembling: list[Any] = []  # all-gathers under way (several ranks)

        def before_read(shard: Shard) -> None:
            if assembling and not defer:
                # Its read may evict the slices the all-gathers under way read.
                for pending in assembling:
                    pending.wait()
                assembling.clear()

        def copy(shard: Shard, host: torch.Tensor) -> torch.cuda.Event | None:
            if shard.piece is None:
                return self.device.copy_in(flat[shard.start : shard.start + shard.numel], host)
            event, pending = self._assemble(flat, shard, own_input=defer)
            assembling.append(pending)
            return event

        def complete() -> None:
            if defer:
                self.assembling[entry.index] = assembling
            else:
                for pending in assembling:
                    pending.wait()

        self.copy_to_device(
            entry,
            copy,
            undo=lambda: self.device.empty(tensor),
            prepare=lambda: self.device.fill(tensor),
            before_read=before_read,
            complete=complete,
        )

    def _assemble(
        self, flat: torch.Tensor, shard: Shard, own_input: bool = False
    ) -> tuple[torch.cuda.Event | None, Any]:
        """Starts the all-gather of ``shard``'s whole piece into the device copy ``flat`` from
        every rank's slice. Returns the copy's event and the collective's handle.
        ``own_input``: the collective reads a copy of the slice, not the arena slot, which may
        be evicted before it completes."""
        partition = self.partition
        assert partition is not None and shard.piece is not None  # a slice across ranks
        start, numel = shard.piece
        out = flat[start : start + numel]
        local = shard.host
        assert local is not None  # settled on the host
        event = None
        if local.dtype != out.dtype or (partition.on_device and local.device != out.device):
            # Compute dtype (mixed precision) and, under NCCL, on the device: a device copy.
            staged = torch.empty(
                shard.numel, dtype=out.dtype, device=out.device if partition.on_device else "cpu"
            )
            event = self.device.copy_in(staged, local)
            self.device.wait(event)
            local = staged
        elif own_input:
            local = local.clone()
        elif not partition.on_device and out.device.type != "cpu":
            raise RuntimeError(
                "a gloo process group cannot gather into device memory: use "
                "the nccl backend with CUDA"
            )
        return event, partition.gather_into(out, local)

    def release(self, entry: ParamEntry) -> None:
        """Drops a hold. The device copy stays cached until eviction needs its bytes."""
        if entry.holds <= 0:
            raise RuntimeError(f"release of {entry.name} without a matching gather")
        entry.holds -= 1
        if self.partition is not None and not entry.holds:
            # Across ranks a gather is a collective, so whether a copy is cached must be the
            # same on every rank; eviction under arena pressure is not (it follows each rank's
            # I/O). So the gathered copy goes when its last use does (ZeRO-3's reshard after
            # forward: backward gathers again), unless it is persistent.
            self.drop_device(entry)

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
            self.registry.set_state(shard, _FROM_DEVICE[shard.state])

    def adopt(self, entry: ParamEntry, device: torch.device) -> None:
        """Gives the parameter its device tensor (real shape, compute dtype, empty storage).
        The parameter shares that storage: gathers fill it, drops empty it."""
        tensor = torch.empty(entry.shape, dtype=entry.compute_dtype, device=device)
        tensor.untyped_storage().resize_(0)
        entry.device_tensor = tensor
        with torch._C.DisableTorchFunctionSubclass():
            entry.param.data = tensor

    def _make_device_room(self, entry: ParamEntry) -> None:
        """Evicts cached device copies, in policy order, until ``entry``'s copy has room: on a
        CPU device one free range of the slab, not only free bytes (see DeviceTier.has_room)."""
        if self.device.has_room(entry.device_bytes):
            return
        trace = self.follower.trace
        position = self.follower.position
        next_use = (lambda e: trace.next_use(e.index, position)) if trace is not None else None
        candidates = sorted(
            (
                e
                for e in self.on_device
                if e.holds == 0 and e is not entry and e.index not in self.persistent
            ),
            key=lambda e: e.index,
        )
        for victim in self.eviction.order(
            candidates, next_use, lambda e: self.last_used.get(e.index, -1)
        ):
            self.drop_device(victim)
            if self.device.has_room(entry.device_bytes):
                return
        if self.device.fits(entry.device_bytes):
            return  # the bytes are free but scattered between copies in use: fresh memory
        held = sorted((e for e in self.on_device if e.holds), key=lambda e: -e.nbytes)
        raise BudgetError(
            f"device budget of {self.device.budget} bytes cannot hold {entry.name} "
            f"({entry.device_bytes} bytes) next to the {len(held)} parameters in use "
            f"({self.device.usage.current} bytes, largest: "
            f"{', '.join(e.name for e in held[:3]) or 'none'}): raise device_budget"
        )
