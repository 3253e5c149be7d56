"""The recorded order in which parameters are needed, and where we are in it.

One iteration (from the root module's forward to the next one) is a sequence of events: a module
about to run forward, or about to run backward. Each event names the parameter entries it needs.
The first iteration in a given mode (training with grad, or inference) is recorded; later
iterations follow it. When an iteration departs from the recording (control flow, a new batch
shape that changes the module order), the follower notices at the first mismatch, stops trusting
the trace for the rest of that iteration and records a fresh one.
"""

from __future__ import annotations

import bisect
import collections
import logging
import statistics
import time
from dataclasses import dataclass, field

from infinity.core.memory import minor_faults

log = logging.getLogger(__name__)

FORWARD = "fwd"
BACKWARD = "bwd"


@dataclass(frozen=True)
class Event:
    kind: str  # FORWARD or BACKWARD
    module: int  # index of the module in attach order
    entries: tuple[int, ...]  # parameter entry indices the module needs


@dataclass
class Trace:
    events: list[Event] = field(default_factory=list)
    #: entry index -> sorted positions of the events that use it
    uses: dict[int, list[int]] = field(default_factory=dict)

    #: how many of the events are forward ones
    forward_events: int = 0
    #: entry index -> position of the last backward event that uses it (after which its
    #: gradient is complete)
    last_backward: dict[int, int] = field(default_factory=dict)
    #: seconds the training thread spent after each event until the next one (or the step),
    #: less the store's stalls and device copies: the module's compute and the loop's own
    #: work, the median of the last iterations that followed this trace (for the planner)
    compute: list[float] = field(default_factory=list)
    #: the process's minor page faults in the same spans, the median of the same iterations,
    #: and in the recorded iteration itself (the first, whose heap kept no freed blocks: see
    #: ``infinity.core.memory``): what a run whose heap never reuses blocks faults afresh
    #: every step, which the planner prices for a budget without room for reuse
    faults: list[float] = field(default_factory=list)
    recorded_faults: list[int] = field(default_factory=list)
    #: position -> the last iterations' (seconds, faults) after that event
    _samples: dict[int, collections.deque] = field(default_factory=dict, repr=False)
    #: (events observed so far, entry index) for each gradient completed in backward, in the
    #: order autograd completed them (not always right after the entry's last event)
    grads: list[tuple[int, int]] = field(default_factory=list)
    _updates: tuple[int, list[tuple[int, int]]] | None = field(default=None, repr=False)

    def append(self, event: Event) -> None:
        position = len(self.events)
        self.events.append(event)
        self.compute.append(0.0)
        self.faults.append(0.0)
        self.recorded_faults.append(0)
        self.forward_events += event.kind == FORWARD
        for entry in event.entries:
            self.uses.setdefault(entry, []).append(position)
            if event.kind == BACKWARD:
                self.last_backward[entry] = position

    def updates_from(self, position: int) -> list[tuple[int, int]]:
        """(position, entry) of each entry's last backward event at or after ``position``, in
        trace order: where an update in backward finds each gradient complete."""
        if self._updates is None or self._updates[0] != len(self.events):
            order = sorted((p, e) for e, p in self.last_backward.items())
            self._updates = (len(self.events), order)
        order = self._updates[1]
        return order[bisect.bisect_left(order, (position, -1)) :]

    def next_use(self, entry: int, position: int) -> float:
        """Events from ``position`` until ``entry`` is next needed, wrapping into the next
        iteration; infinity when the trace never uses it."""
        uses = self.uses.get(entry)
        if not uses:
            return float("inf")
        i = bisect.bisect_left(uses, position)
        if i < len(uses):
            return uses[i] - position
        return uses[0] + len(self.events) - position

    def __len__(self) -> int:
        return len(self.events)


