"""Errors raised by the swap layer.

Every error says what failed, where (file and offset when there is one) and what to do about it,
because the people who read them are training users looking at a log, not swap-layer developers.
"""

from __future__ import annotations

import errno as errno_mod
import os
from pathlib import Path


class OffloadError(Exception):
    """Root of every error this project raises, swap layer and runtime alike. It lives here,
    at the bottom of the dependency chain, so ``infinity.InfinityError`` (which is this class)
    also catches a bad nvme_path or a full disk while swap/ imports nothing from infinity/."""


class SwapError(OffloadError):
    """Base class of every error the swap layer raises."""


class SwapConfigError(SwapError, ValueError):
    """A swap-layer setting is out of range or of the wrong type."""


class NvmePathError(SwapError):
    """A swap directory is missing, not a directory, not writable, or otherwise unusable."""


class SwapSpaceError(SwapError):
    """The swap directory cannot hold the bytes asked for (full disk, quota, preflight check)."""

    def __init__(
        self, message: str, *, path: Path | None = None, needed: int = 0, available: int = 0
    ) -> None:
        super().__init__(message)
        self.path = path
        self.needed = needed
        self.available = available


class PoolExhaustedError(SwapError):
    """Every buffer of a pool is in use and none came back in time."""


class SwapIOError(SwapError, OSError):
    """A read or write against a swap file failed.

    Carries the operation, file, offset and length of the failing request and the OS error.
    """

    def __init__(
        self, op: str, path: Path | str, offset: int, length: int, err: int, detail: str = ""
    ) -> None:
        self.op = op
        self.path = Path(path)
        self.offset = offset
        self.length = length
        self.errno = err
        cause = os.strerror(err) if err else "unexpected result"
        name = errno_mod.errorcode.get(err, str(err)) if err else ""
        hint = _HINTS.get(err, "")
        text = (
            f"{op} of {length} bytes at offset {offset} in {self.path} failed: "
            f"{name + ' ' if name else ''}({cause})"
        )
        if detail:
            text += f"; {detail}"
        if hint:
            text += f". {hint}"
        self.message = text
        Exception.__init__(self, text)

    def __str__(self) -> str:
        return self.message


class IntegrityError(SwapError):
    """Bytes read back from a swap file are not the bytes that were written there.

    ``path``/``offset`` locate the first bad chunk on disk, ``extent`` is the extent's serial,
    ``expected`` the identity (tag) the read asked for, ``found`` what the bytes turned out to be
    (another extent's or version's bytes, zeros, or nothing known)."""

    def __init__(
        self,
        message: str,
        *,
        path: Path | str | None = None,
        offset: int | None = None,
        extent: int | None = None,
        expected: object = None,
        found: str | None = None,
    ) -> None:
        super().__init__(message)
        self.path = Path(path) if path is not None else None
        self.offset = offset
        self.extent = extent
        self.expected = expected
        self.found = found


class TransferTimeoutError(SwapError, TimeoutError):
    """A request did not complete within the configured timeout (``request_timeout`` while the
    engine runs, ``close_timeout`` when it closes). ``path``/``offset``/``timeout`` are set when
    one request is to blame; ``quarantine`` (a ``swap.transfer.Quarantined``) then says which
    buffer range the kernel may still write, and its ``released`` event when it no longer can."""

    def __init__(
        self,
        message: str,
        *,
        path: Path | str | None = None,
        offset: int | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__(message)
        self.path = Path(path) if path is not None else None
        self.offset = offset
        self.timeout = timeout
        self.quarantine: object | None = None


_HINTS = {
    errno_mod.ENOSPC: "The file system is full: free space or point nvme_path at a larger drive",
    errno_mod.EDQUOT: "The disk quota is exhausted: raise it or point nvme_path elsewhere",
    errno_mod.EIO: "The device reported an I/O error: check the drive (dmesg, smartctl)",
    errno_mod.EINVAL: (
        "The request was rejected; with O_DIRECT this usually means a misaligned "
        "buffer or offset, or a file system that does not support direct I/O"
    ),
    errno_mod.EROFS: "The file system is read-only: point nvme_path at a writable directory",
    errno_mod.EACCES: "Permission denied: point nvme_path at a directory this user can write",
}
