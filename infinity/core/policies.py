"""Eviction and prefetch policies, fed by the recorded trace.

Both are small interfaces so a different policy (a cost model, a learned one) can be dropped in.
Eviction picks, among candidates that may be dropped, the one to drop first: with a trace, the one
whose next use is furthest away (Belady's optimal choice); without one, the least recently used.
Prefetch lists the parameter entries worth fetching now, nearest first; the store decides how many
it can afford without over-committing its buffers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from infinity.core.trace import Event, Trace, TraceFollower

T = TypeVar("T")


class EvictionPolicy(ABC):
    @abstractmethod
    def order(
        self,
        candidates: Sequence[T],
        next_use: Callable[[T], float] | None,
        recency: Callable[[T], int],
    ) -> list[T]:
        """``candidates`` in the order they should be evicted. ``next_use`` (events until the
        candidate is needed again) is None when no trace is being followed; ``recency`` is a
        logical clock of the last use."""


class LRUEviction(EvictionPolicy):
    def order(
        self,
        candidates: Sequence[T],
        next_use: Callable[[T], float] | None,
        recency: Callable[[T], int],
    ) -> list[T]:
        return sorted(candidates, key=recency)


class BeladyEviction(EvictionPolicy):
    """Furthest next use first; least recently used while no trace is being followed."""

    def order(
        self,
        candidates: Sequence[T],
        next_use: Callable[[T], float] | None,
        recency: Callable[[T], int],
    ) -> list[T]:
        if next_use is None:
            return sorted(candidates, key=recency)
        return sorted(candidates, key=lambda c: (-next_use(c), recency(c)))


class PrefetchPolicy(ABC):
    @abstractmethod
    def wanted(self, follower: TraceFollower) -> Iterable[int]:
        """Entry indices to fetch ahead, nearest use first."""


class LookaheadPrefetch(PrefetchPolicy):
    """The entries of the next ``depth`` events of the trace that move a sizeable share of the
    bytes, and of the smaller events between them.

    An event counts toward ``depth`` when its entries hold at least 1/8 of the mean bytes of
    the trace's events (``entry_bytes`` gives an entry's; without it every event counts). A
    LoRA layer's adapters and a block's norms take no read time worth a step of look-ahead:
    counted, the window of depth 2 after a base weight held its two adapters and no other
    weight. On the 13 B LoRA (40 layers, 4 GiB) the training thread waited for reads 7-8 s a
    step; counted in base weights, 1.3-1.4 s.

    ``stream_inference``: in an iteration without autograd, the whole trace ahead, wrapping into
    the next iteration. Such an iteration only reads weights, each once, in an order that repeats
    token after token, so the arena is best spent as a window running ahead of compute (the store
    bounds it: a read may only evict what is needed after it). In training the arena also holds
    gradients and optimizer state, which a deep prefetch would push out."""

    #: an event counts toward the depth with this share of the mean event's bytes (the mean, not
    #: the largest: an 8 B Llama's 1 GB embedding would leave its 8 MB k and v out)
    SIZEABLE = 1 / 8

    def __init__(
        self,
        depth: int,
        stream_inference: bool = True,
        entry_bytes: Callable[[int], int] | None = None,
    ) -> None:
        self.depth = depth
        self.stream_inference = stream_inference
        self.entry_bytes = entry_bytes
        #: (the trace they were computed for, whether each of its events counts toward depth)
        self._counted: tuple[Trace, list[bool]] | None = None

    def wanted(self, follower: TraceFollower) -> Iterable[int]:
        seen: set[int] = set()
        trace = follower.trace
        upcoming: Iterable[Event]
        if trace is None or not self.depth:
            upcoming = follower.upcoming(self.depth)
        elif self.stream_inference and follower.inference:
            upcoming = follower.upcoming(len(trace), wrap=True)
        elif self.entry_bytes is None:
            upcoming = follower.upcoming(self.depth)
        else:
            upcoming = self._up_to_depth(trace, follower.position)
        for event in upcoming:
            for entry in event.entries:
                if entry not in seen:
                    seen.add(entry)
                    yield entry

    def _up_to_depth(self, trace: Trace, position: int) -> Iterator[Event]:
        """The events from ``position`` to the ``depth``-th that counts (see the class
        docstring), read in place."""
        counts = self._counts(trace)
        left = self.depth
        for index in range(position, len(trace)):
            if left <= 0:
                return
            yield trace.events[index]
            left -= counts[index]

    def _counts(self, trace: Trace) -> list[bool]:
        if self._counted is None or self._counted[0] is not trace:
            assert self.entry_bytes is not None
            sizes = [sum(map(self.entry_bytes, e.entries)) for e in trace.events]
            sizeable = int(sum(sizes) / max(1, len(sizes)) * self.SIZEABLE)
            self._counted = (trace, [size >= sizeable for size in sizes])
        return self._counted[1]
