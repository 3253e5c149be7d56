"""Finalizers that do not swallow Ctrl-C or a signal handler's exit.

Python ignores an exception raised inside a finalizer (``__del__``, a ``weakref.finalize``
callback): it prints "Exception ignored in ..." and goes on. A signal is handled in whatever
Python code the main thread runs at that moment, so the KeyboardInterrupt of a SIGINT, or the
SystemExit a user's SIGTERM handler raises, is lost when it lands in a finalizer, and training
carries on as if nothing had been asked. The store's accounting runs finalizers for every
tensor autograd saves (the saved-activation meter, the activation offload), which makes that
landing common enough to be seen.

A finalizer wrapped by ``interrupt_safe`` catches those exceptions and leaves them pending. The
store's root forward hook raises them again at the next forward (``raise_pending_interrupt``),
outside any finalizer. A KeyboardInterrupt is also asked for again a moment later by a timer
(``_thread.interrupt_main``), for a loop that runs no hook of ours; asking at once would not do,
as the main thread would handle the request at its next check, still inside the finalizer.

That second request can land in a finalizer too, one nobody wrapped (torch's, a library's, the
garbage collector's), and be swallowed the same way: under load, when backward frees many
saved tensors at once, it was. So once an interrupt is pending, the interpreter's hook for
exceptions it ignores (``sys.unraisablehook``, which Python provides to be replaced) takes a
KeyboardInterrupt or SystemExit it is handed and leaves it pending again, instead of printing
"Exception ignored"; anything else goes to the hook that was there before.
"""

from __future__ import annotations

import _thread
import functools
import sys
import threading
from collections.abc import Callable
from typing import ParamSpec

P = ParamSpec("P")

#: how long the timer waits before asking again, so the finalizer has returned by then
REDELIVER_AFTER_S = 0.05

#: re-entrant: a finalizer run by the collector inside a locked section may end in _rescue
_lock = threading.RLock()
_pending: BaseException | None = None
#: the unraisable hook :func:`_rescue` replaced, which it hands everything else
_previous_hook: Callable[[sys.UnraisableHookArgs], object] | None = None
#: set while :func:`_rescue` hands an exception to ``_previous_hook``
_handing_on = threading.local()


def interrupt_safe(finalizer: Callable[P, None]) -> Callable[P, None]:
    """``finalizer``, with a KeyboardInterrupt or SystemExit raised inside it (by a signal
    handler) raised again afterwards."""

    @functools.wraps(finalizer)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            finalizer(*args, **kwargs)
        except (KeyboardInterrupt, SystemExit) as exc:
            _leave_pending(exc)

    return run


def _leave_pending(exc: BaseException) -> None:
    global _pending
    with _lock:
        if _pending is None:
            _pending = exc
    _rescue_ignored_interrupts()
    if not isinstance(exc, KeyboardInterrupt):
        return
    timer = threading.Timer(REDELIVER_AFTER_S, _redeliver)
    timer.daemon = True
    try:
        timer.start()
    except RuntimeError:
        pass  # the interpreter is shutting down; the hooks still raise it, if any run


def _rescue_ignored_interrupts() -> None:
    """Puts :func:`_rescue` in front of ``sys.unraisablehook`` (unless it is there already)."""
    global _previous_hook
    with _lock:
        if sys.unraisablehook is _rescue:
            return
        _previous_hook = sys.unraisablehook
        sys.unraisablehook = _rescue


def _rescue(unraisable: sys.UnraisableHookArgs) -> None:
    exc = unraisable.exc_value
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        _leave_pending(exc)
        return
    if getattr(_handing_on, "active", False):
        # The hook we hand it to handed it back: one installed after ours, which we then put
        # ourselves in front of again. Python's own hook ends the loop.
        sys.__unraisablehook__(unraisable)
        return
    _handing_on.active = True
    try:
        (_previous_hook or sys.__unraisablehook__)(unraisable)
    finally:
        _handing_on.active = False


def _take_pending() -> BaseException | None:
    global _pending
    with _lock:
        pending, _pending = _pending, None
    return pending


def _redeliver() -> None:
    global _pending
    with _lock:
        if not isinstance(_pending, KeyboardInterrupt):
            return  # raised by a hook already (or something else is pending: the hooks' job)
        _pending = None
    _thread.interrupt_main()


def raise_pending_interrupt() -> None:
    """Raises what a finalizer caught, if anything is pending (on the main thread only: the
    signal was the main thread's)."""
    if _pending is None or threading.current_thread() is not threading.main_thread():
        return
    pending = _take_pending()
    if pending is not None:
        raise pending


__all__ = ["interrupt_safe", "raise_pending_interrupt"]
