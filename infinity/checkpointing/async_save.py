"""An asynchronous checkpoint save: the state at the call, written while training goes on.

The checkpoint's files are written by a background thread (DCP's save, with its own process
group across ranks), but only the training thread may move shards between the tiers. So the
two meet at a bounded staging queue: the training thread copies chunks out of the tiers into it
(in plan order, a little at each module's forward, while the queue holds less than ``cap_bytes``)
and the writer takes them as they come. Before anything changes a shard (the optimizer step's
update of a tile, a parameter write) the chunks of that shard still due are copied first, from
the host copy the step has just read anyway, so the checkpoint is exactly the state at the call;
the step waits only when the queue is over its cap, until the writer has drained it. Host memory
for the save: the cap plus one tile.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from infinity.errors import CheckpointError

log = logging.getLogger(__name__)

ChunkKey = tuple[str, int]


class AsyncSave:
    """One save under way; see the module docstring. ``chunks``: (key, source) in plan order,
    a source being (shard, optimizer state key or None), which ``read`` copies out."""

    def __init__(
        self,
        chunks: list[tuple[ChunkKey, tuple[Any, ...]]],
        read: Callable[[Any], torch.Tensor],
        cap_bytes: int,
        readable: Callable[[Any], bool] = lambda source: True,
    ) -> None:
        #: chunks not yet copied out, in plan order: key -> source (given to ``read``)
        self.pending: OrderedDict[ChunkKey, Any] = OrderedDict(chunks)
        self.of_shard: dict[str, list[ChunkKey]] = {}
        for key, source in chunks:
            self.of_shard.setdefault(source[0].id, []).append(key)
        self.read = read
        #: whether a chunk can be copied out now (a master whose only host copy is gone while
        #: its module computes cannot: it is left for later)
        self.readable = readable
        self.cap = cap_bytes
        self.staged: queue.Queue[tuple[ChunkKey, torch.Tensor] | None] = queue.Queue()
        self.staged_bytes = 0
        self.lock = threading.Condition()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.copied_before_change = 0
        self.wait_seconds = 0.0
        self.started = time.perf_counter()

    # -- the training thread --------------------------------------------------------------------
    def start(self, run: Callable[[], None]) -> None:
        def body() -> None:
            try:
                run()
            except BaseException as exc:
                self.error = exc
                log.error("asynchronous checkpoint save failed: %s", exc)
            finally:
                with self.lock:
                    self.lock.notify_all()

        self.thread = threading.Thread(target=body, name="infinity-checkpoint", daemon=True)
        self.thread.start()

    @property
    def active(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def advance(self) -> None:
        """Copies chunks out in plan order while the queue is under its cap."""
        # Called at every module's forward while a save is under way: walk only as far as the
        # cap allows, without copying the list of what is due.
        taken = []
        try:
            for key, source in self.pending.items():
                if self.staged_bytes >= self.cap or self.error is not None:
                    break
                if self.readable(source):
                    taken.append(key)
                    self._stage(key, source)
        finally:
            for key in taken:
                del self.pending[key]

    def before_change(self, shards: Iterable[Any]) -> None:
        """Copies out what is still due of ``shards`` before they change; waits while the queue
        is over its cap."""
        for shard in shards:
            for key in self.of_shard.get(shard.id, ()):
                source = self.pending.pop(key, None)
                if source is not None:
                    self._stage(key, source)
                    self.copied_before_change += 1
        self._wait_under_cap()

    def finish(self) -> None:
        """Copies out everything left and waits for the writer; raises its failure."""
        while self.pending and self.error is None:
            before = len(self.pending)
            self.advance()
            if len(self.pending) == before and self.staged_bytes < self.cap:
                raise CheckpointError(
                    f"{before} chunks of the asynchronous save cannot be "
                    f"read (their masters are in use on the device)"
                )
            self._wait_under_cap()
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _stage(self, key: ChunkKey, source: Any) -> None:
        tensor = self.read(source)
        with self.lock:
            self.staged_bytes += tensor.numel() * tensor.element_size()
        self.staged.put((key, tensor))

    def _wait_under_cap(self) -> None:
        started = time.perf_counter()
        with self.lock:
            while self.staged_bytes > self.cap and self.error is None and self.active:
                self.lock.wait(timeout=1.0)
        self.wait_seconds += time.perf_counter() - started
        if self.error is not None:
            raise CheckpointError(f"the asynchronous checkpoint save failed: {self.error}")

    # -- the writer thread ----------------------------------------------------------------------
    def stream(self, keys: set[ChunkKey]) -> Iterator[tuple[ChunkKey, torch.Tensor]]:
        """The staged chunks, as they come, until every one of ``keys`` came."""
        left = set(keys)
        while left:
            item = self.staged.get()
            if item is None:
                raise CheckpointError("the asynchronous save was abandoned")
            key, tensor = item
            with self.lock:
                self.staged_bytes -= tensor.numel() * tensor.element_size()
                self.lock.notify_all()
            left.discard(key)
            yield key, tensor
