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
from infinity.core.budgets import compute_copy_bytes, state_part_bytes
from infinity.core.machine import Machine
from infinity.core.shards import ShardRegistry
from infinity.ranks.partition import Partition
from swap import IOBackend, SwapEngine, SwapSpaceError, align_up
from swap.files import SwapDirectories

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

    def open(self, store: SwapUser, for_activations: bool = False) -> SwapEngine:
        """Opens the machine's engine for ``store``'s shards (``for_activations``: the
        activation offload's own)."""

        def open_here() -> SwapEngine:
            engine, temp_dir = open_engine(
                self._config,
                store.registry,
                store.partition,
                master_tier=store.master_tier,
                compute_copies=store.compute_copy_dtype is not None,
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

    @property
    def nvme_bytes(self) -> int:
        """Bytes of NVMe extents the store's engine holds (each shard's home, rounded up)."""
        engine = self.engine  # read once: close() may clear it from the training thread
        return engine.space.allocated_bytes if engine is not None else 0

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


def open_engine(
    config: OffloadConfig,
    registry: ShardRegistry,
    partition: Partition | None,
    *,
    master_tier: str,
    compute_copies: bool,
    engine_overrides: Mapping[str, Any],
    backend_wrapper: Callable[[IOBackend], IOBackend] | None,
) -> tuple[SwapEngine, Path | None]:
    """The engine for ``registry``'s shards, and the temporary directory made for it where
    ``nvme_path`` is not set (None otherwise). Raises SwapSpaceError when a directory has less
    free space than its share of the offloaded state."""
    options: dict[str, Any] = dict(
        master_tier=master_tier,
        compute_copies=compute_copies,
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
    master_tier: str,
    compute_copies: bool,
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
    shards = registry.shards.values()
    shard_bytes = sum(align_up(s.nbytes) for s in shards)
    state_dtype = config.precision.optimizer_state_dtype
    state_bytes = sum(align_up(state_part_bytes(s.nbytes, state_dtype)) for s in shards)
    compute_bytes = (
        sum(align_up(max(compute_copy_bytes(s), 1)) for s in shards) if compute_copies else 0
    )
    # Masters (and their compute copies); gradients and (as Adam keeps) two moments of
    # optimizer state.
    needed = (shard_bytes + compute_bytes if master_tier == "nvme" else 0) + (
        shard_bytes + 2 * state_bytes if config.offload_optimizer == "nvme" else 0
    )
    per_drive = needed // len(paths) + stripe * 2 + len(registry.shards) * 4096
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
    if engine_overrides:
        settings = dataclasses.replace(settings, **engine_overrides)
    return SwapEngine(
        SwapDirectories(tuple(paths)),  # this rank's share of the directories checked above
        settings,
        keep_files=config.keep_swap_files,
        backend_wrapper=backend_wrapper,
        label=label,
    )
