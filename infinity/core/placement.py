"""Moves shards between the tiers: the mechanism under the hooks, the scheduler and the step.

Everything here runs on the training thread. NVMe transfers run in the background (the swap
engine's futures), but their completion is applied to the registry only here, when the training
thread next looks at the shard ("reaping"), so the residency state machine is never mutated from
two threads.

Room is made on demand: before a host slot or a device copy is taken, the eviction policy orders
the candidates and the furthest-needed ones are dropped (clean host copies) or written back first
(dirty ones). Prefetch may only evict what is needed later than the thing it fetches, so it never
pushes out what the next module needs and never over-commits the arena.

The placement keeps the NVMe transfers, companions and compute copies, and owns its parts,
each an object with its own state in its own module, which reaches the placement only through a
protocol of what it needs:

* ``phase`` (:mod:`infinity.core.run_phase`): where the run is (a pass, the step, what the step
  has updated and pins, updates in backward), which the other parts read;
* ``room`` (:mod:`infinity.core.arena_room`): the arena's slots and who holds them, eviction,
  making room and the write-backs ahead of it;
* ``copies`` (:mod:`infinity.core.device_copies`): the entries' device copies (gathers, holds,
  drops), with their own part ``lending`` (:mod:`infinity.core.lending`): device copies that
  are host copies, on a CPU device;
* ``completions`` (:mod:`infinity.core.completions`): applying transfer outcomes, retries,
  quarantine, the I/O counters;
* ``prefetching`` (:mod:`infinity.core.prefetching`): trace-driven reads and write-backs ahead;
* ``gradients`` (:mod:`infinity.training.gradients`): the gradient path and ``p.grad``, made
  by the constructor the store passes (it is training's, a layer above).

Thread safety: everything here belongs to the training thread. Only the counters (plain ints)
and the tiers' usage are read from other threads (``TieredStore.stats()``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infinity.core.arena_room import ArenaRoom
from infinity.core.audit import audit
from infinity.core.completions import MAX_RETRIES, Completions, retryable
from infinity.core.device_copies import DeviceCopies
from infinity.core.lending import HostLending
from infinity.core.policies import EvictionPolicy, PrefetchPolicy
from infinity.core.prefetching import TracePrefetching
from infinity.core.residency import Residency as R
from infinity.core.run_phase import RunPhase
from infinity.core.shards import (
    COMPUTE_KEY,
    GRAD_KEY,
    ParamEntry,
    Shard,
    ShardKind,
    ShardRegistry,
)
from infinity.core.tiers import DeviceTier, HostTier
from infinity.core.timeline import Timeline
from infinity.core.trace import BACKWARD, Event, TraceFollower
from infinity.errors import BudgetError, ParameterAccessError
from swap import HostBuffer, SwapEngine

if TYPE_CHECKING:
    from infinity.ranks.partition import Partition
    from infinity.training.gradients import Gradients

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlacementSettings:
    """What the store decides at attach for the whole run; what changes while it runs is the
    placement's own state, changed through its methods."""

    #: the parameters' masters live on NVMe (host copies in the staging arena)
    params_on_nvme: bool = False
    #: gradients go into companions that are swapped to NVMe like any shard
    grads_on_nvme: bool = False
    #: module index -> qualified name, for the timeline
    module_names: tuple[str, ...] = ()
    #: entries whose device copy is never evicted (param_persistence_threshold)
    persistent: frozenset[int] = frozenset()
    #: cap on bytes of prefetch reads in flight (None: bounded by the arena)
    prefetch_bytes: int | None = None
    #: keep the front of the eviction order clean during the step (see clean_ahead); off
    #: when the arena caches everything, so nothing is ever evicted
    write_behind: bool = True
    #: keep each shard's squared gradient norm from the start (for clipping and overflow
    #: checks); a loop that reads norms turns it on later
    track_grad_norms: bool = True
    #: the loss scale gradients arrive multiplied by at first (fp16 dynamic scaling)
    loss_scale: float = 1.0
    #: attempts of a transfer after its first failure (see infinity.core.completions)
    max_retries: int = MAX_RETRIES
    #: bytes of all-gathers started ahead of the modules that need them (stage 3 across
    #: ranks: prefetch_bucket_size; 0: none)
    assemble_ahead_bytes: int = 64 << 20
    #: which modules keep their gathered copies from forward to backward (stage 3 across
    #: ranks: reshard_after_forward; see infinity.core.reshard)
    reshard_after_forward: bool | str = True
    #: param shards keep a copy of their values in this dtype beside their masters on NVMe,
    #: which gathers read instead of the master (precision.storage_dtype with an optimizer:
    #: half the bytes); None: gathers read the masters
    compute_copy_dtype: torch.dtype | None = None


