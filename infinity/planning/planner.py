"""Predictions before paying for a run: step time, bytes moved and memory per tier.

``TieredStore.predict(**overrides)`` replays the store's recorded trace through a second store
built for the candidate configuration, with the same placement, eviction, prefetch and step
code, over tensors that hold no bytes (the meta device) and a swap engine whose transfers take
simulated time. What is decided is therefore what the store would decide; only time is modelled:

* **compute**: after each trace event, the seconds the recorded run spent until the next one
  (the module's compute and the loop's own work, less the store's stalls and copies; see
  ``Trace.compute``), times the device profile's scale; the optimizer step, the recorded
  step's seconds per updated element (updates and the pipeline's own work, less its waits).
* **device copies**: bytes over the memcpy rate measured in the recorded run (a CPU device), or
  over the host<->device link's bandwidth (a GPU profile).
* **the disk**: one queue of transfers at the disk profile's read and write bandwidth; reads and
  writes share one budget (``DiskProfile.shared``) as on this machine's virtio disk, or run side
  by side. A transfer completes at a simulated time, and waiting for it moves the clock there.
* **contention** (given as measured, :class:`Contention`): while a transfer is in flight the
  compute, the optimizer and the device copies run ``compute_slowdown`` times slower and the disk
  keeps ``io_retained`` of its bandwidth (``simulated_time.py``). The recorded compute already ran
  slowed for the share of it its own bytes kept the disk busy (``Recording.iteration_io``,
  :func:`recorded_disk_share`); the replay takes that out first.

Memory: the tiers' peak bytes are exact (the same accounting); peak RSS is predicted as the
recorded process's RSS less its tiers' peak bytes, plus the candidate's, or the recorded attach's
own peak where that is higher (a model built whole in memory is whole while attach writes it out).

Where updates run (``step_in_backward='auto'``) is decided by the same code as well: the
candidate's config (its arena's room, gradient clipping, fp16 loss scaling) and what the
recorded loop did between backward and ``optimizer.step()`` (``Recording.loop_update_reasons``:
``clip_grad_norm_``, a second backward, ...), which the replay itself does not do. A prediction
says where (``update_mode``) and why not in backward (``update_mode_reasons``).

A budget that cannot hold what one module needs fails the same way attach or the first gather
fails, and the prediction says so (``fits`` False, with the error naming the module).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast, overload

import torch
from torch import nn

from infinity.config import OffloadConfig
from infinity.core.attached import AttachedStore
from infinity.core.budgets import MemoryPlan
from infinity.core.machine import Machine
from infinity.core.memory import fault_seconds, peak_resident_bytes
from infinity.core.overwrite import write_entry_pieces
from infinity.core.shards import ParamEntry
from infinity.core.tiers import DeviceTier, HostTier
from infinity.core.trace import BACKWARD, FORWARD, Trace
from infinity.errors import BudgetError

# the profiles and the heap's figures are part of the planner's interface: re-exported
from infinity.planning.heap import fault_compute as fault_compute
from infinity.planning.heap import heap_report, heap_reuse_starts
from infinity.planning.heap import training_rss as training_rss
from infinity.planning.profiles import GPU_EFFICIENCY as GPU_EFFICIENCY
from infinity.planning.profiles import GPU_PRESETS as GPU_PRESETS
from infinity.planning.profiles import DeviceProfile, DiskProfile, PlanError
from infinity.planning.profiles import device_profile as device_profile
from infinity.planning.profiles import measure_matmul_tflops as measure_matmul_tflops
from infinity.planning.simulated_time import (
    NO_CONTENTION,
    Contention,
    SimulatedClock,
    SimulatedEngine,
)
from infinity.training.update_timing import config_reasons
from swap import EngineStats, SwapEngine, align_up
from swap.files import RangeAllocator

if TYPE_CHECKING:
    from infinity.inference.quantized import WeightQuantizer


log = logging.getLogger(__name__)

GB = 1e9
#: iterations a prediction replays, and the first ones it leaves out of its means (the first
#: records a trace, the second is the first one prefetch follows, and in the third a host tier
#: that holds nearly everything is still filling: a replay starts with every value on NVMe, as
#: after a load, and in the validation matrix's cells at 90% of the state the third iteration
#: read 10-24% and wrote up to 42% more than the ones after it). Which shards the step writes
#: back depends on which reads have landed when a tile is formed, so the bytes written vary
#: from one iteration to the next by +-20% on bench_plan's model, in a run and in its
#: simulation alike: a mean over several steady iterations is what a measured run's mean over
#: its steps is compared with.
ITERATIONS = 13
WARMUP = 3


# -- simulated time -----------------------------------------------------------------------------
class _DeviceTier(DeviceTier):
    """The device tier on the meta device; a copy takes simulated time."""

    def __init__(
        self, budget: int, clock: SimulatedClock, copy_gbps: float, host_memory: bool, copies: int
    ) -> None:
        super().__init__(torch.device("meta"), budget, copies)
        self.clock = clock
        self.copy_gbps = copy_gbps
        self.host_memory = host_memory  # a CPU device: gradients are host tensors already
        #: storage -> its slab range (a CPU device's copies)
        self._simulated: dict[int, int] = {}

    # A CPU device's copies are ranges of a slab (DeviceTier.fill): the same ranges here,
    # holding no bytes, so that eviction makes room where the real tier would.
    @property
    def uses_slab(self) -> bool:
        return self.host_memory

    def _slab_range(self, nbytes: int) -> int | None:
        if self._slab_ranges is None:
            self._slab_ranges = RangeAllocator(self.slab_bytes)
        return self._slab_ranges.take(align_up(nbytes))

    def _fill_from_slab(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        if not self.uses_slab or not nbytes:
            return False
        offset = self._slab_range(nbytes)
        if offset is None:
            self.slab_misses += 1
            return False
        storage.resize_(nbytes)  # meta: no memory
        self._simulated[storage._cdata] = offset
        return True

    def empty(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        offset = self._simulated.pop(storage._cdata, None)
        if offset is not None:
            assert self._slab_ranges is not None
            self._slab_ranges.give(offset, align_up(storage.nbytes()))
        storage.resize_(0)
        self.usage.sub(tensor.numel() * tensor.element_size())

    def copy_in(
        self, dst: torch.Tensor, src: torch.Tensor, quant: WeightQuantizer | None = None
    ) -> None:
        moved = dst if quant is None else src  # a quantized shard crosses as its stored bytes
        nbytes = moved.numel() * moved.element_size()
        self.bytes_in += nbytes
        self.clock.compute(nbytes / (self.copy_gbps * GB))
        return None

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        nbytes = src.numel() * src.element_size()
        self.bytes_out += nbytes
        self.clock.compute(nbytes / (self.copy_gbps * GB))


# -- the replay ---------------------------------------------------------------------------------
@dataclass
class Recording:
    """What a recorded run tells about time and memory: the trace with each event's compute
    seconds, the optimizer (class and options) and the step's seconds per updated element (its
    updates and their bookkeeping, less its waits and copies), the rate of device copies, and
    the process's RSS besides the tiers. :func:`recording_of` reads it
    from an attached store; a planner for a model too large to run here builds one from a
    smaller copy (``infinity/cli/plan.py``)."""

    trace: Trace
    training: bool
    step_seconds_per_element: float = 0.0
    copy_gbps: float = 10.0
    base_rss: int = 0
    optimizer_class: type | None = None
    optimizer_options: dict = dataclasses.field(default_factory=dict)
    #: what the recorded loop did that keeps updates in optimizer.step() under
    #: step_in_backward='auto' (clip_grad_norm_, accumulation, ...: ``UpdateTiming.
    #: loop_reasons``); empty: it allows updates in backward; None: its first step was not
    #: watched (its config kept them in the step from the start), and the loop is taken to
    #: allow them
    loop_update_reasons: list[str] | None = None
    #: the last recorded iteration's bytes read and written, its working seconds (less the
    #: training thread's waits) and those waits (``OffloadedOptimizer.last_iteration_io``): its
    #: compute ran slowed by the disk for as long as those bytes kept the disk busy beyond the
    #: waits, which the replay takes out (:func:`recorded_disk_share`) before it slows compute
    #: beside its own transfers
    iteration_io: tuple[int, int, float, float] | None = None
    #: the process's peak RSS when attach returned (``rss_bound()["attach_peak"]``): with the
    #: model built whole in host memory, attach's own peak, which the budget did not change in
    #: the runs measured; 0: not known (a recording extrapolated from a smaller copy)
    attach_peak_rss: int = 0
    #: the process's RSS besides the tiers in the first step, before freed heap blocks were
    #: kept for reuse (``rss_bound()["bounded_base"]``; 0: not known), the process's own bytes
    #: before attach (``rss_bound()["process"]``), and whether the heap kept blocks at some
    #: point (``rss_bound()["heap_reused"]``, though reuse may have ended where RSS passed the
    #: line): ``base_rss`` then holds what reuse kept, which a budget with no room for it does
    #: not (:func:`training_rss`)
    bounded_base_rss: int = 0
    process_rss: int = 0
    heap_reuse: bool = False
    #: wall seconds a minor page fault adds to compute in the recorded process
    #: (``infinity.core.memory.fault_seconds``; 0: not measured). With the trace's fault counts
    #: (``Trace.recorded_faults``, ``Trace.faults``) it prices the temporaries a budget without
    #: room for heap reuse faults afresh each step, which a recording that reused did not
    fault_seconds: float = 0.0


def recording_of(store: AttachedStore) -> Recording:
    """The recording of an attached store that has run two iterations (the second gives the
    compute times)."""
    if store.model is None or store.placement is None:
        raise PlanError(
            "predict() needs an attached store that offloads (attach, then run two steps)"
        )
    traces = store.follower.traces
    trace = traces.get((True, True)) or traces.get((True, False))
    training = trace is not None
    if trace is None:
        trace = traces.get((False, False)) or traces.get((False, True))
    if trace is None or not any(trace.compute):
        raise PlanError(
            "predict() needs a recorded iteration and one that followed it (the "
            "compute times come from the second): run two training steps (or two "
            "forwards for inference) first"
        )
    optimizer = store.optimizer
    per_element = 0.0
    iteration_io = None
    optimizer_class, options = None, {}
    if optimizer is not None:
        per_element = optimizer.step_seconds_per_element
        iteration_io = optimizer.last_iteration_io
        inner = optimizer.inner
        optimizer_class = type(inner)
        accepted = inspect.signature(optimizer_class.__init__).parameters
        options = {
            k: v
            for k, v in inner.defaults.items()
            if k in accepted and k not in ("fused", "foreach", "capturable", "differentiable")
        }
    device = store.placement.device
    copied, seconds = device.bytes_in + device.bytes_out, device.copy_seconds
    if optimizer is not None and optimizer.last_copies is not None and optimizer.last_copies[1]:
        copied, seconds = optimizer.last_copies  # the last iteration's: the first ones fault
    copy_gbps = copied / seconds / GB if seconds > 0 else 10.0
    stats = store.stats()
    tiers = stats["peak_bytes"]["host"] + (
        stats["peak_bytes"]["device"] if store.device.type == "cpu" else 0
    )
    # The store samples RSS where the heap grows, and can miss the peak between samples; the
    # process's own peak is exact, but may be older than the store (then the prediction errs
    # high, the safe side for a memory plan).
    rss = max(stats["rss_peak_bytes"], peak_resident_bytes())
    bound = stats["rss_bound"] or {}
    timing = store.update_timing
    loop_reasons = None
    if timing is not None and timing.loop_reasons is not None:
        loop_reasons = list(timing.loop_reasons)
    return Recording(
        trace,
        training,
        per_element,
        copy_gbps,
        max(0, rss - tiers),
        optimizer_class,
        options,
        loop_reasons,
        iteration_io,
        bound.get("attach_peak", 0),
        bound.get("bounded_base", 0),
        bound.get("process", 0),
        bool(bound.get("heap_reused")),
        # measured only where it is used: a recording whose heap reused blocks
        fault_seconds() if bound.get("heap_reused") and any(trace.recorded_faults) else 0.0,
    )


def _clone(model: nn.Module, entries: list[ParamEntry]) -> nn.Module:
    """The module tree of ``model`` with meta parameters of each entry's shape and dtype, in the
    same order (tied parameters stay tied), so a store attached to it has the same entries and
    modules, with the same indices."""
    by_id = {id(e.param): e for e in entries}
    made: dict[int, nn.Parameter] = {}

    def param_for(param: nn.Parameter) -> nn.Parameter:
        entry = by_id[id(param)]
        if entry.index not in made:
            made[entry.index] = nn.Parameter(
                torch.empty(entry.shape, dtype=entry.given_dtype or entry.dtype, device="meta"),
                requires_grad=entry.param.requires_grad,
            )
        return made[entry.index]

    return tree_with(model, param_for)


def tree_with(model: nn.Module, param_for: Callable[[nn.Parameter], nn.Parameter]) -> nn.Module:
    """``model``'s module tree as plain modules holding ``param_for(p)`` for each parameter
    ``p``, in the same order (what a store numbers its entries and modules by)."""
    clones: dict[str, nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        clone = nn.Module()
        for key, param in module._parameters.items():
            if param is not None:
                clone.register_parameter(key, param_for(param))
        clones[name] = clone
    for name, clone in clones.items():
        if name:
            parent, _, child = name.rpartition(".")
            setattr(clones[parent], child, clone)
    return clones[""]


def predict(
    store: AttachedStore,
    overrides: dict[str, Any],
    disk: DiskProfile | None = None,
    device: DeviceProfile | None = None,
    iterations: int = ITERATIONS,
    contention: Contention | None = None,
) -> dict[str, Any]:
    """See :meth:`TieredStore.predict`."""
    recording = recording_of(store)
    assert store.model is not None  # recording_of checked it is attached
    config = store.config.replace(**overrides) if overrides else store.config
    return simulate(
        _clone(store.model, store.registry.entries),
        recording,
        config,
        disk or _disk_from(store),
        device,
        iterations,
        cpu_memory=store.device.type == "cpu",
        contention=contention,
    )


def simulate(
    model: nn.Module,
    recording: Recording,
    config: OffloadConfig,
    disk: DiskProfile,
    device: DeviceProfile | None = None,
    iterations: int = ITERATIONS,
    cpu_memory: bool = True,
    contention: Contention | None = None,
    extra: list[float] | None = None,
) -> dict[str, Any]:
    """Attaches a store for ``config`` to ``model`` (its parameters on the meta device, in the
    order the recording's trace numbers them), replays ``iterations`` of the recorded trace
    through it, and reports the mean of those after the first :data:`WARMUP` (at least the
    last; see :meth:`TieredStore.predict` for the keys).
    ``cpu_memory``: the device tier's bytes are host memory (they count in the RSS).
    ``contention``: how compute and the disk slow each other on this machine (measured, as
    ``infinity/cli/common/contention.py`` does); None: not at all, and the result says it was not
    measured. It applies to a CPU device only: a GPU profile's compute does not share the
    cores with the engine (its CPU optimizer does, which is not modelled).

    Where the recorded heap kept freed blocks for reuse and the candidate's budget leaves no
    room for them (:func:`heap_reuse_starts`), its large temporaries fault afresh every step:
    the replay runs again with what those faults cost added to each event's compute
    (``extra``, seconds per event: :func:`fault_compute`). The result's ``heap`` says whether
    the candidate reuses, and what that added."""
    given = config
    host_device = cpu_memory and (device is None or device.link_gbps is None)
    priced = None
    if extra is None and recording.heap_reuse and config.host_budget is not None and host_device:
        priced = fault_compute(recording)
    spare = copy.deepcopy(model) if priced else None  # attach hooks the one it is given

    if recording.training and recording.optimizer_class is not None and not recording.trace.grads:
        raise PlanError(
            "the recording's trace has no gradient events (Trace.grads): the "
            "optimizer would update nothing; record a training step with the store"
        )
    # Where updates run under step_in_backward='auto' is decided as the run decides it: the
    # config's own reasons (gradient clipping, off below, included) and what the recorded loop
    # did between backward and optimizer.step(), which the replay does not do.
    kept_in_step = config_reasons(config.gradient_clipping, loss_scaling=False) + (
        recording.loop_update_reasons or []
    )
    # What only changes arithmetic, or needs real values, is off in the simulation: the fused
    # kernel (no meta implementation), norms for clipping and overflow checks (no values).
    config = config.replace(
        fused_optimizer=False,
        gradient_clipping=0.0,
        verify_checksums=False,
        keep_swap_files=False,
        offload_activations="none",
    )
    device = device or DeviceProfile("this machine")
    contention = contention or NO_CONTENTION
    if device.link_gbps is not None and contention.measured:
        contention = dataclasses.replace(
            NO_CONTENTION,
            source=f"not applied: {device.name} computes beside the engine's threads, not on "
            f"the cores they use ({contention.source})",
        )
    # The recorded compute ran slowed by the disk for part of it: out of it, what ran alone.
    recorded_share = recorded_disk_share(recording, disk, contention)
    alone = 1.0 / (1.0 + (contention.compute_slowdown - 1.0) * recorded_share)
    clock = SimulatedClock(contention, disk.mixed_efficiency)
    copy_gbps = device.link_gbps or recording.copy_gbps
    host_memory = device.link_gbps is None  # a CPU device: the device tier is host memory
    simulated_cpu = cpu_memory and host_memory
    engine = SimulatedEngine(clock, disk)

    machine = _SimulatedMachine(
        engine, clock, copy_gbps, host_memory, simulated_cpu, update_reasons=kept_in_step
    )
    sim = _store_type()(config, machine=machine)
    optimizer = None
    if recording.training and recording.optimizer_class is not None:
        optimizer = recording.optimizer_class(
            [p for p in model.parameters() if p.requires_grad], **recording.optimizer_options
        )
    result: dict[str, Any] = {
        "disk": dataclasses.asdict(disk),
        "device": dataclasses.asdict(device),
        "fits": True,
    }
    try:
        sim.attach(model, optimizer, initialise=False)
        for entry in sim.registry.entries:  # every value on NVMe (or the host), as after a load
            write_entry_pieces(
                sim, entry, lambda shard: torch.empty(shard.numel, dtype=shard.dtype, device="meta")
            )
        assert sim.placement is not None  # attached with something to place
        sim.placement.drain()
        if sim.engine is not None:
            clock.wait_idle()
        clock.stalled = 0.0
        phases = _replay(
            sim,
            recording,
            clock,
            device.compute_scale * alone,
            alone,
            iterations,
            lend=device.link_gbps is None,
            extra=extra,
        )
    except BudgetError as exc:
        result.update(fits=False, error=str(exc))
        return result
    finally:
        _close(sim)
    stats = sim.stats()
    host_peak = stats["peak_bytes"]["host"]
    device_peak = stats["peak_bytes"]["device"]
    result.update(phases)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) if optimizer else 0
    result["resource_seconds"] = resource_seconds(
        result, recording, disk, device, trainable, alone, sum(extra) if extra else 0.0
    )
    result["bound"] = max(result["resource_seconds"], key=result["resource_seconds"].get)
    result["peak_bytes"] = {
        "device": device_peak,
        "host": host_peak,
        "nvme": stats["peak_bytes"]["nvme"],
    }
    result["budgets"] = dict(sim.budgets)
    result["disk_bytes"] = stats["disk"]["preflight_bytes"]  # what the swap files will hold
    # where the replayed steps ran their updates at the end, and why not in backward
    result["update_mode"] = stats["update_mode"]
    result["update_mode_reasons"] = stats["update_mode_reasons"]
    result["contention"] = {
        **contention.as_dict(),
        "recorded_disk_share": recorded_share,
    }
    # Training's peak, or attach's own where that was higher (a model built whole in memory,
    # under a budget whose tiers stay below it).
    tiers = host_peak + (device_peak if host_device else 0)
    largest = max((e.nbytes for e in sim.registry.entries), default=0)
    plan = sim.memory_plan if config.host_budget is not None else None  # no budget: glibc's own
    result["rss_peak_bytes"] = max(
        training_rss(recording, plan, tiers, largest, host_device), recording.attach_peak_rss
    )
    reuse = heap_reuse_starts(recording, plan, tiers, largest, host_device)
    if priced is not None and spare is not None and reuse is False:
        args = (recording, given, disk, device, iterations, cpu_memory, contention)
        return simulate(spare, *args, extra=priced)
    result["heap"] = heap_report(recording, reuse, extra, host_device)
    return result


class ReplayedStore(AttachedStore, Protocol):
    """The store the planner replays a candidate through: an attached store it can attach,
    read the figures of and close."""

    @overload
    def attach(
        self,
        model: nn.Module,
        optimizer: None = None,
        *,
        initialise: bool = True,
        process_group: Any = None,
    ) -> Any: ...

    @overload
    def attach(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        initialise: bool = True,
        process_group: Any = None,
    ) -> Any: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self, restore_params: Any = None) -> None: ...


class StoreType(Protocol):
    """How a replayed store is made: ``TieredStore(config, machine=...)``."""

    def __call__(self, config: OffloadConfig, *, machine: Machine) -> ReplayedStore: ...


_replayed: StoreType | None = None


def replay_with(store_type: StoreType) -> None:
    """Sets the store the planner replays through (``import infinity`` sets
    :class:`infinity.TieredStore`: the store's facade is a layer above the planner)."""
    global _replayed
    _replayed = store_type


def _store_type() -> StoreType:
    if _replayed is None:  # every import of this module runs the package's __init__ first
        raise PlanError("no store to replay through: import infinity first")
    return _replayed


class _SimulatedMachine(Machine):
    """The machine a candidate is replayed on: tensors on the meta device, tiers holding no
    bytes whose device copies take simulated time, the simulated engine, and the recorded
    loop's reasons to keep updates out of backward (the replay does not run the loop)."""

    def __init__(
        self,
        engine: SimulatedEngine,
        clock: SimulatedClock,
        copy_gbps: float,
        host_memory: bool,
        simulated_cpu: bool,
        update_reasons: list[str],
    ) -> None:
        self._engine = engine
        self._clock = clock
        self._copy_gbps = copy_gbps
        self._host_memory = host_memory
        self._simulated_cpu = simulated_cpu
        self._update_reasons = update_reasons

    def device(self, name: str) -> torch.device:
        return torch.device("meta")  # tensors that hold no bytes

    def device_kind(self, device: torch.device) -> str:
        # The budgets the simulated device would get: a CPU device's derive from host
        # memory; a GPU profile's are every parameter unless device_budget says.
        return "cpu" if self._simulated_cpu else "other"

    def tiers(
        self, plan: MemoryPlan, device: torch.device, copies: int, pin_memory: bool
    ) -> tuple[DeviceTier, HostTier]:
        return (
            _DeviceTier(
                plan.device,
                self._clock,
                self._copy_gbps,
                host_memory=self._host_memory,
                copies=copies,
            ),
            HostTier(plan.host_tier, plan.arena, False, slot_size=plan.slot, meta=True),
        )

    def engine(self, open_engine: Callable[[], SwapEngine]) -> SwapEngine:
        return cast(SwapEngine, self._engine)  # the simulated engine: the same calls, no disk

    def update_reasons(self) -> list[str]:
        return list(self._update_reasons)


def recorded_disk_share(recording: Recording, disk: DiskProfile, contention: Contention) -> float:
    """The share of the recorded iteration's compute that ran beside the disk, as the replay
    itself would see it: the disk's seconds for the iteration's bytes at ``disk``'s bandwidth,
    less the training thread's waits (the disk ran alone then, at full speed), slowed beside
    compute as ``contention`` says, over the iteration's working seconds. So a candidate moving
    the recorded bytes gets back the slowing its compute was recorded with, and one moving more
    or fewer gets more or less.

    (The engine's own busy time is not used: it counts a transfer in flight until its
    completion is reaped, which on few cores waits for the compute, and it put 30-54% of the
    validation matrix's recorded MLP steps beside the disk where their bytes needed 10-20%.)"""
    if recording.iteration_io is None:
        return 0.0
    read, written, working, waited = recording.iteration_io
    if working <= 0:
        return 0.0
    read_s = read / (disk.read_gbps * GB)
    write_s = written / (disk.write_gbps * GB)
    alone = read_s + write_s if disk.shared else max(read_s, write_s)
    beside = max(0.0, alone - waited) / contention.io_retained
    return min(1.0, beside / working)


def resource_seconds(
    result: dict[str, Any],
    recording: Recording,
    disk: DiskProfile,
    device: DeviceProfile,
    trainable: int,
    alone: float = 1.0,
    extra: float = 0.0,
) -> dict[str, float]:
    """Each resource's busy seconds in a predicted step (``result``: :func:`simulate`'s):
    the one with the most bounds it (the step is at least its time). In the simulation,
    compute, the optimizer and device copies run one after another on the training thread;
    the disk's transfers overlap them. ``trainable``: the elements the optimizer updates;
    ``alone``: the recorded seconds' share that ran without the disk slowing them; ``extra``:
    seconds the replay added to the recorded compute (:func:`fault_compute`)."""
    gpu = device.link_gbps is not None
    optimizer_s = trainable * recording.step_seconds_per_element * alone
    compute_s = (sum(recording.trace.compute) + extra) * device.compute_scale * alone
    copies = max(0.0, result["step_seconds"] - result["stall_seconds"] - compute_s - optimizer_s)
    read_s = result["bytes_read"] / (disk.read_gbps * GB)
    write_s = result["bytes_written"] / (disk.write_gbps * GB)
    return {
        "GPU compute" if gpu else "compute": compute_s,
        "CPU optimizer": optimizer_s,
        "PCIe link" if gpu else "memcpy": copies,
        "disk": read_s + write_s if disk.shared else max(read_s, write_s),
    }


def _disk_from(store: AttachedStore) -> DiskProfile:
    """This run's own disk, as its engine saw it (bytes over busy seconds per direction)."""
    engine = store.engine
    stats = engine.stats() if engine is not None else None
    if stats is None or not (stats.read_seconds and stats.write_seconds):
        raise PlanError(
            "no disk profile: pass disk=DiskProfile(...) or "
            "DiskProfile.from_bench_json('bench.json') (infinity-bench --json)"
        )
    return DiskProfile(
        stats.bytes_read / stats.read_seconds / GB,
        stats.bytes_written / stats.write_seconds / GB,
        True,
        source="this run's engine",
    )


def _replay(
    sim: Any,
    recorded: Recording,
    clock: SimulatedClock,
    scale: float,
    step_scale: float,
    iterations: int,
    lend: bool,
    extra: list[float] | None = None,
) -> dict[str, Any]:
    """Runs ``iterations`` of the recorded trace through the simulated store (the first
    records its own trace, as a real run's first does) and measures the last. ``scale``
    multiplies the recorded compute seconds (plus ``extra``'s, per event), ``step_scale`` the
    optimizer's."""
    trace = recorded.trace
    placement = sim.placement
    entries = sim.registry.entries
    optimizer = sim.optimizer
    if optimizer is not None:
        inner_step = optimizer.inner.step

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            groups = optimizer.inner.param_groups
            stepped = [p for g in groups for p in g["params"] if p.grad is not None]
            seconds = recorded.step_seconds_per_element * step_scale
            clock.compute(sum(p.numel() for p in stepped) * seconds)
            if stepped and all(optimizer.inner.state.get(p) for p in stepped):
                # Meta tensors hold no values: once their state exists (the first update makes
                # it, and the companions from it), the optimizer's arithmetic changes nothing
                # the replay measures; it was about 40% of a prediction's time.
                return None
            return inner_step(*args, **kwargs)

        optimizer.inner.step = timed_step  # the simulation's own optimizer instance
    measured: list[dict[str, Any]] = []
    for _ in range(iterations):
        engine_before = sim.engine.stats() if sim.engine is not None else EngineStats()
        start, stalled = clock.now, clock.stalled
        marks: dict[str, float] = {}
        sim.stepping.start_iteration(recorded.training, recorded.training)
        holds: dict[ParamEntry, int] = {}
        grads = collections.defaultdict(list)  # events observed -> gradients completed there
        for observed, index in trace.grads:
            grads[observed].append(entries[index])
        for position, event in enumerate(trace.events):
            if event.kind == BACKWARD and "forward" not in marks:
                marks["forward"] = clock.now
            placement.on_event(event)
            used = [entries[i] for i in event.entries]
            for entry in used:
                placement.gather(entry, lend=lend and not recorded.training)
            added = extra[position] if extra is not None else 0.0
            clock.compute((trace.compute[position] + added) * scale)
            if event.kind == FORWARD:
                for entry in used:
                    placement.release(entry)
                if placement.prefetching.inference_iteration_over:
                    placement.prefetching.prefetch_ahead()
                continue
            for entry in used:
                if entry.param.requires_grad:
                    holds[entry] = holds.get(entry, 0) + 1
                else:
                    # Frozen (a LoRA model's base): no gradient hook drops it; the hooks drop
                    # it once the module's backward has computed its inputs' gradients.
                    placement.release(entry)
            # As the gradient hooks do, where autograd completed each gradient.
            for entry in grads.get(position + 1, ()):
                taken = entry.param.requires_grad
                if taken:
                    sim.stepping.grad_arriving(entry)
                    placement.gradients.take_grad(
                        entry, torch.empty(entry.shape, dtype=entry.compute_dtype, device="meta")
                    )
                for _ in range(holds.pop(entry, 0)):
                    placement.release(entry)
                if taken and placement.update_in_backward:
                    sim.stepping.grad_complete(entry, nested=False)
        for entry, count in holds.items():
            for _ in range(count):
                placement.release(entry)
        if recorded.training:
            sim.hooks.backward_pass_finished()
        marks.setdefault("forward", clock.now)
        marks["backward"] = clock.now
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        end = clock.now
        engine_after = sim.engine.stats() if sim.engine is not None else EngineStats()
        measured.append(
            {
                "step_seconds": end - start,
                "phase_seconds": {
                    "forward": marks["forward"] - start,
                    "backward": marks["backward"] - marks["forward"],
                    "step": end - marks["backward"],
                },
                "stall_seconds": clock.stalled - stalled,
                "bytes_read": engine_after.bytes_read - engine_before.bytes_read,
                "bytes_written": engine_after.bytes_written - engine_before.bytes_written,
            }
        )
    return _mean_of(measured[min(WARMUP, iterations - 1) :], iterations)


def _mean_of(steady: list[dict[str, Any]], iterations: int) -> dict[str, Any]:
    """The iterations' mean: seconds as floats, bytes rounded to whole bytes; with each
    iteration's bytes, to show how much they vary."""
    count = len(steady)

    def mean(key: str) -> float:
        return sum(it[key] for it in steady) / count

    steps = [it["step_seconds"] for it in steady]
    return {
        "step_seconds": mean("step_seconds"),
        # the slowest and fastest of the averaged iterations: how far one step may be off
        "step_seconds_spread": (min(steps), max(steps)),
        "phase_seconds": {
            phase: sum(it["phase_seconds"][phase] for it in steady) / count
            for phase in ("forward", "backward", "step")
        },
        "stall_seconds": mean("stall_seconds"),
        "bytes_read": round(mean("bytes_read")),
        "bytes_written": round(mean("bytes_written")),
        "iterations": {
            "replayed": iterations,
            "averaged": count,
            "step_seconds": steps,
            "bytes_read": [it["bytes_read"] for it in steady],
            "bytes_written": [it["bytes_written"] for it in steady],
        },
    }


def _close(sim: Any) -> None:
    try:
        sim.close(restore_params=False)
    except Exception as exc:
        log.debug("closing the simulated store: %s", exc)
