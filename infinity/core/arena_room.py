"""Room in the host staging arena: which shards hold its slots, which go first when room is
needed, and the write-backs that free it.

Room is made on demand: before a host slot is taken, the eviction policy orders the candidates
and the furthest-needed ones are dropped (clean host copies) or written back first (dirty
ones). Prefetch may only evict what is needed later than the thing it fetches, so it never
pushes out what the next module needs and never over-commits the arena. During the step the
front of the eviction order is kept clean ahead of the reads that will need its room
(:meth:`ArenaRoom.clean_ahead`).

The room is the placement's part (:mod:`infinity.core.placement`); it reaches the placement's
transfers, device copies and prefetching through :class:`ArenaUser`, and reads where the run is
from the :class:`~infinity.core.run_phase.RunPhase` they share.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from infinity.core.policies import EvictionPolicy
from infinity.core.residency import Residency as R
from infinity.core.run_phase import RunPhase
from infinity.core.shards import ParamEntry, Shard, ShardKind, ShardRegistry
from infinity.core.tiers import HostTier
from infinity.core.trace import TraceFollower
from swap import SwapEngine

if TYPE_CHECKING:
    from infinity.core.completions import Completions
    from infinity.core.device_copies import DeviceCopies
    from infinity.core.prefetching import TracePrefetching


class ArenaUser(Protocol):
    """What the room needs of the placement: its transfers and the parts that take slots."""

    completions: Completions
    copies: DeviceCopies
    prefetching: TracePrefetching

    def reap(self, shard: Shard, wait: bool = False) -> BaseException | None: ...

    def store_async(self, shard: Shard) -> None: ...

    def drop_device(self, entry: ParamEntry, force: bool = False) -> None: ...

    def compute_copy(self, shard: Shard) -> Shard | None: ...


def _registry_order(shard: Shard) -> tuple[int, bool, str, int]:
    # Within an entry: its companions (the gradient, then optimizer state by key), then the
    # param shard itself.
    return shard.entry.index, shard.kind is ShardKind.PARAM, shard.companion_key or "", shard.start


class ArenaRoom:
    """The arena's slots and who holds them, eviction and write-backs (see the module
    docstring)."""

    def __init__(
        self,
        placement: ArenaUser,
        phase: RunPhase,
        registry: ShardRegistry,
        host: HostTier,
        follower: TraceFollower,
        eviction: EvictionPolicy,
        engine: SwapEngine | None,
        *,
        params_on_nvme: bool,
        persistent: frozenset[int],
    ) -> None:
        self._placement = placement
        self._phase = phase
        self.registry = registry
        self.host = host
        self.follower = follower
        self.eviction = eviction
        self.engine = engine
        self._params_on_nvme = params_on_nvme
        self._persistent = persistent
        #: shards holding an arena slot
        self.in_arena: set[Shard] = set()
        #: arena shards written back to free their room (see :meth:`make_room`): once clean,
        #: they are the first to go
        self.doomed: set[Shard] = set()
        #: write-backs eviction had to start during forward/backward
        self.forced_pass_writes = 0

    def take_slot(
        self, shard: Shard, protect: Iterable[Shard], horizon: float, strict: bool = False
    ) -> bool:
        """Gives ``shard`` an arena slot, evicting as allowed; False if none can be had."""
        self._placement.completions.reclaim_quarantine()
        offset = self._placement.copies.lending.after_previous(shard)
        if offset is None:
            offset = self.host.take_arena(shard.nbytes)
        if offset is None:
            offset = self.make_room(
                shard.nbytes, set(protect) | {shard}, horizon, strict and horizon > 0
            )
            if offset is None:
                return False
        shard.arena_offset = offset
        shard.host = self.host.arena_view(offset, shard.dtype, shard.host_numel)
        self.in_arena.add(shard)
        return True

    def free_slot(self, shard: Shard) -> None:
        """Gives ``shard``'s arena slot back (its host copy goes with it)."""
        self._placement.copies.wait_host_reads((shard,))  # a device copy may still read the slot
        assert shard.arena_offset is not None, f"{shard} has no arena slot"
        self.host.give_arena(shard.arena_offset, shard.nbytes)
        self.in_arena.discard(shard)
        self.doomed.discard(shard)
        shard.arena_offset = None
        shard.host = None

    def leave_slot(self, shard: Shard) -> None:
        """``shard`` leaves its arena slot without giving it back: a timed-out read may still
        write there (the slot is quarantined; see :mod:`infinity.core.completions`)."""
        self.in_arena.discard(shard)
        shard.arena_offset = None
        shard.host = None

    def no_room(self, shard: Shard) -> str:
        text = (
            f"no room in the host staging arena ({self.host.arena_bytes} bytes, "
            f"{self.host.usage.current} in use) for shard {shard.id} ({shard.nbytes} bytes)"
        )
        completions = self._placement.completions
        if completions.quarantine:
            engine, arena = self.engine, self.host.arena
            assert engine is not None  # a quarantine holds reads of the engine's
            hung = [q for q in engine.quarantined() if q.buffer is arena]
            return (
                f"{text}: {completions.quarantined_bytes} bytes of it are quarantined behind "
                f"reads that timed out (the drive hangs?)"
                + (f", e.g. a {hung[0].describe()}" if hung else "")
            )
        return f"{text}: raise buffer_count or buffer_size, or host_budget"

    def ranking(self):
        """Events until a shard is needed again, or None without a trace. Companions (grads,
        optimizer state) are needed by the step, after the iteration's last event. A master
        whose compute copy is current is needed by its update only (gathers read the copy),
        and a compute copy by the gathers before its update rewrites it."""
        trace = self.follower.trace
        if trace is None:
            return None
        position = self.follower.position
        end = len(trace) - position + 0.5

        stepped = self._phase.stepped
        full = len(trace)

        masters_due = self._params_on_nvme and self._phase.masters_due
        # The step walks the shards in entry order: within it, a later entry is needed later.
        in_step = 0.5 / (len(self.registry.entries) + 1)

        last_backward = trace.last_backward if self._phase.update_in_backward else {}

        def next_use(shard: Shard) -> float:
            index = shard.entry.index
            update = last_backward.get(index)
            # ``requires_grad`` is read only where it decides: on the parameter (a tensor
            # subclass) each read is a __torch_function__ call, and a streamed forward ranks
            # thousands of shards.
            if shard.kind is ShardKind.COMPUTE:
                use = trace.next_use(index, position)
                master = shard.owner
                assert master is not None  # a companion
                if shard.version != master.version:
                    return end + full  # stale: never read again
                if masters_due and index not in stepped and shard.entry.param.requires_grad:
                    # Its update rewrites it: the gathers after that do not read these bytes.
                    rewrite = update - position if update is not None else end
                    if use >= rewrite:
                        return end + full
                return use
            # Updated in backward once its gradient is complete: after the entry's last
            # backward event, and autograd may complete it only after the next module's event
            # has fired. Until then the update is imminent, master and state alike (ranked a
            # step away, its state was evicted and read straight back).
            if (
                update is not None
                and update < position
                and index not in stepped
                and (shard.kind is not ShardKind.PARAM or shard.entry.param.requires_grad)
            ):
                return 0.5
            if shard.kind is not ShardKind.PARAM:
                if update is not None:
                    if index in stepped:
                        return update + full - position + 0.5
                    return update - position + 0.5
                return end + full if index in stepped else end + in_step * index
            use = trace.next_use(index, position)
            if self._placement.compute_copy(shard) is not None:
                # Gathers read the compute copy: the master is next needed by its update.
                if not shard.entry.param.requires_grad:
                    return end + full
                if update is not None:
                    ahead = update - position + 0.5
                    return ahead + full if index in stepped or ahead < 0 else ahead
                return end + in_step * index + (full if index in stepped else 0)
            if masters_due and use >= end - 0.5:
                # Next used in the next iteration: after this iteration's step, and before it
                # when the step updates the master (needed there, however far the use is).
                return end + in_step * index if self._step_will_update(shard) else use + 1.0
            return use

        # Each caller ranks its candidates and then keeps those needed after its horizon, both
        # before it changes any state: one computation per shard serves both (the ranking alone
        # was a tenth of the training thread's time on a 0.65 B GPT under a 1 GiB budget).
        known: dict[Shard, float] = {}

        def remembered(shard: Shard) -> float:
            use = known.get(shard)
            if use is None:
                use = known[shard] = next_use(shard)
            return use

        return remembered

    @staticmethod
    def evictable(shard: Shard) -> bool:
        if shard.kind is not ShardKind.PARAM:
            return True
        if shard.entry.lent:  # the host copy is the device copy
            return shard.entry.holds == 0
        # A slice across ranks was copied into its bucket when the device copy was assembled.
        return (
            shard.entry.holds == 0 or shard.state is R.DEVICE_HOST_NVME or shard.piece is not None
        )

    def victims(
        self,
        protect: set[Shard],
        horizon: float,
        next_use: Callable[[Shard], float] | None,
    ) -> list[Shard]:
        """Arena shards that may be evicted now and are next needed after ``horizon`` (see
        :meth:`_beyond`), in the order the policy would evict them. Filtered before they are
        ranked: once the arena is a window of reads ahead, most prefetches find nothing needed
        after theirs, and then rank nothing."""
        candidates = self._beyond(
            [
                s
                for s in self.in_arena
                if s not in protect and s not in self._phase.pinned and self.evictable(s)
            ],
            horizon,
            next_use,
        )
        # In registry order, so that ties (a shard's companions share its next use) break the
        # same way in every run, and in the planner's replay of it.
        candidates.sort(key=_registry_order)
        return self.eviction.order(
            candidates, next_use, lambda s: self._placement.copies.last_used.get(s.entry.index, -1)
        )

    def make_room(
        self, nbytes: int, protect: set[Shard], horizon: float, strict: bool = False
    ) -> int | None:
        """Evicts until ``nbytes`` fit. Only clean host copies (an NVMe copy valid) are dropped:
        dirty ones are written back first and stay until that write completed. Write-backs are
        started for about ``nbytes`` at a time, in eviction order, never for everything dirty:
        one read that finds no clean room must not turn into a write of the whole arena.
        On demand (no ``horizon``), when no room could be made because write-backs failed,
        raises the write error (that is why there is no room). ``strict`` (with a horizon)
        evicts in policy order only: once write-backs under way will free the room, it waits
        for them rather than drop a clean shard needed sooner."""
        next_use = self.ranking()
        candidates = self.victims(protect, horizon, next_use)
        # Ahead of need (a horizon), a shard written back to make room goes first once its
        # write has landed, wherever the policy ranks it now: updates since then put fresher
        # dirty shards ahead of it (the ones just updated are needed last), and starting their
        # writes instead would leave it to be updated again unread, its write wasted, while
        # the front kept moving. On demand the first clean candidate goes anyway.
        for shard in candidates if horizon else ():
            if shard in self.doomed:
                self._placement.reap(shard)
                if shard.state.on_nvme:
                    offset = self._evict_for(shard, nbytes)
                    if offset is not None:
                        return offset
        cost = self.host.slot_cost
        write_error: BaseException | None = None
        coming = 0  # bytes whose write-back is in flight: room once it completes
        for shard in candidates:
            self._placement.reap(shard)
            if strict and coming >= nbytes:
                # Room is on its way from shards needed later than the rest: evicting a
                # clean one needed sooner would make a read that must be repeated.
                return None
            if shard.state is R.HOST:
                if coming < nbytes:
                    self._forced_write(shard)
                    coming += cost(shard.nbytes)
                continue
            if shard.state is R.HOST_STORING:
                coming += cost(shard.nbytes)
                if horizon:
                    continue  # prefetch does not wait for write-back
                write_error = self._placement.reap(shard, wait=True) or write_error
            offset = self._evict_for(shard, nbytes)
            if offset is not None:
                return offset
        if horizon:
            return None
        # Demand: wait for transfers in flight (write-backs, and prefetches that would otherwise
        # pin the arena) and evict what they free, in policy order; when that is not enough
        # (the freed ranges are not contiguous), write back and evict the rest one by one.
        for shard in candidates:
            if (
                shard.state is R.DEVICE_HOST
                and shard.entry.holds == 0
                and shard.entry.index not in self._persistent
            ):
                # A dirty master whose device copy is cached, not in use (after an update in
                # backward, the next forward leaves it so): drop that copy, which is never
                # newer, so the master can be written back.
                self._placement.drop_device(shard.entry)
            if shard.state is R.HOST:
                self._forced_write(shard)
            if shard.pending is not None:
                error = self._placement.reap(shard, wait=True)
                if shard.state is R.HOST:
                    write_error = error or write_error
            offset = self._evict_for(shard, nbytes)
            if offset is not None:
                return offset
        if write_error is not None:
            raise write_error  # counted in io_failures when its write gave up
        return None

    def _forced_write(self, shard: Shard) -> None:
        """A write-back that eviction needs now; remembered when a forward or backward pass
        forced it, or the step did for a shard it had not updated yet (dirty since the last
        step), so the next forward can start it ahead (see :meth:`TracePrefetching.write_ahead`)."""
        self._placement.store_async(shard)
        self.doomed.add(shard)
        if self._phase.in_pass:
            self.forced_pass_writes += 1
        elif not self._phase.masters_due or shard.entry.index in self._phase.stepped:
            return  # outside a training iteration, or updated by this step
        self._placement.prefetching.remember_forced(shard)

    def horizon_after_step(self) -> float:
        """An eviction horizon past this iteration's step: within it, :meth:`_next_use` ranks
        every shard the step still has to update. Without a trace it is infinity, which
        :meth:`_beyond` reads as "not needed by the running step"."""
        trace = self.follower.trace
        if trace is None:
            return math.inf
        return len(trace) - self.follower.position + 1.0

    def _beyond(
        self, candidates: list[Shard], horizon: float, next_use: Callable[[Shard], float] | None
    ) -> list[Shard]:
        """The candidates next needed after ``horizon`` (all of them for no horizon). Without
        a trace only the running step's own order is known: past the step, a shard it has
        still to update is needed sooner, and nothing else is known to be."""
        if not horizon:
            return candidates
        if next_use is not None:
            return [s for s in candidates if next_use(s) > horizon]
        if horizon == math.inf and self._phase.masters_due and not self._phase.in_pass:
            return [s for s in candidates if not self._step_will_update(s)]
        return candidates

    def _step_will_update(self, shard: Shard) -> bool:
        """Whether this iteration's step has still to update ``shard`` (a trainable master or
        a companion of an entry it has not reached yet)."""
        if shard.kind is ShardKind.COMPUTE:
            return False  # the step writes it, never reads it
        return shard.entry.index not in self._phase.stepped and (
            shard.kind is not ShardKind.PARAM or shard.entry.param.requires_grad
        )

    def clean_ahead(
        self, reserve: int, protect: Iterable[Shard] = (), horizon: float = 0.0
    ) -> None:
        """Starts write-backs of dirty arena shards, in eviction order, until ``reserve`` bytes
        of the arena are free or held by clean copies.

        Writing every updated shard back after the step costs a full write of the training
        state per step even when most of it stays cached. Only the shards at the front of
        the eviction order will be dropped before their next use, so only they need a current
        NVMe copy, and they get it ahead of the read that will need their room. Only shards
        next used beyond ``horizon`` are written."""
        if self.engine is None:
            return
        host = self.host
        reclaimable = min(host.arena_bytes, host.budget) - host.usage.current
        if reclaimable >= reserve:
            return
        next_use = self.ranking()
        victims = self.victims(set(protect), horizon, next_use)
        for shard in victims:
            if reclaimable >= reserve:
                break
            self._placement.reap(shard)
            if shard.state is R.HOST:
                self._placement.store_async(shard)
                self.doomed.add(shard)
            if shard.state in (R.HOST_NVME, R.DEVICE_HOST_NVME, R.HOST_STORING):
                reclaimable += host.slot_cost(shard.nbytes)

    def _evict_for(self, shard: Shard, nbytes: int) -> int | None:
        """Drops ``shard``'s host copy if it is clean (or already gone: a failed read released
        its slot), then tries to take ``nbytes``."""
        if shard.kind is ShardKind.PARAM and shard.entry.lent:
            self._placement.drop_device(shard.entry)  # a lent device copy goes with the host copy
        if shard.state in (R.HOST_NVME, R.DEVICE_HOST_NVME):
            self.evict_host(shard)
        elif shard in self.in_arena:
            return None  # dirty, or a transfer still in flight
        return self.host.take_arena(nbytes)

    def evict_host(self, shard: Shard) -> None:
        if shard.state is R.HOST_NVME:
            self.registry.set_state(shard, R.NVME)
        elif shard.state is R.DEVICE_HOST_NVME:
            self.registry.set_state(shard, R.DEVICE_NVME)
        else:
            raise RuntimeError(f"cannot evict the host copy of {shard}")
        self.free_slot(shard)