@dataclass
class CompressedTraffic:
    """Bytes the swap files moved for shards kept in fewer bytes, beside what moving their
    values as they are would have taken: optimizer state (``Shard.encoding``) against fp32, and
    compute copies, read instead of their masters and written beside them:
    ``stats()['compression']``."""

    state_read: int = 0
    state_read_as_fp32: int = 0
    state_written: int = 0
    state_written_as_fp32: int = 0
    compute_read: int = 0
    compute_read_as_masters: int = 0
    compute_written: int = 0

    def count(self, shard: Shard, write: bool) -> None:
        if shard.encoding is None and shard.kind is not ShardKind.COMPUTE:
            return
        master = shard.owner
        assert master is not None  # a compute copy or an encoded state: both companions
        if shard.kind is ShardKind.COMPUTE:
            if write:
                self.compute_written += shard.nbytes
            else:
                self.compute_read += shard.nbytes
                self.compute_read_as_masters += master.nbytes
        elif write:
            self.state_written += shard.nbytes
            self.state_written_as_fp32 += 4 * master.numel
        else:
            self.state_read += shard.nbytes
            self.state_read_as_fp32 += 4 * master.numel


def _tag(shard: Shard) -> list:
    """The identity a shard's bytes are written and read under: a read of another shard's or
    another version's bytes fails verification instead of being trained on."""
    return [shard.id, shard.version]


def _swap(engine: SwapEngine | None, host: HostTier) -> tuple[SwapEngine, HostBuffer]:
    """The swap engine and the staging arena, which every NVMe transfer uses."""
    arena = host.arena
    assert engine is not None and arena is not None  # NVMe transfers need both
    return engine, arena


def _record_io(timeline: Timeline, shard: Shard, op: str, prefetch: bool) -> None:
    record = timeline.io_started(shard.id, op, shard.nbytes, prefetch)
    shard.io_record = record
    if record is not None:
        assert shard.pending is not None  # the transfer just started
        shard.pending.add_done_callback(lambda f: Timeline.io_finished(record, f.exception()))


