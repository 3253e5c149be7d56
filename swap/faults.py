"""A backend wrapper that injects faults, for tests and the soak tool.

``FaultInjectingBackend(inner)`` is an :class:`IOBackend` that passes requests to ``inner`` and,
when a rule says so, makes one misbehave instead. Nothing in the normal I/O path knows about it:
an engine built without it runs exactly the code it always ran (zero cost when not used).

Fault kinds:

* ``eio``: the request fails with EIO and moves nothing;
* ``short``: only a 4096-multiple prefix (half, rounded down, at least one page) is moved and the
  short count returned, so the engine has to continue the rest. Requests of one page cannot be
  shortened and do not match a ``short`` rule;
* ``enospc``: a write fails with ENOSPC (writes only);
* ``slow``: the request waits ``delay`` seconds on a timer thread, then goes to the inner
  backend; other requests are not held up;
* ``hang``: the request never completes until the backend is closed (the engine's
  ``request_timeout`` is what gives up on it). It never reaches the inner backend, so its memory
  is never touched; close releases it with ECANCELED;
* ``drop``: success is reported without moving any byte: a write that silently did not land, or
  a read that left the buffer as it was.

Rules are checked in the order they were added; a request gets at most one fault.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import heapq
import logging
import random
import threading
import time
from collections import Counter
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass

from swap.backends.base import IOBackend, IORequest, Op, outcome_of, resolve
from swap.buffers import ALIGNMENT

log = logging.getLogger(__name__)

KINDS = ("eio", "short", "enospc", "slow", "hang", "drop")
OPS = ("read", "write", "any")
_WRITE_ONLY = frozenset({"enospc"})


@dataclass
class _Rule:
    kinds: tuple[str, ...]  # one kind, or the kinds random mode picks from
    op: str
    times: int | None  # faults still to inject; None = no limit
    probability: float
    delay: float
    skip: int  # matching requests still to let through first (``after``)
    random_delay: bool = False

    def applicable(self, request: IORequest) -> tuple[str, ...]:
        if self.op != "any" and self.op != request.op.value:
            return ()
        return tuple(k for k in self.kinds if _applies(k, request))


def _applies(kind: str, request: IORequest) -> bool:
    if kind in _WRITE_ONLY and request.op is not Op.WRITE:
        return False
    if kind == "short" and request.length <= ALIGNMENT:
        return False
    return True


def _short_length(length: int) -> int:
    return max(ALIGNMENT, (length // 2) // ALIGNMENT * ALIGNMENT)


class FaultInjectingBackend(IOBackend):
    """Wraps ``inner``; see the module docstring. ``seed`` makes probabilistic rules and random
    mode reproducible. ``injected`` counts the faults injected per kind.

    It takes chains of one request (``max_chain`` stays 1): an engine over it submits request by
    request, each with its own fault decision, and a hung request holds only its own slot."""

    def __init__(self, inner: IOBackend, seed: int = 0) -> None:
        super().__init__(inner.queue_depth, inner.close_timeout)
        self.inner = inner
        # The engine reports and logs the backend that really does the I/O.
        self.name = inner.name
        self.direct = inner.direct
        self.counters = inner.counters
        self.injected: Counter[str] = Counter()
        self.requests = 0
        self._rules: list[_Rule] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._hung: list[tuple[Future[int], IORequest]] = []
        self._timers: list[tuple[float, int, Future[int], IORequest]] = []
        self._timer_cond = threading.Condition(self._lock)
        self._timer_thread: threading.Thread | None = None
        self._sequence = 0
        self._closed = False

    # -- configuration ----------------------------------------------------------------------
    def inject(
        self,
        kind: str,
        op: str = "any",
        times: int | None = 1,
        probability: float = 1.0,
        delay: float = 0.0,
        after: int = 0,
    ) -> FaultInjectingBackend:
        """Makes the next ``times`` matching requests (None: all of them) fail with ``kind``,
        each with ``probability``, after letting the first ``after`` matching ones through."""
        _check_kind(kind)
        if kind in _WRITE_ONLY and op == "read":
            raise ValueError(f"fault {kind!r} applies to writes only")
        self._add(
            _Rule(
                (kind,),
                _check_op(op),
                _check_times(times),
                _check_probability(probability),
                _check_delay(delay),
                _check_after(after),
            )
        )
        return self

    def random_faults(
        self,
        rate: float,
        kinds: tuple[str, ...] | list[str] = ("eio", "short", "slow"),
        max_delay: float = 0.05,
    ) -> FaultInjectingBackend:
        """Random mode: every request gets, with probability ``rate``, a fault drawn uniformly
        from the ``kinds`` that apply to it; ``slow`` waits uniform(0, ``max_delay``) s."""
        kinds = tuple(kinds)
        if not kinds:
            raise ValueError("random_faults needs at least one kind")
        for kind in kinds:
            _check_kind(kind)
        self._add(
            _Rule(
                kinds,
                "any",
                None,
                _check_probability(rate),
                _check_delay(max_delay),
                0,
                random_delay=True,
            )
        )
        return self

    def clear(self) -> None:
        """Removes every rule. Requests already hung or delayed stay so."""
        with self._lock:
            self._rules.clear()

    @property
    def hung(self) -> int:
        with self._lock:
            return len(self._hung)

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    # -- I/O --------------------------------------------------------------------------------
    def plugged(self) -> AbstractContextManager[None]:
        return self.inner.plugged()

    def flush(self) -> None:
        self.inner.flush()

    def submit(self, request: IORequest) -> Future[int]:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.name} backend is closed")
            self.requests += 1
            kind, delay = self._pick_locked(request)
            if kind is not None:
                self.injected[kind] += 1
        if kind is None:
            return self.inner.submit(request)
        log.debug(
            "injecting %s into a %s of %d bytes at offset %d (fd %d)",
            kind,
            request.op.value,
            request.length,
            request.offset,
            request.fd,
        )
        if kind == "eio":
            return _failed(OSError(errno.EIO, "Input/output error (injected fault)"))
        if kind == "enospc":
            return _failed(OSError(errno.ENOSPC, "No space left on device (injected fault)"))
        if kind == "drop":
            future: Future[int] = Future()
            future.set_result(request.length)
            return future
        if kind == "short":
            return self.inner.submit(
                dataclasses.replace(request, length=_short_length(request.length))
            )
        future = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            if kind == "hang":
                self._hung.append((future, request))
            else:  # slow
                self._sequence += 1
                heapq.heappush(
                    self._timers, (time.monotonic() + delay, self._sequence, future, request)
                )
                self._start_timer_locked()
                self._timer_cond.notify()
        return future

    def _pick_locked(self, request: IORequest) -> tuple[str | None, float]:
        for rule in self._rules:
            if rule.times == 0:
                continue
            kinds = rule.applicable(request)
            if not kinds:
                continue
            if rule.skip:
                rule.skip -= 1
                continue
            if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                continue
            if rule.times is not None:
                rule.times -= 1
            kind = kinds[0] if len(kinds) == 1 else self._rng.choice(kinds)
            delay = self._rng.uniform(0.0, rule.delay) if rule.random_delay else rule.delay
            return kind, delay
        return None, 0.0

    def _start_timer_locked(self) -> None:
        if self._timer_thread is None:
            self._timer_thread = threading.Thread(
                target=self._run_timers, name="swap-fault-timer", daemon=True
            )
            self._timer_thread.start()

    def _run_timers(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (
                    not self._timers or self._timers[0][0] > time.monotonic()
                ):
                    wait = self._timers[0][0] - time.monotonic() if self._timers else None
                    self._timer_cond.wait(wait)
                if self._closed:
                    return
                _, _, future, request = heapq.heappop(self._timers)
            # Outside the lock: the inner backend may complete inline and run engine callbacks.
            try:
                inner = self.inner.submit(request)
            except Exception as exc:
                resolve(future, exc)
                continue
            inner.add_done_callback(functools.partial(_chain, outer=future))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            hung, self._hung = self._hung, []
            delayed, self._timers = self._timers, []
            self._timer_cond.notify_all()
        # Neither kind ever reached the inner backend, so their memory is untouched: a plain
        # ECANCELED, not an abandoned request whose buffer must stay quarantined.
        for future, _request in hung:
            resolve(
                future, OSError(errno.ECANCELED, "the backend was closed; injected hang released")
            )
        for _, _, future, _request in delayed:
            resolve(
                future,
                OSError(errno.ECANCELED, "the backend was closed while the request was delayed"),
            )
        if self._timer_thread is not None and self._timer_thread is not threading.current_thread():
            self._timer_thread.join(5.0)
        self.inner.close()

    def __repr__(self) -> str:
        return f"FaultInjectingBackend({self.inner!r}, injected={dict(self.injected)})"


def _failed(error: BaseException) -> Future[int]:
    future: Future[int] = Future()
    future.set_exception(error)
    return future


def _chain(inner: Future[int], outer: Future[int]) -> None:
    if inner.cancelled():
        resolve(outer, OSError(errno.ECANCELED, "the inner backend cancelled the request"))
    else:
        resolve(outer, outcome_of(inner))


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; choose one of {', '.join(KINDS)}")


def _check_op(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    return op


def _check_times(times: int | None) -> int | None:
    if times is not None and (not isinstance(times, int) or isinstance(times, bool) or times < 1):
        raise ValueError(f"times must be a positive integer or None, got {times!r}")
    return times


def _check_probability(value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"probability must be within [0, 1], got {value!r}")
    return float(value)


def _check_delay(delay: float) -> float:
    if not delay >= 0.0:
        raise ValueError(f"delay must be >= 0 seconds, got {delay!r}")
    return float(delay)


def _check_after(after: int) -> int:
    if not isinstance(after, int) or isinstance(after, bool) or after < 0:
        raise ValueError(f"after must be a non-negative integer, got {after!r}")
    return after
