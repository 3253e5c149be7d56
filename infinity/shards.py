"""Shards and the registry that owns their state.

A shard is a contiguous range of one parameter's flattened elements: the whole parameter when it
fits in one swap buffer, else ``ceil(bytes / buffer_size)`` pieces, so a parameter larger than a
buffer streams through the buffers in pieces instead of failing. Shards are keyed by a stable id
(the parameter's qualified name, plus ``#k`` for piece k), which is what a checkpoint or a later
distributed partition will use to find them again.

All state lives here, in the registry, never as attributes on ``nn.Parameter``.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from infinity.residency import Residency, check_transition

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Shard:
    id: str
    entry: "ParamEntry"
    start: int                      # first element within the flattened parameter
    numel: int
    dtype: torch.dtype
    state: Residency = Residency.EMPTY
    #: the host copy (a view into the staging arena, or a standalone host tensor)
    host: torch.Tensor | None = None
    #: byte offset of ``host`` inside the arena, when it lives there
    arena_offset: int | None = None
    #: the NVMe home
    extent: object | None = None
    #: an NVMe transfer in flight
    pending: "Future[int] | None" = None
    #: accumulated gradient on the host (fp32, same numel), None when no gradient yet
    grad: torch.Tensor | None = None
    #: the host parameter the wrapped optimizer updates
    step_param: torch.nn.Parameter | None = None
    #: CUDA event marking the end of the last copy out of ``host`` (the slot is busy until then)
    copy_event: object | None = None
    version: int = 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def in_arena_pending(self) -> bool:
        return self.pending is not None

    def __repr__(self) -> str:
        return f"Shard({self.id}, {self.numel} x {self.dtype}, {self.state.name})"


@dataclass(eq=False)
class ParamEntry:
    """One model parameter: its shards and its device copy."""
    name: str
    param: torch.nn.Parameter
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool
    shards: list[Shard] = field(default_factory=list)
    #: the gathered device tensor (``param.data`` points at it while gathered)
    device_tensor: torch.Tensor | None = None
    #: reasons the device copy must stay: active modules and pending backward uses
    holds: int = 0
    index: int = 0

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class ShardRegistry:
    """Owns every shard and parameter entry; the one place residency changes happen."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.shards: dict[str, Shard] = {}
        self.entries: list[ParamEntry] = []
        self._by_param: dict[int, ParamEntry] = {}

    def add_param(self, name: str, param: torch.nn.Parameter, max_shard_bytes: int) -> ParamEntry:
        entry = ParamEntry(name, param, param.shape, param.dtype, param.requires_grad,
                           index=len(self.entries))
        itemsize = param.dtype.itemsize
        per_shard = max(1, max_shard_bytes // itemsize)
        numel = param.numel()
        count = max(1, -(-numel // per_shard))
        for k in range(count):
            start = k * per_shard
            shard_id = name if count == 1 else f"{name}#{k}"
            shard = Shard(shard_id, entry, start, min(per_shard, numel - start), param.dtype)
            entry.shards.append(shard)
            self.shards[shard_id] = shard
        self.entries.append(entry)
        self._by_param[id(param)] = entry
        return entry

    def entry_of(self, param: torch.Tensor) -> ParamEntry | None:
        return self._by_param.get(id(param))

    def set_state(self, shard: Shard, new: Residency) -> None:
        with self.lock:
            check_transition(shard.id, shard.state, new)
            shard.state = new

    def count(self, predicate) -> int:
        with self.lock:
            return sum(s.nbytes for s in self.shards.values() if predicate(s.state))

    def snapshot(self) -> dict[str, dict]:
        """A JSON-able description of every shard (for checkpoints and debugging)."""
        with self.lock:
            return {s.id: {"param": s.entry.name, "start": s.start, "numel": s.numel,
                           "dtype": str(s.dtype).removeprefix("torch."),
                           "state": s.state.name, "version": s.version}
                    for s in self.shards.values()}
