"""How a store divides its memory, and the bound on the process's RSS that follows.

With an explicit ``host_budget`` H the store promises that the process's peak RSS stays within

    bound = process + H + device outside H + transients outside H + saved activations
            (+ with offload_optimizer='cpu', the optimizer state and gradients in host tensors)

* **process**: the process without the store's bytes, measured at attach with torch's runtime
  initialised (interpreter, torch, the model's module objects, the loop's own data);
* **H** holds the staging arena, CPU-offloaded parameters and, on a CPU device, the device
  tier's working copies when their budget is derived (the device is the same RAM); what is left
  is reserved for the store's transients (:func:`transient_bytes`: with an optimizer, autograd's
  gradient buffers of the largest trained parameter and the first step's optimizer state;
  without one, nothing of training's). A checkpoint save takes its write buffers out of that
  reserve (:attr:`MemoryPlan.checkpoint_buffer_size`) rather than reserving them for a save
  that may never come;
* **device outside H**: an explicit ``device_budget`` on a CPU device, or every parameter when
  they stay on the device (``offload_param='none'``);
* **transients outside H**: the part of the reserve that an arena the size the config asks for
  (``buffer_count x buffer_size``) left no room for in H;
* **saved activations**: what autograd keeps from forward for backward, unless
  ``offload_activations`` moves it (then H or the staging buffers hold it). It grows with the
  tokens per micro-batch, so it is measured (:class:`infinity.observability.saved_activations.
  SavedActivationMeter`) and reported, not budgeted.

Everything here is arithmetic over the registered parameters' sizes: the planner's simulation
uses the same functions and so predicts the same budgets.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from infinity.config import DEFAULT_BUFFER_SIZE
from infinity.core.shards import ParamEntry, Shard, ShardKind
from infinity.core.state_sizes import stored_nbytes
from infinity.errors import BudgetError
from swap import align_up

log = logging.getLogger(__name__)

MIB = 1 << 20
#: a checkpoint save's write buffers (swap.stream_file.StreamWriter): this many, each of
#: between 1 and 16 MiB as the transients' reserve allows (MemoryPlan.checkpoint_buffer_size)
CHECKPOINT_WRITE_BUFFERS = 4
CHECKPOINT_BUFFER_MAX = 16 * MIB
CHECKPOINT_BUFFER_MIN = MIB
#: small allocations the store makes after attach (registry objects, heap fragmentation)
HEAP_SLACK = 32 * MIB


def activation_staging_bytes(slot: int) -> int:
    """Host memory of activation offload's staging buffers to NVMe: four of at most 16 MiB
    (infinity.training.activations, offload_for_store)."""
    return 4 * align_up(min(16 * MIB, max(MIB, slot)))


#: (module name, its parameters' entries), in the model's module order
Modules = Sequence[tuple[str, Sequence[ParamEntry]]]


def slot_size(config: Any) -> int:
    """The swap buffer (and arena slot) size: ``buffer_size``, or the one derived from the host
    budget (``OffloadConfig.swap_buffer_size``)."""
    return int(config.swap_buffer_size())


def state_part_bytes(nbytes: int, state_dtype: str, widened: bool = False) -> int:
    """Bytes of one per-element optimizer state tensor of a shard of ``nbytes`` master bytes, as
    ``precision.optimizer_state_dtype`` stores it (an estimate before the optimizer made it):
    fp32 masters; or ``widened``, bf16 masters updated in fp32 (precision.master_dtype), whose
    state is fp32 of twice their bytes."""
    if widened:
        return stored_nbytes(state_dtype, nbytes // 2)
    return stored_nbytes(state_dtype, nbytes // 4) if state_dtype != "fp32" else nbytes


def compute_copy_bytes(shard: Shard) -> int:
    """Bytes of ``shard``'s compute copy (precision.storage_dtype with an optimizer: 2-byte
    copies of floating-point masters of 4 bytes), 0 where it keeps none."""
    dtype = shard.dtype
    return shard.nbytes // 2 if dtype.is_floating_point and dtype.itemsize == 4 else 0


def compute_copies_kept(config: Any, training: bool, params_on_nvme: bool) -> bool:
    """Whether the store keeps compute copies beside the masters (see ``compute_copy_bytes``)."""
    precision = config.precision
    return (
        training
        and params_on_nvme
        and not precision.widened_masters
        and precision.storage_dtype in ("bf16", "fp16")
    )


def slot_cost(slot: int) -> Callable[[int], int]:
    """Arena bytes a range takes in slots of ``slot`` bytes (a whole slot when over half of
    one, as :class:`infinity.core.arena.SlotArena` places it)."""

    def cost(nbytes: int) -> int:
        size = align_up(max(nbytes, 1))
        return slot if 2 * size > slot else size

    return cost


# -- the device tier ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DeviceFloor:
    """The least device budget a training pass can run with: the module whose parameters take
    the most bytes, next to every parameter shared with other modules (a tied embedding and
    head: its copy is held from the first use's backward until its gradient is complete, at
    the last one) and the persistent ones."""

    nbytes: int
    module: str
    module_bytes: int
    shared: tuple[str, ...]
    shared_bytes: int
    persistent_bytes: int

    def describe(self) -> str:
        parts = []
        if self.shared_bytes:
            parts.append(
                f"{self.shared_bytes} bytes of parameters shared with other modules "
                f"({', '.join(self.shared[:3])}), held from their first use's backward until "
                f"their gradient is complete"
            )
        if self.persistent_bytes:
            parts.append(
                f"{self.persistent_bytes} bytes of persistent parameters "
                f"(param_persistence_threshold)"
            )
        return " next to " + " and ".join(parts) if parts else ""


def device_floor(modules: Modules, persistent: set[int], training: bool = True) -> DeviceFloor:
    """See :class:`DeviceFloor`. Without training (no optimizer: inference) nothing is held
    through a backward, so shared parameters are only their modules'."""
    by_index = {entry.index: entry for _, entries in modules for entry in entries}
    shared = shared_entries(modules) - persistent if training else set()
    persistent_bytes = sum(by_index[i].device_bytes for i in persistent if i in by_index)
    best: DeviceFloor | None = None
    for name, entries in modules:
        own = {e.index for e in entries} - persistent
        module_bytes = sum(by_index[i].device_bytes for i in own)
        others = sorted(shared - own)
        shared_bytes = sum(by_index[i].device_bytes for i in others)
        total = module_bytes + shared_bytes + persistent_bytes
        if best is None or total > best.nbytes:
            best = DeviceFloor(
                total,
                name,
                module_bytes,
                tuple(by_index[i].name for i in others),
                shared_bytes,
                persistent_bytes,
            )
    assert best is not None, "a model with parameters has a module that owns them"
    return best


