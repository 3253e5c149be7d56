"""Run directories left behind by runs that died without cleaning up, and their reclaiming.

A run that is killed (SIGKILL, the OOM killer, a pre-empted job) cannot remove its swap files,
and a real run's are hundreds of GB. So each run directory holds a lock file on which the live
process keeps an exclusive ``flock``: the kernel drops it when the process dies, however it
dies. A later run on the same directory takes the lock of every run directory whose lock is
free and removes that directory; a live run's lock cannot be taken, so its directory is never
touched, and two runs reclaiming at once cannot both take one directory.

Only directories that are certainly ours are candidates: named with the run-directory prefix,
a real directory (not a symlink), owned by this user, holding a regular lock file. A directory
kept on purpose (``keep_swap_files``) gets a ``kept`` marker at close and is left alone.

Runs start side by side (the ranks of a job, all restarted at once by ``torchrun``), each
reclaiming while the others create their directories, so:

* the lock file gets its name only once it is locked: a reclaimer never finds a new run's lock
  free in the instant between its creation and its ``flock``;
* a forked child (a DataLoader worker) shares its parent's lock, and would keep a dead run's
  directory locked for as long as it lingers: children close their copy at fork (the parent
  keeps the lock);
* a reclaimer that takes a lock whose directory another reclaimer has just removed moves on.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: the lock file inside every run directory, held while the run lives
LOCK_NAME = "owner.lock"
#: the lock file's name while it is created, before it is locked (never a candidate's)
_NEW_LOCK_NAME = "owner.lock.new"
#: the marker of a run directory kept on purpose at close (``keep_swap_files``)
KEPT_NAME = "kept"


@dataclass(frozen=True)
class Leftover:
    """A run directory whose run is gone: its path, the bytes its files take, its age."""

    path: Path
    nbytes: int
    age_seconds: float


class RunLock:
    """The lock a live run holds on its directory; released by ``close`` or by the kernel."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_NAME
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        new = run_dir / _NEW_LOCK_NAME
        self._fd: int | None = os.open(new, flags, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(self._fd, f"{os.getpid()}\n".encode())
            # Named a lock file only now that it is held: see the module docstring.
            os.rename(new, self.path)
        except OSError:
            os.close(self._fd)
            self._fd = None
            raise
        _held.add(self)

    def close(self, keep: bool) -> None:
        """Releases the lock; ``keep`` marks the directory as kept, so no run reclaims it."""
        if self._fd is None:
            return
        try:
            if keep:
                (self.path.parent / KEPT_NAME).touch(mode=0o600)
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None
            _held.discard(self)

    def forget_in_child(self) -> None:
        """In a forked child: closes the child's copy of the descriptor without unlocking (the
        lock belongs to the open file, which the parent still holds)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


#: the locks this process holds, closed in forked children
_held: weakref.WeakSet[RunLock] = weakref.WeakSet()


def _forget_locks_in_child() -> None:
    for lock in list(_held):
        lock.forget_in_child()
    _held.clear()


os.register_at_fork(after_in_child=_forget_locks_in_child)


def find_leftovers(root: Path, prefix: str) -> list[Leftover]:
    """The run directories under ``root`` whose run is gone (reads only; takes no lock for
    longer than it takes to test it)."""
    found = []
    for run_dir in _candidates(root, prefix):
        fd = _take_lock(run_dir)
        if fd is not None:
            try:
                found.append(_describe(run_dir))
            finally:
                os.close(fd)
    return found


def reclaim_leftovers(root: Path, prefix: str) -> list[Leftover]:
    """Removes the run directories under ``root`` whose run is gone; returns what it removed."""
    removed = []
    for run_dir in _candidates(root, prefix):
        fd = _take_lock(run_dir)
        if fd is None:
            continue  # a live run, or another run reclaiming it right now
        try:
            leftover = _describe(run_dir)
            shutil.rmtree(run_dir)
        except OSError as exc:
            log.warning(
                "could not remove the swap directory %s of a run that is gone: %s", run_dir, exc
            )
            continue
        finally:
            os.close(fd)
        log.warning(
            "removed the swap directory %s of a run that ended without cleaning up "
            "(%d bytes, %.1f hours old)",
            run_dir,
            leftover.nbytes,
            leftover.age_seconds / 3600,
        )
        removed.append(leftover)
    return removed


def describe(found: list[Leftover]) -> str:
    """One line for a report: how many directories of dead runs, how many bytes, the oldest."""
    total = sum(f.nbytes for f in found)
    oldest = max(f.age_seconds for f in found) / 3600
    return (
        f"{len(found)} swap director{'y' if len(found) == 1 else 'ies'} of runs that died "
        f"without cleaning up ({total / 2**20:.1f} MiB, oldest {oldest:.1f} h): "
        f"{', '.join(str(f.path) for f in found)}"
    )


def _candidates(root: Path, prefix: str) -> list[Path]:
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    uid = os.geteuid()
    out = []
    for entry in entries:
        if not entry.name.startswith(prefix) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            lock = os.lstat(Path(entry.path) / LOCK_NAME)
        except OSError:
            continue  # no lock file: being created right now, or not a run directory of ours
        if stat.S_ISREG(lock.st_mode) and not os.path.lexists(Path(entry.path) / KEPT_NAME):
            out.append(Path(entry.path))
    return out


def _take_lock(run_dir: Path) -> int | None:
    """The lock file's descriptor with the lock held, or None while its run holds it."""
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    # Another reclaimer may have held it, removed the directory and let go since it was opened:
    # the lock taken is then an unlinked file's.
    try:
        still_there = os.path.samestat(os.fstat(fd), os.lstat(run_dir / LOCK_NAME))
    except OSError:
        still_there = False
    if not still_there:
        os.close(fd)
        return None
    return fd


def _describe(run_dir: Path) -> Leftover:
    nbytes = 0
    newest = 0.0
    for path in run_dir.iterdir():
        info = path.lstat()
        nbytes += info.st_blocks * 512  # what the preallocated files take on the drive
        newest = max(newest, info.st_mtime)
    newest = newest or run_dir.lstat().st_mtime
    return Leftover(run_dir, nbytes, max(0.0, time.time() - newest))
