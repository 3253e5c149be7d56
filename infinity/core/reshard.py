"""ZeRO stage 3 across ranks: which modules keep their all-gathered parameters from forward to
their backward instead of dropping them after forward (``reshard_after_forward``).

By default a module's gathered copy goes as soon as its forward is done, and its backward
all-gathers it again. The modules whose backward comes first are the last ones of forward:
keeping their copies saves one all-gather each, and the wait for it at the start of backward,
for the device memory the copies hold in between. Which modules keep theirs is decided from the
recorded trace, the parameters' sizes and the device budget alone, so every rank makes the same
choice (a gather is a collective: all ranks must run it, or none).

- ``'auto'``: from the last forward module back, as long as their copies fit the device budget
  beside the persistent parameters and room for two of the largest modules (one computing, one
  gathered ahead), which the others need while these are held.
- ``False``: every module's; refused at attach when the device budget cannot hold every
  parameter beside room for the largest one.
- ``True``: none (every backward gathers again).

A module that runs more than once in an iteration (shared layers) keeps nothing: its backward
could not tell which call's copy it has. Frozen parameters keep nothing either (no gradient
hook would drop them early). Copies kept by a forward whose backward never runs (a forward with
grad enabled for evaluation) are dropped at the next iteration's start.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from infinity.core.shards import ParamEntry
from infinity.core.trace import BACKWARD, FORWARD, Trace
from infinity.errors import BudgetError

#: plans kept at once: one per mode that runs backward (training; a grad-enabled evaluation)
_PLANS_KEPT = 4


class KeptForBackward:
    """The modules that keep their gathered copies for backward, and the copies kept now."""

    def __init__(
        self,
        entries: Sequence[ParamEntry],
        *,
        budget: int,
        persistent: frozenset[int],
        every: bool,
    ) -> None:
        self._entries = entries
        self._persistent = persistent
        self._every = every
        self._budget = budget
        self._persistent_bytes = sum(entries[i].device_bytes for i in persistent)
        #: the last few traces' plans (a re-recorded trace replaces its mode's): id(trace) ->
        #: (trace, the modules, in attach order, that keep their copies under it)
        self._plans: dict[int, tuple[Trace, frozenset[int]]] = {}
        #: copies held past their forward: entry -> holds (one per forward call that kept it)
        self.held: dict[ParamEntry, int] = {}
        #: all-gathers saved: parameters a backward found kept
        self.saved_gathers = 0
        if every:
            total = sum(e.device_bytes for e in entries)
            largest = max((e.device_bytes for e in entries), default=0)
            if total + largest > budget:
                raise BudgetError(
                    f"reshard_after_forward=False keeps every module's gathered parameters "
                    f"until its backward: {total} bytes, plus room for the largest "
                    f"({largest}), is more than device_budget ({budget}). Raise device_budget "
                    f"to at least {total + largest}, or use reshard_after_forward='auto' (the "
                    f"last modules, as the budget allows)"
                )

    def modules(self, trace: Trace) -> frozenset[int]:
        """The modules whose copies ``trace``'s iterations keep for backward."""
        plan = self._plans.get(id(trace))
        if plan is not None and plan[0] is trace:
            return plan[1]
        modules = self._plan(trace)
        if len(self._plans) >= _PLANS_KEPT:
            del self._plans[next(iter(self._plans))]  # the oldest
        self._plans[id(trace)] = (trace, modules)
        return modules

    def _plan(self, trace: Trace) -> frozenset[int]:
        forwards = [e for e in trace.events if e.kind == FORWARD]
        calls = collections.Counter(e.module for e in forwards)
        with_backward = {e.module for e in trace.events if e.kind == BACKWARD}
        sizes = [self._bytes(e.entries) for e in forwards]
        largest = max(sizes, default=0)
        room = self._budget - self._persistent_bytes - (largest if self._every else 2 * largest)
        kept: set[int] = set()
        counted: set[int] = set()
        total = 0
        for event in reversed(forwards):
            if calls[event.module] != 1 or event.module not in with_backward:
                continue
            fresh = [i for i in set(event.entries) if self._keepable(i) and i not in counted]
            nbytes = sum(self._entries[i].device_bytes for i in fresh)
            if total + nbytes > room:
                break
            kept.add(event.module)
            counted.update(fresh)
            total += nbytes
        return frozenset(kept)

    def _keepable(self, index: int) -> bool:
        return index not in self._persistent and self._entries[index].param.requires_grad

    def _bytes(self, indices: Sequence[int]) -> int:
        return sum(self._entries[i].device_bytes for i in set(indices))

    def keep(
        self, module: int, released: Sequence[ParamEntry], trace: Trace | None
    ) -> set[ParamEntry]:
        """Of the entries a module's forward is done with, those whose copies (and holds) stay
        for its backward; the caller releases the others."""
        if trace is None or module not in self.modules(trace):
            return set()
        kept = {e for e in released if self._keepable(e.index)}
        for entry in kept:
            self.held[entry] = self.held.get(entry, 0) + 1
        return kept

    def take(self, entries: Sequence[ParamEntry]) -> dict[ParamEntry, int]:
        """The holds kept for ``entries``, handed to their backward (which drops them with its
        own once their gradients are in)."""
        taken = {e: self.held.pop(e) for e in entries if e in self.held}
        self.saved_gathers += len(taken)
        return taken

    def drain(self) -> dict[ParamEntry, int]:
        """Every hold still kept: a forward whose backward did not come, or did not reach
        these modules."""
        held, self.held = self.held, {}
        return held
