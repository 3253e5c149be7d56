"""Eviction and prefetch policies, fed by the recorded trace.

Both are small interfaces so a different policy (a cost model, a learned one) can be dropped in.
Eviction picks, among candidates that may be dropped, the one to drop first: with a trace, the one
whose next use is furthest away (Belady's optimal choice); without one, the least recently used.
Prefetch lists the parameter entries worth fetching now, nearest first; the store decides how many
it can afford without over-committing its buffers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterable, Sequence

from infinity.trace import Trace, TraceFollower


class EvictionPolicy(ABC):
    @abstractmethod
    def order(self, candidates: Sequence[int], follower: TraceFollower,
              last_used: dict[int, int]) -> list[int]:
        """``candidates`` (entry indices) in the order they should be evicted."""


class LRUEviction(EvictionPolicy):
    def order(self, candidates: Sequence[int], follower: TraceFollower,
              last_used: dict[int, int]) -> list[int]:
        return sorted(candidates, key=lambda e: last_used.get(e, -1))


class BeladyEviction(EvictionPolicy):
    """Furthest next use first; falls back to LRU while no trace is being followed."""

    def __init__(self) -> None:
        self._fallback = LRUEviction()

    def order(self, candidates: Sequence[int], follower: TraceFollower,
              last_used: dict[int, int]) -> list[int]:
        trace: Trace | None = follower.trace
        if trace is None:
            return self._fallback.order(candidates, follower, last_used)
        position = follower.position
        return sorted(candidates, key=lambda e: (-trace.next_use(e, position),
                                                 last_used.get(e, -1)))


class PrefetchPolicy(ABC):
    @abstractmethod
    def wanted(self, follower: TraceFollower) -> Iterable[int]:
        """Entry indices to fetch ahead, nearest use first."""


class LookaheadPrefetch(PrefetchPolicy):
    """The entries of the next ``depth`` events of the trace."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def wanted(self, follower: TraceFollower) -> Iterable[int]:
        seen: set[int] = set()
        for event in follower.upcoming(self.depth):
            for entry in event.entries:
                if entry not in seen:
                    seen.add(entry)
                    yield entry
