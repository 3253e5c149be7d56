"""Trace-driven reads and write-backs ahead of need: the part of
:class:`~infinity.core.placement.Placement` that runs at each module event.

At each event the prefetch policy names the entries worth reading now, nearest use first, and a
read may only evict what is needed after it (see ``Placement._make_arena_room``); with updates in
backward the optimizer state of the next updates is read too. Write-ahead starts, during forward,
the write-backs the last pass had to wait for. The state these use (the policy, the byte cap, the
write-ahead lists) is set up in ``Placement.__init__``; everything runs on the training thread.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

from infinity.core.residency import Residency as R
from infinity.core.shards import Shard, ShardKind
from infinity.core.trace import FORWARD, Event, Trace
from infinity.training.optimizer import state_companions


class TracePrefetching:
    """Mixed into Placement: its state and its eviction mechanism are Placement's."""

    def write_ahead(self, share: float) -> None:
        """Starts the write-backs the last pass had to wait for, ``share`` of them per call
        (called at each forward event, while the disk would otherwise idle under compute):
        the shards are mostly the same every iteration (parameters and optimizer state the step
        made dirty), and nothing changes them before the step, so their eviction in backward
        finds them clean at the cost of the same write. One that this pass ends up not evicting
        is written again after the step (a few percent more bytes on a small GPT)."""
        last = self._forced_last
        stop = min(len(last), self._prewritten + max(1, round(share * len(last))))
        while self._prewritten < stop:
            shard = last[self._prewritten]
            self._prewritten += 1
            self.reap(shard)
            if shard.state is R.HOST and shard in self.in_arena and shard not in self.pinned:
                self.store_async(shard)
                self.writes_ahead += 1

    def on_event(self, event: Event) -> None:
        self.follower.observe(event, busy=self.busy_seconds)
        if self.timeline.enabled:
            names = self.settings.module_names
            self.timeline.event(
                event.kind, names[event.module] if event.module < len(names) else str(event.module)
            )
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
        current = {
            shard for index in event.entries for shard in self.registry.entries[index].shards
        }
        budget = self.prefetch_ahead(protect=current)
        if budget is not None and self.update_in_backward:
            # Strict: it reads far ahead, and what a read evicts out of order must be read
            # again (without it, half as many bytes again were read at bench_overlap's smallest
            # arena). In forward only the state of updates a few events away: further, the room
            # would come from masters and state that this backward needs before them, each read
            # twice; without any, backward began by waiting for the first updates' state while
            # the disk had idled through forward.
            reach = (
                math.inf
                if event.kind != FORWARD
                else 2 * max(1, getattr(self.prefetcher, "depth", 1)) + 1
            )
            self._prefetch(self._state_wanted(trace, position, reach), budget, strict=True)

    def prefetch_ahead(self, protect: set[Shard] | frozenset = frozenset()) -> int | None:
        """Starts the reads the prefetch policy wants now (see :meth:`_prefetch`)."""
        trace = self.follower.trace
        if not self.nvme or trace is None:
            return None
        position = self.follower.position
        budget = self.settings.prefetch_bytes
        if budget is not None:
            budget -= sum(s.nbytes for s in self.in_arena if s.state is R.NVME_LOADING)
        entries = self.registry.entries

        def wanted() -> Iterator[tuple[Shard, float]]:
            # Only shards still on NVMe: the window ahead is mostly read already (with
            # streaming inference, the whole trace is walked at every event).
            for index in self.prefetcher.wanted(self.follower):
                horizon = None
                for shard in entries[index].shards:
                    if shard.state is R.NVME:
                        if horizon is None:
                            horizon = trace.next_use(index, position) + 0.5
                        yield shard, horizon

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
        budget: int | None,
        strict: bool = False,
        protect: set[Shard] | frozenset = frozenset(),
    ) -> int | None:
        """Starts the reads of ``wanted`` (shard, horizon) in order, each evicting only what is
        needed after its horizon. Returns the ``prefetch_bytes`` left (``math.inf`` without a
        cap), or None once a read found no room or the cap was reached: prefetch less, never
        over-commit."""
        left = math.inf if budget is None else budget
        for shard, horizon in wanted:
            self.reap(shard)
            if shard.state is not R.NVME:
                continue
            if left < shard.nbytes or not self.load_async(
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
            if index in self.stepped:
                continue
            for shard in self.registry.entries[index].shards:
                for companion in shard.companions.values():
                    if companion.kind is ShardKind.GRAD:
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
        if self.engine is None or trace is None:
            return
        position = self.follower.position
        missing, horizon = 0, 0.0
        for update, index in trace.updates_from(position)[:updates]:
            if index in self.stepped:
                continue
            horizon = update - position + 1.0
            for shard in self.registry.entries[index].shards:
                missing += sum(
                    self.host.slot_cost(part.nbytes)
                    for part in (shard, *state_companions(shard).values())
                    if part.state in (R.NVME, R.DEVICE_NVME)
                )
        if missing:
            self.clean_ahead(missing, horizon=horizon)
