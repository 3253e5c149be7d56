"""Where the training run is, as the placement's decisions need it: inside a forward/backward
pass or its step, which entries the running step has updated, the host copies it pins, and
whether updates run in backward. The placement's parts read it (eviction ranks by it, gathers
choose their source by it); the hooks and the step change it through its methods.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from infinity.core.shards import ParamEntry, Shard


class RunPhase:
    """The run's phase and the step's progress (see the module docstring)."""

    def __init__(self) -> None:
        #: shards whose host copies are in use right now (the optimizer's current tile)
        self.pinned: set[Shard] = set()
        #: entries the running optimizer step has updated: their optimizer state is next
        #: needed a whole iteration later, that of the others in this step
        self.stepped: set[int] = set()
        #: the optimizer updates each entry in backward, as its gradient completes (the
        #: ``step_in_backward`` option): its optimizer state is needed there, not in the step
        self.update_in_backward = False
        #: the last module event was a backward one (gathers for an update in backward read
        #: the master, which the update needs anyway)
        self.in_backward = False
        #: between the first forward hook and optimizer.step()
        self.in_pass = False
        #: a training pass began and its step has not finished: the step needs the masters
        self.masters_due = False
        #: the training thread's seconds updating parameters inside backward (updates in
        #: backward), less their waits: not the model's compute
        self._backward_update_seconds = 0.0

    def set_update_in_backward(self, enabled: bool) -> None:
        """Whether the optimizer updates each entry in backward, as its gradient completes
        (``step_in_backward``; :class:`~infinity.training.update_timing.UpdateTiming` decides)."""
        self.update_in_backward = enabled

    @contextlib.contextmanager
    def pinned_while(self, shards: set[Shard]) -> Iterator[None]:
        """Keeps the host copies of ``shards`` from eviction for the block (the optimizer's
        tile). ``shards`` itself is the pinned set: what :meth:`pin` adds shows in it."""
        self.pinned = shards
        try:
            yield
        finally:
            self.pinned = set()

    def pin(self, shard: Shard) -> None:
        """Adds ``shard`` to the pinned host copies (optimizer state made during the tile)."""
        self.pinned.add(shard)

    def mark_stepped(self, entry: ParamEntry) -> None:
        """The running optimizer step has updated ``entry``."""
        self.stepped.add(entry.index)

    def pass_started(self) -> None:
        self.in_pass = True
        self.masters_due = True

    def pass_finished(self) -> None:
        """The step begins: what it writes is not the passes' to learn from."""
        self.in_pass = False

    def step_finished(self) -> None:
        """The step ended (or failed): eviction ranks companions and masters alike again."""
        self.stepped.clear()
        self.masters_due = False

    @property
    def backward_update_seconds(self) -> float:
        """Seconds of updates run in backward so far, less their waits and copies."""
        return self._backward_update_seconds

    def count_backward_update(self, seconds: float) -> None:
        """An update in backward took ``seconds`` of the training thread, waits excluded."""
        self._backward_update_seconds += seconds
