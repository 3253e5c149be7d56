"""Trace-driven reads and write-backs ahead of need: the part of
:class:`~infinity.core.placement.Placement` that runs at each module event.

At each event the prefetch policy names the entries worth reading now, nearest use first, and a
read may only evict what is needed after it (see ``ArenaRoom.make_room``); with updates in
backward the optimizer state of the next updates is read too. Write-ahead starts, during forward,
the write-backs the last pass had to wait for.

:class:`TracePrefetching` keeps its own state (the policy, the byte cap, what the last pass had
to write back and how much of it was started ahead); what it needs of the placement (its arena
shards and transfers) is :class:`ReadsAndWrites`. Everything runs on the training thread.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Protocol

from infinity.core.policies import PrefetchPolicy
from infinity.core.residency import Residency as R
from infinity.core.run_phase import RunPhase
from infinity.core.shards import Shard, ShardKind, ShardRegistry, state_companions
from infinity.core.tiers import HostTier
from infinity.core.trace import BACKWARD, FORWARD, Event, Trace, TraceFollower


class ReadsAndWrites(Protocol):
    """What reading and writing ahead needs of the placement."""

    @property
    def in_arena(self) -> set[Shard]: ...

    #: where the run is: the pinned host copies, the entries the step has updated, updates
    #: in backward
    phase: RunPhase

    def reap(self, shard: Shard, wait: bool = False) -> BaseException | None: ...

    def store_async(self, shard: Shard) -> None: ...

    def load_async(
        self,
        shard: Shard,
        protect: Iterable[Shard] = (),
        horizon: float = 0.0,
        prefetch: bool = False,
        read_ahead: bool = False,
        strict: bool = False,
    ) -> bool: ...

    def clean_ahead(
        self, reserve: int, protect: Iterable[Shard] = (), horizon: float = 0.0
    ) -> None: ...

    def gather_source(self, shard: Shard, backward: bool | None = None) -> Shard: ...


class TracePrefetching:
    """Reads and write-backs ahead of need for one placement (see the module docstring)."""

    def __init__(
        self,
        placement: ReadsAndWrites,
        registry: ShardRegistry,
        follower: TraceFollower,
        host: HostTier,
        policy: PrefetchPolicy,
        *,
        nvme: bool,
        swaps: bool,
        prefetch_bytes: int | None,
    ) -> None:
        """``nvme``: the parameters' masters are on NVMe (what prefetch reads); ``swaps``:
        anything is (a swap engine exists)."""
        self._placement = placement
        self.registry = registry
        self.follower = follower
        self.host = host
        self.policy = policy
        self.nvme = nvme
        self.swaps = swaps
        #: cap on bytes of prefetch reads in flight (None: bounded by the arena)
        self.prefetch_bytes = prefetch_bytes
        #: learn and start ahead the write-backs a pass had to wait for (see write_ahead);
        #: benchmarks and tests turn it off to compare
        self.write_ahead_enabled = True
        #: write-behind learned from the last forward + backward: the dirty shards that its
        #: reads and gradients had to evict, written back on the spot while the pass waited
        self._forced_writes: list[Shard] = []
        self._forced_last: list[Shard] = []
        self._prewritten = 0  # how many of _forced_last this pass has looked at
        #: write-backs started ahead
        self.writes_ahead = 0

    # -- write-ahead ----------------------------------------------------------------------------
    def remember_forced(self, shard: Shard) -> None:
        """A training iteration had to wait for ``shard``'s write-back: the next one starts it
        ahead (see :meth:`write_ahead`). Gradients are not remembered: they change during
        backward."""
        if shard.kind is not ShardKind.GRAD:
            self._forced_writes.append(shard)

    def pass_started(self) -> None:
        """A forward pass with autograd begins: what the last one had to write back is what
        this one writes ahead."""
        self._forced_last, self._forced_writes = self._forced_writes, []
        self._prewritten = 0

    def write_ahead(self, share: float) -> None:
        """Starts the write-backs the last pass had to wait for, ``share`` of them per call
        (called at each forward event, while the disk would otherwise idle under compute):
        the shards are mostly the same every iteration (parameters and optimizer state the step
        made dirty), and nothing changes them before the step, so their eviction in backward
        finds them clean at the cost of the same write. One that this pass ends up not evicting
        is written again after the step (a few percent more bytes on a small GPT)."""
        placement = self._placement
        last = self._forced_last
        stop = min(len(last), self._prewritten + max(1, round(share * len(last))))
        while self._prewritten < stop:
            shard = last[self._prewritten]
            self._prewritten += 1
            placement.reap(shard)
            if (
                shard.state is R.HOST
                and shard in placement.in_arena
                and shard not in placement.phase.pinned
            ):
                placement.store_async(shard)
                self.writes_ahead += 1

    # -- at each event --------------------------------------------------------------------------
    def at_event(self, event: Event) -> None:
        """Reads (and write-backs) ahead after the follower observed ``event``."""
        if not self.nvme or self.follower.trace is None:
            return
        trace = self.follower.trace
        position = self.follower.position
        if (
            event.kind == FORWARD
            and self.write_ahead_enabled
            and self._prewritten < len(self._forced_last)
        ):
            self.write_ahead(1.0 / max(1, trace.forward_events))
        # The event's own shards are gathered right after this: their next use counted from
        # past the event is an iteration away, so without protection a prefetch would evict
        # them first, and the gather would read them again.
        placement = self._placement
        current = {
            placement.gather_source(shard)
            for index in event.entries
            for shard in self.registry.entries[index].shards
        }
        budget = self.prefetch_ahead(protect=current)
        if budget is not None and self._placement.phase.update_in_backward:
            # Strict: it reads far ahead, and what a read evicts out of order must be read
            # again (without it, half as many bytes again were read at bench_overlap's smallest
            # arena). In forward only the state of updates a few events away: further, the room
            # would come from masters and state that this backward needs before them, each read
            # twice; without any, backward began by waiting for the first updates' state while
            # the disk had idled through forward.
            reach = (
                math.inf
                if event.kind != FORWARD
                else 2 * max(1, getattr(self.policy, "depth", 1)) + 1
            )
            self._prefetch(self._state_wanted(trace, position, reach), budget, strict=True)

    def prefetch_ahead(self, protect: set[Shard] | frozenset = frozenset()) -> float | None:
        """Starts the reads the prefetch policy wants now (see :meth:`_prefetch`)."""
        trace = self.follower.trace
        if not self.nvme or trace is None:
            return None
        position = self.follower.position
        budget = self.prefetch_bytes
        if budget is not None:
            budget -= sum(s.nbytes for s in self._placement.in_arena if s.state is R.NVME_LOADING)
        if not self.registry.on_nvme:  # everything is read already (the host tier holds it)
            return math.inf if budget is None else budget
        entries = self.registry.entries

        def wanted() -> Iterator[tuple[Shard, float]]:
            # Only shards still on NVMe: the window ahead is mostly read already (with
            # streaming inference, the whole trace is walked at every event).
            for index in self.policy.wanted(self.follower):
                shards = entries[index].shards
                # A gather reads a shard itself unless the shard is on NVMe: an entry none of
                # whose shards is there has nothing to read, whenever it is used.
                if not any(shard.state is R.NVME for shard in shards):
                    continue
                use = trace.next_use(index, position)
                if use == math.inf:
                    continue
                # What the gather at that use reads: the master, or its compute copy.
                backward = trace.events[int(position + use) % len(trace)].kind == BACKWARD
                for shard in shards:
                    source = self._placement.gather_source(shard, backward)
                    if source.state is R.NVME:
                        yield source, use + 0.5

        return self._prefetch(wanted(), budget, protect=protect)

    @property
    def inference_iteration_over(self) -> bool:
        """Whether a followed iteration without autograd has run its last module. Nothing
        else runs until the next iteration's first module (a decode step's sampling, the
        caller's loop), so the room its release freed should go to the next iteration's first
        reads at once (``prefetch_ahead``)."""
        follower = self.follower
        return (
            follower.inference
            and follower.trace is not None
            and follower.position == len(follower.trace)
        )

    def _prefetch(
        self,
        wanted: Iterable[tuple[Shard, float]],
        budget: float | None,
        strict: bool = False,
        protect: set[Shard] | frozenset = frozenset(),
    ) -> float | None:
        """Starts the reads of ``wanted`` (shard, horizon) in order, each evicting only what is
        needed after its horizon. Returns the ``prefetch_bytes`` left (``math.inf`` without a
        cap), or None once a read found no room or the cap was reached: prefetch less, never
        over-commit."""
        placement = self._placement
        left = math.inf if budget is None else budget
        for shard, horizon in wanted:
            placement.reap(shard)
            if shard.state is not R.NVME:
                continue
            if left < shard.nbytes or not placement.load_async(
                shard, protect, horizon=horizon, prefetch=True, strict=strict
            ):
                return None
            left -= shard.nbytes
        return left

    def _state_wanted(
        self, trace: Trace, position: int, reach: float = math.inf
    ) -> Iterator[tuple[Shard, float]]:
        """With updates in backward: the optimizer state of the entries to be updated next,
        in the order backward will update them, with their horizons, up to a third of the
        arena and to updates at most ``reach`` events away. Further ahead, a read would make
        its shard the one needed last in the arena, which the next gradient's slot evicts: the
        same bytes read again and again."""
        window = self.host.arena_bytes // 3
        for update, index in trace.updates_from(position):
            if update - position > reach:
                return
            if index in self._placement.phase.stepped:
                continue
            for shard in self.registry.entries[index].shards:
                for companion in shard.companions.values():
                    if companion.kind in (ShardKind.GRAD, ShardKind.COMPUTE):
                        continue
                    window -= self.host.slot_cost(companion.nbytes)
                    if window < 0:
                        return
                    yield companion, update - position + 1.0

    def clean_for_updates(self, updates: int = 4) -> None:
        """With updates in backward, after one: starts the write-backs that the reads of the
        next ``updates`` updates will need room for (their masters and optimizer state not on
        host yet), of shards used after the last of them only. Left to the reads themselves, the
        room came from a dirty shard whose write the read then waited for, with the disk busy
        writing and reading at once; started here, the writes overlap the update just done and
        the gradients still to come. Four: on the 100.7M MLP under a 0.7 GiB budget, 0.14-0.27 s
        of stall a step instead of 0.21-0.42 (six interleaved runs each), bytes within 4%, and
        no change under 1.0 GiB; eight stalled as little but wrote 10% more, for room that later
        reads took back."""
        trace = self.follower.trace
        if not self.swaps or trace is None:
            return
        position = self.follower.position
        missing, horizon = 0, 0.0
        for update, index in trace.updates_from(position)[:updates]:
            if index in self._placement.phase.stepped:
                continue
            horizon = update - position + 1.0
            for shard in self.registry.entries[index].shards:
                missing += sum(
                    self.host.slot_cost(part.nbytes)
                    for part in (shard, *state_companions(shard).values())
                    if part.state in (R.NVME, R.DEVICE_NVME)
                )
        if missing:
            self._placement.clean_ahead(missing, horizon=horizon)
