"""Activation offload: what autograd saves in forward leaves the device and comes back in backward.

``offload_activations='cpu'`` or ``'nvme'`` makes the store create one :class:`ActivationOffload`
at attach. It installs ``torch.autograd.graph.saved_tensors_hooks`` around the model's forward
and forward hooks on every module:

* **pack** (a tensor autograd saves): parameters and views of them (``weight.t()`` in linear,
  the store's device copies), small tensors (below ``min_bytes``) and anything that is not a
  plain dense tensor on the store's device stay as they are. Everything else is remembered by
  its *storage* (the unit that holds memory): views of one storage (``q``, ``k``, ``v`` split
  from one ``qkv`` output) share one copy and come back as views of one restored storage with
  their own sizes, strides and offsets, so kernels see the same layouts and results are
  bit-equal.
* **module boundary** (each module's pre- and post-forward): the storages packed since the last
  boundary form a *group*; their bytes are copied out (into host memory counted in the host
  tier, pinned with CUDA; or through aligned staging buffers into extents the swap engine
  allocates) and the device references are dropped, so each saved tensor's memory is free as
  soon as the forward itself lets go of it.
* **backward**: when a module's output gets its gradient (its backward is next), and at each
  unpack, the groups that backward needs next are fetched, newest first, up to
  ``prefetch_depth`` groups ahead (and ``prefetch_bytes``): the group needed now, then the one
  before it, ... A fetched storage stays on the device until autograd drops every saved tensor
  that uses it (after their nodes ran).

Activation checkpointing (``torch.utils.checkpoint``): in both modes the recomputed region runs
under checkpoint's own saved-tensor hooks, which take precedence, so only what the outer graph
saves (the region's inputs, which both modes save through autograd) passes through pack; the
recomputation in backward happens while these hooks are not installed.

Bookkeeping happens on the training thread. Autograd may drop a saved tensor on another thread
(CUDA backward), so freeing the host memory or extent of a storage nobody references any more is
queued and done at the next hook.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infinity.core.finalizers import interrupt_safe
from infinity.core.streams import same_device
from infinity.errors import BudgetError, InfinityError
from infinity.training.activation_records import (
    Packed,
    ReadUse,
    Resources,
    StagingUse,
    Stored,
    WriteUse,
)
from infinity.training.param_access import SavedParameter
from swap import BufferPool, HostBuffer, SwapEngine, align_up

if TYPE_CHECKING:
    from infinity.core.attached import AttachedStore


log = logging.getLogger(__name__)

#: saved tensors whose storage is smaller than this stay on the device: copying them costs more
#: in per-tensor overhead than their memory is worth
MIN_BYTES = 64 << 10
#: staging buffers between the device and the swap engine (nvme): count and largest size
STAGING_COUNT = 4
STAGING_BYTES = 16 << 20


class ActivationOffloadError(InfinityError, RuntimeError):
    """A saved activation could not be written out or read back (the message names the module
    whose forward saved it, its size and the cause)."""


class ActivationOffload:
    """Moves saved activations of one attached model to host memory or NVMe and back."""

    def __init__(
        self,
        target: str,
        device: torch.device,
        *,
        host_room: int | None,
        engine: SwapEngine | None,
        pin_memory: bool,
        prefetch_depth: int,
        prefetch_bytes: int | None,
        param_storages: Callable[[], Iterable[torch.Tensor]],
        saved_parameter: Callable[[torch.Tensor], Any] = lambda tensor: None,
        device_bytes: Callable[[], int] = lambda: 0,
        min_bytes: int = MIN_BYTES,
        staging_bytes: int = STAGING_BYTES,
        staging_count: int = STAGING_COUNT,
    ) -> None:
        """``host_room``: bytes of the host budget left for activations, staging buffers
        included (None: the budget was derived for the model's state, and activations come on
        top of it). They are counted here, not in the host tier, whose bytes are the arena's
        and the parameters' (placement's arithmetic and audit rely on that).
        ``param_storages``: the tensors whose storages are parameters (never offloaded).
        ``saved_parameter``: what to keep of an attached parameter autograd saves, an object
        whose ``unpack()`` gives backward its values (ParamAccess.saved), or None.
        ``device_bytes``: the device tier's bytes now, sampled with the activations' own for
        the combined peak."""
        if target not in ("cpu", "nvme"):
            raise ValueError(f"offload target must be 'cpu' or 'nvme', got {target!r}")
        if target == "nvme" and engine is None:
            raise ValueError("offload_activations='nvme' needs the store's swap engine")
        self.target = target
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin = pin_memory and self.cuda
        self.host_room = host_room
        self.engine = engine
        self.prefetch_depth = max(1, prefetch_depth)
        self.prefetch_bytes = prefetch_bytes
        self.min_bytes = min_bytes
        #: autograd may drop a saved tensor anywhere: a signal landing there is not lost
        self._on_dead_safe = interrupt_safe(self._on_dead)
        self._param_storages = param_storages
        self._saved_parameter = saved_parameter
        self._tier_bytes = device_bytes
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.handles: list[Any] = []
        # The counters finalizers change: from autograd threads, or from this thread when a
        # collection runs inside a locked block (so it must be reentrant).
        self._lock = threading.RLock()
        # -- forward
        self._depth = 0  # nested root forwards
        self._hooks: Any = None  # the saved_tensors_hooks context while entered
        self._group = 0  # the group that packs go to now
        self._pending: list[Stored] = []  # packed since the last boundary
        self._module: list[str] = []  # modules whose forward is running, innermost last
        self._seen: dict[int, tuple[Any, Stored]] = {}  # storage address -> (tensor ref, stored)
        self._param_ptrs: set[int] | None = None
        # -- backward
        self._groups: dict[int, list[weakref.ref]] = {}  # group -> its storages
        self._group_ids: list[int] = []  # sorted keys of _groups
        self._loads: list[Stored] = []  # fetches under way, oldest first
        self._dead: collections.deque[Resources] = collections.deque()
        # -- nvme staging
        self._staging: BufferPool | None = None
        self._uses: collections.deque[StagingUse] = collections.deque()
        self.chunk = 0
        self.host_bytes = 0
        self.peak_host_bytes = 0
        if target == "nvme":
            self.chunk = align_up(staging_bytes)
            self._claim_host(self.chunk * staging_count, "its staging buffers")
            self._staging = BufferPool(
                staging_count, self.chunk, pin_memory=self.pin, name="activation staging"
            )
        # -- stats
        self.offloaded_bytes = 0
        self.offloaded_tensors = 0
        self.fetched_bytes = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.stall_seconds = 0.0
        self.demand_fetches = 0
        self.prefetches = 0
        self.current_device = 0
        self.peak_device = 0
        self.peak_device_total = 0

    # -- installation -------------------------------------------------------------------------

    @property
    def swap_engine(self) -> SwapEngine:
        """The engine of target 'nvme' (it has one: checked at construction)."""
        assert self.engine is not None  # target 'nvme' has one (checked above)
        return self.engine

    @property
    def _stream(self) -> torch.cuda.Stream:
        assert self.copy_stream is not None  # made on CUDA
        return self.copy_stream

    @property
    def _pool(self) -> BufferPool:
        assert self._staging is not None  # made for target 'nvme'
        return self._staging

    def install(self, root: nn.Module) -> None:
        """Hooks on ``root`` (the saved-tensor hooks around its forward) and on every module
        (the boundaries). Registered after the store's own hooks, so a module's parameters are
        gathered before its pre-hook here looks for their storages."""
        offload = self

        def root_pre(module: nn.Module, args: Any) -> None:
            if module is root:
                offload._enter(module)

        def root_post(module: nn.Module, args: Any, output: Any) -> None:
            if module is root:
                offload._exit()

        self.handles.append(root.register_forward_pre_hook(_opaque(root_pre)))
        for name, module in root.named_modules():
            label = name or type(module).__name__
            self.handles.append(module.register_forward_pre_hook(_opaque(self._make_pre(label))))
            self.handles.append(
                module.register_forward_hook(_opaque(self._make_post(label)), always_call=True)
            )
        # Last, so that it runs after every other post-hook of the root (its boundary included).
        self.handles.append(root.register_forward_hook(_opaque(root_post), always_call=True))

    def _make_pre(self, label: str) -> Callable:
        def pre(module: nn.Module, args: Any) -> None:
            if self._hooks is None:
                return
            self._boundary()
            self._module.append(label)
            self._param_ptrs = None  # the store has just gathered this module's parameters

        return pre

    def _make_post(self, label: str) -> Callable:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            if self._hooks is None:
                return
            first = self._group_ids[-1] if self._group_ids else -1
            self._boundary()
            if self._module:
                self._module.pop()
            if torch.is_grad_enabled() and self._group_ids and self._group_ids[-1] > first:
                # This module's forward saved something here: once its output gets a gradient,
                # its backward is next and needs those groups, newest first.
                self._hook_output(output, self._group_ids[-1])

        return post

    def _hook_output(self, output: Any, group: int) -> None:
        tensors = [t for t in _tensors(output) if t.requires_grad and t.grad_fn is not None]
        if not tensors:
            return
        offload = weakref.ref(self)

        def backward_next(grad: torch.Tensor) -> None:
            this = offload()
            if this is not None and this.handles:
                this._housekeeping()
                this._prefetch(group)

        tensors[0].register_hook(_opaque(backward_next))

    def _enter(self, root: nn.Module) -> None:
        self._depth += 1
        if self._depth > 1 or not torch.is_grad_enabled() or _in_backward():
            return  # nested, nothing saved, or checkpoint's recomputation in backward
        self._housekeeping()
        self._seen.clear()
        self._param_ptrs = None
        self._module = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def _exit(self) -> None:
        self._depth -= 1
        if self._depth > 0 or self._hooks is None:
            return
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(None, None, None)
        self._boundary()
        self._seen.clear()

    # -- pack / boundary (forward) --------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> Any:
        kept = self._saved_parameter(tensor)
        if kept is not None:
            return kept
        if not self._offloadable(tensor):
            return tensor
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        version = tensor._version
        seen = self._seen.get(address)
        if seen is not None:
            ref, stored = seen
            # The first tensor still alive keeps the storage alive: the address is this one.
            if ref() is not None and stored.version == version:
                return Packed(stored, tensor)
        source = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        source.set_(storage, 0, (storage.nbytes(),), (1,))
        module = self._module[-1] if self._module else "?"
        stored = Stored(source, version, self._group, module)
        stored.res.device_bytes = stored.nbytes
        self._count_device(stored.nbytes)
        weakref.finalize(stored, self._on_dead_safe, stored.res)
        self._seen[address] = (weakref.ref(tensor), stored)
        self._pending.append(stored)
        return Packed(stored, tensor)

    def _offloadable(self, tensor: torch.Tensor) -> bool:
        if (
            type(tensor) is not torch.Tensor
            or tensor.layout is not torch.strided
            or not same_device(tensor.device, self.device)
            or tensor.is_conj()
            or tensor.is_neg()
        ):
            return False  # parameters (their own class), subclasses, other devices, lazy bits
        base = tensor._base
        if isinstance(base, nn.Parameter):
            return False
        storage = tensor.untyped_storage()
        if storage.nbytes() < self.min_bytes:
            return False
        if self._param_ptrs is None:
            self._param_ptrs = {t.untyped_storage().data_ptr() for t in self._param_storages()}
        return storage.data_ptr() not in self._param_ptrs

    def _boundary(self) -> None:
        """Copies out what was packed since the last boundary, as one group."""
        pending, self._pending = self._pending, []
        if pending:
            group = self._group
            self._groups[group] = [weakref.ref(s) for s in pending]
            self._group_ids.append(group)
            self._group += 1
            if self.cuda:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
            for stored in pending:
                self._copy_out(stored)
        self._housekeeping()

    def _copy_out(self, stored: Stored) -> None:
        source, stored.source = stored.source, None
        if source is None:
            return
        res = stored.res
        self.offloaded_bytes += res.nbytes
        self.offloaded_tensors += 1
        if self.target == "cpu":
            res.host = self._host_alloc(res.nbytes, stored)
            stored.event = self.copy(res.host, source)
        else:
            res.extent = self.swap_engine.allocate(res.nbytes)
            for offset in range(0, res.nbytes, self.chunk):
                nbytes = min(self.chunk, res.nbytes - offset)
                buf = self._take_staging()
                assert buf is not None  # waited for
                use = WriteUse(self, buf, stored, offset, nbytes)
                use.event = self.copy(use.buf.tensor[:nbytes], source[offset : offset + nbytes])
                self._start_use(use, res)
        if self.cuda:
            # The allocator must not hand the bytes out again before the copy has read them.
            source.record_stream(self._stream)
        self._uncount(res)

    def _host_alloc(self, nbytes: int, stored: Stored) -> torch.Tensor:
        self._claim_host(nbytes, stored.describe())
        # Pinned with CUDA: the copies in and out are then asynchronous.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def _claim_host(self, nbytes: int, what: str) -> None:
        """Counts ``nbytes`` of host memory, within what the host budget leaves (if set)."""
        with self._lock:
            if self.host_room is not None and self.host_bytes + nbytes > self.host_room:
                raise BudgetError(
                    f"offload_activations='{self.target}': {what} does not fit in host "
                    f"memory: host_budget leaves {self.host_room} bytes for activations after "
                    f"the staging arena and the parameters held in host memory, and "
                    f"{self.host_bytes} are in use. Raise host_budget, use "
                    f"offload_activations='nvme', or checkpoint activations "
                    f"(torch.utils.checkpoint) so that fewer are saved"
                )
            self.host_bytes += nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """``dst.copy_(src)``; on CUDA on the copy stream, returning the event marking it."""
        if not self.cuda:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return event

    # -- staging buffers (nvme) -----------------------------------------------------------------
    def _take_staging(self, wait: bool = True) -> HostBuffer | None:
        self._poll_uses()
        while True:
            buf = self._pool.try_acquire("activations")
            if buf is not None or not wait:
                return buf
            if not self._uses:
                raise RuntimeError("activation staging: no buffer free and none in use")
            use = self._uses[0]  # the staging buffers are all in these uses
            started = time.perf_counter()
            use.poll(wait=True)
            self.stall_seconds += time.perf_counter() - started
            self._poll_uses()

    def _start_use(self, use: StagingUse, res: Resources) -> None:
        res.uses.append(use)
        self._uses.append(use)
        self._poll_uses()

    def _poll_uses(self) -> None:
        for use in list(self._uses):
            if use.poll(wait=False):
                self._finish_use(use)

    def _finish_use(self, use: StagingUse) -> None:
        self._uses.remove(use)
        try:
            use.stored.res.uses.remove(use)
        except ValueError:
            pass
        self._pool.release(use.buf)

    # -- backward -------------------------------------------------------------------------------
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, SavedParameter):
            return packed.unpack()
        if not isinstance(packed, Packed):
            return packed
        stored = packed.stored
        self._housekeeping()
        if stored.back is None or stored.loading:
            started = time.perf_counter()
            if stored.back is None:
                self.demand_fetches += 1
                self._fetch(stored)
            self._prefetch(stored.group)
            self._finish(stored)
            self.stall_seconds += time.perf_counter() - started
        else:
            self._prefetch(stored.group)
        if stored.error is not None:
            self._raise(stored)
        if self.cuda and stored.event is not None:
            torch.cuda.current_stream(self.device).wait_event(stored.event)
        assert stored.back is not None  # fetched above
        view = torch.empty(0, dtype=packed.dtype, device=self.device)
        view.set_(stored.back.untyped_storage(), packed.offset, packed.size, packed.stride)
        return view

    def _raise(self, stored: Stored) -> None:
        where = "NVMe" if self.target == "nvme" else "host memory"
        raise ActivationOffloadError(
            f"activation offload: {stored.describe()} could not be brought back from {where} "
            f"for backward: {stored.error}. The gradient cannot be computed without it; fix "
            f"the cause (the swap directory's drive, its free space) or set "
            f"offload_activations='none'"
        ) from stored.error

    def _prefetch(self, group: int) -> None:
        """Starts fetching what backward needs from ``group`` on: its storages not yet back,
        then those of the ``prefetch_depth`` groups before it, newest first, within
        ``prefetch_bytes`` bytes under way."""
        budget = self.prefetch_bytes
        if budget is not None:
            budget -= sum(s.nbytes for s in self._loads)
        last = bisect.bisect_right(self._group_ids, group) - 1
        # ``group`` and the prefetch_depth groups before it: the window counts groups already
        # back too, or each unpack would reach further ahead and backward would hold them all.
        for index in range(last, max(last - self.prefetch_depth, -1), -1):
            refs = self._groups.get(self._group_ids[index], ())
            members = [
                s
                for s in (ref() for ref in refs)
                if s is not None and s.back is None and s.source is None
            ]
            for stored in members:
                if budget is not None:
                    if stored.nbytes > budget:
                        return
                    budget -= stored.nbytes
                if not self._fetch(stored, prefetch=True):
                    return

    def _fetch(self, stored: Stored, prefetch: bool = False) -> bool:
        """Starts bringing ``stored`` back; False when a prefetch found no staging buffer."""
        if stored.back is not None:
            return True
        res = stored.res
        if self.target == "nvme":
            # Its writes must have landed before it is read back.
            for use in list(res.uses):
                use.poll(wait=True)
                self._finish_use(use)
            if stored.error is not None:
                return True  # raised by the unpack that needs it
        stored.back = torch.empty(res.nbytes, dtype=torch.uint8, device=self.device)
        if self.cuda:
            # The new block may have been freed by kernels still queued on the compute stream.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            stored.back.record_stream(self._stream)
        res.device_bytes = res.nbytes
        self._count_device(res.nbytes)
        self.fetched_bytes += res.nbytes
        if prefetch:
            self.prefetches += 1
        if self.target == "cpu":
            assert res.host is not None  # offloaded to host memory
            stored.event = self.copy(stored.back, res.host)
            return True
        stored.event = None
        stored.loading = True
        stored.chunks_left = [
            (offset, min(self.chunk, res.nbytes - offset))
            for offset in range(0, res.nbytes, self.chunk)
        ]
        self._loads.append(stored)
        return self._issue(stored, wait=not prefetch)

    def _issue(self, stored: Stored, wait: bool) -> bool:
        """Starts the chunk reads of ``stored`` that staging buffers allow."""
        while stored.chunks_left:
            buf = self._take_staging(wait=wait)
            if buf is None:
                return False
            offset, nbytes = stored.chunks_left.pop(0)
            use = ReadUse(self, buf, stored, offset, nbytes)
            extent = stored.res.extent
            assert extent is not None  # written before
            use.future = self.swap_engine.read(extent, buf, nbytes=nbytes, extent_offset=offset)
            self._start_use(use, stored.res)
        return True

    def _finish(self, stored: Stored) -> None:
        """Waits until ``stored`` is back on the device (its reads, or its host copy)."""
        if self.target == "cpu" or not stored.loading:
            return
        self._issue(stored, wait=True)
        for use in list(stored.res.uses):
            use.poll(wait=True)
            self._finish_use(use)
        stored.loading = False
        self._loads.remove(stored)

    def _housekeeping(self) -> None:
        """Advances staging uses, continues fetches that waited for a buffer, and frees what
        autograd no longer holds."""
        if self._staging is not None:
            self._poll_uses()
            for stored in list(self._loads):
                if stored.chunks_left and not self._issue(stored, wait=False):
                    break
                if not stored.chunks_left and not stored.res.uses:
                    stored.loading = False
                    self._loads.remove(stored)
        while self._dead:
            res = self._dead.popleft()
            for use in list(res.uses):
                use.poll(wait=True)  # its transfers must end before its extent is reused
                self._finish_use(use)
            self._release(res)
            refs = self._groups.get(res.group)
            if refs is not None and all(ref() is None for ref in refs):
                del self._groups[res.group]
                self._group_ids.remove(res.group)

    def _release(self, res: Resources) -> None:
        self._uncount(res)
        if res.host is not None:
            with self._lock:
                self.host_bytes -= res.nbytes
            res.host = None
        if res.extent is not None:
            self.swap_engine.free(res.extent)
            res.extent = None

    # -- accounting -----------------------------------------------------------------------------
    def _count_device(self, nbytes: int) -> None:
        with self._lock:
            self.current_device += nbytes
            self.peak_device = max(self.peak_device, self.current_device)
            self.peak_device_total = max(
                self.peak_device_total, self.current_device + self._tier_bytes()
            )

    def _on_dead(self, res: Resources) -> None:
        """Autograd let go of a storage (maybe on its own thread): its device bytes are free
        now; its host copy or extent is freed by the training thread's next hook."""
        self._uncount(res)
        self._dead.append(res)

    def _uncount(self, res: Resources) -> None:
        with self._lock:
            self.current_device -= res.device_bytes
            res.device_bytes = 0

    def stats(self) -> dict[str, Any]:
        return {
            "target": self.target,
            # bytes copied out of the device (each storage once per forward) and how many
            "offloaded_bytes": self.offloaded_bytes,
            "offloaded_tensors": self.offloaded_tensors,
            "fetched_bytes": self.fetched_bytes,
            # saved activations held on the device by this (not yet copied out, or fetched back
            # and still used by backward), now and at the peak; and the peak of those plus the
            # device tier's parameter bytes, sampled together
            "current_device_bytes": self.current_device,
            "peak_device_bytes": self.peak_device,
            "peak_device_total_bytes": self.peak_device_total,
            "host_bytes": self.host_bytes,
            "peak_host_bytes": self.peak_host_bytes,
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "demand_fetches": self.demand_fetches,
            "prefetches": self.prefetches,
            # the training thread waiting for activations: fetches backward needed at once,
            # staging buffers forward had to wait for
            "stall_seconds": self.stall_seconds,
        }

    def close(self) -> None:
        """Removes the hooks and waits for transfers; what autograd still holds (a graph never
        run backward) keeps its host copy, and its extents go with the swap files."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)
        self._pending.clear()
        self._seen.clear()
        self._loads.clear()
        for use in list(self._uses):
            try:
                use.poll(wait=True)
            except Exception as exc:
                log.debug("activation transfer failed at close: %s", exc)
            self._finish_use(use)
        while self._dead:
            self._release(self._dead.popleft())
        if self._staging is not None:
            with self._lock:
                self.host_bytes -= self._staging.nbytes
            self._staging.close()
            self._staging = None


def offload_for_store(
    store: AttachedStore, model: nn.Module, engine: SwapEngine | None
) -> ActivationOffload:
    """The activation offload of an attached ``store`` (``offload_activations``), hooked on
    ``model``: within the host room the store's budgets leave, on ``engine`` (the store's swap
    engine, or one of its own when nothing else is on NVMe; None: activations stay in host
    memory)."""
    config = store.config
    placement = store.placement
    room = None
    if config.host_budget is not None:
        room = config.host_budget
        plan = store.memory_plan
        if placement is not None and plan is not None:
            # what the arena, host-held parameters and a CPU device leave
            held = 0 if store.master_tier == "nvme" else store.budgets["params"]
            room = plan.host_tier - store.budgets["arena"] - held
        if room <= 0:
            raise BudgetError(
                f"offload_activations='{config.offload_activations}' needs host memory, "
                f"but host_budget ({config.host_budget} bytes) is all taken by the staging "
                f"arena and the parameters held in host memory: raise host_budget, or "
                f"lower buffer_count x buffer_size"
            )
    if placement is not None:
        entries = store.registry.entries
        params: Callable[[], list[torch.Tensor]] = lambda: [
            e.device_tensor for e in entries if e.device_tensor is not None
        ]
        device_bytes: Callable[[], int] = lambda: placement.device.usage.current
    else:  # the store only reports: the parameters are the model's own, on the device
        params = lambda: list(model.parameters())
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        device_bytes = lambda: total
    offload = ActivationOffload(
        config.offload_activations,
        store.device,
        host_room=room,
        engine=engine,
        pin_memory=config.pin_memory,
        prefetch_depth=config.prefetch_depth,
        prefetch_bytes=config.prefetch_bytes,
        param_storages=params,
        saved_parameter=store.access.saved if store.access is not None else lambda tensor: None,
        device_bytes=device_bytes,
        staging_bytes=min(16 << 20, max(1 << 20, config.swap_buffer_size())),
    )
    offload.install(model)
    return offload


def _in_backward() -> bool:
    """Whether a backward pass runs on this thread (checkpoint's recomputation)."""
    from infinity.training.hooks import _graph_task  # the store's one reading of it

    task = _graph_task()
    return task is not None and task != -1


def _opaque(hook: Callable) -> Callable:
    """Run as Python, never traced by torch.compile (as the store's own hooks)."""
    return torch.compiler.disable(hook, recursive=True)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a module's output (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


__all__ = ["ActivationOffload", "ActivationOffloadError", "MIN_BYTES"]
