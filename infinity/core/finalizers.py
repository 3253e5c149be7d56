"""Finalizers that do not swallow Ctrl-C.

Python ignores an exception raised inside a finalizer (``__del__``, a ``weakref.finalize``
callback): it prints "Exception ignored in ..." and goes on. A SIGINT's KeyboardInterrupt is
raised in whatever Python code the main thread runs when the signal is handled, so one that
lands in a finalizer is lost and training carries on as if Ctrl-C had never been pressed. The
store's accounting runs finalizers for every tensor autograd saves (the saved-activation meter,
the activation offload), which makes that landing common enough to be seen.

A finalizer wrapped by ``interrupt_safe`` catches the KeyboardInterrupt and leaves it pending.
It is raised again outside the finalizer by whichever comes first: the store's next forward
hook (``raise_pending_interrupt``), or a timer that asks for it again a moment later
(``_thread.interrupt_main``, for a loop that runs no hook of ours). Asking at once would not do:
the main thread handles the request at its next check, still inside the finalizer.
"""

from __future__ import annotations

import _thread
import functools
import threading
from collections.abc import Callable
from typing import ParamSpec

P = ParamSpec("P")

#: how long the timer waits before asking again, so the finalizer has returned by then
REDELIVER_AFTER_S = 0.05

_lock = threading.Lock()
_pending = False


def interrupt_safe(finalizer: Callable[P, None]) -> Callable[P, None]:
    """``finalizer``, with a KeyboardInterrupt raised inside it delivered again afterwards."""

    @functools.wraps(finalizer)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            finalizer(*args, **kwargs)
        except KeyboardInterrupt:
            _leave_pending()

    return run


def _leave_pending() -> None:
    global _pending
    with _lock:
        _pending = True
    timer = threading.Timer(REDELIVER_AFTER_S, _redeliver)
    timer.daemon = True
    try:
        timer.start()
    except RuntimeError:
        pass  # the interpreter is shutting down: the hooks still raise it, if any run


def _take_pending() -> bool:
    global _pending
    with _lock:
        pending, _pending = _pending, False
    return pending


def _redeliver() -> None:
    if _take_pending():
        _thread.interrupt_main()


def raise_pending_interrupt() -> None:
    """Raises the KeyboardInterrupt a finalizer caught, if one is pending (on the main thread:
    the interrupt is the main thread's)."""
    if _pending and threading.current_thread() is threading.main_thread() and _take_pending():
        raise KeyboardInterrupt


__all__ = ["interrupt_safe", "raise_pending_interrupt"]
