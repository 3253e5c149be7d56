"""Process-lifetime bookkeeping of attached stores: one store per model, and swap files that do
not outlive the process.

Swap files are scratch space, often many GiB, so they must go when the process goes:

* ``close()`` and ``with TieredStore(...)`` remove them on the ordinary paths, exceptions included.
* SIGINT raises KeyboardInterrupt, which unwinds through the user's ``with``/``finally`` blocks;
  an ``atexit`` hook then closes whatever store is still open.
* SIGTERM (what ``kill``, SLURM, Kubernetes and torchrun send) kills a Python process without
  unwinding and without running ``atexit`` hooks. While a store is open a handler is installed
  (main thread only, as Python requires) that removes the swap files and then lets the default
  action run, so the process still dies from SIGTERM with the status callers expect.

The SIGTERM handler must not close stores the ordinary way: it runs on the main thread between
two bytecodes, possibly while that same thread holds the swap engine's (non-reentrant) lock or is
half-way through placement bookkeeping, so a normal close could deadlock or wait for transfers
that will never finish. It only unlinks the files and directories the engine created: unlinking
is safe at any point, and I/O still in flight on other threads lands in unlinked inodes.

A handler the user installed before attach is chained to instead of the default action, and is
run first and alone: it decides (a "stop after this step and checkpoint" flag must find the store
still working; a handler that raises SystemExit unwinds, and ``with``/``atexit`` clean up). The
handler is removed again when the last store closes, unless something replaced it meanwhile.

Forked children (DataLoader workers, ``os.fork``) inherit the handler and the registry but not
the stores' ownership: they never remove their parent's swap files.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import threading
import weakref
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from torch import nn

from infinity.errors import AttachError

if TYPE_CHECKING:  # the store imports this module
    from infinity.store import TieredStore

log = logging.getLogger(__name__)

_lock = threading.Lock()
#: stores attached (or attaching) and not yet torn down; weak, so a store dropped without close()
#: is still collected (its engine's own atexit hook in the swap layer then closes the engine)
_stores: weakref.WeakSet[TieredStore] = weakref.WeakSet()
#: every module of an attached model -> its store, so a second store cannot attach it
_owners: weakref.WeakKeyDictionary[nn.Module, weakref.ref[TieredStore]] = (
    weakref.WeakKeyDictionary()
)
#: the process whose stores these are; a forked child must not remove its parent's files
_owner_pid = os.getpid()
#: SIGTERM's disposition before ours was installed (None: ours is not installed)
_previous: Any = None


def register(store: TieredStore, model: nn.Module) -> None:
    """Claims ``model`` (and every submodule) for ``store`` and arms the SIGTERM and exit
    cleanup. Raises AttachError, changing nothing, when another open store holds any of them:
    its parameters are placeholders then, and attaching them again fails deep inside torch."""
    global _owner_pid
    with _lock:
        for name, module in model.named_modules():
            ref = _owners.get(module)
            other = ref() if ref is not None else None
            if other is not None and other is not store:
                where = f"its submodule '{name}'" if name else "it"
                raise AttachError(
                    f"{type(model).__name__} cannot be attached: {where} is already attached to "
                    f"another TieredStore; close that store first (store.close() gives the "
                    f"parameters back) or attach the model to only one store"
                )
        for module in model.modules():
            _owners[module] = weakref.ref(store)
        if not _stores:
            _owner_pid = os.getpid()
        _stores.add(store)
        _install_locked()


def unregister(store: TieredStore) -> None:
    """Forgets ``store`` (its swap files are gone); the last one out removes the handler."""
    with _lock:
        _stores.discard(store)
        for module, ref in list(_owners.items()):
            if ref() is store or ref() is None:
                del _owners[module]
        if not _stores:
            _uninstall_locked()


def store_of(module: nn.Module) -> TieredStore | None:
    """The open store ``module`` (or the model it is part of) is attached to, if any."""
    with _lock:
        ref = _owners.get(module)
    return ref() if ref is not None else None


def open_stores() -> list[TieredStore]:
    """The stores of this process that are attached and not yet closed."""
    return list(_stores) if os.getpid() == _owner_pid else []


# -- SIGTERM --------------------------------------------------------------------------------------
def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _install_locked() -> None:
    global _previous
    if not _on_main_thread():
        # signal.signal only works on the main thread; close() and atexit still clean up.
        log.debug(
            "attached from a thread other than the main thread: swap files are not "
            "removed if the process is killed by SIGTERM"
        )
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return
    if current is signal.SIG_IGN or current is None:
        # Ignored: SIGTERM cannot kill the process, nothing to clean up after. None: a handler
        # installed outside Python, which could not be chained to; leave it in charge.
        log.debug(
            "SIGTERM is %s: not installing the swap cleanup handler",
            "ignored" if current is signal.SIG_IGN else "handled outside Python",
        )
        return
    # Also when ours was replaced while stores were open: the replacement is chained to now.
    signal.signal(signal.SIGTERM, _on_sigterm)
    _previous = current


def _uninstall_locked() -> None:
    global _previous
    if not _on_main_thread():
        return  # off the main thread it stays; with no store open it only chains or dies
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, _previous if _previous is not None else signal.SIG_DFL)
        _previous = None
    # else: someone replaced ours after attach; theirs stays, and so does whatever it chains to


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    previous = _previous
    if previous is _on_sigterm:  # cannot happen (install checks); never recurse forever
        previous = None
    if callable(previous):
        # The user's policy decides; see the module docstring. If it raises (SystemExit), the
        # unwinding closes the stores; if it returns, training goes on and needs its files.
        previous(signum, frame)
        return
    if os.getpid() == _owner_pid:
        try:
            remove_swap_files()
        except Exception:
            log.exception("removing swap files on SIGTERM failed")
    # Die the way SIGTERM kills when nobody handles it: exit status -SIGTERM (143 in a shell),
    # which schedulers and torchrun read as "terminated", not "failed".
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    raise SystemExit(128 + signum)  # not reached: the default action ends the process


def remove_swap_files() -> int:
    """Unlinks the swap files and run directories of every open store (and of engines whose
    store was dropped without close), without waiting for or locking anything: for a process
    about to die. Returns how many files it removed. Kept files (keep_swap_files) stay."""
    if os.getpid() != _owner_pid:
        return 0
    removed = 0
    engines: list[Any] = []
    temp_dirs: list[Path] = []
    for store in list(_stores):
        if store.engine is not None:
            engines.append(store.engine)
        if store.temp_dir is not None and not store.config.keep_swap_files:
            temp_dirs.append(store.temp_dir)
    try:  # engines of stores dropped without close(): still open, files still on disk
        from swap.engine import open_engines

        engines += [e for e in open_engines() if e not in engines]
    except Exception:
        pass
    for engine in engines:
        if engine.keep_files:
            continue
        space = engine.space
        # Only what the engine created: its files by path, then its (now empty) run dirs. A
        # name planted in a run dir is not ours and keeps the directory from being removed.
        for file in list(space.files):
            try:
                file.path.unlink(missing_ok=True)
                removed += 1
            except OSError as exc:
                log.warning("could not remove swap file %s: %s", file.path, exc)
        for lock in list(space.lock_files):
            lock.unlink(missing_ok=True)
        for run_dir in list(space.run_dirs):
            try:
                run_dir.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not remove swap directory %s: %s", run_dir, exc)
    for temp_dir in temp_dirs:
        shutil.rmtree(temp_dir, ignore_errors=True)
    if engines or temp_dirs:
        log.warning(
            "terminated: removed %d swap file(s) of %d swap engine(s)", removed, len(engines)
        )
    return removed


# -- exit and fork --------------------------------------------------------------------------------
def _close_at_exit() -> None:
    """Closes stores still open when the interpreter exits (a forgotten close(), or an
    exception such as KeyboardInterrupt that ended the program), removing their swap files.
    Registered after the swap layer's own hook, so it runs first (atexit is last-in, first-out)
    and the engines are closed through their stores."""
    for store in open_stores():
        try:
            store.close(restore_params=False)  # the process is ending: nothing to give back
        except Exception:
            log.exception("closing an infinity store at exit failed")


def _forget_in_child() -> None:
    """After fork, in the child: the stores, their files and the model belong to the parent."""
    global _lock
    _lock = threading.Lock()  # another parent thread may have held it at the fork
    _stores.clear()
    _owners.clear()
    # The swap layer forgets the parent's engines in a forked child by itself.
    # The handler stays installed (it is the parent's disposition), but with no stores it only
    # chains or dies; _owner_pid still names the parent, so nothing of it is removed.


atexit.register(_close_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)
