"""Moves shards between the tiers: the mechanism under the hooks, the scheduler and the step.

Everything here runs on the training thread. NVMe transfers run in the background (the swap
engine's futures), but their completion is applied to the registry only here, when the training
thread next looks at the shard ("reaping"), so the residency state machine is never mutated from
two threads.

Room is made on demand: before a host slot or a device copy is taken, the eviction policy orders
the candidates and the furthest-needed ones are dropped (clean host copies) or written back first
(dirty ones). Prefetch may only evict what is needed later than the thing it fetches, so it never
pushes out what the next module needs and never over-commits the arena.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable

import torch

from infinity.errors import BudgetError
from infinity.policies import EvictionPolicy, PrefetchPolicy
from infinity.residency import Residency as R
from infinity.shards import ParamEntry, Shard, ShardRegistry
from infinity.tiers import DeviceTier, HostTier
from infinity.timeline import Timeline
from infinity.trace import Event, TraceFollower
from swap import SwapEngine

log = logging.getLogger(__name__)

_TO_DEVICE = {R.HOST: R.DEVICE_HOST, R.HOST_NVME: R.DEVICE_HOST_NVME}
_FROM_DEVICE = {R.DEVICE_HOST: R.HOST, R.DEVICE_HOST_NVME: R.HOST_NVME, R.DEVICE_NVME: R.NVME}


class Placement:
    def __init__(self, registry: ShardRegistry, device: DeviceTier, host: HostTier,
                 engine: SwapEngine | None, follower: TraceFollower, eviction: EvictionPolicy,
                 prefetch: PrefetchPolicy, *, params_on_nvme: bool, grads_on_nvme: bool,
                 timeline: Timeline | None = None) -> None:
        self.registry = registry
        self.timeline = timeline or Timeline()
        self.params_on_nvme = params_on_nvme
        self.grads_on_nvme = grads_on_nvme
        self.device = device
        self.host = host
        self.engine = engine
        self.follower = follower
        self.eviction = eviction
        self.prefetcher = prefetch
        self.in_arena: set[Shard] = set()
        #: shards whose host copies are in use right now (the optimizer's current tile)
        self.pinned: set[Shard] = set()
        self.on_device: set[ParamEntry] = set()
        self.last_used: dict[int, int] = {}
        self.clock = 0
        self.stall_seconds = 0.0
        self.prefetched_loads = 0
        #: reads the optimizer step started for its next tile
        self.read_ahead_loads = 0
        self.demand_loads = 0
        self.grad_bytes = 0
        self.grad_peak = 0
        #: the loss scale gradients arrive multiplied by (fp16 dynamic scaling), divided out here
        self.loss_scale = 1.0
        #: module index -> qualified name, for the timeline
        self.module_names: list[str] = []
        #: entries whose device copy is never evicted (param_persistence_threshold)
        self.persistent: set[int] = set()
        #: cap on bytes of prefetch reads in flight (None: bounded by the arena)
        self.prefetch_bytes: int | None = None
        #: write updated shards back right after the step (else only when evicted)
        self.write_behind = True

    @property
    def nvme(self) -> bool:
        return self.params_on_nvme

    # -- initialisation ---------------------------------------------------------------------
    def initialise(self, entry: ParamEntry, source: torch.Tensor) -> None:
        """Takes the parameter's values into the host tier (and NVMe): EMPTY -> HOST(...)."""
        flat = source.detach().reshape(-1)
        for shard in entry.shards:
            piece = flat[shard.start:shard.start + shard.numel]
            if self.nvme:
                self._host_slot(shard, protect=(), horizon=0.0)
                shard.host.copy_(piece)
                self.registry.set_state(shard, R.HOST)
                self.store_async(shard)
            else:
                shard.host = self.host.allocate(shard.numel, shard.dtype)
                shard.host.copy_(piece)
                self.registry.set_state(shard, R.HOST)

    # -- reaping NVMe completions -----------------------------------------------------------
    def reap(self, shard: Shard, wait: bool = False) -> None:
        future = shard.pending
        if future is None:
            return
        if not future.done():
            if not wait:
                return
            started = time.perf_counter()
            # A real-length torch.profiler range while recording (a no-op otherwise).
            with self.timeline.profile_range("infinity::stall", shard.id):
                try:
                    future.result()
                except Exception:
                    pass  # handled below
                ended = time.perf_counter()
                self.timeline.stall(shard.io_record, shard.id, started, ended)
            self.stall_seconds += ended - started
        shard.pending = None
        error = future.exception()
        if shard.state is R.NVME_LOADING:
            if error is not None:
                self._free_slot(shard)
                self.registry.set_state(shard, R.NVME)
                raise error
            self.registry.set_state(shard, R.HOST_NVME)
        elif shard.state is R.HOST_STORING:
            if error is not None:
                self.registry.set_state(shard, R.HOST)  # host copy stays the valid one
                raise error
            self.registry.set_state(shard, R.HOST_NVME)

    def drain(self) -> None:
        """Waits for every transfer in flight (before a checkpoint, at close)."""
        for shard in list(self.in_arena):
            self.reap(shard, wait=True)

    def flush(self) -> None:
        """Writes every dirty host copy in the arena to NVMe and waits: afterwards every
        NVMe-backed shard's swap extent holds its current value."""
        for shard in list(self.in_arena):
            self.reap(shard, wait=True)
            if shard.state is R.HOST:
                self.store_async(shard)
        self.drain()

    # -- host slots ---------------------------------------------------------------------------
    def _host_slot(self, shard: Shard, protect: Iterable[Shard], horizon: float) -> bool:
        """Gives ``shard`` an arena slot, evicting as allowed; False if none can be had."""
        offset = self.host.take_arena(shard.nbytes)
        if offset is None:
            offset = self._make_arena_room(shard.nbytes, set(protect) | {shard}, horizon)
            if offset is None:
                return False
        shard.arena_offset = offset
        shard.host = self.host.arena_view(offset, shard.dtype, shard.numel)
        self.in_arena.add(shard)
        return True

    def _free_slot(self, shard: Shard) -> None:
        if shard.copy_event is not None:
            shard.copy_event.synchronize()
            shard.copy_event = None
        self.host.give_arena(shard.arena_offset, shard.nbytes)
        self.in_arena.discard(shard)
        shard.arena_offset = None
        shard.host = None

    def _next_use(self):
        """Events until a shard is needed again, or None without a trace. Companions (grads,
        optimizer state) are needed by the step, after the iteration's last event."""
        trace = self.follower.trace
        if trace is None:
            return None
        position = self.follower.position
        end = len(trace) - position + 0.5

        def next_use(shard: Shard) -> float:
            if shard.kind != "param":
                return end
            return trace.next_use(shard.entry.index, position)
        return next_use

    @staticmethod
    def _evictable(shard: Shard) -> bool:
        if shard.kind != "param":
            return True
        return shard.entry.holds == 0 or shard.state is R.DEVICE_HOST_NVME

    def _make_arena_room(self, nbytes: int, protect: set[Shard], horizon: float) -> int | None:
        next_use = self._next_use()
        candidates = [s for s in self.in_arena
                      if s not in protect and s not in self.pinned and self._evictable(s)]
        candidates = self.eviction.order(candidates, next_use,
                                         lambda s: self.last_used.get(s.entry.index, -1))
        for shard in candidates:
            if horizon and next_use is not None and next_use(shard) <= horizon:
                break  # everything after this is needed sooner than what we fetch
            self.reap(shard)
            if shard.state in (R.HOST, R.DEVICE_HOST):
                if shard.state is R.HOST:
                    self.store_async(shard)
                continue
            if shard.state is R.HOST_STORING:
                if horizon:
                    continue  # prefetch does not wait for write-back
                self.reap(shard, wait=True)
            if shard.state is R.NVME_LOADING:
                continue
            self._evict_host(shard)
            offset = self.host.take_arena(nbytes)
            if offset is not None:
                return offset
        if horizon:
            return None
        # Demand: wait for transfers in flight (write-backs, and prefetches that would otherwise
        # pin the arena) and evict what they free, in policy order.
        for shard in candidates:
            if shard.in_arena_pending():
                self.reap(shard, wait=True)
            if shard.state in (R.HOST_NVME, R.DEVICE_HOST_NVME):
                self._evict_host(shard)
                offset = self.host.take_arena(nbytes)
                if offset is not None:
                    return offset
        return None

    def _evict_host(self, shard: Shard) -> None:
        if shard.state is R.HOST_NVME:
            self.registry.set_state(shard, R.NVME)
        elif shard.state is R.DEVICE_HOST_NVME:
            self.registry.set_state(shard, R.DEVICE_NVME)
        else:
            raise RuntimeError(f"cannot evict the host copy of {shard}")
        self._free_slot(shard)

    # -- NVMe transfers -----------------------------------------------------------------------
    def store_async(self, shard: Shard) -> None:
        assert self.engine is not None and shard.host is not None
        if shard.extent is None:
            shard.extent = self.engine.allocate(shard.nbytes)
        self.registry.set_state(shard, R.HOST_STORING)
        shard.pending = self.engine.write(shard.extent, self.host.arena, nbytes=shard.nbytes,
                                          buffer_offset=shard.arena_offset)
        self._record_io(shard, "write", prefetch=False)

    def load_async(self, shard: Shard, protect: Iterable[Shard] = (),
                   horizon: float = 0.0, prefetch: bool = False,
                   read_ahead: bool = False) -> bool:
        """Starts NVME -> host; False when no slot could be had within the horizon."""
        if shard.state is not R.NVME:
            return True
        if not self._host_slot(shard, protect, horizon):
            return False
        self.registry.set_state(shard, R.NVME_LOADING)
        shard.pending = self.engine.read(shard.extent, self.host.arena, nbytes=shard.nbytes,
                                         buffer_offset=shard.arena_offset)
        self._record_io(shard, "read", prefetch=prefetch)
        if prefetch:
            self.prefetched_loads += 1
        elif read_ahead:
            self.read_ahead_loads += 1
        else:
            self.demand_loads += 1
        return True

    def _record_io(self, shard: Shard, op: str, prefetch: bool) -> None:
        record = self.timeline.io_started(shard.id, op, shard.nbytes, prefetch)
        shard.io_record = record
        if record is not None:
            shard.pending.add_done_callback(
                lambda f: Timeline.io_finished(record, f.exception()))

    def ensure_host(self, shard: Shard, protect: Iterable[Shard] = ()) -> None:
        self.reap(shard)
        if shard.state is R.NVME:
            if not self.load_async(shard, protect):
                raise BudgetError(
                    f"no room in the host staging arena ({self.host.arena_bytes} bytes, "
                    f"{self.host.usage.current} in use) for shard {shard.id} ({shard.nbytes} "
                    f"bytes): raise buffer_count or buffer_size, or host_budget")
        if shard.state is R.NVME_LOADING:
            self.reap(shard, wait=True)
        if not shard.state.on_host:
            raise RuntimeError(f"{shard} has no host copy")

    # -- device copies ------------------------------------------------------------------------
    def gather(self, entry: ParamEntry, hold: bool = True) -> None:
        """Makes the parameter's device copy resident (filling its storage from the host
        masters) and takes a hold on it."""
        self.clock += 1
        self.last_used[entry.index] = self.clock
        if not entry.resident:
            self._make_device_room(entry)
            if self.nvme:
                # Start every load the arena allows at once, so the reads overlap.
                for shard in entry.shards:
                    self.reap(shard)
                    if shard.state is R.NVME:
                        self.load_async(shard, protect=entry.shards, horizon=0.5)
            tensor = entry.param.data
            self.device.fill(tensor)
            flat = tensor.view(-1)
            events = []
            waiting = list(entry.shards)
            with torch.no_grad():
                for shard in entry.shards:
                    self.ensure_host(shard, protect=waiting)
                    waiting.remove(shard)
                    if shard.state is R.HOST_STORING:
                        self.reap(shard, wait=True)  # copy from a settled state
                    event = self.device.copy_in(flat[shard.start:shard.start + shard.numel],
                                                shard.host)
                    shard.copy_event = event
                    events.append(event)
                    self.registry.set_state(shard, _TO_DEVICE[shard.state])
            for event in events:
                self.device.wait(event)
            entry.resident = True
            self.on_device.add(entry)
        if hold:
            entry.holds += 1

    def release(self, entry: ParamEntry) -> None:
        """Drops a hold. The device copy stays cached until eviction needs its bytes."""
        if entry.holds <= 0:
            raise RuntimeError(f"release of {entry.name} without a matching gather")
        entry.holds -= 1

    def drop_device(self, entry: ParamEntry, force: bool = False) -> None:
        """Frees the device copy's bytes. The parameter keeps its tensor and storage object,
        with the storage shrunk to zero bytes: views of it that autograd saved in forward
        (``weight.t()`` in a linear layer) see the values again once the next gather refills
        the same storage, instead of keeping a stale copy alive."""
        if not entry.resident or (entry.index in self.persistent and not force):
            return
        if entry.holds:
            raise RuntimeError(f"{entry.name} is in use on the device")
        self.device.empty(entry.param.data)
        entry.resident = False
        self.on_device.discard(entry)
        for shard in entry.shards:
            self.registry.set_state(shard, _FROM_DEVICE[shard.state])

    def adopt(self, entry: ParamEntry, device: torch.device) -> None:
        """Gives the parameter its device tensor (real shape, compute dtype, empty storage)."""
        tensor = torch.empty(entry.shape, dtype=entry.compute_dtype, device=device)
        tensor.untyped_storage().resize_(0)
        entry.param.data = tensor

    def _make_device_room(self, entry: ParamEntry) -> None:
        if self.device.fits(entry.device_bytes):
            return
        trace = self.follower.trace
        position = self.follower.position
        next_use = (lambda e: trace.next_use(e.index, position)) if trace is not None else None
        candidates = [e for e in self.on_device
                      if e.holds == 0 and e is not entry and e.index not in self.persistent]
        for victim in self.eviction.order(candidates, next_use,
                                          lambda e: self.last_used.get(e.index, -1)):
            self.drop_device(victim)
            if self.device.fits(entry.device_bytes):
                return
        held = sorted((e for e in self.on_device if e.holds), key=lambda e: -e.nbytes)
        raise BudgetError(
            f"device budget of {self.device.budget} bytes cannot hold {entry.name} "
            f"({entry.device_bytes} bytes) next to the {len(held)} parameters in use "
            f"({self.device.usage.current} bytes, largest: "
            f"{', '.join(e.name for e in held[:3]) or 'none'}): raise device_budget")

    # -- trace-driven prefetch ----------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        self.follower.observe(event)
        if self.timeline.enabled:
            names = self.module_names
            self.timeline.event(event.kind, names[event.module] if event.module < len(names)
                                else str(event.module))
        if not self.nvme or self.follower.trace is None:
            return
        trace = self.follower.trace
        position = self.follower.position
        budget = self.prefetch_bytes
        if budget is not None:
            budget -= sum(s.nbytes for s in self.in_arena if s.state is R.NVME_LOADING)
        for index in self.prefetcher.wanted(self.follower):
            entry = self.registry.entries[index]
            horizon = trace.next_use(index, position)
            for shard in entry.shards:
                self.reap(shard)
                if shard.state is not R.NVME:
                    continue
                if budget is not None and budget < shard.nbytes:
                    return  # prefetch_bytes reached
                if not self.load_async(shard, horizon=horizon + 0.5, prefetch=True):
                    return  # out of room: prefetch less, never over-commit
                if budget is not None:
                    budget -= shard.nbytes

    # -- companions (gradients and optimizer state on NVMe) -----------------------------------
    def companion(self, shard: Shard, kind: str, numel: int, dtype: torch.dtype) -> Shard:
        found = shard.companions.get(kind)
        if found is None:
            found = Shard(f"{shard.id}@{kind}", shard.entry, shard.start, numel, dtype, kind=kind)
            shard.companions[kind] = found
        return found

    def fill(self, shard: Shard, source: torch.Tensor | None = None) -> torch.Tensor:
        """Gives an EMPTY companion a host slot (optionally filled from ``source``); it is then
        HOST (dirty): written back when evicted or after the step."""
        if not self._host_slot(shard, protect=(), horizon=0.0):
            raise BudgetError(f"no room in the host staging arena for {shard.id} "
                              f"({shard.nbytes} bytes): raise host_budget or buffer_count")
        if source is not None:
            shard.host.copy_(source)
        self.registry.set_state(shard, R.HOST)
        return shard.host

    def discard(self, shard: Shard) -> None:
        """Drops a companion's contents (a consumed gradient); keeps its NVMe extent for reuse."""
        if shard.state is R.EMPTY:
            return
        self.reap(shard, wait=True)
        if shard.arena_offset is not None:
            self._free_slot(shard)
        self.registry.set_state(shard, R.EMPTY)

    # -- gradients ----------------------------------------------------------------------------
    def take_grad(self, entry: ParamEntry, grad: torch.Tensor) -> None:
        """Moves a finished device gradient into the entry's shards' host accumulators (fp32
        master dtype), dividing out the loss scale and keeping each shard's squared norm for
        clipping and overflow checks."""
        scale = self.loss_scale
        started = time.perf_counter()
        flat = grad.detach().reshape(-1)
        for shard in entry.shards:
            piece = flat[shard.start:shard.start + shard.numel]
            if scale != 1.0:
                piece = piece.to(shard.dtype) / scale  # unscale before accumulating
            if self.grads_on_nvme:
                target = self._grad_companion_for_write(shard)
                if target is None:
                    holder = self.companion(shard, "grad", shard.numel, shard.dtype)
                    target = self.fill(holder)
                    target.copy_(piece)
                else:
                    target.add_(piece.to(target.dtype))
            else:
                if shard.grad is None and piece.device.type == "cpu" and \
                        piece.dtype == shard.dtype and piece.is_contiguous():
                    # A gradient computed in host memory (no GPU) already is a host tensor:
                    # keep it instead of copying it (the hook drops param.grad right after).
                    shard.grad = piece
                    self.grad_bytes += shard.nbytes
                    self.grad_peak = max(self.grad_peak, self.grad_bytes)
                elif shard.grad is None:
                    shard.grad = torch.empty(shard.numel, dtype=shard.dtype,
                                             pin_memory=self.host.pin)
                    shard.grad.copy_(piece)
                    self.grad_bytes += shard.nbytes
                    self.grad_peak = max(self.grad_peak, self.grad_bytes)
                else:
                    shard.grad.add_(piece.to(shard.grad.device, shard.grad.dtype))
                target = shard.grad
            # vector_norm reduces without a full-size temporary (a float64 copy would be 2x the
            # gradient); its fp32 accumulation is accurate enough for clipping and overflow.
            shard.grad_sq_norm = float(torch.linalg.vector_norm(target)) ** 2 \
                if target.is_floating_point() else 0.0
        self.timeline.span(entry.name, "d2h", started, time.perf_counter())

    def _grad_companion_for_write(self, shard: Shard) -> torch.Tensor | None:
        """The host view of an existing gradient to accumulate into (read back if needed),
        marked dirty; None when the shard has no gradient yet."""
        holder = shard.companions.get("grad")
        if holder is None or holder.state is R.EMPTY:
            return None
        self.ensure_host(holder)
        if holder.state is R.HOST_STORING:
            self.reap(holder, wait=True)
        if holder.state is R.HOST_NVME:
            self.registry.set_state(holder, R.HOST)
        return holder.host

    def has_grad(self, shard: Shard) -> bool:
        if self.grads_on_nvme:
            holder = shard.companions.get("grad")
            return holder is not None and holder.state is not R.EMPTY
        return shard.grad is not None

    def grad_view(self, shard: Shard) -> torch.Tensor | None:
        """The shard's host gradient (its companion must already be on the host)."""
        if self.grads_on_nvme:
            holder = shard.companions.get("grad")
            if holder is None or holder.state is R.EMPTY:
                return None
            return holder.host
        return shard.grad

    def clear_grads(self, set_to_none: bool = True) -> None:
        for shard in self.registry.shards.values():
            shard.grad_sq_norm = 0.0
            if self.grads_on_nvme:
                holder = shard.companions.get("grad")
                if holder is not None:
                    self.discard(holder)
                continue
            if shard.grad is None:
                continue
            if set_to_none:
                shard.grad = None
                self.grad_bytes -= shard.nbytes
            else:
                shard.grad.zero_()
