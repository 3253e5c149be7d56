"""The tiered store: the public object users create, attach and close.

``attach`` registers every parameter as one or more shards, moves their values into the host tier
(and onto NVMe when parameters are offloaded there), installs the module hooks and wraps the
optimizer. From then on the user's loop runs unchanged; see ``docs/architecture.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, overload

import psutil
import torch
from torch import nn

from infinity.checkpointing.state_dict import install_state_dict_hooks, write_entry
from infinity.config import OffloadConfig
from infinity.core import handback, lifecycle
from infinity.core.budgets import (
    CHECKPOINT_WRITE_BUFFERS,
    MemoryPlan,
    UpdateRoom,
    arena_reason,
    compute_copy_bytes,
    plan_memory,
    slot_size,
    state_part_bytes,
    update_room,
)
from infinity.core.memory import (
    HeapWatch,
    bound_heap_retention,
    host_tensor_bytes,
    huge_page_allocations,
    peak_resident_bytes,
    resident_bytes,
    warm_runtime,
)
from infinity.core.placement import Placement, PlacementSettings
from infinity.core.policies import BeladyEviction, LookaheadPrefetch
from infinity.core.shards import ParamEntry, Shard, ShardRegistry
from infinity.core.streams import device_named
from infinity.core.tiers import DeviceTier, HostTier
from infinity.core.trace import TraceFollower
from infinity.errors import AttachError, CheckpointError, ConfigError
from infinity.inference.quantized import WeightQuantization
from infinity.observability.reporting import MemoryFigures, store_stats
from infinity.observability.saved_activations import SavedActivationMeter
from infinity.observability.timeline import Timeline
from infinity.ranks.ddp_guard import DDPGuard
from infinity.ranks.partition import Partition
from infinity.training.hooks import HookSet
from infinity.training.optimizer import OffloadedOptimizer
from infinity.training.param_access import ParamAccess
from infinity.training.precision import COMPUTE_DTYPES, STORAGE_DTYPES, LossScaler
from infinity.training.stepping import Stepping
from infinity.training.update_timing import UpdateTiming, config_reasons
from swap import IOBackend, SwapEngine, SwapSpaceError, align_up
from swap.files import SwapDirectories

if TYPE_CHECKING:
    from infinity.checkpointing.checkpoint import Checkpointer
    from infinity.inference.kv_cache import OffloadedKVCache
    from infinity.training.activations import ActivationOffload

log = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=nn.Module)


def resolve_device(name: str) -> torch.device:
    """The device ``name`` names, with its index (``cuda`` is ``cuda:N``, N the current device):
    tensors made on it report one, and every comparison with them must see the same device."""
    return device_named(name, torch.cuda.is_available(), torch.cuda.current_device)


class TieredStore:
    """Holds a model's parameters across device, host and NVMe. See the package docstring."""

    def __init__(
        self,
        config: OffloadConfig | None = None,
        *,
        backend_wrapper: Callable[[IOBackend], IOBackend] | None = None,
        engine_overrides: Mapping[str, Any] | None = None,
    ) -> None:
        """``backend_wrapper`` (tests and tools only) wraps the swap engine's I/O backend, e.g.
        in a fault-injecting backend; None costs nothing. ``engine_overrides`` (tests and tools
        only) replaces fields of the engine's ``EngineSettings`` that the config has no key for,
        such as a tiny ``close_timeout`` under injected hangs.

        Threads: the store is driven by one training thread (attach, forward/backward, step,
        state_dict, materialize, close are not thread-safe). ``stats()`` and the timeline's
        ``snapshot``/``summary`` may be called from other threads at any time."""
        if isinstance(config, Mapping):
            config = OffloadConfig.from_dict(config)  # the native JSON format, strictly
        elif config is not None and not isinstance(config, OffloadConfig):
            raise ConfigError(
                f"TieredStore expects an OffloadConfig or a dict of its fields, "
                f"got {type(config).__name__}"
            )
        self.config = config or OffloadConfig()
        self._backend_wrapper = backend_wrapper
        self._engine_overrides = dict(engine_overrides or {})
        self._sample_lock = threading.Lock()  # stats() samples peaks from other threads too
        self.device = resolve_device(self.config.device)
        self.registry = ShardRegistry()
        self.follower = TraceFollower()
        self.placement: Placement | None = None
        #: this rank's share across data-parallel ranks (infinity.ranks.partition); None: one
        #: process
        self.partition: Partition | None = None
        #: saves and loads checkpoints (infinity.checkpointing.checkpoint), made on first use
        self._checkpoints: Checkpointer | None = None
        #: what serves operations on attached parameters outside the hooks (p.grad, reads,
        #: store.gathered)
        self.access: ParamAccess | None = None
        self.engine: SwapEngine | None = None
        #: moves saved activations off the device (offload_activations;
        #: infinity.training.activations)
        self.activations: ActivationOffload | None = None
        #: the engine activations use when nothing else of the model is on NVMe
        self._activation_engine: SwapEngine | None = None
        self.hooks: HookSet | None = None
        self.optimizer: OffloadedOptimizer | None = None
        self.model: nn.Module | None = None
        self.budgets: dict[str, int] = {}
        #: how the store divides its memory, and the terms of the RSS bound (infinity.core.budgets)
        self.memory_plan: MemoryPlan | None = None
        #: the process's RSS at attach without the model's parameters (the bound's fixed part)
        self._process_bytes = 0
        #: the process's peak RSS (VmHWM) when attach returned: a model built whole in host
        #: memory is whole while attach writes it out, a peak training may never reach again
        self._attach_peak = 0
        #: saved activations held in host memory, counted for the bound (a CPU device)
        self.activation_meter: SavedActivationMeter | None = None
        #: the last checkpoint saved (its path, and the steps done then), for close's warning
        self._last_checkpoint: tuple[Path, int] | None = None
        #: close's 'auto' found the parameters too large to give back: (bytes, room, what)
        self._declined_restore: handback.Declined | None = None
        self._temp_dir: Path | None = None
        self._handles: list[Any] = []
        self._nvme_peak = 0
        self._closed = False
        self._host_tier: HostTier | None = None
        self._rss_peak = 0
        precision = self.config.precision
        self.compute_dtype = COMPUTE_DTYPES[precision.dtype]
        self.storage_dtype = STORAGE_DTYPES.get(precision.storage_dtype)
        #: precision.storage_dtype int8/int4: the weights stored quantized (inference)
        self.weight_quantization = WeightQuantization.from_precision(
            precision.storage_dtype, precision.quant_group_size
        )
        #: with an optimizer, storage_dtype is that of the compute copies gathers read, kept
        #: beside the masters on NVMe (infinity.core.placement); None: gathers read the masters
        self._compute_copy_dtype: torch.dtype | None = None
        self.scaler = LossScaler(precision) if precision.dtype == "fp16" else None
        #: transfers, waits and compute spans, recorded while ``timeline.enabled``
        self.timeline = Timeline()
        #: the optimizer step and updates in backward, and what the loop does around them
        self.stepping = Stepping(self)
        #: where optimizer updates run (step_in_backward), once an optimizer is attached
        self.update_timing: UpdateTiming | None = None
        #: with a host budget: RSS kept under the budgets' line while heap blocks are reused
        self._heap_watch: HeapWatch | None = None
        self._bounded_base = 0  # RSS besides the tiers in the first step (0: not seen)
        #: overlap the step's reads, updates and writes (False: one after another, which only
        #: benchmarks want, to show what the pipeline saves)
        self.pipeline_step = True
        if self.config.host_budget is not None:
            # Before the model's first CPU tensors where the caller made the store first: torch
            # reads the setting once (infinity.core.memory).
            huge_page_allocations()

    # -- what the step counted ----------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Optimizer steps taken (a skipped fp16 step does not count)."""
        return self.stepping.steps

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps fp16 loss scaling skipped (gradients that overflowed)."""
        return self.stepping.skipped_steps

    @property
    def last_grad_norm(self) -> float:
        """The global gradient norm of the last step; computed only where something needs it
        (gradient_clipping, fp16 overflow checks), NaN otherwise."""
        return self.stepping.last_grad_norm

    @property
    def temp_dir(self) -> Path | None:
        """The temporary directory swapped to when ``nvme_path`` is not set (None otherwise)."""
        return self._temp_dir

    @property
    def last_checkpoint(self) -> dict[str, float]:
        """Figures (seconds, bytes) of the last checkpoint saved or loaded; empty before."""
        return dict(self._checkpoints.last) if self._checkpoints is not None else {}

    @property
    def master_tier(self) -> str:
        """Where the parameters' master copies live between steps. ``offload_param='none'``
        with an offloaded optimizer (ZeRO-Offload) keeps every parameter on the device and
        its master with the optimizer state; so does mixed precision with nothing offloaded."""
        config = self.config
        if config.offload_param != "none":
            return config.offload_param
        return "nvme" if config.offload_optimizer == "nvme" else "cpu"

    @property
    def _params_stay_on_device(self) -> bool:
        """Every parameter whole on the device between uses: ``offload_param='none'``, except
        under ZeRO stage 3 across ranks, where the device holds a module's gathered copy only
        while it runs."""
        partition = self.partition
        return self.config.offload_param == "none" and (partition is None or partition.stage < 3)

    # -- attach -------------------------------------------------------------------------------
    @overload
    def attach(
        self,
        model: ModelT,
        optimizer: None = None,
        *,
        initialise: bool = True,
        process_group: Any = None,
    ) -> tuple[ModelT, None]: ...

    @overload
    def attach(
        self,
        model: ModelT,
        optimizer: torch.optim.Optimizer,
        *,
        initialise: bool = True,
        process_group: Any = None,
    ) -> tuple[ModelT, torch.optim.Optimizer]: ...

    def attach(
        self,
        model: ModelT,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        initialise: bool = True,
        process_group: Any = None,
    ) -> tuple[ModelT, torch.optim.Optimizer | None]:
        """Takes over ``model``'s parameters (and wraps ``optimizer``). Parameters on the meta
        device are initialised module by module with ``reset_parameters()``; with
        ``initialise=False`` (their values will come from ``load_pretrained`` or
        ``load_state_dict``) none is, and nothing is allocated or written for them until then.

        Under torch.distributed with several ranks (``process_group``, default the whole world)
        the training state is partitioned across the ranks as ZeRO stage ``config.zero_stage``
        does (see :mod:`infinity.ranks.partition`); every rank must call ``attach`` with the same
        model and config. Initial values are rank 0's."""
        if self._closed:
            raise AttachError("this store is closed; create a new TieredStore")
        if self.model is not None:
            raise AttachError("this store is already attached to a model; use one store per model")
        if not isinstance(model, nn.Module):
            raise AttachError(
                f"attach expects an nn.Module, got {type(model).__name__}: pass "
                f"the model (a torch.nn.Module) and then its optimizer"
            )
        self._check_optimizer(model, optimizer)
        storage = self.config.precision.storage_dtype
        if self.storage_dtype is not None and optimizer is not None:
            # Training: the masters keep their precision for the updates, and a compute copy
            # in storage_dtype beside each on NVMe is what gathers read.
            if self.compute_dtype != self.storage_dtype:
                raise AttachError(
                    f"precision.storage_dtype={storage!r} with an optimizer keeps a copy of "
                    f"each parameter in {storage} beside its master on NVMe for forward and "
                    f"backward to compute with, which they do only under precision.dtype="
                    f"{storage!r} (it is {self.config.precision.dtype!r}): set precision.dtype="
                    f"{storage!r} too, or leave storage_dtype 'auto'"
                )
            if self.config.offload_param != "nvme":
                raise AttachError(
                    f"precision.storage_dtype={storage!r} with an optimizer keeps a copy of "
                    f"each parameter in {storage} beside its master on NVMe, which forward and "
                    f"backward read instead (half the bytes), but offload_param="
                    f"{self.config.offload_param!r} keeps no masters on NVMe: set "
                    f"offload_param='nvme', or leave storage_dtype 'auto'"
                )
            self._compute_copy_dtype = self.storage_dtype
            self.storage_dtype = None  # the masters stay as they are
        self.partition = Partition.join(process_group, self.config, self.device)
        if self.weight_quantization is not None:
            self.weight_quantization.check_attach(
                training=optimizer is not None,
                offload_param=self.config.offload_param,
                partitioned=self.partition is not None,
                slot_bytes=slot_size(self.config),
            )
        for name, buffer in model.named_buffers():
            if buffer.is_meta:
                raise AttachError(
                    f"buffer '{name}' is on the meta device: the store takes over parameters, "
                    f"not buffers, so it would have no values in forward. Build the model with "
                    f"only its parameters on the meta device (accelerate.init_empty_weights(), "
                    f"whose default leaves buffers real), or give the buffers values first"
                )
        config = self.config
        if (
            config.offload_param == "none"
            and config.offload_optimizer == "none"
            and self.compute_dtype is None
            and self.storage_dtype is None
            and self.partition is None
        ):
            log.info(
                "offload_param and offload_optimizer are 'none' and precision is fp32: "
                "parameters and optimizer stay on %s and the store only reports",
                self.device,
            )
            self.model = model.to(self.device)
            if config.offload_activations != "none":
                lifecycle.register(self, model)  # swap files may exist from here on
                try:
                    self._attach_activations(model)
                except BaseException:
                    self._teardown(restore=False)
                    raise
            return model, optimizer
        if config.buffer_count == 1 and "nvme" in (config.offload_param, config.offload_optimizer):
            log.warning(
                "buffer_count=1: every swap transfer waits for the one buffer, so NVMe "
                "I/O is serialised with compute; use buffer_count >= 2 to overlap them"
            )
        # Claims the model (refused if another store holds it) and arms the SIGTERM/exit
        # cleanup before the first swap file can exist; _teardown disarms it.
        lifecycle.register(self, model)
        try:
            self._attach(model, optimizer, initialise)
        except BaseException:
            self._teardown(restore=True)
            raise
        self._attach_peak = peak_resident_bytes()
        # The user's optimizer, wrapped (an OffloadedOptimizer is a torch Optimizer); None when
        # none was given.
        return model, self.optimizer if optimizer is not None else None

    @staticmethod
    def _check_optimizer(model: nn.Module, optimizer: Any) -> None:
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

    def _attach(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, initialise: bool = True
    ) -> None:
        config = self.config
        nvme = self.master_tier == "nvme" or config.offload_optimizer == "nvme"
        if config.host_budget is not None:
            # An explicit host budget asks for bounded memory: freed temporaries must go back to
            # the system (costs page faults on large allocations; see infinity.core.memory).
            bound_heap_retention()
            warm_runtime()  # its memory is the process's own, measured next
        # The process without the model: what stays when the store holds the parameters.
        model_bytes = sum(
            p.numel() * p.element_size()
            for p in model.parameters()
            if p.device.type == "cpu" and not p.is_meta
        )
        self._process_bytes = process_bytes = max(resident_bytes() - model_bytes, 0)
        slot = slot_size(config)
        if self.partition is not None and config.buffer_size is None:
            slot = self.partition.min_across(slot)  # the shards must be cut alike on every rank
        quantization = self.weight_quantization
        for name, param in model.named_parameters():
            self.registry.add_param(
                name,
                param,
                max_shard_bytes=slot,
                compute_dtype=self.compute_dtype,
                partition=self.partition,
                storage_dtype=self.storage_dtype,
                quant=quantization.quantizer_in_slot(name, param, slot) if quantization else None,
            )
        if not self.registry.entries:
            raise AttachError("the model has no parameters to offload")
        if self.partition is not None:
            self.partition.check_same_model(self.registry.entries, config)
        module_entries = []
        for module_name, module in model.named_modules():
            entries = []
            for _, param in module.named_parameters(recurse=False):
                entry = self.registry.entry_of(param)
                if entry is not None and entry not in entries:
                    entries.append(entry)
            if entries:
                module_entries.append((module_name or type(module).__name__, module, entries))
        total = sum(e.nbytes for e in self.registry.entries)
        trained = (
            None
            if optimizer is None
            else {
                entry.index
                for group in optimizer.param_groups
                for param in group["params"]
                if param.requires_grad and (entry := self.registry.entry_of(param)) is not None
            }
        )
        self._plan_memory(module_entries, slot, trained)
        self.model = model
        device_tier, self._host_tier = self._make_tiers()
        if nvme:
            self.engine = self._open_engine()
        settings = PlacementSettings(
            params_on_nvme=self.master_tier == "nvme",
            grads_on_nvme=config.offload_optimizer == "nvme",
            module_names=tuple(name for name, _, _ in module_entries),
            persistent=frozenset(
                e.index
                for e in self.registry.entries
                if self._params_stay_on_device or e.numel <= config.param_persistence_threshold
            ),
            prefetch_bytes=config.prefetch_bytes,
            # During the step, the shards about to be evicted are written back ahead of the
            # reads that need their room (Placement.clean_ahead); when the arena caches
            # everything nothing is evicted, and dirty shards are written only at close with
            # keep_swap_files.
            write_behind=not self._cached_all,
            # Per-shard norms cost a pass over every gradient: only when clipping or overflow
            # checks use them.
            track_grad_norms=self.scaler is not None or config.gradient_clipping > 0,
            loss_scale=self.scaler.scale if self.scaler is not None else 1.0,
            compute_copy_dtype=self._compute_copy_dtype,
            assemble_ahead_bytes=config.prefetch_bucket_size,
            reshard_after_forward=config.reshard_after_forward,
        )
        if self.partition is not None:
            # Which shards travel together in collectives, the same on every rank.
            self.partition.plan(
                self.registry.entries,
                [entries for _, _, entries in module_entries],
                settings.persistent,
                config,
                self.budgets["device"],
            )
        self.placement = Placement(
            self.registry,
            device_tier,
            self._host_tier,
            self.engine,
            self.follower,
            BeladyEviction(),
            LookaheadPrefetch(config.prefetch_depth),
            settings,
            partition=self.partition,
            timeline=self.timeline,
        )
        started = time.perf_counter()
        self._initialise(model, initialise)
        log.info(
            "attached %d parameters (%d shards, %.1f MB) in %.2f s: params on %s, "
            "device budget %d, host budget %d",
            len(self.registry.entries),
            len(self.registry.shards),
            total / 1e6,
            time.perf_counter() - started,
            "the device (masters on " + self.master_tier + ")"
            if self._params_stay_on_device
            else config.offload_param,
            self.budgets["device"],
            self.budgets["host"],
        )
        plan = self.memory_plan
        assert plan is not None
        if config.host_budget is not None:
            limit = plan.static_bound(process_bytes)
            self._heap_watch = HeapWatch(plan.heap_line(process_bytes))
            log.info(
                "RSS bound %d bytes: process %d + host_budget %d + device outside it %d + "
                "transients outside it %d, plus saved activations (measured: "
                "stats()['rss_bound']); heap reuse after the first step while RSS < %d",
                limit,
                process_bytes,
                plan.host,
                plan.device_outside_host,
                plan.transient_outside,
                self._heap_watch.limit,
            )
        self.hooks = HookSet(self, model, [(m, e) for _, m, e in module_entries])
        self.hooks.install()
        if self.scaler is not None:
            self._handles.append(self.scaler.install(model))
        self._handles += install_state_dict_hooks(self, model)
        self._handles.append(DDPGuard(model))  # an error, not a crash, if DDP wraps it
        if optimizer is not None:
            self.optimizer = OffloadedOptimizer.wrap(self, optimizer)
            reasons, sizing = self._against_updates_in_backward(module_entries)
            self.update_timing = UpdateTiming(
                config.step_in_backward, reasons, self.placement, warn=sizing
            )
        # Last: from here on every operation on a parameter goes through the store.
        self.access = ParamAccess(self)
        self.access.install()
        self._attach_activations(model)  # its hooks run after the store's, which gather
        if self.activations is None and self.device.type == "cpu":
            # Saved activations are host memory outside the budgets here: counted for the bound.
            placement = self.placement
            self.activation_meter = SavedActivationMeter(
                lambda a: placement.device.holds_address(a) or placement.host.holds_address(a),
                self.access.saved,
            )
            self.activation_meter.install(model)

    def _against_updates_in_backward(self, module_entries: list) -> tuple[list[str], bool]:
        """What in the config keeps ``step_in_backward='auto'`` from updating in backward, each
        with the way to lift it; and whether one is the arena's size (a sizing, not a choice)."""
        config = self.config
        reasons = []
        sizing = False
        if self.engine is not None:
            # An update in backward needs its master, gradient and (Adam's two) moments in the
            # arena next to what backward holds, and the pipeline's three stages (update, read
            # ahead, write back): room for four of the largest. And masters updated in backward
            # are dirty when the next forward gathers them: a module's dirty masters in use
            # cannot make room for its other shards, so the arena holds the largest module's
            # masters twice over. Below that, updates stay in optimizer.step(), which has the
            # whole arena.
            host, placement = self._host_tier, self.placement
            assert host is not None and placement is not None  # made by attach, before this
            modules = [(name, entries) for name, _, entries in module_entries]
            params_on_nvme = placement.params_on_nvme
            state_on_nvme = config.offload_optimizer == "nvme"
            room = update_room(
                host.arena_bytes,
                host.slot_size,
                self.registry.shards.values(),
                modules,
                params_on_nvme=params_on_nvme,
                state_on_nvme=state_on_nvme,
                state_dtype=config.precision.optimizer_state_dtype,
                compute_copies=self._compute_copy_dtype is not None,
            )
            # An arena that caches every offloaded byte keeps every update's parts in it: the
            # pipeline's room is for shards that come and go.
            cached_all = self.memory_plan is not None and self.memory_plan.cached_all
            if not room.fits and not cached_all:
                reasons.append(self._arena_too_small(room, modules, params_on_nvme, state_on_nvme))
                sizing = True
        reasons += config_reasons(config.gradient_clipping, loss_scaling=self.scaler is not None)
        return reasons, sizing

    def _arena_too_small(
        self, room: UpdateRoom, modules: list, params_on_nvme: bool, state_on_nvme: bool
    ) -> str:
        """Why the arena keeps updates out of backward, and the ways out (infinity.core.budgets:
        the host budget whose arena has the room, smaller buffers)."""
        plan = self.memory_plan
        assert plan is not None
        config = self.config
        shards = list(self.registry.shards.values())

        def plan_at(host_budget: int) -> MemoryPlan:
            changed = config.replace(host_budget=host_budget)
            return plan_memory(
                changed,
                self.registry.entries,
                shards,
                modules,
                slot=slot_size(changed),
                device_kind=self._device_kind(),
                params_stay_on_device=self._params_stay_on_device,
                master_tier=self.master_tier,
                training=True,
                cuda_free=lambda: torch.cuda.mem_get_info(self.device)[0],
            )

        return arena_reason(
            room,
            plan,
            self.registry.entries,
            modules,
            params_on_nvme=params_on_nvme,
            state_parts=2 if state_on_nvme else 0,
            # With activations in host memory the arena is the swap buffers, not what H leaves.
            plan_at=plan_at if config.offload_activations != "cpu" else None,
            state_dtype=config.precision.optimizer_state_dtype,
            compute_copies=self._compute_copy_dtype is not None,
        )

    def _attach_activations(self, model: nn.Module) -> None:
        """Creates the activation offload (``offload_activations``) and hooks it on ``model``."""
        if self.config.offload_activations != "none":
            from infinity.training.activations import offload_for_store

            engine = self.engine
            if self.config.offload_activations == "nvme" and engine is None:
                # Its own engine: the store's decides how the optimizer steps (stepping.py).
                engine = self._activation_engine = self._open_engine()
            self.activations = offload_for_store(self, model, engine)

    def _make_tiers(self) -> tuple[DeviceTier, HostTier]:
        """The device and host tiers under the budgets (the planner's simulation makes its own,
        holding no bytes)."""
        plan = self.memory_plan
        assert plan is not None
        return (
            DeviceTier(self.device, plan.device, copies=len(self.registry.entries)),
            HostTier(plan.host_tier, plan.arena, self.config.pin_memory, slot_size=plan.slot),
        )

    def _device_kind(self) -> str:
        """What the device's budget is derived from: "cpu" (host memory), "cuda" (its own
        memory) or "other" (every parameter fits); the planner's simulation says what it
        simulates."""
        return self.device.type if self.device.type in ("cpu", "cuda") else "other"

    def _initialise(self, model: nn.Module, initialise: bool = True) -> None:
        """Moves every parameter's values into the store and leaves a placeholder behind.

        Parameters on the meta device (a model built under ``torch.device("meta")``) are
        materialised one module at a time with the module's ``reset_parameters()``, so a model
        larger than host memory never exists in memory whole. Those of a module without one
        (``LlamaRMSNorm``) are left without values, allocating nothing, until a checkpoint load
        writes them (``load_pretrained``, ``load_state_dict``)."""
        placement = self.placement
        assert placement is not None  # made by attach, before this
        registry = self.registry
        done: set[int] = set()

        def take(entry: ParamEntry) -> None:
            if self.partition is not None:
                # Every rank starts from rank 0's values, as DistributedDataParallel makes sure.
                with torch.no_grad():
                    self.partition.broadcast(entry.param.data)
            if entry.index in done:
                write_entry(self, entry, entry.param.data)  # re-initialised by a later module
            else:
                placement.initialise(entry, entry.param.data)
                done.add(entry.index)
            placement.adopt(entry, self.device)

        references: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None and param.is_meta:
                    references.setdefault(id(param), []).append((module, name))
        for module_name, module in model.named_modules():
            own = [(n, p) for n, p in module._parameters.items() if p is not None]
            if not any(p.is_meta for _, p in own):
                continue
            if not initialise or not callable(getattr(module, "reset_parameters", None)):
                for _, param in own:
                    if param.is_meta:
                        entry = registry.entry_of(param)
                        assert entry is not None  # every parameter of the model is registered
                        # Shape and dtype come from the device tensor adopt() gives it.
                        # (On the planner's meta device the placeholder is meta too.)
                        real = nn.Parameter(
                            torch.empty(
                                0,
                                dtype=param.dtype,
                                device=(self.device if self.device.type == "meta" else None),
                            ),
                            requires_grad=param.requires_grad,
                        )
                        for owner, owner_name in references.pop(id(param), []):
                            owner._parameters[owner_name] = real
                        registry.rebind(entry, real)
                        placement.adopt(entry, self.device)
                        placement.mark_uninitialised(entry)
                        done.add(entry.index)
                log.debug(
                    "module '%s' (%s): parameters on the meta device left without values "
                    "until a checkpoint is loaded",
                    module_name,
                    type(module).__name__,
                )
                continue
            for _, param in own:
                entry = registry.entry_of(param)
                assert entry is not None  # every parameter of the model is registered
                if param.is_meta:
                    real = nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype),
                        requires_grad=param.requires_grad,
                    )
                    for owner, owner_name in references.pop(id(param), []):
                        owner._parameters[owner_name] = real
                    registry.rebind(entry, real)
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

    def _plan_memory(self, module_entries: list, slot: int, trained: set[int] | None) -> None:
        """The budgets (infinity.core.budgets), logged. ``trained``: the indices of the entries
        the optimizer updates (None without one)."""
        config = self.config
        plan = plan_memory(
            config,
            self.registry.entries,
            list(self.registry.shards.values()),
            [(name, entries) for name, _, entries in module_entries],
            slot=slot,
            device_kind=self._device_kind(),
            params_stay_on_device=self._params_stay_on_device,
            master_tier=self.master_tier,
            training=trained is not None,
            trained=trained,
            cuda_free=lambda: torch.cuda.mem_get_info(self.device)[0],
            agree=self.partition.min_across if self.partition is not None else None,
        )
        self.memory_plan = plan
        self.budgets = plan.budgets()
        #: the arena holds every offloaded byte: updated shards may stay dirty until evicted
        self._cached_all = plan.cached_all
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

    def _open_engine(self) -> SwapEngine:
        config = self.config
        given: list[Path] = list(config.nvme_path)
        if not given:
            self._temp_dir = Path(tempfile.mkdtemp(prefix="infinity-nvme-"))
            given = [self._temp_dir]
            log.info("nvme_path not set: swapping to the temporary directory %s", self._temp_dir)
        # Unusable directories (missing, a file, read-only) are named as such before the
        # free-space preflight, which would otherwise misreport them as full; the engine
        # checks them no more.
        paths = list(SwapDirectories.check(given).paths)
        label = ""
        if self.partition is not None:
            paths = self.partition.drives(paths)
            label = f"rank{self.partition.rank}-"
        stripe = config.aio.block_size
        shards = self.registry.shards.values()
        shard_bytes = sum(align_up(s.nbytes) for s in shards)
        state_dtype = config.precision.optimizer_state_dtype
        state_bytes = sum(align_up(state_part_bytes(s.nbytes, state_dtype)) for s in shards)
        compute_bytes = (
            sum(align_up(max(compute_copy_bytes(s), 1)) for s in shards)
            if self._compute_copy_dtype is not None
            else 0
        )
        # Masters (and their compute copies); gradients and (as Adam keeps) two moments of
        # optimizer state.
        needed = (shard_bytes + compute_bytes if self.master_tier == "nvme" else 0) + (
            shard_bytes + 2 * state_bytes if config.offload_optimizer == "nvme" else 0
        )
        per_drive = needed // len(paths) + stripe * 2 + len(self.registry.shards) * 4096
        for path in paths:
            if path.is_dir():
                free = shutil.disk_usage(path).free
                if free < per_drive:
                    raise SwapSpaceError(
                        f"nvme_path {path} has {free} bytes free but the offloaded state needs "
                        f"{per_drive} bytes there: free space, add directories to nvme_path, or "
                        f"offload less",
                        path=path,
                        needed=per_drive,
                        available=free,
                    )
        settings = config.aio.engine_settings(
            file_size=align_up(per_drive), verify_checksums=config.verify_checksums
        )
        if self._engine_overrides:
            settings = dataclasses.replace(settings, **self._engine_overrides)
        return SwapEngine(
            SwapDirectories(tuple(paths)),  # this rank's share of the directories checked above
            settings,
            keep_files=config.keep_swap_files,
            backend_wrapper=self._backend_wrapper,
            label=label,
        )

    # -- parameters outside forward ---------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(
        self, params: Iterable[torch.Tensor] | None = None, modify: bool = False
    ) -> Iterator[None]:
        """Holds ``params`` (default: every attached parameter; any iterable, such as one
        module's ``.parameters()``) on the device with their real values for the block. With
        ``modify=True`` the block may write them in place (``nn.init``, ``copy_``, ``p.data =
        ...``): on exit what changed is written back to the masters and NVMe, and the
        optimizer's state is kept. Outside such a block, reads of a parameter work as they are
        and in-place writes raise :class:`~infinity.errors.ParameterAccessError`.
        Tensors taken from the parameters inside (views) are valid only inside."""
        if self._closed:
            raise AttachError("this store is closed; create a new TieredStore")
        if self.model is None:
            raise AttachError("store.gathered() needs an attached model: call attach() first")
        if self.access is None:  # attach handed the model back untouched: plain parameters
            yield
            return
        with self.access.gathered(params, modify):
            yield

    def load_pretrained(self, path: str | Path) -> Any:
        """Streams Hugging Face safetensors weights (a file, or a directory with
        ``model.safetensors`` or ``model.safetensors.index.json``) into the attached model's
        parameters, one shard at a time, never the whole model in memory; keys are the model's
        own names. Returns ``(missing_keys, unexpected_keys)`` as ``load_state_dict`` does.
        See :mod:`infinity.checkpointing.pretrained`."""
        if self.model is None or self.placement is None:
            raise AttachError("load_pretrained() needs an attached model: call attach() first")
        from infinity.checkpointing.pretrained import load_pretrained

        return load_pretrained(self, Path(path))

    def kv_cache(
        self, target: str = "host", budget: int | str | None = None, **options: Any
    ) -> OffloadedKVCache:
        """A KV cache for ``model.generate(..., cache=...)`` whose layers wait in host RAM
        (``target='host'``) or on NVMe (``'nvme'``) and come back one layer ahead of use, on
        this store's device, within ``budget`` bytes there (default: a quarter of the device
        budget). ``nvme`` swaps under this store's nvme_path (or ``nvme_path=``) with its aio
        settings; ``options`` are the other :class:`~infinity.inference.KVOffloadConfig`
        fields. One per ``generate`` call; close it after. See :mod:`infinity.inference`."""
        from infinity.inference import KVOffloadConfig, offloaded_kv_cache

        settings: dict[str, Any] = {"aio": self.config.aio}
        settings["verify_checksums"] = self.config.verify_checksums
        if target == "nvme":
            paths = self.config.nvme_path or ((self.temp_dir,) if self.temp_dir else ())
            if paths:
                settings["nvme_path"] = paths[0]
        if budget is None and self.budgets.get("device"):
            budget = self.budgets["device"] // 4
        if budget is not None:
            settings["budget"] = budget
        settings.update(options, target=target)
        return offloaded_kv_cache(KVOffloadConfig.from_dict(settings), device=self.device)

    def save_checkpoint(
        self, path: str | Path, extra: Any = None, async_save: bool = False
    ) -> None:
        """Saves the training state (masters, optimizer state, loss scaler, step counts, RNG states
        and ``extra``: anything JSON-able or small tensors, such as a scheduler's state_dict and the
        data position) to the directory ``path``, on every rank together, shard by shard (see
        :mod:`infinity.checkpointing.checkpoint`). A crash during the save leaves the previous
        checkpoint at ``path`` intact. With ``async_save`` the call returns once the save has
        started and training goes on; the checkpoint is still exactly the state at the call (what a
        step would change is copied out first): see :mod:`infinity.checkpointing.async_save`."""
        self.stepping.loop_acted("save_checkpoint()")
        if self._heap_watch is not None:
            plan = self.memory_plan
            assert plan is not None  # attached (checked by _checkpointer)
            self._heap_watch.make_room(CHECKPOINT_WRITE_BUFFERS * plan.checkpoint_buffer_size)
        self._checkpointer("save_checkpoint").save(Path(path), extra, async_save)
        self._last_checkpoint = (Path(path), self.steps)

    def wait_for_checkpoint(self) -> None:
        """Completes a save started with ``async_save=True`` (copying out what is left of the
        state at its call), raising its failure. The next save, a load and ``close()`` wait
        for it too."""
        if self._checkpoints is not None:
            self._checkpoints.wait()

    def before_state_change(self, shards: Iterable[Shard]) -> None:
        """Called (by the step, state dict and checkpoint loads) before masters or optimizer
        state of ``shards`` change: an asynchronous save copies what it has not written yet."""
        if self._checkpoints is not None:
            self._checkpoints.before_change(shards)

    def checkpoint_progress(self) -> None:
        """Called at each module's forward: an asynchronous save moves on."""
        if self._checkpoints is not None:
            self._checkpoints.progress()

    def load_checkpoint(self, path: str | Path) -> Any:
        """Restores what :meth:`save_checkpoint` wrote (after ``attach``, on every rank
        together; any number of ranks, whatever the saving run had) and returns its
        ``extra``."""
        if path is None:
            raise CheckpointError(
                "load_checkpoint(None): no checkpoint given. latest_checkpoint() returns None "
                "when its directory holds no complete checkpoint (the first start of a job): "
                "load only when it found one (if latest is not None: ...)"
            )
        return self._checkpointer("load_checkpoint").load(Path(path))

    @staticmethod
    def latest_checkpoint(directory: str | Path) -> Path | None:
        """The newest complete checkpoint directly under ``directory`` (the one a restarted job
        resumes from): a checkpoint :meth:`save_checkpoint` finished, every rank's files and
        the metadata written, with the most steps done. Saves that did not finish (a rank
        killed during one leaves ``<path>.partial``) and incomplete directories are passed
        over, each logged with the reason. None when there is none: ``directory`` missing,
        empty, or holding only unfinished saves (the first start of a job). Raises
        CheckpointError when ``directory`` is a file, a checkpoint itself, or unreadable.
        Under torch.distributed, rank 0 decides for all: call it on every rank. See
        :mod:`infinity.checkpointing.latest`."""
        from infinity.checkpointing.latest import latest_checkpoint

        return latest_checkpoint(Path(directory))

    def _checkpointer(self, what: str) -> Any:
        if self._closed:
            raise AttachError("this store is closed; create a new TieredStore")
        if self.model is None or self.placement is None:
            raise AttachError(
                f"{what}() needs a model attached with something offloaded: call "
                f"attach() first (a store that only reports leaves the model as "
                f"it is: checkpoint it with torch.distributed.checkpoint)"
            )
        if self.weight_quantization is not None:
            raise CheckpointError(
                f"{what}() saves and restores training state, and weights stored quantized "
                f"(precision.storage_dtype={self.weight_quantization.kind!r}) are for inference: "
                f"load them with load_pretrained() or load_state_dict(); model.state_dict() "
                f"gives their decoded values"
            )
        if self._checkpoints is None:
            from infinity.checkpointing.checkpoint import Checkpointer

            self._checkpoints = Checkpointer(self)
        return self._checkpoints

    def predict(
        self, disk: Any = None, device: Any = None, contention: Any = None, **overrides: Any
    ) -> dict[str, Any]:
        """What this model's iteration would cost with the config's fields replaced by ``overrides``
        (``host_budget``, ``device_budget``, ``buffer_count``, ``buffer_size``, ``prefetch_depth``,
        ``offload_param``, ``offload_optimizer``, ``precision``, ...), on ``disk`` (an
        :class:`infinity.planning.planner.DiskProfile`; default: this run's disk as its engine saw
        it) and ``device`` (a :class:`~infinity.planning.planner.DeviceProfile` or a preset's
        name, such as ``"H100"``; default this machine) and ``contention`` (an
        :class:`~infinity.planning.simulated_time.Contention`:
        how compute and the disk slow each other here, as measured; default: not at all, and
        the result's ``contention`` says it was not measured). Needs two recorded
        iterations. Returns ``step_seconds`` (the mean of the replayed iterations) with
        ``step_seconds_spread`` (their fastest and slowest),
        ``phase_seconds`` (forward, backward, step), ``bytes_read``/``bytes_written`` per
        iteration, ``resource_seconds`` (compute, the optimizer, copies, the disk) and ``bound``
        (the busiest of them), ``peak_bytes`` per tier, ``rss_peak_bytes``, ``stall_seconds``,
        ``update_mode`` and ``update_mode_reasons`` (where the updates would run, as
        ``stats()`` says: decided by the config's own reasons and by what this run's loop did
        between backward and ``optimizer.step()``), ``heap`` (whether the candidate's heap
        would keep freed blocks for reuse, and the seconds its temporaries' page faults add
        where this run's heap did and the candidate's would not) and ``fits`` (False with the
        ``error`` that attach or the first gather would raise). Runs the store's own placement
        over tensors that hold no bytes: see :mod:`infinity.planning.planner`."""
        from infinity.planning.planner import predict
        from infinity.planning.profiles import device_profile

        if isinstance(device, str):  # a preset's name: "H100", "this machine", ...
            device = device_profile(device)
        return predict(self, overrides, disk=disk, device=device, contention=contention)

    # -- called by the step and the hooks ---------------------------------------------------------
    def after_step(self, optimizer: OffloadedOptimizer, first: bool) -> None:
        """Called when ``optimizer.step()`` has updated the shards (``first``: the first
        step)."""
        if first and self._heap_watch is not None:
            # From now on every step allocates the same sizes: reuse freed blocks instead of
            # faulting fresh mappings, for as long as RSS stays under the line.
            # Expected to stay in the heap: the device tier's copies (host memory without a
            # GPU) and a few gradients and autograd temporaries of the largest parameter.
            largest = max(e.nbytes for e in self.registry.entries)
            plan = self.memory_plan
            assert plan is not None  # made by attach
            # The process besides its tiers with the heap bounded, as the first step saw it:
            # what a prediction for a budget that leaves no room for reuse starts from.
            placement = self.placement
            assert placement is not None  # made by attach
            tiers = placement.host.usage.peak + (
                placement.device.usage.peak if self.device.type == "cpu" else 0
            )
            self._bounded_base = max(0, self._heap_watch.seen_peak - tiers)
            # Host memory the user keeps outside the tiers (offload_optimizer="cpu": optimizer
            # state and gradients in host tensors) exists only now; the line moves up by it.
            gradients = placement.gradients
            outside = (0 if gradients.grads_on_nvme else gradients.grad_peak) + (
                0 if optimizer.swap_state else host_tensor_bytes(optimizer.inner.state)
            )
            wanted = plan.heap_reuse_wanted(largest, self.device.type == "cpu")
            self._heap_watch.start(largest, wanted, outside=outside)
        self.watch_heap()
        self._sample_memory()

    def watch_heap(self) -> None:
        """Called where the heap grows (module gathers, step tiles)."""
        if self._heap_watch is not None:
            self._heap_watch.check()

    # -- reporting ------------------------------------------------------------------------------
    def _sample_memory(self) -> None:
        rss = psutil.Process().memory_info().rss
        nvme = self._nvme_bytes()
        with self._sample_lock:  # a racing max() from another thread must not lower a peak
            self._rss_peak = max(self._rss_peak, rss)
            self._nvme_peak = max(self._nvme_peak, nvme)

    def _nvme_bytes(self) -> int:
        """Bytes of NVMe extents held (each shard's home, rounded up to 4096)."""
        engine = self.engine  # read once: close() may clear it from the training thread
        return engine.space.allocated_bytes if engine is not None else 0

    def rss_bound(self) -> dict[str, int] | None:
        """The bound on the process's peak RSS and its terms (see infinity.core.budgets), with
        the saved activations' peak as measured so far, the process's own peak (VmHWM) and its
        peak when attach returned (``attach_peak``); None before attach."""
        plan = self.memory_plan
        if plan is None:
            return None
        activations = 0
        if self.device.type == "cpu":
            if self.activation_meter is not None:
                activations = self.activation_meter.peak_bytes
            elif self.activations is not None:
                activations = self.activations.peak_device
        # offload_optimizer='cpu': the optimizer state and the gradients are host tensors that
        # host_budget does not cap (as they would be without the store)
        outside = 0
        optimizer, placement = self.optimizer, self.placement
        if optimizer is not None and placement is not None and not optimizer.swap_state:
            outside = host_tensor_bytes(optimizer.inner.state)
            if not placement.gradients.grads_on_nvme:
                outside += placement.gradients.grad_peak
        static = plan.static_bound(self._process_bytes)
        return {
            "process": self._process_bytes,
            "host_budget": plan.host,
            "device_outside_host": plan.device_outside_host,
            "transient_outside_host": plan.transient_outside,
            "optimizer_outside_host": outside,
            "activations": activations,
            "bound": static + outside + activations,
            "peak": peak_resident_bytes(),
            "attach_peak": self._attach_peak,
            "bounded_base": self._bounded_base,
            "heap_reused": int(self._heap_watch is not None and self._heap_watch.started),
        }

    def stats(self) -> dict[str, Any]:
        """Bytes per tier (current and peak), I/O totals and timings, steps; see
        :func:`infinity.observability.reporting.store_stats` for each key."""
        self._sample_memory()
        return store_stats(
            self,
            MemoryFigures(
                nvme_bytes=self._nvme_bytes(),
                nvme_peak=self._nvme_peak,
                rss_peak=self._rss_peak,
                heap_reuse=bool(self._heap_watch and self._heap_watch.active),
                rss_bound=self.rss_bound(),
            ),
        )

    # -- teardown -------------------------------------------------------------------------------
    def materialize(self, entry: ParamEntry) -> torch.Tensor:
        """The parameter's current values as a new host tensor of its shape."""
        placement = self.placement
        assert placement is not None
        # a quantized weight comes back decoded, in the dtype it computes in
        out = torch.empty(
            entry.shape, dtype=entry.compute_dtype if entry.quantized else entry.dtype
        )
        flat = out.view(-1)
        if entry.resident:
            placement.settle(entry)
            assert entry.device_tensor is not None  # resident
            flat.copy_(entry.device_tensor.reshape(-1))
            return out
        for shard in entry.shards:
            placement.ensure_host(shard)
            host = shard.host
            assert host is not None  # ensured
            if shard.piece is None:
                shard.values_into(flat[shard.start : shard.start + shard.numel], host)
            else:  # every rank's slice: a collective, on every rank
                assert self.partition is not None  # only partitioned shards have pieces
                start, numel = shard.piece
                flat[start : start + numel].copy_(self.partition.gather_flat(host, numel))
        return out

    def close(self, restore_params: bool | str | Iterable[Any] | None = None) -> None:
        """Waits for transfers, gives parameters their values back as ordinary tensors on the
        store's device, removes hooks, swap files and buffers.

        ``restore_params`` says which (None: the config's ``restore_params``, 'auto' by
        default): True every parameter, False none, 'auto' every parameter when their bytes fit
        in host_budget (without one, in half the memory available) and none otherwise, or
        parameters, modules or parameter names: only those. Parameters not given back are left
        on the meta device; with 'auto' declining, a warning says where their values are (the
        last checkpoint, kept swap files, or nowhere). True with parameters larger than
        host_budget is refused before anything is torn down (BudgetError): the store stays
        usable, to save a checkpoint or close with another choice. The values are read back
        while the staging arena's memory is handed back, so close's peak stays about the larger
        of the two, not their sum.

        Everything is released even when I/O fails; the first failure (a parameter that could
        not be read back, kept swap files that could not be brought up to date) is raised
        afterwards."""
        if self._closed:
            return
        selection = self._restore_selection(restore_params)
        if (
            self._checkpoints is not None
            and self._checkpoints.pending is not None
            and not (self.partition is not None and self.partition.failed)
        ):
            self._checkpoints.wait()  # a save under way needs the tiers until it is done
        try:
            failure = self._teardown(selection)
        finally:
            self._closed = True
        if failure is not None:
            raise failure

    def _restore_selection(self, choice: bool | str | Iterable[Any] | None) -> set[int]:
        """The indices of the entries ``close`` gives back (see ``close``)."""
        placement = self.placement
        if placement is None or self.model is None:
            return set()  # nothing was taken over (or attach failed before): nothing to give
        partition = self.partition
        chosen, self._declined_restore = handback.choose(
            self.config.restore_params if choice is None else choice,
            registry=self.registry,
            uninitialised=placement.uninitialised,
            model=self.model,
            room=self._restore_room,
            refuse_too_large=self.config.host_budget is not None,
            agree=partition.min_across if partition is not None and not partition.failed else None,
        )
        return chosen

    def _restore_room(self) -> tuple[int, str]:
        """The bytes of parameters 'auto' hands back at close, and what bounds them."""
        plan = self.memory_plan
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return free + (plan.device if plan is not None else 0), "the device's free memory"
        if self.config.host_budget is not None:
            return self.config.host_budget, "host_budget"
        tiers = (plan.arena + plan.device) if plan is not None else 0
        return psutil.virtual_memory().available // 2 + tiers, "half the memory available"

    def _teardown(self, restore: bool | set[int]) -> BaseException | None:
        """Releases everything; returns the first I/O failure met on the way, if any.
        ``restore``: the indices of the entries to give back (True: all)."""
        placement = self.placement
        failure: BaseException | None = None
        if self.partition is not None and self.partition.failed:
            restore = False  # gathering the values would wait for ranks that are gone
        if restore is True:
            restore = {e.index for e in self.registry.entries}
        try:
            if placement is not None:
                if self.config.keep_swap_files:
                    try:
                        placement.flush()  # the kept files must hold the current values
                    except Exception as exc:
                        log.error("close: the kept swap files are not current: %s", exc)
                        failure = exc
                # Failed write-backs do not matter here: the host copies stay valid.
                placement.drain()
                placement.lending.return_lent()  # before the parameters get their values back
                if self.access is not None:
                    self.access.remove()  # the parameters are plain again
                if self.activation_meter is not None:
                    self.activation_meter.remove()
                if self._heap_watch is not None:
                    self._heap_watch.stop()  # before the parameters' memory is allocated
                failure = self._restore(restore or set()) or failure
        finally:
            if self.activations is not None:
                self.activations.close()  # before the engine its transfers use
            if self._activation_engine is not None:
                self._activation_engine.close()
                self._activation_engine = None
            if self._heap_watch is not None:
                self._heap_watch.stop()  # the next store in this process starts bounded again
            if self.hooks is not None:
                self.hooks.remove()
            for handle in self._handles:
                handle.remove()
            self._handles = []
            if self.engine is not None:
                self.engine.close()
                self.engine = None
            if placement is not None:
                placement.lending.return_lent()  # they would view the host memory closed next
                placement.device.close()
                if self._host_tier is not None:
                    state = self.optimizer.inner.state.values() if self.optimizer else ()
                    handback.forget_host_views(self.registry, state, self._host_tier)
            if self._host_tier is not None:
                self._host_tier.close()
            if self._temp_dir is not None:
                if self.config.keep_swap_files:
                    log.info("swap files kept in %s (keep_swap_files)", self._temp_dir)
                else:
                    shutil.rmtree(self._temp_dir, ignore_errors=True)
                self._temp_dir = None
            lifecycle.unregister(self)  # its files are gone; releases the model
        return failure

    def _restore(self, chosen: set[int]) -> BaseException | None:
        """Gives the ``chosen`` entries their values back, the others initialised go to the
        meta device (infinity.core.handback); returns the first failure."""
        placement = self.placement
        assert placement is not None and self.model is not None
        left, failure = handback.hand_back(
            chosen,
            registry=self.registry,
            placement=placement,
            device=self.device,
            materialize=self.materialize,
            same_order_everywhere=self.partition is not None,
        )
        handback.leave_on_meta(self.model, left)
        declined = self._declined_restore
        if declined is not None:
            log.warning(
                "close: the parameters (%d bytes) are more than %s (%d bytes) leaves to hand "
                "them back, so restore_params='auto' left them on the meta device. Their "
                "values are %s",
                declined.nbytes,
                declined.what,
                declined.room,
                handback.where_values_are(
                    self._last_checkpoint, self.steps, self.config.keep_swap_files
                ),
            )
        return failure

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
