"""The DCP planners of infinity's checkpoints (:mod:`infinity.checkpointing.checkpoint`): what
each rank saves as chunks of each parameter's master and optimizer state, read from the tiers
only when DCP's writer asks for them, and where each chunk a load reads goes, written into its
shard through the tiers as soon as its bytes are in."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from infinity.checkpointing.async_save import AsyncSave
from infinity.core.residency import Residency as R
from infinity.core.shards import Shard, state_companions
from infinity.errors import CheckpointError
from infinity.training.optimizer import (
    OffloadedOptimizer,
    step_param_of,
    step_shape,
)

if TYPE_CHECKING:
    from infinity.core.attached import AttachedStore
    from infinity.core.placement import Placement


def per_element(value: Any, shard: Shard) -> bool:
    """Whether an optimizer state value holds one number per element of ``shard`` (saved
    as chunks beside the parameter's); anything else goes into the state JSON."""
    return isinstance(value, torch.Tensor) and value.numel() == shard.numel and value.dim() > 0


def chunks_of(store: AttachedStore) -> list[tuple[str, Shard, str | None]]:
    """(key, shard, optimizer state key or None) for every chunk this rank holds."""
    out: list[tuple[str, Shard, str | None]] = []
    optimizer = store.optimizer
    for entry in store.registry.entries:
        for shard in entry.shards:
            if not shard.real_numel:
                continue  # all padding
            out.append((f"param/{entry.name}", shard, None))
            if optimizer is None or shard.step_param is None:
                continue
            swapped = state_companions(shard) if optimizer.swap_state else {}
            keys = [
                key
                for key, value in optimizer.inner.state.get(shard.step_param, {}).items()
                if per_element(value, shard) or key in swapped
            ]
            for key in keys:
                out.append((f"optim/{entry.name}/{key}", shard, key))
    return out


class ShardSavePlanner(SavePlanner):
    """Plans this rank's chunks and reads each from the tiers when the writer asks."""

    def __init__(self, store: AttachedStore) -> None:
        self.store = store
        placement = store.placement
        assert placement is not None  # made by Checkpointer, once attached
        self.placement = placement
        self.sources: dict[tuple[str, int], tuple[Shard, str | None]] = {}
        #: an asynchronous save's staging queue (None: read on demand, in this thread)
        self.source: AsyncSave | None = None

    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        # Built by prepare() on the training thread: an asynchronous save's writer thread must
        # not walk the optimizer's state while the step changes it.
        return self.plan

    def prepare(self) -> None:
        items = []
        for key, shard, state_key in chunks_of(self.store):
            dtype = shard.dtype if state_key is None else self._state_dtype(shard, state_key)
            offsets = torch.Size([shard.start])
            items.append(
                WriteItem(
                    index=MetadataIndex(key, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(
                            offsets=offsets, sizes=torch.Size([shard.real_numel])
                        ),
                        properties=TensorProperties(dtype=dtype),
                        size=torch.Size([shard.entry.numel]),
                    ),
                )
            )
            self.sources[(key, shard.start)] = (shard, state_key)
        self.plan = SavePlan(items)

    def _state_dtype(self, shard: Shard, key: str) -> torch.dtype:
        companion = state_companions(shard).get(key)
        if companion is not None:
            # State kept in fewer bytes is saved as its fp32 values: the checkpoint loads into
            # the plain optimizer, and into a store that keeps it otherwise.
            return self._optimizer().state_dtype(companion)
        return self._optimizer().inner.state[step_param_of(shard)][key].dtype

    def _optimizer(self) -> OffloadedOptimizer:
        optimizer = self.store.optimizer
        assert optimizer is not None  # only then are there optimizer chunks
        return optimizer

    def stream_from(self, source: AsyncSave) -> None:
        """An asynchronous save: the writer gets the chunks as ``source`` copies them out."""
        self.source = source

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = create_default_global_save_plan(all_plans)
        self.metadata = metadata
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.read(*self.sources[_chunk_key(write_item.index)])

    def stream(self, items: list[WriteItem]) -> Any:
        """(item, tensor) pairs: in plan order, or, for an asynchronous save, as the training
        thread copies the chunks out."""
        if self.source is None:
            return self._read_ahead(items)
        by_key = {_chunk_key(i.index): i for i in items}
        return ((by_key[key], tensor) for key, tensor in self.source.stream(set(by_key)))

    def _read_ahead(self, items: list[WriteItem]) -> Iterator[tuple[WriteItem, torch.Tensor]]:
        """The chunks in plan order, with the NVMe reads of the next ones (up to a third of
        the arena) under way while the writer writes this one."""
        placement = self.placement
        parts = [self._part(*self.sources[_chunk_key(i.index)]) for i in items]
        window = placement.host.arena_bytes // 3
        started: dict[int, int] = {}  # item index -> bytes whose read is under way
        ahead = 0
        for i, item in enumerate(items):
            ahead = max(ahead, i)
            while (
                placement.engine is not None
                and ahead < len(items)
                and (ahead == i or sum(started.values()) < window)
            ):
                part = parts[ahead]
                if part is not None:
                    placement.reap(part)
                    if part.state is R.NVME:
                        protect = {p for p in parts[i : ahead + 1] if p is not None}
                        if not placement.load_async(part, protect=protect):
                            break
                        started[ahead] = part.nbytes
                ahead += 1
            # No copy: the writer copies the bytes into its buffers before the next read.
            tensor = self.read(*self.sources[_chunk_key(item.index)], copy=False)
            started.pop(i, None)
            yield item, tensor

    def _part(self, shard: Shard, state_key: str | None) -> Shard | None:
        """The shard whose bytes hold a chunk (the master, or its state's companion); None
        for state that lives in memory."""
        if state_key is None:
            return shard if self.placement.nvme else None
        return state_companions(shard).get(state_key)

    def read(self, shard: Shard, state_key: str | None, copy: bool = True) -> torch.Tensor:
        """This rank's chunk of ``shard`` (its master, or an optimizer state): a copy, or
        (``copy=False``) a view valid until the tiers next move something."""
        out = self._view(self.placement, shard, state_key)
        return out.clone() if copy else out

    def _view(self, placement: Placement, shard: Shard, state_key: str | None) -> torch.Tensor:
        real = shard.real_numel
        if state_key is None:
            placement.ensure_host(shard)
            return shard.host_copy()[:real]
        companion = state_companions(shard).get(state_key)
        if companion is not None:
            placement.ensure_host(companion)
            if companion.encoding is not None:
                values = self._optimizer().state_values(shard, state_key, companion)
                return values.reshape(-1)[:real]
            return companion.host_copy()[:real]
        value = self._optimizer().inner.state[step_param_of(shard)][state_key]
        return value.detach().reshape(-1)[:real]

    def lookup_object(self, index: MetadataIndex) -> Any:
        raise CheckpointError("this checkpoint format keeps tensors only")

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        raise CheckpointError("this checkpoint format keeps tensors only")


class ShardLoadPlanner(LoadPlanner):
    """Reads this rank's chunks (whatever slices the checkpoint was saved in) and writes each
    into its shard as soon as all of its bytes are in."""

    def __init__(self, store: AttachedStore, load_optimizer: bool) -> None:
        self.store = store
        placement = store.placement
        assert placement is not None  # made by Checkpointer, once attached
        self.placement = placement
        self.load_optimizer = load_optimizer
        self.metadata: Metadata | None = None
        self.targets: dict[tuple[str, int], tuple[Shard, str | None]] = {}
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.waiting: dict[tuple[str, int], int] = {}
        self.stashed: set[tuple[int, str]] = set()

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        assert metadata is not None  # a load reads the checkpoint's metadata first
        self.metadata = metadata
        #: what the checkpoint holds, by key (tensors only: this format has nothing else)
        self.saved: dict[str, TensorStorageMetadata] = {}
        for key, held in metadata.state_dict_metadata.items():
            assert isinstance(held, TensorStorageMetadata), f"{key} is not a tensor"
            self.saved[key] = held

    def create_local_plan(self) -> LoadPlan:
        saved = self.saved
        items: list[ReadItem] = []
        wanted: list[tuple[str, Shard, str | None]] = []
        for entry in self.store.registry.entries:
            for shard in entry.shards:
                if not shard.real_numel:
                    continue
                wanted.append((f"param/{entry.name}", shard, None))
                if self.load_optimizer and shard.step_param is not None:
                    prefix = f"optim/{entry.name}/"
                    wanted += [
                        (key, shard, key[len(prefix) :]) for key in saved if key.startswith(prefix)
                    ]
        for key, shard, state_key in wanted:
            if key not in saved:
                raise CheckpointError(f"the checkpoint has no {key}")
            chunk = ChunkStorageMetadata(
                offsets=torch.Size([shard.start]), sizes=torch.Size([shard.real_numel])
            )
            reads = create_read_items_for_chunk_list(key, saved[key], [chunk])
            covered = sum(r.lengths[0] for r in reads)
            if covered != shard.real_numel:
                raise CheckpointError(
                    f"the checkpoint covers {covered} of the "
                    f"{shard.real_numel} elements of {key} from "
                    f"{shard.start} on: it is incomplete"
                )
            self.targets[(key, shard.start)] = (shard, state_key)
            self.waiting[(key, shard.start)] = len(reads)
            items += reads
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointError("this checkpoint format keeps tensors only")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = _chunk_key(read_item.dest_index)
        buffer = self.buffers.get(target)
        if buffer is None:
            shard, _ = self.targets[target]
            dtype = self.saved[target[0]].properties.dtype
            buffer = self.buffers[target] = torch.empty(shard.real_numel, dtype=dtype)
        return buffer.narrow(0, read_item.dest_offsets[0], read_item.lengths[0])

    def adopt(self, read_item: ReadItem, source: torch.Tensor) -> bool:
        """Takes ``source`` (the checkpoint's bytes, read for this item) as the whole of its
        destination when it is: one read, no buffer of ours and no copy into it."""
        target = _chunk_key(read_item.dest_index)
        shard, _ = self.targets[target]
        if (
            self.waiting[target] != 1
            or target in self.buffers
            or read_item.lengths[0] != shard.real_numel
        ):
            return False
        self.buffers[target] = source
        self.commit_tensor(read_item, source)
        return True

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        target = _chunk_key(read_item.dest_index)
        self.waiting[target] -= 1
        if self.waiting[target]:
            return
        buffer = self.buffers.pop(target)
        shard, state_key = self.targets[target]
        if state_key is None:
            self._write_master(shard, buffer)
        else:
            self._write_state(shard, state_key, buffer)

    def _write_master(self, shard: Shard, values: torch.Tensor) -> None:
        store = self.store
        placement = self.placement
        placement.prepare_overwrite(shard)
        if shard.state is R.HOST_STORING:
            placement.reap(shard, wait=True)
        shard.fill_from(values.to(shard.dtype))
        if shard.state is not R.HOST:
            store.registry.set_state(shard, R.HOST)
        shard.version += 1
        if placement.nvme:
            placement.store_async(shard)
            placement.refresh_compute_copy(shard, write_back=True)

    def _write_state(self, shard: Shard, key: str, values: torch.Tensor) -> None:
        optimizer = self.store.optimizer
        assert optimizer is not None  # load_optimizer: there is one
        state = optimizer.inner.state.setdefault(step_param_of(shard), {})
        # Without padding, the planner's buffer itself (ours now): no copy.
        state[key] = shard.padded(values).view(step_shape(shard))
        if optimizer.swap_state:
            # Into its companion now: per-element state is never all in memory at once.
            optimizer.stash_loaded_state(shard, keep_others=True)

    def finish(self) -> None:
        """After the reads: entries that had no values have them now; persistent device
        copies come back (the same order on every rank: gathers are collectives)."""
        if self.waiting and any(self.waiting.values()):
            left = [k for k, n in self.waiting.items() if n]
            raise CheckpointError(f"the checkpoint did not deliver {left[:3]}")
        placement = self.placement
        for entry in self.store.registry.entries:
            placement.mark_initialised(entry)
        for entry in self.store.registry.entries:
            if entry.index in placement.persistent:
                placement.gather(entry, hold=False)


def _chunk_key(index: MetadataIndex) -> tuple[str, int]:
    """A chunk's key in the planners: its checkpoint key and first element."""
    assert index.offset is not None  # every chunk of ours has one (a flat range)
    return index.fqn, index.offset[0]


# -- JSON for what is not a per-element tensor -----------------------------------------------------
