"""The optimizer step over offloaded shards: the global gradient norm, fp16 overflow skipping
and clipping, then the update of every shard wherever it lives, pipelined over the staging arena
(read ahead, update a tile, write back what the next reads need room for); and updates in
backward (``step_in_backward``) as each gradient completes.

:class:`Stepping` is a part of the store (``store.stepping``) with its own state (the step
counts, the last gradient norm, a step that failed part-way, the entries updated in backward);
the hooks, the wrapped optimizer and parameter access tell it what the loop does. What it uses
of the store is :class:`~infinity.core.attached.AttachedStore`. Design notes: the "step"
section of ``docs/architecture.md``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Set
from typing import TYPE_CHECKING

from infinity.core.residency import Residency as R
from infinity.core.shards import GRAD_KEY, ParamEntry, Shard, state_companions
from infinity.errors import BudgetError
from infinity.training.precision import global_norm

if TYPE_CHECKING:
    from infinity.core.attached import AttachedStore
    from infinity.core.placement import Placement
    from infinity.training.optimizer import OffloadedOptimizer
    from infinity.training.update_timing import UpdateTiming

log = logging.getLogger(__name__)


class Stepping:
    """The optimizer step and updates in backward of one store (see the module docstring)."""

    def __init__(self, store: AttachedStore) -> None:
        self._store = store
        #: optimizer steps taken, and those fp16 overflow skipped
        self.steps = 0
        self.skipped_steps = 0
        #: global gradient norm of the last step; computed only where something needs it
        #: (gradient_clipping, fp16 overflow checks), NaN otherwise
        self.last_grad_norm = math.nan
        #: a step that failed part-way (its clipping factor, the ids of the shards it updated),
        #: until it is finished or abandoned
        self._unfinished: tuple[float, set[str]] | None = None
        #: entries that step_in_backward updated since the last optimizer.step()
        self._updated_in_backward: set[int] = set()

    @property
    def _placement(self) -> Placement:
        placement = self._store.placement
        assert placement is not None  # the step and its hooks exist once attached
        return placement

    @property
    def updated_in_backward(self) -> Set[int]:
        """Entries whose update ran in backward since the last ``optimizer.step()`` (their
        gradients were consumed there)."""
        return self._updated_in_backward

    def restore_counts(self, steps: int, skipped_steps: int) -> None:
        """The step counts a checkpoint load brings back."""
        self.steps = steps
        self.skipped_steps = skipped_steps

    # -- what the loop does -------------------------------------------------------------------
    def start_iteration(self, grad_enabled: bool, training: bool) -> None:
        """The root module's forward begins a new iteration."""
        self._unfinished = None  # a new forward moves on from a step that failed
        self.loop_acted("a forward pass")
        store = self._store
        store.follower.start_iteration((grad_enabled, training))
        if store.placement is not None and grad_enabled:
            store.placement.prefetching.pass_started()
            store.placement.phase.pass_started()

    def loop_acted(self, what: str, grads: bool = False) -> None:
        """The loop used the model (``grads``: its gradients) outside forward and backward;
        where updates run may depend on it (infinity.training.update_timing)."""
        timing = self._store.update_timing
        if timing is not None:
            timing.loop_acted(what, grads)

    def gradients_cleared(self) -> None:
        """``zero_grad()`` or ``p.grad = None``."""
        timing = self._store.update_timing
        if timing is None:
            return
        timing.gradients_cleared(len(self._updated_in_backward))
        if timing.auto and not timing.in_backward:
            # Updates left backward after some ran there (a backward that raised, then
            # zero_grad): the next backward is not a second one on top of them.
            self._updated_in_backward.clear()

    def abandon_unfinished(self) -> None:
        """``zero_grad()``: a step that failed part-way is abandoned with its gradients."""
        self._unfinished = None

    # -- the step -------------------------------------------------------------------------------
    def run(self, optimizer: OffloadedOptimizer) -> None:
        """``optimizer.step()``."""
        with self._store.timeline.timed("optimizer.step", "step"):
            self._step(optimizer)

    def _step(self, optimizer: OffloadedOptimizer) -> None:
        store = self._store
        placement = self._placement
        placement.follower.pause(placement.busy_seconds)
        placement.gradients.finish_reductions()
        placement.gradients.completed()  # not updated in backward: this step updates them
        placement.phase.pass_finished()
        timing = store.update_timing
        if timing is not None:
            hooks = store.hooks
            assert hooks is not None  # installed at attach, before the optimizer is wrapped
            timing.step_starts(hooks.backward_passes, optimizer)
        try:
            self._step_updates(optimizer)
        finally:
            if timing is not None:
                timing.step_ends()

    def _step_updates(self, optimizer: OffloadedOptimizer) -> None:
        store = self._store
        placement = self._placement
        todo = [s for s in optimizer.shards if placement.gradients.has_grad(s)]
        for entry in {s.entry for s in todo}:
            if entry.holds:
                raise RuntimeError(
                    f"optimizer.step() while {entry.name} is in use by a forward or backward pass"
                )
        if self._unfinished is not None:
            # The last step failed part-way: finish it for the shards it had not updated, with
            # the same clipping factor; the global norm and the loss scale were settled when it
            # started.
            multiplier, done = self._unfinished
            todo = [s for s in todo if s.id not in done]
        else:
            done = set()
            norm = (
                global_norm(placement.gradients.global_sq_norms([todo]))
                if placement.gradients.track_grad_norms
                else math.nan
            )
            self.last_grad_norm = norm
            scaler = store.scaler
            if scaler is not None:
                overflow = not math.isfinite(norm)
                scaler.update(overflow)
                placement.gradients.set_loss_scale(scaler.scale)
                if overflow:
                    self.skipped_steps += 1
                    return  # the user's zero_grad() discards the overflowed gradients
            multiplier = 1.0
            clip = store.config.gradient_clipping
            if clip > 0 and norm > clip:
                multiplier = clip / (norm + 1e-6)
        # Entries updated in backward get their persistent device copies back below with the
        # others (across ranks only here: see grad_complete).
        in_backward = [store.registry.entries[i] for i in self._updated_in_backward]
        self._updated_in_backward.clear()
        updated = {s.entry for s in todo}
        for entry in updated:
            placement.drop_device(entry, force=True)  # refreshed from the master below or on use
        if store.engine is None:
            self._update_in_memory(optimizer, todo, multiplier)
        else:
            self._unfinished = (multiplier, done)
            try:
                self._tiled_step(optimizer, todo, multiplier, done)
            except BaseException as exc:
                updated_now = sum(1 for s in todo if s.id in done)
                left = len(todo) - updated_now
                _add_note(
                    exc,
                    f"optimizer.step() stopped after updating {updated_now} of {len(todo)} "
                    f"shards. Once the cause is fixed, optimizer.step() finishes this step for "
                    f"the other {left} (same clipping factor); optimizer.zero_grad() or a new "
                    f"forward abandons it, leaving the model partly updated.",
                )
                raise
            finally:
                placement.phase.step_finished()
            self._unfinished = None
        for entry in sorted(updated.union(in_backward), key=lambda e: e.index):
            # In the same order on every rank; across ranks every entry with a gradient is
            # here, whether this rank updated it in backward or now.
            if entry.index in placement.persistent and not entry.resident:
                placement.gather(entry, hold=False)  # persistent copies come back right away
        self.steps += 1
        store.after_step(optimizer, first=self.steps == 1)

    def _update_in_memory(
        self, optimizer: OffloadedOptimizer, todo: list[Shard], multiplier: float
    ) -> None:
        """The update without swap files: every master and its state are in memory."""
        optimizer.update(todo, multiplier)
        for shard in todo:
            self._store.registry.set_state(shard, R.HOST)
            shard.version += 1

    # -- updates in backward (step_in_backward) -------------------------------------------------
    def grad_arriving(self, entry: ParamEntry) -> None:
        """Called before a gradient of ``entry`` is taken: refuses a second backward whose
        gradients would meet an update already applied."""
        timing = self._store.update_timing
        if timing is None:
            return
        if entry.index in self._updated_in_backward:
            timing.refused_second_backward()
            raise RuntimeError(timing.second_backward_message(entry.name))
        timing.gradient_arriving(self._store.optimizer)

    def grad_complete(self, entry: ParamEntry, nested: bool) -> None:
        """With ``step_in_backward``: updates ``entry``'s shards now that backward has
        completed its gradient. Left to ``optimizer.step()``: a gradient taken inside a nested
        backward (reentrant activation checkpointing: more of it may follow), an entry still
        held by a forward, and the rest of a step that failed part-way."""
        store = self._store
        placement = self._placement
        optimizer = store.optimizer
        if not placement.update_in_backward:
            return
        if optimizer is None or nested or entry.holds or self._unfinished is not None:
            placement.gradients.park_grads(entry)  # left to optimizer.step(): into the budget
            return
        todo = [
            s for s in entry.shards if s.step_param is not None and placement.gradients.has_grad(s)
        ]
        if not todo:
            return
        placement.drop_device(entry, force=True)  # refreshed from the master on next use
        self._updated_in_backward.add(entry.index)
        started, busy = time.perf_counter(), placement.busy_seconds
        with store.timeline.timed(entry.name, "step"):
            if store.engine is None:
                self._update_in_memory(optimizer, todo, 1.0)
            else:
                done: set[str] = set()
                try:
                    self._tiled_step(optimizer, todo, 1.0, done)
                except BaseException as exc:
                    timing = store.update_timing
                    if isinstance(exc, BudgetError) and timing is not None and timing.auto:
                        self._update_left_to_step(timing, entry, todo, done, exc)
                        return
                    _add_note(
                        exc,
                        f"the update of {entry.name} in backward stopped after "
                        f"{len(done)} of its {len(todo)} shards; optimizer.step() "
                        f"updates the others, optimizer.zero_grad() abandons them",
                    )
                    raise
        for shard in todo:
            # Consumed: optimizer.step() must not apply it again, and its memory is free now.
            placement.gradients.drop_grad(shard)
        placement.prefetching.clean_for_updates()
        # The update's own time, without its waits and copies: the trace's compute times
        # leave it out, and the optimizer's per-element rate counts it (the planner's replay)
        placement.phase.count_backward_update(
            time.perf_counter() - started - (placement.busy_seconds - busy)
        )
        if entry.index in placement.persistent and store.partition is None:
            # Across ranks a gather is a collective, and whether this update ran in backward
            # or was left to the step (no room) is this rank's own: optimizer.step() gathers.
            placement.gather(entry, hold=False)

    def _update_left_to_step(
        self,
        timing: UpdateTiming,
        entry: ParamEntry,
        todo: list[Shard],
        done: set[str],
        exc: BudgetError,
    ) -> None:
        """'auto' chose updates in backward, and this one found no room next to what backward
        holds: what it had not updated waits for optimizer.step(), which has the whole arena,
        and updates stay there from now on (no sizing crash from a default). Across ranks only
        this one does: where updates run must stay the same on every rank, since the device
        copies an update drops decide collectives, and the arena is this rank's own."""
        placement = self._placement
        for shard in todo:
            if shard.id in done:
                placement.gradients.drop_grad(shard)  # applied: the step must not apply it again
        try:
            placement.gradients.park_grads(entry)
        except BudgetError:
            pass  # no room for its companion either: the step reads it where autograd left it
        timing.no_room(entry.name, str(exc).splitlines()[0], for_good=self._store.partition is None)

    def _companions(self, shard: Shard, optimizer: OffloadedOptimizer) -> list[Shard]:
        out = []
        if self._placement.gradients.grad_in_companion(shard):
            out.append(shard.companions[GRAD_KEY])
        if optimizer.swap_state:
            out += state_companions(shard).values()
        return out

    def _tiled_step(
        self, optimizer: OffloadedOptimizer, todo: list[Shard], multiplier: float, done: set[str]
    ) -> None:
        """Read ahead, update a tile, write back what the next reads need room for: the pipeline
        over the staging arena.
        A tile's reads (master, gradient, optimizer state) overlap the previous tile's update
        and writes; the step costs about max(read, update, write), not their sum. The ids of
        the shards it updated go into ``done``, as they are updated."""
        store = self._store
        placement = self._placement
        params_on_nvme = placement.nvme

        def parts(shard: Shard) -> list[Shard]:
            own = [shard] if params_on_nvme else []
            return own + self._companions(shard, optimizer)

        cost = placement.host.slot_cost

        def size(shard: Shard) -> int:
            total = sum(cost(p.nbytes) for p in parts(shard))
            if placement.has_compute_copy(shard):
                total += cost(shard.nbytes // 2)  # its compute copy, written after the update
            if optimizer.swap_state and not state_companions(shard):
                # First step: the optimizer creates its state in ordinary memory before it moves
                # to companions; a tile of one keeps that transient to one shard's worth.
                total = tile_limit
            return total

        # Three stages share the arena: the tile being updated, the shards being read ahead and
        # the updated ones being written. A tile has at least one shard and at most a third of
        # the arena (in slot bytes); it ends before a shard whose reads are not done, so the
        # update never waits for more than the one shard it cannot start without.
        tile_limit = placement.host.arena_bytes // 3
        # Read-ahead takes free room and the room of what this step is done with, never that of
        # a shard the step still has to update: evicting it would cost a write and a read back
        # within the same step, and updates free room (dropped gradients) faster than the disk
        # fills it.
        after_step = placement.room.horizon_after_step()
        # Without a trace (the first step, or one that ran differently) eviction among what the
        # step is done with is least recently used and may push out the masters the next
        # forward needs first: read-ahead then stops at a tile's worth.
        window = tile_limit if placement.follower.trace is None else math.inf

        def ready(shard: Shard) -> bool:
            for part in parts(shard):
                placement.reap(part)
                if not part.state.on_host:
                    return False
            return True

        def read_ahead(shard: Shard, protect: set[Shard], upcoming: set[Shard]) -> bool:
            """Starts the reads of ``shard``'s parts, adding each to ``upcoming``; False when
            one found no room (the ones started stay started)."""
            for part in parts(shard):
                placement.reap(part)
                if not placement.load_async(
                    part, protect=protect | upcoming, horizon=after_step, read_ahead=True
                ):
                    return False
                upcoming.add(part)
            return True

        ahead = 0  # todo[i:ahead] have their reads started
        ahead_bytes = 0  # their size
        written: list[Shard] = []  # the tile's compute copies, made from its updated masters
        i = 0
        while i < len(todo):
            tile: list[Shard] = []
            used = 0
            while i < len(todo) and (
                not tile or (used + size(todo[i]) <= tile_limit and ready(todo[i]))
            ):
                tile.append(todo[i])
                used += size(todo[i])
                if i < ahead:
                    ahead_bytes -= size(todo[i])
                i += 1
            needed = [p for shard in tile for p in parts(shard)]
            protect = set(needed)
            for part in needed:
                placement.reap(part)
                if part.state is R.NVME:
                    placement.load_async(part, protect=protect, horizon=after_step)
            for part in needed:
                placement.ensure_host(part, protect=protect)
                if part.state is R.HOST_STORING:
                    placement.reap(part, wait=True)
            # Read the next shards, in step order, while this tile is updated.
            if ahead < i:
                ahead, ahead_bytes = i, 0
            upcoming: set[Shard] = set()
            while (
                store.pipeline_step
                and ahead < len(todo)
                and (ahead == i or ahead_bytes + size(todo[ahead]) <= window)
                and read_ahead(todo[ahead], protect, upcoming)
            ):
                ahead_bytes += size(todo[ahead])
                ahead += 1
            with placement.phase.pinned_while(protect):
                changed = optimizer.update(tile, multiplier)
                store.watch_heap()
                for shard in tile:
                    store.registry.set_state(shard, R.HOST)
                    shard.version += 1
                    placement.phase.mark_stepped(shard.entry)
                    done.add(shard.id)
                    if placement.gradients.grads_on_nvme:
                        placement.gradients.drop_grad(shard)
                for shard in tile:
                    # The next gathers read it: dirty, written back behind like the state.
                    compute = placement.refresh_compute_copy(shard, write_back=False)
                    if compute is not None:
                        placement.phase.pin(compute)
                        written.append(compute)
            for companion in changed:
                companion.version += 1
            if placement.settings.write_behind:
                # The reads of the next two tiles will need room: make it now, by writing back
                # what will be evicted first, so that those reads never wait for a write.
                missing = sum(
                    cost(p.nbytes)
                    for shard in todo[i : i + 2 * len(tile)]
                    for p in parts(shard)
                    if not p.state.on_host and p.state is not R.NVME_LOADING
                )
                placement.clean_ahead(missing, protect=protect | upcoming, horizon=after_step)
            if not store.pipeline_step:
                for part in [*tile, *changed, *written]:
                    placement.reap(part, wait=True)
            written.clear()


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``; Python 3.10 has no notes, so there the note is logged."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
    else:
        log.error("%s", note)