class TraceFollower:
    """Records the first iteration of each mode and follows it afterwards."""

    def __init__(self) -> None:
        self.traces: dict[object, Trace] = {}
        self.mode: object = None
        self.position = 0
        # Record from the start even if the root module never runs forward (a loop that calls
        # submodules directly): such a run is one long iteration.
        self.recording: Trace | None = Trace()
        self.following: Trace | None = None
        self.diverged_iterations = 0
        self._warned = False
        #: (time, the store's busy seconds, the process's minor faults) at the last event
        self._mark: tuple[float, float, int] | None = None

    def start_iteration(self, mode: object) -> None:
        self._finish_iteration()
        self._mark = None  # the time since the last iteration's end is the loop's, not a module's
        self.mode = mode
        self.position = 0
        trace = self.traces.get(mode)
        if trace is None:
            self.recording, self.following = Trace(), None
        else:
            self.recording, self.following = None, trace

    def _finish_iteration(self) -> None:
        if self.recording is not None and len(self.recording):
            self.traces[self.mode] = self.recording
        if self.following is not None and self.position != len(self.following):
            # Ended early (a shorter iteration): the trace is not what runs now.
            self._diverged(
                f"iteration ended after {self.position} of {len(self.following)} recorded events"
            )
            if self.recording is not None and len(self.recording):
                self.traces[self.mode] = self.recording
        self.recording = None

    def observe(self, event: Event, busy: float = 0.0) -> None:
        """Advances past ``event``; notices a departure from the trace. ``busy``: the store's
        stall and copy seconds so far, which the compute measured since the last event
        excludes."""
        self._clock(busy)
        if self.following is not None:
            expected = (
                self.following.events[self.position]
                if self.position < len(self.following)
                else None
            )
            if expected != event:
                self._diverged(
                    f"event {self.position} was {_name(event)}, the trace expected "
                    f"{_name(expected) if expected else 'the end of the iteration'}"
                )
                # Re-record from the start of this iteration: keep what matched so far.
                self.recording = Trace()
                for past in self.following.events[: self.position]:
                    self.recording.append(past)
                self.following = None
        if self.recording is not None:
            self.recording.append(event)
        self.position += 1

    def grad_ready(self, entry: int) -> None:
        """Records that ``entry``'s gradient is complete, at this point of the iteration."""
        if self.recording is not None:
            self.recording.grads.append((self.position, entry))

    def pause(self, busy: float = 0.0) -> None:
        """The iteration's events are over (the optimizer step begins): the last event's
        compute ends here."""
        self._clock(busy)
        self._mark = None

    def _clock(self, busy: float) -> None:
        now, faults = time.perf_counter(), minor_faults()
        following, recording = self.following, self.recording
        if self._mark is not None and 0 < self.position:
            then, busy_then, faults_then = self._mark
            position = self.position - 1
            if following is not None and position < len(following):
                samples = following._samples.setdefault(position, collections.deque(maxlen=5))
                samples.append((max(0.0, now - then - (busy - busy_then)), faults - faults_then))
                # One iteration on a busy machine can be far off; the median of a few is not.
                following.compute[position] = statistics.median(s for s, _ in samples)
                following.faults[position] = statistics.median(f for _, f in samples)
            elif recording is not None and position < len(recording):
                recording.recorded_faults[position] = faults - faults_then
        tracked = following is not None or recording is not None
        self._mark = (now, busy, faults) if tracked else None

    def _diverged(self, why: str) -> None:
        self.diverged_iterations += 1
        if not self._warned:
            log.warning(
                "this iteration departs from the recorded trace (%s): fetching on demand "
                "for the rest of it and re-recording; further departures are logged at "
                "debug level",
                why,
            )
            self._warned = True
        else:
            log.debug("trace departure: %s", why)

    @property
    def trace(self) -> Trace | None:
        """The trace being followed, or None while recording or after a departure."""
        return self.following

    def upcoming(self, depth: int, wrap: bool = False) -> list[Event]:
        """The next ``depth`` events; ``wrap``: past this iteration's end into the next one's
        start (an iteration that repeats, as a decode step does token after token)."""
        if self.following is None:
            return []
        events = self.following.events
        ahead = events[self.position : self.position + depth]
        if wrap and len(ahead) < depth:
            ahead = ahead + events[: min(depth - len(ahead), self.position)]
        return ahead

    @property
    def inference(self) -> bool:
        """Whether the iteration under way runs without autograd (no backward, no step)."""
        return isinstance(self.mode, tuple) and not self.mode[0]


def _name(event: Event) -> str:
    return f"{event.kind}(module {event.module})"
