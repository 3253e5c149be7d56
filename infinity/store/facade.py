"""The tiered store: the public object users create, attach and close.

``attach`` registers every parameter as one or more shards, moves their values into the host tier
(and onto NVMe when parameters are offloaded there), installs the module hooks and wraps the
optimizer. From then on the user's loop runs unchanged; see ``docs/architecture.md``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch
from torch import nn

from infinity.checkpointing.checkpoint import Checkpointer
from infinity.checkpointing.latest import latest_checkpoint
from infinity.checkpointing.pretrained import load_pretrained
from infinity.checkpointing.state_dict import install_state_dict_hooks
from infinity.config import OffloadConfig
from infinity.core import handback, lifecycle
from infinity.core.budgets import MemoryPlan, slot_size
from infinity.core.disk_needs import state_tensors
from infinity.core.machine import Machine
from infinity.core.memory import (
    bound_heap_retention,
    huge_page_allocations,
    warm_runtime,
)
from infinity.core.placement import Placement
from infinity.core.shards import ParamEntry, Shard, ShardRegistry
from infinity.core.tiers import HostTier
from infinity.core.trace import TraceFollower
from infinity.errors import AttachError, CheckpointError, ConfigError
from infinity.inference import kv_config, offloaded_kv_cache
from infinity.inference.quantized import WeightQuantization
from infinity.observability.reporting import store_stats
from infinity.observability.saved_activations import SavedActivationMeter
from infinity.observability.timeline import Timeline
from infinity.planning.planner import predict
from infinity.planning.profiles import device_profile
from infinity.ranks.ddp_guard import DDPGuard
from infinity.ranks.partition import Partition
from infinity.store import attaching, closing
from infinity.store.memory_watch import StoreMemory
from infinity.store.swap_space import StoreSwap
from infinity.training.activations import offload_for_store
from infinity.training.hooks import HookSet
from infinity.training.optimizer import OffloadedOptimizer
from infinity.training.param_access import ParamAccess
from infinity.training.precision import COMPUTE_DTYPES, MASTER_DTYPES, LossScaler, stored_dtype
from infinity.training.stepping import Stepping
from infinity.training.update_timing import UpdateTiming
from swap import IOBackend, SwapEngine

if TYPE_CHECKING:
    from infinity.inference.kv_cache import OffloadedKVCache
    from infinity.training.activations import ActivationOffload

log = logging.getLogger("infinity.store")

ModelT = TypeVar("ModelT", bound=nn.Module)


class TieredStore:
    """Holds a model's parameters across device, host and NVMe. See the package docstring."""

    def __init__(
        self,
        config: OffloadConfig | None = None,
        *,
        backend_wrapper: Callable[[IOBackend], IOBackend] | None = None,
        engine_overrides: Mapping[str, Any] | None = None,
        machine: Machine | None = None,
    ) -> None:
        """``backend_wrapper`` (tests and tools only) wraps the swap engine's I/O backend, e.g.
        in a fault-injecting backend; None costs nothing. ``engine_overrides`` (tests and tools
        only) replaces fields of the engine's ``EngineSettings`` that the config has no key for,
        such as a tiny ``close_timeout`` under injected hangs. ``machine``: what the store runs
        on (:class:`~infinity.core.machine.Machine`, this machine by default); the planner
        passes a simulated one.

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
        self._machine = machine or Machine()
        #: the swap engines and the temporary directory they swap to
        self._swap = StoreSwap(
            self.config,
            self._machine,
            engine_overrides=dict(engine_overrides or {}),
            backend_wrapper=backend_wrapper,
        )
        self.device = self._machine.device(self.config.device)
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
        #: moves saved activations off the device (offload_activations;
        #: infinity.training.activations)
        self.activations: ActivationOffload | None = None
        self.hooks: HookSet | None = None
        self.optimizer: OffloadedOptimizer | None = None
        self.model: nn.Module | None = None
        self.budgets: dict[str, int] = {}
        #: how the store divides its memory, and the terms of the RSS bound (infinity.core.budgets)
        self.memory_plan: MemoryPlan | None = None
        #: the process's memory: its RSS besides the model, peaks, the heap watch
        self._memory = StoreMemory()
        #: saved activations held in host memory, counted for the bound (a CPU device)
        self.activation_meter: SavedActivationMeter | None = None
        #: the last checkpoint saved (its path, and the steps done then), for close's warning
        self._last_checkpoint: tuple[Path, int] | None = None
        #: close's 'auto' found the parameters too large to give back: (bytes, room, what)
        self._declined_restore: handback.Declined | None = None
        self._handles: list[Any] = []
        self._closed = False
        self._host_tier: HostTier | None = None
        precision = self.config.precision
        self.compute_dtype = COMPUTE_DTYPES[precision.dtype]
        self.storage_dtype = stored_dtype(precision)
        #: precision.storage_dtype int8/int4: the weights stored quantized (inference)
        self.weight_quantization = WeightQuantization.from_precision(
            precision.storage_dtype, precision.quant_group_size
        )
        #: with an optimizer, storage_dtype is that of the compute copies gathers read, kept
        #: beside the masters on NVMe (infinity.core.placement); None: gathers read the masters
        self.compute_copy_dtype: torch.dtype | None = None
        self.scaler = LossScaler(precision) if precision.dtype == "fp16" else None
        #: transfers, waits and compute spans, recorded while ``timeline.enabled``
        self.timeline = Timeline()
        #: the optimizer step and updates in backward, and what the loop does around them
        self.stepping = Stepping(self)
        #: where optimizer updates run (step_in_backward), once an optimizer is attached
        self.update_timing: UpdateTiming | None = None
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
        return self._swap.temp_dir

    @property
    def engine(self) -> SwapEngine | None:
        """The swap engine of the model's state (None: nothing of it on NVMe)."""
        return self._swap.engine

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
        device are initialised module by module (``reset_parameters()``, and a model's own
        ``_init_weights`` as its constructor runs it: Hugging Face models); with
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
        attaching.check_model(model)
        attaching.check_optimizer(model, optimizer)
        if self.storage_dtype is not None and optimizer is not None:
            # Training: the masters keep their precision for the updates, and a compute copy
            # in storage_dtype beside each on NVMe is what gathers read.
            attaching.check_compute_copies(self.config, self.compute_dtype, self.storage_dtype)
            self.compute_copy_dtype = self.storage_dtype
            self.storage_dtype = None  # the masters stay as they are
        self.partition = Partition.join(process_group, self.config, self.device)
        if self.weight_quantization is not None:
            self.weight_quantization.check_attach(
                training=optimizer is not None,
                offload_param=self.config.offload_param,
                partitioned=self.partition is not None,
                slot_bytes=slot_size(self.config),
            )
        attaching.check_buffers(model)
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
        self._memory.attached()
        # The user's optimizer, wrapped (an OffloadedOptimizer is a torch Optimizer); None when
        # none was given.
        return model, self.optimizer if optimizer is not None else None

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
        self._memory.measure_process(model)
        slot = slot_size(config)
        if self.partition is not None and config.buffer_size is None:
            slot = self.partition.min_across(slot)  # the shards must be cut alike on every rank
        attaching.register_params(
            model,
            self.registry,
            slot,
            compute_dtype=self.compute_dtype,
            storage_dtype=self.storage_dtype,
            partition=self.partition,
            quantization=self.weight_quantization,
            frozen=attaching.frozen_params(optimizer),
            frozen_dtype=self.compute_copy_dtype,
            master_dtype=MASTER_DTYPES[config.precision.master_dtype],
        )
        if self.partition is not None:
            self.partition.check_same_model(self.registry.entries, config)
        modules = attaching.module_entries(model, self.registry)
        total = sum(e.nbytes for e in self.registry.entries)
        trained = attaching.trained_entries(optimizer, self.registry)
        plan = self._budgets(modules, config, slot, trained)
        self.memory_plan = plan
        self.budgets = plan.budgets()
        attaching.log_budgets(plan, config)
        self.model = model
        device_tier, self._host_tier = self._machine.tiers(
            plan, self.device, len(self.registry.entries), config.pin_memory
        )
        if nvme:
            self._swap.open(
                self,
                trained=trained,
                state_tensor_count=state_tensors(optimizer),
                cached_all=plan.cached_all,
            )
        settings = attaching.placement_settings(
            config,
            self.registry,
            modules,
            master_tier=self.master_tier,
            params_stay_on_device=self._params_stay_on_device,
            # the arena holds every offloaded byte: updated shards may stay dirty until evicted
            cached_all=plan.cached_all,
            scaler=self.scaler,
            compute_copy_dtype=self.compute_copy_dtype,
        )
        if self.partition is not None:
            # Which shards travel together in collectives, the same on every rank.
            self.partition.plan(
                self.registry.entries,
                [entries for _, _, entries in modules],
                settings.persistent,
                config,
                self.budgets["device"],
            )
        host_tier = self._host_tier
        self.placement = attaching.make_placement(
            self.registry,
            device_tier,
            host_tier,
            self.engine,
            self.follower,
            settings,
            prefetch_depth=config.prefetch_depth,
            partition=self.partition,
            timeline=self.timeline,
        )
        started = time.perf_counter()
        attaching.initialise_values(self, model, initialise)
        log.info(
            "attached %d parameters (%d shards, %.1f MB) in %.2f s: params on %s, "
            "device budget %d, host budget %d",
            len(self.registry.entries),
            len(self.registry.shards),
            total / 1e6,
            time.perf_counter() - started,
            f"the device (masters on {self.master_tier})"
            if self._params_stay_on_device
            else config.offload_param,
            self.budgets["device"],
            self.budgets["host"],
        )
        if config.host_budget is not None:
            self._memory.bound(plan)
        self.hooks = HookSet(self, model, [(m, e) for _, m, e in modules])
        self.hooks.install()
        if self.scaler is not None:
            self._handles.append(self.scaler.install(model))
        self._handles += install_state_dict_hooks(self, model)
        self._handles.append(DDPGuard(model))  # an error, not a crash, if DDP wraps it
        if optimizer is not None:
            self.optimizer = OffloadedOptimizer.wrap(self, optimizer)
            reasons, sizing = attaching.updates_kept_in_step(
                config,
                self.registry,
                modules,
                plan,
                arena=host_tier if self.engine is not None else None,
                params_on_nvme=self.placement.nvme,
                compute_copies=self.compute_copy_dtype is not None,
                loss_scaling=self.scaler is not None,
                plan_at=lambda host_budget: self._budgets(
                    modules, config.replace(host_budget=host_budget), None, trained
                ),
            )
            self.update_timing = UpdateTiming(
                config.step_in_backward,
                reasons + self._machine.update_reasons(),
                self.placement,
                warn=sizing,
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

    def _budgets(
        self,
        modules: attaching.ModuleEntries,
        config: OffloadConfig,
        slot: int | None,
        trained: set[int] | None,
    ) -> MemoryPlan:
        """The budgets for ``config`` (``slot``: the shards' size; None: the config's own, for
        another host budget than the store's, which is not agreed across ranks; ``trained``:
        the entries the optimizer updates, None without one)."""
        return attaching.budgets_for(
            config,
            self.registry,
            modules,
            slot=slot if slot is not None else slot_size(config),
            device=self.device,
            device_kind=self._machine.device_kind(self.device),
            params_stay_on_device=self._params_stay_on_device,
            master_tier=self.master_tier,
            trained=trained,
            agree=self.partition.min_across
            if self.partition is not None and slot is not None
            else None,
        )

    def _attach_activations(self, model: nn.Module) -> None:
        """Creates the activation offload (``offload_activations``) and hooks it on ``model``."""
        if self.config.offload_activations != "none":
            engine = self.engine
            if self.config.offload_activations == "nvme" and engine is None:
                # Its own engine: the store's decides how the optimizer steps (stepping.py).
                engine = self._swap.open(self, for_activations=True)
            self.activations = offload_for_store(self, model, engine)

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
        config = self.config
        paths = config.nvme_path or ((self.temp_dir,) if self.temp_dir else ())
        settings = kv_config.for_store(
            config.aio,
            config.verify_checksums,
            tuple(paths),
            self.budgets.get("device", 0),
            target,
            budget,
            options,
        )
        return offloaded_kv_cache(settings, device=self.device)

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
        checkpoints = self._checkpointer("save_checkpoint")
        plan = self.memory_plan
        if self._memory.bounded and plan is not None:
            self._memory.make_room(plan.checkpoint_write_bytes)
        checkpoints.save(Path(path), extra, async_save)
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
        return latest_checkpoint(Path(directory))

    def _checkpointer(self, what: str) -> Checkpointer:
        if self._closed:
            raise AttachError("this store is closed; create a new TieredStore")
        if self.model is None or self.placement is None:
            raise AttachError(
                f"{what}() needs a model attached with something offloaded: call "
                f"attach() first (a store that only reports leaves the model as "
                f"it is: checkpoint it with torch.distributed.checkpoint)"
            )
        if self.weight_quantization is not None:
            self.weight_quantization.check_checkpoint(what)
        if self._checkpoints is None:
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
        if isinstance(device, str):  # a preset's name: "H100", "this machine", ...
            device = device_profile(device)
        return predict(self, overrides, disk=disk, device=device, contention=contention)

    # -- called by the step and the hooks ---------------------------------------------------------
    def after_step(self, optimizer: OffloadedOptimizer, first: bool) -> None:
        """Called when ``optimizer.step()`` has updated the shards (``first``: the first
        step)."""
        if first and self._memory.bounded:
            plan, placement = self.memory_plan, self.placement
            assert plan is not None and placement is not None  # made by attach
            self._memory.first_step(plan, placement, optimizer, self.registry.entries, self.device)
        self.watch_heap()
        self._memory.sample(self._swap.nvme_bytes)

    def watch_heap(self) -> None:
        """Called where the heap grows (module gathers, step tiles)."""
        self._memory.check()

    # -- reporting ------------------------------------------------------------------------------
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
        return self._memory.rss_bound(plan, activations, self.optimizer, self.placement)

    def stats(self) -> dict[str, Any]:
        """Bytes per tier (current and peak), I/O totals and timings, steps; see
        :func:`infinity.observability.reporting.store_stats` for each key, and ``disk``:
        :meth:`infinity.store.swap_space.StoreSwap.report`."""
        nvme = self._swap.nvme_bytes
        self._memory.sample(nvme)
        figures = self._memory.figures(nvme, self.rss_bound())
        return {**store_stats(self, figures), "disk": self._swap.report(self.registry)}

    # -- teardown -------------------------------------------------------------------------------
    def materialize(self, entry: ParamEntry) -> torch.Tensor:
        """The parameter's current values as a new host tensor of its shape."""
        placement = self.placement
        assert placement is not None
        return handback.values_of(entry, placement)

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
        selection: set[int] = set()
        if self.placement is not None and self.model is not None:  # else nothing taken over
            selection, self._declined_restore = closing.choose(
                self.config.restore_params if restore_params is None else restore_params,
                self.model,
                self.registry,
                self.placement,
                self.device,
                self.config,
                self.memory_plan,
            )
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
                self._memory.stop()  # before the parameters' memory is allocated
                assert self.model is not None  # attached: a placement was made
                failure = (
                    closing.restore(
                        restore or set(),
                        model=self.model,
                        registry=self.registry,
                        placement=placement,
                        device=self.device,
                        materialize=self.materialize,
                        partitioned=self.partition is not None,
                        declined=self._declined_restore,
                        last_checkpoint=self._last_checkpoint,
                        steps=self.steps,
                        keep_swap_files=self.config.keep_swap_files,
                    )
                    or failure
                )
        finally:
            if self.activations is not None:
                self.activations.close()  # before the engine its transfers use
            self._swap.close_activations()
            self._memory.stop()  # the next store in this process starts bounded again
            if self.hooks is not None:
                self.hooks.remove()
            for handle in self._handles:
                handle.remove()
            self._handles = []
            self._swap.close()  # the engine, and the temporary directory it swapped to
            if placement is not None:
                placement.lending.return_lent()  # they would view the host memory closed next
                placement.device.close()
                if self._host_tier is not None:
                    state = self.optimizer.inner.state.values() if self.optimizer else ()
                    handback.forget_host_views(self.registry, state, self._host_tier)
            if self._host_tier is not None:
                self._host_tier.close()
            lifecycle.unregister(self)  # its files are gone; releases the model
        return failure

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
