"""Waiting in tests without asserting on elapsed time.

A busy machine stretches every wait, so tests assert on outcomes (results, errors, log records,
counters, order of events) and use time only as a guard against hangs: ``GUARD`` is far past
any wait a loaded machine could cause, so reaching it means that something never returns."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

#: seconds after which a call or a condition that has not come is taken for a hang
GUARD = 60.0


def returns(call: Callable[..., Any], *args: Any, guard: float = GUARD, what: str = "") -> Any:
    """``call(*args)`` on a helper thread; its result, or its exception raised here. Fails the
    test if it has not returned after ``guard`` seconds (the thread is left behind, daemonic)."""
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            outcome["result"] = call(*args)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=body, name=f"test-call-{what or call.__name__}", daemon=True)
    thread.start()
    thread.join(guard)
    if thread.is_alive():
        raise AssertionError(f"{what or call.__name__} hung: still running after {guard:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


def until(condition: Callable[[], Any], guard: float = GUARD, what: str = "the condition") -> Any:
    """Polls ``condition`` until it returns something true, and returns that; fails the test if
    it has not after ``guard`` seconds."""
    deadline = time.monotonic() + guard
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not come within {guard:g} s")
        time.sleep(0.01)


@contextlib.contextmanager
def logged(logger: str = "swap", level: int = logging.ERROR) -> Iterator[list[str]]:
    """The messages of ``logger`` (and its children) at ``level`` and above while inside."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(level)
    target = logging.getLogger(logger)
    target.addHandler(handler)
    try:
        yield messages
    finally:
        target.removeHandler(handler)


def closes(close: Callable[[], Any], gives_up: bool = False) -> None:
    """Runs ``close`` (a swap engine's or backend's, or a store's) guarded against a hang, and
    checks whether it gave up on requests still in flight: the engine and the backends log an
    error when they do, after waiting out their close_timeout. ``gives_up``: the test left a
    request that never completes. Where it did not, this is what shows that close did not wait
    for something that would never come (a request nobody submitted, a slot counted twice),
    without timing it."""
    with logged() as errors:
        returns(close, what="close()")
    gave_up = [m for m in errors if "in flight" in m]
    assert bool(gave_up) == gives_up, gave_up or "close() gave up on nothing"
