"""The steps of ``TieredStore.attach`` that decide rather than hold: refusing an optimizer the
store could not wrap, the modules' parameters, the placement's settings, the budgets, what keeps
updates out of backward, and moving every parameter's values into the store."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from infinity.config import OffloadConfig
from infinity.core.attached import AttachedStore
from infinity.core.budgets import MemoryPlan, arena_reason, plan_memory, update_room
from infinity.core.overwrite import write_entry
from infinity.core.placement import Placement, PlacementSettings
from infinity.core.policies import BeladyEviction, LookaheadPrefetch
from infinity.core.shards import ParamEntry, ShardRegistry
from infinity.core.tiers import DeviceTier, HostTier
from infinity.core.timeline import Timeline
from infinity.core.trace import TraceFollower
from infinity.errors import AttachError
from infinity.inference.quantized import WeightQuantization
from infinity.ranks.partition import Partition
from infinity.store import model_init
from infinity.training.gradients import Gradients
from infinity.training.precision import LossScaler
from infinity.training.update_timing import config_reasons
from swap import SwapEngine

log = logging.getLogger("infinity.store")

#: (qualified name, module, the entries of its own parameters), for every module with some
ModuleEntries = list[tuple[str, nn.Module, list[ParamEntry]]]


def check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise AttachError(
            f"attach expects an nn.Module, got {type(model).__name__}: pass "
            f"the model (a torch.nn.Module) and then its optimizer"
        )


def check_buffers(model: nn.Module) -> None:
    """Refuses buffers on the meta device: the store takes over parameters only."""
    for name, buffer in model.named_buffers():
        if buffer.is_meta:
            raise AttachError(
                f"buffer '{name}' is on the meta device: the store takes over parameters, "
                f"not buffers, so it would have no values in forward. Build the model with "
                f"only its parameters on the meta device (accelerate.init_empty_weights(), "
                f"whose default leaves buffers real), or give the buffers values first"
            )


def check_compute_copies(
    config: OffloadConfig, compute_dtype: torch.dtype | None, storage_dtype: torch.dtype
) -> None:
    """Refuses ``precision.storage_dtype`` with an optimizer where the compute copies it keeps
    beside the masters on NVMe could not be what forward and backward compute with."""
    storage = config.precision.storage_dtype
    if compute_dtype != storage_dtype:
        raise AttachError(
            f"precision.storage_dtype={storage!r} with an optimizer keeps a copy of "
            f"each parameter in {storage} beside its master on NVMe for forward and "
            f"backward to compute with, which they do only under precision.dtype="
            f"{storage!r} (it is {config.precision.dtype!r}): set precision.dtype="
            f"{storage!r} too, or leave storage_dtype 'auto'"
        )
    if config.offload_param != "nvme":
        raise AttachError(
            f"precision.storage_dtype={storage!r} with an optimizer keeps a copy of "
            f"each parameter in {storage} beside its master on NVMe, which forward and "
            f"backward read instead (half the bytes), but offload_param="
            f"{config.offload_param!r} keeps no masters on NVMe: set "
            f"offload_param='nvme', or leave storage_dtype 'auto'"
        )


def check_optimizer(model: nn.Module, optimizer: Any) -> None:
    """Refuses an optimizer the store could not wrap, before anything is moved: a wrong
    type, or parameters the model does not have (they would never get gradients)."""
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise AttachError(
            f"attach expects a torch.optim.Optimizer (or None) as optimizer, "
            f"got {type(optimizer).__name__}: build it with "
            f"torch.optim.AdamW(model.parameters(), ...)"
        )
    own = {id(p) for p in model.parameters()}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in own:
                raise AttachError(
                    f"the optimizer's param_groups[{index}] holds a parameter of shape "
                    f"{tuple(param.shape)} that is not part of the attached model: build "
                    f"the optimizer from model.parameters()"
                )


def register_params(
    model: nn.Module,
    registry: ShardRegistry,
    slot: int,
    *,
    compute_dtype: torch.dtype | None,
    storage_dtype: torch.dtype | None,
    partition: Partition | None,
    quantization: WeightQuantization | None,
    frozen: Callable[[nn.Parameter], bool] = lambda _: False,
    frozen_dtype: torch.dtype | None = None,
    master_dtype: torch.dtype = torch.float32,
) -> None:
    """Registers every parameter of ``model`` as shards of at most ``slot`` bytes; those
    ``frozen`` says the optimizer never updates are kept in ``frozen_dtype`` where given (the
    compute copies' dtype: a frozen parameter needs no master beside them)."""
    for name, param in model.named_parameters():
        registry.add_param(
            name,
            param,
            max_shard_bytes=slot,
            compute_dtype=compute_dtype,
            partition=partition,
            storage_dtype=frozen_dtype
            if frozen_dtype is not None and frozen(param)
            else storage_dtype,
            quant=quantization.quantizer_in_slot(name, param, slot) if quantization else None,
            master_dtype=master_dtype,
        )
    if not registry.entries:
        raise AttachError("the model has no parameters to offload")


def frozen_params(optimizer: torch.optim.Optimizer | None) -> Callable[[nn.Parameter], bool]:
    """Which parameters ``optimizer`` never updates: those that require no gradient or are in
    none of its param groups (without an optimizer, none: nothing is trained)."""
    if optimizer is None:
        return lambda _: False
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return lambda param: not param.requires_grad or id(param) not in held


def module_entries(model: nn.Module, registry: ShardRegistry) -> ModuleEntries:
    """Every module with parameters of its own, and their entries."""
    found = []
    for module_name, module in model.named_modules():
        entries = []
        for _, param in module.named_parameters(recurse=False):
            entry = registry.entry_of(param)
            if entry is not None and entry not in entries:
                entries.append(entry)
        if entries:
            found.append((module_name or type(module).__name__, module, entries))
    return found


def trained_entries(
    optimizer: torch.optim.Optimizer | None, registry: ShardRegistry
) -> set[int] | None:
    """The indices of the entries ``optimizer`` updates (None without one)."""
    if optimizer is None:
        return None
    return {
        entry.index
        for group in optimizer.param_groups
        for param in group["params"]
        if param.requires_grad and (entry := registry.entry_of(param)) is not None
    }


def budgets_for(
    config: OffloadConfig,
    registry: ShardRegistry,
    modules: ModuleEntries,
    *,
    slot: int,
    device: torch.device,
    device_kind: str,
    params_stay_on_device: bool,
    master_tier: str,
    trained: set[int] | None,
    agree: Callable[[int], int] | None = None,
) -> MemoryPlan:
    """The budgets (infinity.core.budgets) for ``config`` and the registry's parameters
    (``trained``: the entries the optimizer updates, None without one)."""
    return plan_memory(
        config,
        registry.entries,
        list(registry.shards.values()),
        [(name, entries) for name, _, entries in modules],
        slot=slot,
        device_kind=device_kind,
        params_stay_on_device=params_stay_on_device,
        master_tier=master_tier,
        trained=trained,
        cuda_free=lambda: torch.cuda.mem_get_info(device)[0],
        agree=agree,
    )


def log_budgets(plan: MemoryPlan, config: OffloadConfig) -> None:
    log.info(
        "budgets: device %d bytes%s, host %d bytes (arena %d in slots of %d, transients "
        "%d; params %d bytes)",
        plan.device,
        " (derived, part of the host budget)"
        if plan.device_in_host
        else ("" if config.device_budget is not None else " (derived)"),
        plan.host,
        plan.arena,
        plan.slot,
        plan.transient_reserved,
        plan.params,
    )


def placement_settings(
    config: OffloadConfig,
    registry: ShardRegistry,
    modules: ModuleEntries,
    *,
    master_tier: str,
    params_stay_on_device: bool,
    cached_all: bool,
    scaler: LossScaler | None,
    compute_copy_dtype: torch.dtype | None,
) -> PlacementSettings:
    """What the placement is told for the whole run."""
    return PlacementSettings(
        params_on_nvme=master_tier == "nvme",
        grads_on_nvme=config.offload_optimizer == "nvme",
        module_names=tuple(name for name, _, _ in modules),
        persistent=frozenset(
            e.index
            for e in registry.entries
            if params_stay_on_device or e.numel <= config.param_persistence_threshold
        ),
        prefetch_bytes=config.prefetch_bytes,
        # During the step, the shards about to be evicted are written back ahead of the
        # reads that need their room (Placement.clean_ahead); when the arena caches
        # everything nothing is evicted, and dirty shards are written only at close with
        # keep_swap_files.
        write_behind=not cached_all,
        # Per-shard norms cost a pass over every gradient: only when clipping or overflow
        # checks use them.
        track_grad_norms=scaler is not None or config.gradient_clipping > 0,
        loss_scale=scaler.scale if scaler is not None else 1.0,
        compute_copy_dtype=compute_copy_dtype,
        assemble_ahead_bytes=config.prefetch_bucket_size,
        reshard_after_forward=config.reshard_after_forward,
    )


def make_placement(
    registry: ShardRegistry,
    device: DeviceTier,
    host: HostTier,
    engine: SwapEngine | None,
    follower: TraceFollower,
    settings: PlacementSettings,
    *,
    prefetch_depth: int,
    partition: Partition | None,
    timeline: Timeline,
) -> Placement:
    """The placement over the tiers, with its eviction and prefetch policies and the gradient
    path (training's, which the placement's core layer does not import: made here)."""
    return Placement(
        registry,
        device,
        host,
        engine,
        follower,
        BeladyEviction(),
        LookaheadPrefetch(prefetch_depth, entry_bytes=lambda index: registry.entries[index].nbytes),
        settings,
        make_gradients=lambda slots: Gradients(
            slots,
            registry,
            device,
            host,
            grads_on_nvme=settings.grads_on_nvme,
            track_norms=settings.track_grad_norms,
            loss_scale=settings.loss_scale,
            partition=partition,
            timeline=timeline,
        ),
        partition=partition,
        timeline=timeline,
    )


def updates_kept_in_step(
    config: OffloadConfig,
    registry: ShardRegistry,
    modules: ModuleEntries,
    plan: MemoryPlan,
    *,
    arena: HostTier | None,
    params_on_nvme: bool,
    compute_copies: bool,
    loss_scaling: bool,
    plan_at: Callable[[int], MemoryPlan],
) -> tuple[list[str], bool]:
    """What in the config keeps ``step_in_backward='auto'`` from updating in backward, each
    with the way to lift it; and whether one is the arena's size (a sizing, not a choice).
    ``arena``: the host tier whose arena the swapped updates run in (None: nothing swaps);
    ``plan_at``: the budgets at another host budget."""
    reasons = []
    sizing = False
    if arena is not None:
        # An update in backward needs its master, gradient and (Adam's two) moments in the
        # arena next to what backward holds, and the pipeline's three stages (update, read
        # ahead, write back): room for four of the largest. And masters updated in backward
        # are dirty when the next forward gathers them: a module's dirty masters in use
        # cannot make room for its other shards, so the arena holds the largest module's
        # masters twice over. Below that, updates stay in optimizer.step(), which has the
        # whole arena.
        named = [(name, entries) for name, _, entries in modules]
        state_on_nvme = config.offload_optimizer == "nvme"
        room = update_room(
            arena.arena_bytes,
            arena.slot_size,
            registry.shards.values(),
            named,
            params_on_nvme=params_on_nvme,
            state_on_nvme=state_on_nvme,
            state_dtype=config.precision.optimizer_state_dtype,
            widened=config.precision.widened_masters,
            compute_copies=compute_copies,
        )
        # An arena that caches every offloaded byte keeps every update's parts in it: the
        # pipeline's room is for shards that come and go.
        if not room.fits and not plan.cached_all:
            # Why the arena keeps updates out of backward, and the ways out
            # (infinity.core.budgets: the host budget whose arena has the room, smaller
            # buffers).
            reasons.append(
                arena_reason(
                    room,
                    plan,
                    registry.entries,
                    named,
                    params_on_nvme=params_on_nvme,
                    state_parts=2 if state_on_nvme else 0,
                    # With activations in host memory the arena is the swap buffers, not what
                    # H leaves.
                    plan_at=plan_at if config.offload_activations != "cpu" else None,
                    state_dtype=config.precision.optimizer_state_dtype,
                    widened=config.precision.widened_masters,
                    compute_copies=compute_copies,
                )
            )
            sizing = True
    reasons += config_reasons(config.gradient_clipping, loss_scaling=loss_scaling)
    return reasons, sizing


def initialise_values(store: AttachedStore, model: nn.Module, initialise: bool = True) -> None:
    """Moves every parameter's values into the store and leaves a placeholder behind.

    Parameters on the meta device (a model built under ``torch.device("meta")``) are
    materialised one module at a time with the module's ``reset_parameters()``, so a model
    larger than host memory never exists in memory whole; a model that initialises its modules
    itself (``_init_weights``, as Hugging Face models do) gets that too, replayed in the order
    its constructor runs it (:mod:`infinity.store.model_init`), and peft's LoRA adapters get
    peft's initialisation (A drawn as peft draws it, B zeros). Parameters nothing initialises
    (a module without ``reset_parameters()`` outside such a model), and all of them with
    ``initialise=False``, are left without values, allocating nothing, until a checkpoint load
    writes them (``load_pretrained``, ``load_state_dict``)."""
    placement = store.placement
    assert placement is not None  # made by attach, before this
    registry = store.registry
    device = store.device
    partition = store.partition
    done: set[int] = set()

    def take(entry: ParamEntry) -> None:
        if partition is not None:
            # Every rank starts from rank 0's values, as DistributedDataParallel makes sure.
            with torch.no_grad():
                partition.broadcast(entry.param.data)
        if entry.index in done:
            write_entry(store, entry, entry.param.data)  # re-initialised by a later module
        else:
            placement.initialise(entry, entry.param.data)
            done.add(entry.index)
        placement.adopt(entry, device)

    references: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                references.setdefault(id(param), []).append((module, name))

    def rebound(param: nn.Parameter, real: nn.Parameter) -> ParamEntry:
        entry = registry.entry_of(param)
        assert entry is not None  # every parameter of the model is registered
        owners = references.pop(id(param), [])
        for owner, owner_name in owners:
            owner._parameters[owner_name] = real
        references[id(real)] = owners  # a materialised one may still be left without values
        registry.rebind(entry, real)
        return entry

    def materialise(module: nn.Module, name: str) -> nn.Parameter:
        param = module._parameters[name]
        assert param is not None
        real = nn.Parameter(
            torch.empty(param.shape, dtype=param.dtype), requires_grad=param.requires_grad
        )
        rebound(param, real)
        return real

    def without_values(param: nn.Parameter) -> None:
        # Shape and dtype come from the device tensor adopt() gives it.
        # (On the planner's meta device the placeholder is meta too.)
        real = nn.Parameter(
            torch.empty(0, dtype=param.dtype, device=(device if device.type == "meta" else None)),
            requires_grad=param.requires_grad,
        )
        entry = rebound(param, real)
        placement.adopt(entry, device)
        placement.mark_uninitialised(entry)
        done.add(entry.index)

    def take_param(param: nn.Parameter) -> None:
        entry = registry.entry_of(param)
        assert entry is not None  # every parameter of the model is registered
        take(entry)

    if initialise and model_init.model_init_of(model):
        # The model's own initialisation (_init_weights, a Hugging Face model's), replayed.
        model_init.initialise_as_built(model, materialise, take_param, without_values)
    if initialise:
        # peft's LoRA adapters: peft's own initialisation (B zeros), replayed after the model's.
        model_init.initialise_adapters(model, materialise, take_param)
    for module_name, module in model.named_modules():
        own = [(n, p) for n, p in module._parameters.items() if p is not None]
        if not any(p.is_meta for _, p in own):
            continue
        if not initialise or not callable(getattr(module, "reset_parameters", None)):
            for _, param in own:
                if param.is_meta:
                    without_values(param)
            log.debug(
                "module '%s' (%s): parameters on the meta device left without values "
                "until a checkpoint is loaded",
                module_name,
                type(module).__name__,
            )
            continue
        for name, param in own:
            entry = registry.entry_of(param)
            assert entry is not None  # every parameter of the model is registered
            if param.is_meta:
                materialise(module, name)
            elif entry.index in done:
                param.data = torch.empty(entry.shape, dtype=entry.values_dtype)
        with torch.no_grad():
            module.reset_parameters()
        for param in module._parameters.values():
            if param is not None:
                entry = registry.entry_of(param)
                assert entry is not None  # every parameter of the model is registered
                take(entry)
    for entry in registry.entries:
        if entry.index not in done:
            take(entry)