def shared_entries(modules: Modules) -> set[int]:
    """The indices of the entries more than one module uses (tied weights)."""
    owners: dict[int, int] = {}
    for _, entries in modules:
        for entry in entries:
            owners[entry.index] = owners.get(entry.index, 0) + 1
    return {index for index, count in owners.items() if count > 1}


def working_set(modules: Modules, depth: int) -> int:
    """The most device bytes of ``depth + 1`` consecutive modules: one computing and the ones
    prefetch readies after it."""
    sizes = [sum(e.device_bytes for e in entries) for _, entries in modules]
    span = max(1, depth + 1)
    return max(sum(sizes[i : i + span]) for i in range(max(1, len(sizes) - span + 1)))


def cpu_device_default(
    modules: Modules, floor: DeviceFloor, depth: int, device_total: int, host_budget: int
) -> int:
    """A CPU device's derived budget under a host budget, of which it is a part: twice the
    working set (the modules computing and the ones ready next, and as many kept from forward
    for the start of backward) next to the shared and persistent parameters, at most a quarter
    of the host budget, never below the floor nor above every parameter. (Without a host budget
    it is every parameter, so that ``store.gathered()`` of the whole model works.)"""
    want = 2 * working_set(modules, depth) + floor.shared_bytes + floor.persistent_bytes
    return min(device_total, max(floor.nbytes, min(want, host_budget // 4)))


# -- the host side ---------------------------------------------------------------------------------
def transient_bytes(
    entries: Sequence[ParamEntry],
    shards: Iterable[Shard],
    trained: Collection[int] | None = None,
    widened: bool = False,
    shared: Collection[int] = frozenset(),
) -> int:
    """Host memory the store makes and frees around its tiers, at most this much at a time, for
    what this attach will do. ``trained``: the indices of the entries an optimizer updates
    (None: no optimizer). With one, in backward, autograd's gradient of the largest trained
    parameter (kept for its update) next to, for a parameter used twice (tied), its second
    contribution and their sum, and in the first step the optimizer's new state of one trained
    shard (two moments) before it moves to its companions. Without one (inference, or nothing
    trained) the decode of one shard into the compute dtype. Frozen parameters get no
    gradient and no state. ``widened``: bf16 masters updated in fp32 (precision.master_dtype):
    an update also holds its shard's master and gradient in fp32, beside fp32 state.
    ``shared``: the indices of the entries more than one module uses (:func:`shared_entries`);
    only those get a second contribution and a sum. An untied 8 B Llama's embedding and head
    (1.05 GB of bf16 each) reserved 3.15 GB of a 4 GiB budget for a sum that never comes, and
    left its arena 0.3 GB. (A module called twice in one forward sums two gradients of its own
    parameters too; attach cannot know it, and such a model's peak may pass the bound by one
    gradient.) Plus a margin for small allocations."""
    shards = list(shards)
    indices = frozenset(trained or ())
    trained_entries = [e for e in entries if e.index in indices]
    if trained_entries:
        largest_param = max(e.nbytes for e in trained_entries)
        # autograd's gradient, and for a parameter used twice its second one and their sum
        gradients = max(e.nbytes * (3 if e.index in shared else 1) for e in trained_entries)
        # two moments as they are (fp32 masters), or in fp32 with the master and gradient
        # widened beside them: 4 fp32 tensors of the shard
        largest_update = max(
            (16 * s.numel if widened else 2 * s.nbytes for s in shards if s.entry.index in indices),
            default=2 * largest_param,
        )
        need = max(gradients, largest_update)
    else:
        need = max((s.nbytes for s in shards), default=0)
    return need + HEAP_SLACK


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The budgets a store runs under, and the terms of its RSS bound (see the module
    docstring)."""

    device: int
    host: int
    arena: int
    params: int
    slot: int
    #: the device tier is part of the host budget (a CPU device's derived budget under H)
    device_in_host: bool
    #: the device tier's bytes are host memory (a CPU device) outside the host budget
    device_outside_host: int
    #: transients reserved inside the host budget, and those outside it
    transient_reserved: int
    transient_outside: int
    #: the arena would cache every offloaded byte
    cached_all: bool
    #: bytes the arena needs to cache everything
    needed: int

    @property
    def checkpoint_buffer_size(self) -> int:
        """Each of a checkpoint save's write buffers: the save comes between steps, where the
        transients' reserve is free, so its buffers take that reserve (less the margin for small
        allocations), split in CHECKPOINT_WRITE_BUFFERS, between 1 and 16 MiB."""
        reserve = self.transient_reserved + self.transient_outside - HEAP_SLACK
        each = max(reserve, 0) // CHECKPOINT_WRITE_BUFFERS // MIB * MIB
        return max(CHECKPOINT_BUFFER_MIN, min(CHECKPOINT_BUFFER_MAX, each))

    @property
    def checkpoint_write_bytes(self) -> int:
        """All of a checkpoint save's write buffers."""
        return CHECKPOINT_WRITE_BUFFERS * self.checkpoint_buffer_size

    @property
    def host_tier(self) -> int:
        """What the host tier may hold: the host budget less the device tier carved from it."""
        return self.host - (self.device if self.device_in_host else 0)

    def budgets(self) -> dict[str, int]:
        """``stats()['budgets']``."""
        return {
            "device": self.device,
            "host": self.host,
            "arena": self.arena,
            "params": self.params,
            "slot": self.slot,
            "device_in_host": int(self.device_in_host),
            "transient_reserved": self.transient_reserved,
        }

    def static_bound(self, process: int) -> int:
        """The RSS bound without the saved activations."""
        return process + self.host + self.device_outside_host + self.transient_outside

    def heap_line(self, process: int) -> int:
        """The RSS under which freed heap blocks are kept for reuse (``infinity.core.memory.
        HeapWatch``): the bound without the saved activations, less the transients, which come
        on top of whatever the heap keeps, and less a margin: RSS is sampled where the heap
        grows, and may pass the line in between."""
        limit = self.static_bound(process)
        return limit - self.transient_reserved - self.transient_outside - limit // 64

    def heap_reuse_wanted(self, largest: int, cpu_device: bool) -> int:
        """What keeping one step's large temporaries in the heap is expected to add: the device
        tier's copies where they are host memory outside the host budget, and a few gradients
        and autograd temporaries of the largest parameter (``largest`` bytes)."""
        device = self.device if cpu_device and not self.device_in_host else 0
        return device + 4 * largest


def plan_memory(
    config: Any,
    entries: Sequence[ParamEntry],
    shards: Sequence[Shard],
    modules: Modules,
    *,
    slot: int,
    device_kind: str,
    params_stay_on_device: bool,
    master_tier: str,
    trained: Collection[int] | None,
    cuda_free: Callable[[], int] = lambda: 0,
    agree: Callable[[int], int] | None = None,
) -> MemoryPlan:
    """The budgets for ``config`` and these parameters. ``device_kind``: "cpu" (the device is
    host memory), "cuda" (its own memory, ``cuda_free`` bytes free) or "other" (the planner's
    simulation of a device it has no figures for: every parameter fits). ``trained``: the
    indices of the entries the optimizer updates, None without one (inference: backward holds
    no shared parameters, and the transients are no training's; see :func:`transient_bytes`).
    ``agree``: across ranks,
    the minimum of a value over every rank (their device tiers must decide alike)."""
    training = trained is not None
    total = sum(e.nbytes for e in entries)
    device_total = sum(e.device_bytes for e in entries)
    persistent = {
        e.index
        for e in entries
        if params_stay_on_device or e.numel <= config.param_persistence_threshold
    }
    floor = device_floor(modules, persistent, training)
    host_budget: int | None = config.host_budget
    device_in_host = False
    if config.device_budget is not None:
        device = config.device_budget
    elif device_kind == "cuda":
        device = min(device_total, int(cuda_free() * 0.5))
    elif device_kind == "cpu" and not params_stay_on_device and host_budget is not None:
        # The device is host memory: its budget comes out of the host budget's account.
        device = cpu_device_default(
            modules, floor, config.prefetch_depth, device_total, host_budget
        )
        device_in_host = True
    else:
        device = device_total
    if agree is not None and config.device_budget is None:
        device = agree(device)
    if params_stay_on_device:
        if config.device_budget is not None and device < device_total:
            raise BudgetError(
                f"offload_param='none' keeps every parameter on the device "
                f"({device_total} bytes) but device_budget is {device}: raise "
                f"device_budget to at least {device_total}, or set offload_param to 'cpu' "
                f"or 'nvme' so parameters leave the device between uses"
            )
        device = device_total
    elif device < floor.nbytes:
        raise BudgetError(
            f"device_budget of {device} bytes cannot hold module '{floor.module}', whose "
            f"parameters take {floor.module_bytes} bytes and must be on the device together "
            f"while it runs{floor.describe()}: set device_budget to at least {floor.nbytes}"
        )
    params_nvme = master_tier == "nvme"
    optim_nvme = config.offload_optimizer == "nvme"
    resident = 0 if params_nvme else total  # host tensors outside the arena
    carved = device if device_in_host else 0
    widened = config.precision.widened_masters
    params = [s for s in shards if s.kind is ShardKind.PARAM]
    transient = transient_bytes(entries, params, trained, widened, shared_entries(modules))
    needed = 0
    arena = 0
    reserved = 0
    if params_nvme or optim_nvme:
        cost = slot_cost(slot)
        shard_bytes = sum(cost(s.nbytes) for s in shards)
        state_dtype = config.precision.optimizer_state_dtype
        state_bytes = sum(cost(state_part_bytes(s.nbytes, state_dtype, widened)) for s in shards)
        compute_bytes = (
            sum(cost(compute_copy_bytes(s)) for s in shards)
            if compute_copies_kept(config, training, params_nvme)
            else 0
        )
        # What the arena would need to cache everything: masters (and their compute copies),
        # gradients and (estimated: two moments, as Adam keeps) optimizer state, in slot bytes,
        # plus one slot for the gaps that packing small shards into shared slots leaves.
        needed = (
            (shard_bytes + compute_bytes if params_nvme else 0)
            + (shard_bytes + 2 * state_bytes if optim_nvme else 0)
            + slot
        )
        # The swap buffers, or a larger cache of up to max_in_cpu bytes in front of the drives,
        # but never more than caching everything needs.
        pool = max(config.buffer_count * slot, min(config.max_in_cpu, needed))
        if host_budget is None:
            arena = min(pool, needed)
            host_budget = resident + arena
        else:
            staging = activation_staging_bytes(slot) if config.offload_activations == "nvme" else 0
            room = host_budget - resident - carved - staging
            if config.offload_activations == "cpu":
                # The rest of the budget is the activations' (their offload counts them there).
                arena = min(pool, room, needed)
            else:
                # Everything left once the transients have their reserve, but never less than
                # the swap buffers the config asks for, where they fit.
                arena = min(needed, max(min(pool, room), room - transient))
                reserved = max(0, min(transient, room - arena))
        if arena < min(slot, needed):
            what = f" after the CPU device tier's {carved} bytes" if carved else ""
            raise BudgetError(
                f"host_budget of {host_budget} bytes leaves {max(arena, 0)} bytes for swap "
                f"buffers{what}, less than one buffer ({slot} bytes): raise "
                f"host_budget to at least {resident + carved + slot} or lower buffer_size"
            )
    elif host_budget is None:
        host_budget = total
    if resident + carved > host_budget:
        if params_stay_on_device:
            raise BudgetError(
                f"offload_param='none' with offload_optimizer='cpu' keeps every "
                f"parameter's master copy in host memory ({total} bytes) but host_budget "
                f"is {host_budget}: raise host_budget or use offload_optimizer='nvme' "
                f"(the masters go with the optimizer state)"
            )
        extra = f" next to the CPU device tier's {carved} bytes" if carved else ""
        raise BudgetError(
            f"offload_param='cpu' keeps every parameter in host memory ({total} bytes){extra} "
            f"but host_budget is {host_budget}: raise host_budget to at least "
            f"{resident + carved} or use offload_param='nvme'"
        )
    device_outside = device if device_kind == "cpu" and not device_in_host else 0
    return MemoryPlan(
        device=device,
        host=host_budget,
        arena=arena,
        params=total,
        slot=slot,
        device_in_host=device_in_host,
        device_outside_host=device_outside,
        transient_reserved=reserved,
        transient_outside=transient - reserved,
        cached_all=bool(arena) and arena >= needed,
        needed=needed,
    )


# -- updates in backward ---------------------------------------------------------------------------
def update_part_bytes(
    shard: Shard,
    state_on_nvme: bool,
    state_dtype: str = "fp32",
    compute_copies: bool = False,
    widened: bool = False,
) -> list[int]:
    """Bytes of each part an update of ``shard`` in backward needs in the arena: its master,
    its gradient (a parked gradient takes a companion's room), with compute copies the one it
    writes and, with the optimizer state on NVMe, each state companion: as they are once
    made, estimated before that as Adam's two moments as ``state_dtype`` stores them. Counted
    part by part, so that state kept in fewer bytes needs less room."""
    parts = [shard.nbytes, shard.nbytes]
    if compute_copies and compute_copy_bytes(shard):
        parts.append(compute_copy_bytes(shard))
    if state_on_nvme:
        state = [c.nbytes for kind, c in shard.companions.items() if kind.startswith("optim")]
        parts += state or 2 * [state_part_bytes(shard.nbytes, state_dtype, widened)]
    return parts


@dataclasses.dataclass(frozen=True)
class UpdateRoom:
    """Whether the arena has room to update in backward: four of the largest update's parts
    (the update, the reads ahead and the write-backs of the pipeline, and what backward holds)
    and, with the masters on NVMe, the largest module's masters twice over (updated masters are
    dirty when the next forward gathers them)."""

    arena: int
    update: int
    module_masters: int

    @property
    def needed(self) -> int:
        return max(4 * self.update, 2 * self.module_masters)

    @property
    def fits(self) -> bool:
        return self.arena >= self.needed


def update_room(
    arena: int,
    slot: int,
    shards: Iterable[Shard],
    modules: Modules,
    *,
    params_on_nvme: bool,
    state_on_nvme: bool,
    state_dtype: str = "fp32",
    compute_copies: bool = False,
    widened: bool = False,
) -> UpdateRoom:
    cost = slot_cost(slot)
    update = max(
        sum(
            cost(b)
            for b in update_part_bytes(s, state_on_nvme, state_dtype, compute_copies, widened)
        )
        for s in shards
        if s.kind is ShardKind.PARAM
    )
    masters = (
        max(sum(cost(s.nbytes) for e in entries for s in e.shards) for _, entries in modules)
        if params_on_nvme
        else 0
    )
    return UpdateRoom(arena, update, masters)


def update_room_at(
    slot: int,
    entries: Sequence[ParamEntry],
    modules: Modules,
    *,
    params_on_nvme: bool,
    state_parts: int,
    state_dtype: str = "fp32",
    compute_copies: bool = False,
    widened: bool = False,
) -> int:
    """The arena bytes updates in backward need (:class:`UpdateRoom`'s rule) with the
    parameters cut into shards of at most ``slot`` bytes and placed in slots of that size."""
    cost = slot_cost(slot)

    def pieces(nbytes: int) -> list[int]:
        full, rest = divmod(nbytes, slot)
        return [slot] * full + ([rest] if rest else [])

    def update_of(nbytes: int) -> int:
        state = state_parts * cost(state_part_bytes(nbytes, state_dtype, widened))
        compute = cost(nbytes // 2) if compute_copies else 0
        return 2 * cost(nbytes) + state + compute

    update = max(update_of(min(e.nbytes, slot)) for e in entries)
    masters = (
        max(sum(cost(p) for e in module for p in pieces(e.nbytes)) for _, module in modules)
        if params_on_nvme
        else 0
    )
    return max(4 * update, 2 * masters)


def largest_slot_for_updates(
    arena: int,
    entries: Sequence[ParamEntry],
    modules: Modules,
    *,
    params_on_nvme: bool,
    state_parts: int,
    state_dtype: str = "fp32",
    compute_copies: bool = False,
    widened: bool = False,
) -> int | None:
    """The largest power-of-two ``buffer_size`` with which an arena of ``arena`` bytes would
    have room to update in backward, or None below 64 KiB."""
    slot = DEFAULT_BUFFER_SIZE
    while slot >= 64 << 10:
        arena_slots = arena // slot * slot
        needed = update_room_at(
            slot,
            entries,
            modules,
            params_on_nvme=params_on_nvme,
            state_parts=state_parts,
            state_dtype=state_dtype,
            compute_copies=compute_copies,
            widened=widened,
        )
        if arena_slots >= needed:
            return slot
        slot //= 2
    return None


def host_budget_for_updates(
    start: int, plan_at: Callable[[int], MemoryPlan], needed_at: Callable[[int], int]
) -> int:
    """The least host budget from ``start`` up (in steps of what is missing) whose arena has
    room to update in backward: ``plan_at(budget)`` is the plan a budget gets (its derived
    buffer size and device tier included), ``needed_at(slot)`` the rule's bytes at a slot."""
    budget = start
    for _ in range(64):
        try:
            plan = plan_at(budget)
        except BudgetError:
            budget *= 2
            continue
        arena = plan.arena // plan.slot * plan.slot
        needed = needed_at(plan.slot)
        if arena >= needed:
            return budget
        budget += needed - arena + plan.slot
    return budget


def arena_reason(
    room: UpdateRoom,
    plan: MemoryPlan,
    entries: Sequence[ParamEntry],
    modules: Modules,
    *,
    params_on_nvme: bool,
    state_parts: int,
    plan_at: Callable[[int], MemoryPlan] | None,
    state_dtype: str = "fp32",
    compute_copies: bool = False,
    widened: bool = False,
) -> str:
    """Why an arena keeps updates out of backward, and the ways out: the host budget whose
    arena has the room (``plan_at(budget)``: the plan a budget gets, its derived buffer size and
    device tier included; None where the arena does not follow the budget), and the largest
    ``buffer_size`` with which this arena has it."""

    def needed_at(slot: int) -> int:
        return update_room_at(
            slot,
            entries,
            modules,
            params_on_nvme=params_on_nvme,
            state_parts=state_parts,
            state_dtype=state_dtype,
            compute_copies=compute_copies,
            widened=widened,
        )

    ways = []
    if plan_at is not None:
        start = max(plan.host, room.arena) + room.needed - room.arena
        ways.append(f"raise host_budget to >= {host_budget_for_updates(start, plan_at, needed_at)}")
    slot = largest_slot_for_updates(
        room.arena,
        entries,
        modules,
        params_on_nvme=params_on_nvme,
        state_parts=state_parts,
        state_dtype=state_dtype,
        compute_copies=compute_copies,
        widened=widened,
    )
    if slot is not None and slot < plan.slot:
        ways.append(f"set buffer_size <= {slot}")
    return (
        f"the staging arena ({room.arena} bytes in buffers of {plan.slot}) is too small to "
        f"update in backward: it needs {room.needed} bytes, 4 x {room.update} (the largest "
        f"update's parts) and 2 x {room.module_masters} (the largest module's masters): "
        + (" or ".join(ways) or "raise host_budget")
    )


__all__ = [
    "arena_reason",
    "DeviceFloor",
    "host_budget_for_updates",
    "update_room_at",
    "MemoryPlan",
    "UpdateRoom",
    "cpu_device_default",
    "device_floor",
    "largest_slot_for_updates",
    "plan_memory",
    "slot_cost",
    "slot_size",
    "transient_bytes",
    "update_room",
    "working_set",
]
