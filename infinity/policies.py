"""Eviction and prefetch policies, fed by the recorded trace.

Both are small interfaces so a different policy (a cost model, a learned one) can be dropped in.
Eviction picks, among candidates that may be dropped, the one to drop first: with a trace, the one
whose next use is furthest away (Belady's optimal choice); without one, the least recently used.
Prefetch lists the parameter entries worth fetching now, nearest first; the store decides how many
it can afford without over-committing its buffers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterable, Sequence, TypeVar

from infinity.trace import TraceFollower

T = TypeVar("T")


class EvictionPolicy(ABC):
    @abstractmethod
    def order(self, candidates: Sequence[T], next_use: Callable[[T], float] | None,
              recency: Callable[[T], int]) -> list[T]:
        """``candidates`` in the order they should be evicted. ``next_use`` (events until the
        candidate is needed again) is None when no trace is being followed; ``recency`` is a
        logical clock of the last use."""


class LRUEviction(EvictionPolicy):
    def order(self, candidates: Sequence[T], next_use: Callable[[T], float] | None,
              recency: Callable[[T], int]) -> list[T]:
        return sorted(candidates, key=recency)


class BeladyEviction(EvictionPolicy):
    """Furthest next use first; least recently used while no trace is being followed."""

    def order(self, candidates: Sequence[T], next_use: Callable[[T], float] | None,
              recency: Callable[[T], int]) -> list[T]:
        if next_use is None:
            return sorted(candidates, key=recency)
        return sorted(candidates, key=lambda c: (-next_use(c), recency(c)))


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
