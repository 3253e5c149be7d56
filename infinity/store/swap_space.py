"""The store's swap engines: the directories they swap to (``nvme_path``, this rank's share of
them, or a temporary directory removed at close), checked for the room the offloaded state needs
before any file is made; the store's own engine and, where nothing else of the model is on NVMe,
the activation offload's."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from infinity.config import OffloadConfig
from infinity.core.disk_needs import DiskBytes, plan_disk, stored_on_disk
from infinity.core.machine import Machine
from infinity.core.shards import ShardRegistry
from infinity.ranks.partition import Partition
from swap import IOBackend, SwapEngine, SwapSpaceError, align_up
from swap.files import SwapDirectories, SwapSpace

log = logging.getLogger("infinity.store")


class SwapUser(Protocol):
    """What the engine is sized for: the store's shards and where their masters live."""

    @property
    def registry(self) -> ShardRegistry: ...

    @property
    def partition(self) -> Partition | None: ...

    @property
    def master_tier(self) -> str: ...

    @property
    def compute_copy_dtype(self) -> torch.dtype | None: ...


class StoreSwap:
    """The store's engines and its temporary swap directory (see the module docstring)."""

    def __init__(
        self,
        config: OffloadConfig,
        machine: Machine,
        *,
        engine_overrides: Mapping[str, Any],
        backend_wrapper: Callable[[IOBackend], IOBackend] | None,
    ) -> None:
        self._config = config
        self._machine = machine
        self._engine_overrides = dict(engine_overrides)
        self._backend_wrapper = backend_wrapper
        #: the store's engine (None: nothing of the model on NVMe)
        self.engine: SwapEngine | None = None
        #: the engine activations use when nothing else of the model is on NVMe
        self.activation_engine: SwapEngine | None = None
        #: the temporary directory swapped to when ``nvme_path`` is not set
        self.temp_dir: Path | None = None
        #: what the run stores on NVMe by kind, as the preflight counted it (None: no engine
        #: for the model's state)
        self.needs: DiskBytes | None = None
        #: the entries the optimizer updates (None: no optimizer)
        self._trained: set[int] | None = None

    def open(
        self,
        store: SwapUser,
        for_activations: bool = False,
        *,
        trained: set[int] | None = None,
        state_tensor_count: int = 0,
        cached_all: bool = False,
    ) -> SwapEngine:
        """Opens the machine's engine for ``store``'s shards (``for_activations``: the
        activation offload's own). ``trained``: the entries the optimizer updates (None: no
        optimizer); ``state_tensor_count``: its per-element state tensors per parameter;
        ``cached_all``: the arena holds every offloaded byte (nothing is evicted)."""
        if not for_activations:
            self._trained = trained
            self.needs = disk_needs(
                self._config,
                store,
                trained=trained,
                state_tensor_count=state_tensor_count,
                drives=self._drives(store.partition),
                cached_all=cached_all,
            )
        needs = self.needs

        def open_here() -> SwapEngine:
            engine, temp_dir = open_engine(
                self._config,
                store.registry,
                store.partition,
                needed=needs.total if needs is not None and not for_activations else 0,
                engine_overrides=self._engine_overrides,
                backend_wrapper=self._backend_wrapper,
            )
            if temp_dir is not None:
                self.temp_dir = temp_dir
            return engine

        engine = self._machine.engine(open_here)
        if for_activations:
            self.activation_engine = engine
        else:
            self.engine = engine
        return engine

    def _drives(self, partition: Partition | None) -> int:
        """How many directories this rank's extents are striped over."""
        given = list(self._config.nvme_path)
        if not given:
            return 1
        return len(partition.drives(given)) if partition is not None else len(given)

    @property
    def nvme_bytes(self) -> int:
        """Bytes of NVMe extents the store's engine holds (each shard's home, rounded up)."""
        engine = self.engine  # read once: close() may clear it from the training thread
        return engine.space.allocated_bytes if engine is not None else 0

    def report(self, registry: ShardRegistry) -> dict[str, Any]:
        """``stats()['disk']``: the bytes the preflight counted, those the swap files take on
        the disk (now and at most; what ``du`` shows), those the extents hold, and each by
        kind (``needs``: the preflight's, ``stored``: the extents' now)."""
        engine = self.engine  # read once: close() may clear it from the training thread
        space = getattr(engine, "space", None)  # a simulated engine's (planning) has no files
        files = space if isinstance(space, SwapSpace) else None
        stored = stored_on_disk(
            registry.entries, self._trained, lambda e: getattr(e, "capacity", e.nbytes)
        )
        return {
            "preflight_bytes": self.needs.total if self.needs is not None else 0,
            "allocated_bytes": files.disk_bytes if files is not None else 0,
            "peak_allocated_bytes": files.peak_disk_bytes if files is not None else 0,
            "extent_bytes": space.allocated_bytes if space is not None else 0,
            "needs": self.needs.as_dict() if self.needs is not None else DiskBytes().as_dict(),
            "stored": stored.as_dict(),
        }

    def close_activations(self) -> None:
        """Closes the activation offload's own engine (after the offload itself)."""
        if self.activation_engine is not None:
            self.activation_engine.close()
            self.activation_engine = None

    def close(self) -> None:
        """Closes the store's engine and removes the temporary directory (unless
        ``keep_swap_files``)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.temp_dir is not None:
            if self._config.keep_swap_files:
                log.info("swap files kept in %s (keep_swap_files)", self.temp_dir)
            else:
                shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


def disk_needs(
    config: OffloadConfig,
    store: SwapUser,
    *,
    trained: set[int] | None,
    state_tensor_count: int,
    drives: int,
    cached_all: bool = False,
) -> DiskBytes:
    """What ``store``'s run keeps on NVMe, by kind (:func:`infinity.core.disk_needs.plan_disk`).

    With ``step_in_backward='auto'`` the first step runs in ``optimizer.step()`` and stores
    every gradient, so their bytes are counted (the disk must hold them then); once updates
    move into backward their extents are freed and the files give the blocks back
    (:func:`infinity.core.disk_needs.release_gradient_space`), so the preflight is the run's
    peak. Only ``step_in_backward=True`` stores none. Where the arena holds every offloaded byte
    (``cached_all``), gradients and optimizer state are never evicted, so never written: only
    the values written at attach are (and, with ``keep_swap_files``, all of it at close)."""
    stripe = max(config.aio.block_size, 4096)
    return plan_disk(
        store.registry.entries,
        trained=trained,
        masters_on_nvme=store.master_tier == "nvme",
        state_on_nvme=config.offload_optimizer == "nvme"
        and (not cached_all or config.keep_swap_files),
        compute_dtype=store.compute_copy_dtype,
        grads_stored=config.step_in_backward is not True,
        state_tensor_count=state_tensor_count,
        state_dtype=config.precision.optimizer_state_dtype,
        extent=lambda nbytes: SwapSpace.extent_capacity(nbytes, drives, stripe),
        widened=config.precision.widened_masters,
    )


def open_engine(
    config: OffloadConfig,
    registry: ShardRegistry,
    partition: Partition | None,
    *,
    needed: int,
    engine_overrides: Mapping[str, Any],
    backend_wrapper: Callable[[IOBackend], IOBackend] | None,
) -> tuple[SwapEngine, Path | None]:
    """The engine for ``registry``'s shards, and the temporary directory made for it where
    ``nvme_path`` is not set (None otherwise). Raises SwapSpaceError when a directory has less
    free space than its share of the ``needed`` bytes the run stores."""
    options: dict[str, Any] = dict(
        needed=needed,
        engine_overrides=engine_overrides,
        backend_wrapper=backend_wrapper,
    )
    given: list[Path] = list(config.nvme_path)
    if given:
        return _open(config, registry, partition, given, **options), None
    temp_dir = Path(tempfile.mkdtemp(prefix="infinity-nvme-"))
    log.info("nvme_path not set: swapping to the temporary directory %s", temp_dir)
    try:
        return _open(config, registry, partition, [temp_dir], **options), temp_dir
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise


def _open(
    config: OffloadConfig,
    registry: ShardRegistry,
    partition: Partition | None,
    given: list[Path],
    *,
    needed: int,
    engine_overrides: Mapping[str, Any],
    backend_wrapper: Callable[[IOBackend], IOBackend] | None,
) -> SwapEngine:
    # Unusable directories (missing, a file, read-only) are named as such before the
    # free-space preflight, which would otherwise misreport them as full; the engine
    # checks them no more.
    paths = list(SwapDirectories.check(given).paths)
    label = ""
    if partition is not None:
        paths = partition.drives(paths)
        label = f"rank{partition.rank}-"
    stripe = config.aio.block_size
    share = -(-needed // len(paths))
    # The free space asked for keeps a margin for a file system's own blocks; the files grow
    # only as the run stores (grow_files), to what it needs.
    per_drive = share + stripe * 2 + len(registry.shards) * 4096
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
        # a file's largest size: one file holds this drive's share, whatever is stored beyond
        # it (activations, relocated extents) makes more
        file_size=max(align_up(share), _MIN_FILE),
        verify_checksums=config.verify_checksums,
        grow_files=True,
    )
    if engine_overrides:
        settings = dataclasses.replace(settings, **engine_overrides)
    return SwapEngine(
        SwapDirectories(tuple(paths)),  # this rank's share of the directories checked above
        settings,
        keep_files=config.keep_swap_files,
        backend_wrapper=backend_wrapper,
        label=label,
    )


#: the smallest swap file (its largest size: a growing file takes only what is stored)
_MIN_FILE = 64 << 20