class Placement:
    """Where every shard's copies are, and the moves between the tiers (see the module
    docstring). Its settings are fixed at construction; what changes during the run changes
    through its methods."""

    def __init__(
        self,
        registry: ShardRegistry,
        device: DeviceTier,
        host: HostTier,
        engine: SwapEngine | None,
        follower: TraceFollower,
        eviction: EvictionPolicy,
        prefetch: PrefetchPolicy,
        settings: PlacementSettings,
        *,
        make_gradients: Callable[[Placement], Gradients],
        partition: Partition | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        """``make_gradients``: the gradient path's constructor, given the placement (its
        ``GradientSlots``); the store passes it, as the gradients are training's, a layer above."""
        self.registry = registry
        self.timeline = timeline or Timeline()
        self.settings = settings
        #: this rank's place among data-parallel ranks (infinity.ranks.partition); None: one process
        self.partition = partition
        self.device = device
        self.host = host
        self.engine = engine
        self.follower = follower
        self.eviction = eviction
        #: where the run is (a pass, the step, updates in backward), which the parts read
        self.phase = RunPhase()
        #: the staging arena's slots, eviction and the write-backs that free room
        self.room = ArenaRoom(
            self,
            self.phase,
            registry,
            host,
            follower,
            eviction,
            engine,
            params_on_nvme=settings.params_on_nvme,
            persistent=settings.persistent,
        )
        self.prefetched_loads = 0
        #: reads the optimizer step started for its next tile
        self.read_ahead_loads = 0
        self.demand_loads = 0
        #: entries attached without values (a meta-device module without reset_parameters):
        #: their shards stay EMPTY until a checkpoint load writes them
        self.uninitialised: set[int] = set()
        #: bytes moved for shards kept in fewer bytes, and what they would have taken
        self.compressed = CompressedTraffic()
        #: the outcomes of NVMe transfers: reaping, retries, quarantine, I/O counters
        self.completions = Completions(
            self, registry, host, engine, self.timeline, settings.max_retries
        )
        #: the entries' device copies (gathers, holds, drops, room on the device)
        self.copies = DeviceCopies(
            self,
            registry,
            device,
            host,
            follower,
            eviction,
            partition=partition,
            persistent=settings.persistent,
            assemble_ahead_bytes=settings.assemble_ahead_bytes,
            reshard_after_forward=settings.reshard_after_forward,
            device_ahead=getattr(prefetch, "depth", 0),
        )
        #: reads and write-backs ahead of need, driven by the trace
        self.prefetching = TracePrefetching(
            self,
            registry,
            follower,
            host,
            prefetch,
            nvme=settings.params_on_nvme,
            swaps=engine is not None,
            prefetch_bytes=settings.prefetch_bytes,
        )
        #: the gradient path and what the loop sees of gradients
        self.gradients = make_gradients(self)

    @property
    def nvme(self) -> bool:
        """The parameters' masters live on NVMe (their host copies in the staging arena)."""
        return self.settings.params_on_nvme

    @property
    def persistent(self) -> frozenset[int]:
        return self.settings.persistent

    @property
    def update_in_backward(self) -> bool:
        """Whether the optimizer updates each entry in backward (see :class:`RunPhase`)."""
        return self.phase.update_in_backward

    @property
    def in_arena(self) -> set[Shard]:
        """The shards holding an arena slot (see :class:`ArenaRoom`)."""
        return self.room.in_arena

    def free_slot(self, shard: Shard) -> None:
        """Gives ``shard``'s arena slot back; see :meth:`ArenaRoom.free_slot`."""
        self.room.free_slot(shard)

    def leave_slot(self, shard: Shard) -> None:
        """``shard`` leaves its slot without giving it back; see :meth:`ArenaRoom.leave_slot`."""
        self.room.leave_slot(shard)

    def clean_ahead(
        self, reserve: int, protect: Iterable[Shard] = (), horizon: float = 0.0
    ) -> None:
        """Starts write-backs until ``reserve`` bytes of the arena are free or clean; see
        :meth:`ArenaRoom.clean_ahead`."""
        self.room.clean_ahead(reserve, protect, horizon)

    # -- state the run changes, through these -----------------------------------------------
    def mark_uninitialised(self, entry: ParamEntry) -> None:
        """``entry`` was attached without values: its shards stay EMPTY until written."""
        self.uninitialised.add(entry.index)

    def mark_initialised(self, entry: ParamEntry) -> None:
        """``entry``'s values were written (a checkpoint or state dict load)."""
        self.uninitialised.discard(entry.index)

    @property
    def busy_seconds(self) -> float:
        """The training thread's seconds in the store's waits, device copies and updates run
        in backward so far: what the trace's compute times between module events leave out
        (the planner replays each on its own)."""
        return (
            self.completions.stall_seconds
            + self.device.copy_seconds
            + self.phase.backward_update_seconds
        )

    # -- module events --------------------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        """A module is about to run (forward or backward): the trace follower observes it,
        the timeline records it, and reads and write-backs ahead of need start."""
        self.follower.observe(event, busy=self.busy_seconds)
        self.phase.in_backward = event.kind == BACKWARD
        if self.timeline.enabled:
            names = self.settings.module_names
            self.timeline.event(
                event.kind, names[event.module] if event.module < len(names) else str(event.module)
            )
        self.prefetching.at_event(event)

    # -- initialisation ---------------------------------------------------------------------
    def initialise(self, entry: ParamEntry, source: torch.Tensor) -> None:
        """Takes the parameter's values into the host tier (and NVMe): EMPTY -> HOST(...)."""
        flat = source.detach().reshape(-1)
        for shard in entry.shards:
            piece = shard.part_of(flat)
            if self.nvme:
                self.room.take_slot(shard, protect=(), horizon=0.0)
                shard.fill_from(piece)
                self.registry.set_state(shard, R.HOST)
                self.store_async(shard)
                self.refresh_compute_copy(shard, write_back=True)
            else:
                shard.host = self.host.allocate(shard.host_numel, shard.dtype)
                shard.fill_from(piece)
                self.registry.set_state(shard, R.HOST)

    # -- host slots ---------------------------------------------------------------------------
    # -- transfer outcomes (infinity.core.completions) -------------------------------------------
    def reap(self, shard: Shard, wait: bool = False) -> BaseException | None:
        """Applies the outcome of ``shard``'s NVMe transfer once it has finished (``wait``:
        waits for it); see :meth:`Completions.reap`."""
        return self.completions.reap(shard, wait)

    def drain(self) -> BaseException | None:
        """Waits for every transfer in flight (before a checkpoint, at close). Returns the first
        error of a transfer that failed for good (states stay legal; see ``reap``)."""
        first = None
        for shard in list(self.room.in_arena):
            error = self.reap(shard, wait=True)
            first = first or error
        return first

    def flush(self) -> None:
        """Writes every dirty host copy in the arena to NVMe and waits: afterwards every
        NVMe-backed shard's swap extent holds its current value, or this raises the error of a
        write that failed for good (the shard stays dirty on the host)."""
        errors: dict[Shard, BaseException] = {}
        for shard in list(self.room.in_arena):
            error = self.reap(shard, wait=True)
            if error is not None:
                errors[shard] = error
            if shard.state is R.HOST:
                self.store_async(shard)
        for shard in list(self.room.in_arena):
            error = self.reap(shard, wait=True)
            if error is not None:
                errors[shard] = error
        dirty = [s for s in self.room.in_arena if s.state is R.HOST]
        if dirty:
            error = next((errors[s] for s in dirty if s in errors), None)
            if error is not None:
                raise error
            raise RuntimeError(
                f"flush left {len(dirty)} shard(s) dirty: {', '.join(s.id for s in dirty[:3])}"
            )

    # -- NVMe transfers -----------------------------------------------------------------------
    def store_async(self, shard: Shard) -> None:
        """Starts HOST -> NVMe (HOST -> HOST_STORING)."""
        engine, arena = _swap(self.engine, self.host)
        assert shard.host is not None and shard.arena_offset is not None, f"{shard} not in arena"
        if shard.extent is None:
            shard.extent = engine.allocate(shard.nbytes)
        self.completions.attempt(shard)
        # The engine refuses a bad request synchronously: the state changes only once the
        # transfer exists, so a refusal leaves the shard HOST.
        future = engine.write(
            shard.extent,
            arena,
            nbytes=shard.nbytes,
            buffer_offset=shard.arena_offset,
            tag=_tag(shard),
        )
        self.registry.set_state(shard, R.HOST_STORING)
        shard.pending = future
        self.compressed.count(shard, write=True)
        _record_io(self.timeline, shard, "write", prefetch=False)

    def load_async(
        self,
        shard: Shard,
        protect: Iterable[Shard] = (),
        horizon: float = 0.0,
        prefetch: bool = False,
        read_ahead: bool = False,
        strict: bool = False,
    ) -> bool:
        """Starts NVME -> host; False when no slot could be had within the horizon (and,
        ``strict``, in eviction order: see :meth:`_make_arena_room`)."""
        if shard.state is not R.NVME:
            return True
        if not self.room.take_slot(shard, protect, horizon, strict):
            return False
        self.completions.attempt(shard)
        engine, arena = _swap(self.engine, self.host)
        assert shard.extent is not None and shard.arena_offset is not None  # NVME, slot taken
        try:
            future = engine.read(
                shard.extent,
                arena,
                nbytes=shard.nbytes,
                buffer_offset=shard.arena_offset,
                tag=_tag(shard),
            )
        except BaseException:
            self.free_slot(shard)  # refused: nothing in flight, the shard stays NVME
            raise
        self.registry.set_state(shard, R.NVME_LOADING)
        shard.pending = future
        self.compressed.count(shard, write=False)
        _record_io(self.timeline, shard, "read", prefetch=prefetch)
        if prefetch:
            self.prefetched_loads += 1
        elif read_ahead:
            self.read_ahead_loads += 1
        else:
            self.demand_loads += 1
        return True

    def ensure_host(self, shard: Shard, protect: Iterable[Shard] = ()) -> None:
        """Makes ``shard``'s host copy valid, reading it from NVMe if needed. A failed read
        (a failed prefetch of it included) is retried ``max_retries`` times, then its error is
        raised with the shard back in ``NVME`` (nothing lost)."""
        error = self.reap(shard)
        if shard.state is R.EMPTY and shard.kind is ShardKind.PARAM:
            raise ParameterAccessError(
                f"parameter '{shard.entry.name}' has no values yet (shard {shard.id}): it was "
                f"attached on the meta device without reset_parameters(), so its values must "
                f"come from a checkpoint: store.load_pretrained(path) or "
                f"model.load_state_dict(...) before the first forward"
            )
        while not shard.state.on_host:
            if shard.state is R.NVME:
                completions = self.completions
                failures = completions.failures(shard)
                if error is not None and (
                    failures > completions.max_retries or not retryable(error)
                ):
                    completions.gave_up(shard)
                    log.error(
                        "read of shard %s failed %d time(s); giving up: %s: %s",
                        shard.id,
                        failures,
                        type(error).__name__,
                        error,
                    )
                    raise error
                if not self.load_async(shard, protect):
                    if error is not None:  # the retry found no room: the failure is the news
                        completions.gave_up(shard)
                        raise error
                    raise BudgetError(self.room.no_room(shard))
            if shard.state is R.NVME_LOADING:
                error = self.reap(shard, wait=True)
            elif not shard.state.on_host:
                raise RuntimeError(f"{shard} has no host copy")

    def prepare_overwrite(self, shard: Shard, protect: Iterable[Shard] = ()) -> None:
        """Gives ``shard`` a host copy that the caller is about to overwrite whole, without
        reading its NVMe copy first, so a shard whose NVMe copy cannot be read (a corrupted or
        stale extent) can be healed by writing its value again (a checkpoint load). Afterwards
        the shard is on the host; from ``NVME`` it is ``HOST`` with undefined contents, which
        the caller must fill before anything else reads them."""
        self.copies.wait_host_reads((shard,))
        self.reap(shard, wait=True)
        # A param shard that never had values (uninitialised):
        if shard.state is R.EMPTY and shard.kind is ShardKind.PARAM:
            if not self.nvme:
                shard.host = self.host.allocate(shard.host_numel, shard.dtype)
            elif not self.room.take_slot(shard, protect, horizon=0.0):
                raise BudgetError(self.room.no_room(shard))
            self.registry.set_state(shard, R.HOST)
            return
        if shard.state is not R.NVME:
            return
        if not self.room.take_slot(shard, protect, horizon=0.0):
            raise BudgetError(self.room.no_room(shard))
        self.completions.forget(shard)
        # Its NVMe copy is superseded: through EMPTY (nothing valid), then HOST (dirty).
        self.registry.set_state(shard, R.EMPTY)
        self.registry.set_state(shard, R.HOST)

    # -- companions (gradients and optimizer state beside a param shard) --------------------
    def companion(
        self,
        shard: Shard,
        key: str,
        numel: int,
        dtype: torch.dtype,
        encoding: str | None = None,
    ) -> Shard:
        """``shard``'s companion under ``key`` (``GRAD_KEY``, or ``"optim:<state key>"``),
        made EMPTY on first use (``encoding``: see ``Shard.encoding``)."""
        found = shard.companions.get(key)
        if found is None:
            kind = {GRAD_KEY: ShardKind.GRAD, COMPUTE_KEY: ShardKind.COMPUTE}.get(
                key, ShardKind.OPTIM
            )
            found = Shard(
                f"{shard.id}@{key}",
                shard.entry,
                shard.start,
                numel,
                dtype,
                kind=kind,
                companion_key=key,
                encoding=encoding,
                owner=shard,
            )
            shard.companions[key] = found
        return found

    def fill(self, shard: Shard, source: torch.Tensor | None = None) -> torch.Tensor:
        """Gives an EMPTY companion a host slot (optionally filled from ``source``); it is then
        HOST (dirty): written back when evicted or after the step."""
        if not self.room.take_slot(shard, protect=(), horizon=0.0):
            raise BudgetError(self.room.no_room(shard))
        host = shard.host
        assert host is not None  # the slot just taken
        if source is not None:
            host.copy_(source)
        self.registry.set_state(shard, R.HOST)
        return host

    # -- compute copies (precision.storage_dtype with an optimizer) -----------------------------
    def has_compute_copy(self, shard: Shard) -> bool:
        """Whether ``shard`` (a param shard) keeps a compute copy: masters on NVMe in a dtype
        larger than the copies' (floating point)."""
        dtype = self.settings.compute_copy_dtype
        return (
            dtype is not None
            and self.nvme
            and shard.kind is ShardKind.PARAM
            and shard.dtype.is_floating_point
            and dtype.itemsize < shard.dtype.itemsize
        )

    def compute_copy(self, shard: Shard) -> Shard | None:
        """``shard``'s compute copy when it holds the master's current values, else None."""
        compute = shard.companions.get(COMPUTE_KEY)
        if compute is None or compute.state is R.EMPTY or compute.version != shard.version:
            return None
        return compute

    def refresh_compute_copy(
        self, shard: Shard, write_back: bool, protect: Iterable[Shard] = ()
    ) -> Shard | None:
        """After ``shard``'s master got new values on the host, its compute copy gets them too
        (cast), at the master's version; ``write_back``: its NVMe write starts now, else it is
        dirty until the step's write-behind or an eviction writes it. Returns the compute copy;
        None without one, or where the arena had no room for it: it is then out of date, and
        gathers read the master until its next update."""
        if not self.has_compute_copy(shard):
            return None
        dtype = self.settings.compute_copy_dtype
        assert dtype is not None  # has_compute_copy
        compute = self.companion(shard, COMPUTE_KEY, shard.numel, dtype)
        keep = {shard, *protect}
        if compute.state is R.EMPTY:
            if not self.room.take_slot(compute, protect=keep, horizon=0.0):
                return None
            self.registry.set_state(compute, R.HOST)
        else:
            try:
                self.prepare_overwrite(compute, protect=keep)
            except BudgetError:
                return None
            if compute.state is R.HOST_STORING:
                self.reap(compute, wait=True)
            if compute.state is not R.HOST:
                self.registry.set_state(compute, R.HOST)
        self.copies.wait_host_reads((compute,))  # a device copy may still read the old values
        compute.host_copy().copy_(shard.host_copy())
        compute.version = shard.version
        if write_back:
            self.store_async(compute)
        return compute

    def gather_source(self, shard: Shard, backward: bool | None = None) -> Shard:
        """What a gather of ``shard`` reads: its compute copy (half the bytes) where it is
        current, unless the master is on the host already (or its read is under way), or an
        update in backward will need the master right after a backward gather (one read
        serves both). ``backward``: whether the gather is a backward one (None: the last
        module event's kind, for a gather now)."""
        if shard.state is not R.NVME:
            return shard
        compute = self.compute_copy(shard)
        if compute is None:
            return shard
        backward = self.phase.in_backward if backward is None else backward
        if backward and self.phase.update_in_backward and shard.entry.param.requires_grad:
            return shard
        return compute

    def discard(self, shard: Shard) -> None:
        """Drops a companion's contents (a consumed gradient); keeps its NVMe extent for reuse."""
        if shard.state is R.EMPTY:
            return
        self.reap(shard, wait=True)
        if shard.arena_offset is not None:
            self.free_slot(shard)
        self.registry.set_state(shard, R.EMPTY)

    # -- device copies (infinity.core.device_copies) -------------------------------------------
    def gather(self, entry: ParamEntry, hold: bool = True, lend: bool = False) -> None:
        """Makes the entry's device copy resident and takes a hold on it; see
        :meth:`DeviceCopies.gather`."""
        self.copies.gather(entry, hold, lend)

    def release(self, entry: ParamEntry) -> None:
        """Drops a hold; see :meth:`DeviceCopies.release`."""
        self.copies.release(entry)

    def drop_device(self, entry: ParamEntry, force: bool = False) -> None:
        """Frees the entry's device copy; see :meth:`DeviceCopies.drop_device`."""
        self.copies.drop_device(entry, force)

    def settle(self, entry: ParamEntry) -> None:
        """Completes the all-gathers under way for the entry's device copy."""
        self.copies.settle(entry)

    def assemble_ahead(self) -> None:
        """Starts the next module's all-gathers (ZeRO stage 3 across ranks); see
        :meth:`DeviceCopies.assemble_ahead`."""
        self.copies.assemble_ahead()

    def adopt(self, entry: ParamEntry, device: torch.device) -> None:
        """Gives the parameter its (empty) device tensor; see :meth:`DeviceCopies.adopt`."""
        self.copies.adopt(entry, device)

    @property
    def lending(self) -> HostLending:
        """The device copies' lent and staged copies (a CPU device, without autograd)."""
        return self.copies.lending

    # -- self-check -----------------------------------------------------------------------------
    def audit(self) -> list[str]:
        """Checks the bookkeeping against itself; see :func:`infinity.core.audit.audit`."""
        return audit(self)
