"""Swap directories, swap files (allocated whole, or as extents are taken) and the extent
allocator.

Layout: each directory of ``nvme_path`` gets one private run directory (mode 0700, random name,
created exclusively), locked by the live process; directories of runs that died are reclaimed by the
next run on the same directory (:mod:`swap.leftovers`). Inside it live swap files (mode 0600,
``O_EXCL | O_NOFOLLOW``), each allocated with ``posix_fallocate`` so that writes land in
allocated blocks and never extend the file: extending writes go through the kernel's worker threads
and lose about half the throughput. A file is allocated whole when made, or, growing
(``grow``), one extent's range at a time as extents are taken, so the disk holds what is stored
rather than a worst case.

An :class:`Extent` is the home of one shard's bytes. With several directories (one per drive)
it is striped RAID-0 style in ``stripe_size`` units, so one large transfer keeps every drive busy.
Each stripe member is one contiguous, 4096-aligned segment of one file. The extent records its
logical size, so padding up to the alignment and the end of a file never leak into a read.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from swap.buffers import ALIGNMENT, align_up
from swap.errors import NvmePathError, SwapSpaceError
from swap.leftovers import Leftover, RunLock, reclaim_leftovers

log = logging.getLogger(__name__)

RUN_DIR_PREFIX = "infinity-swap-"


def check_directory(path: Path) -> Path:
    """Resolves ``path`` and checks that a run directory can be made in it; raises NvmePathError."""
    path = Path(path).expanduser()
    if not path.exists():
        raise NvmePathError(
            f"nvme_path {path} does not exist: create it (mkdir -p {path}) or "
            f"point nvme_path at an existing directory on your NVMe drive"
        )
    if not path.is_dir():
        raise NvmePathError(f"nvme_path {path} is not a directory: point nvme_path at a directory")
    if os.statvfs(path).f_flag & os.ST_RDONLY:
        raise NvmePathError(
            f"nvme_path {path} is on a read-only file system: point nvme_path at "
            f"a directory on a writable drive"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise NvmePathError(
            f"nvme_path {path} is not writable by this user: fix its permissions "
            f"or choose another directory"
        )
    return path.resolve()


@dataclass(frozen=True)
class SwapDirectories:
    """Directories :func:`check_directory` accepted, resolved, in order. :class:`SwapSpace` and
    the swap engine take one in place of paths and check nothing again, so a caller that
    checks first (to report free space, say) checks each directory once."""

    paths: tuple[Path, ...]

    @classmethod
    def check(cls, paths: Iterable[Path | str]) -> SwapDirectories:
        """Checks every directory before anything is created in any of them."""
        return cls(tuple(check_directory(Path(p)) for p in paths))


class SwapFile:
    """One swap file; reads and writes go through its descriptor at absolute offsets. Allocated
    whole when made, or (``grow``) range by range as extents are taken from it (:meth:`reserve`),
    up to ``capacity``."""

    def __init__(
        self, path: Path, capacity: int, direct: bool, drive: int = 0, grow: bool = False
    ) -> None:
        self.path = path
        self.capacity = capacity
        self.direct = direct
        self.drive = drive  # index of the directory it lives in: the engine queues per drive
        #: the file system has no fallocate: the file is sized whole (sparse) instead
        self._sized = False
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        if direct:
            flags |= os.O_DIRECT
        try:
            self.fd = os.open(path, flags, 0o600)
        except OSError as exc:
            # Nothing was created, so nothing is removed: a name that already exists (a planted
            # file or symlink) belongs to someone else and is left alone.
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise SwapSpaceError(
                    f"cannot create swap file {path}: {exc}. Free space or "
                    f"inodes on that file system",
                    path=path,
                    needed=capacity,
                ) from exc
            if exc.errno in (errno.EEXIST, errno.ELOOP):
                raise NvmePathError(
                    f"refusing to use swap file {path}: something else already "
                    f"exists under that name in the private swap directory "
                    f"(planted file or symlink?)"
                ) from exc
            raise NvmePathError(f"cannot create swap file {path}: {exc}") from exc
        if grow:
            return
        try:
            os.posix_fallocate(self.fd, 0, capacity)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                # No fallocate (some network file systems; glibc's emulation fails on O_DIRECT
                # with EINVAL): size the file so reads past the last write see zeros; writes
                # may then allocate blocks, which is slower but correct.
                log.warning("%s: fallocate is not supported, swap writes may be slower", path)
                try:
                    os.ftruncate(self.fd, capacity)
                    return
                except OSError as trunc_exc:
                    exc = trunc_exc
            os.close(self.fd)
            self.fd = -1
            path.unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                free = shutil.disk_usage(path.parent).free
                raise SwapSpaceError(
                    f"cannot preallocate {capacity} bytes for swap file {path}: only {free} bytes "
                    f"free on that file system. Free space, lower the offloaded size, or add "
                    f"another directory to nvme_path",
                    path=path,
                    needed=capacity,
                    available=free,
                ) from exc
            raise NvmePathError(f"cannot preallocate swap file {path}: {exc}") from exc

    def reserve(self, offset: int, length: int) -> None:
        """Allocates ``[offset, offset + length)`` on the disk (a growing file, before an
        extent there is handed out), so writes land in allocated blocks. Raises SwapSpaceError
        when the file system is full; the file keeps what it held."""
        if self._sized:
            return
        try:
            os.posix_fallocate(self.fd, offset, length)
            return
        except OSError as exc:
            error = exc
        if error.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            # As at creation without fallocate: sized whole, sparse; writes allocate blocks.
            log.warning("%s: fallocate is not supported, swap writes may be slower", self.path)
            try:
                os.ftruncate(self.fd, max(self.capacity, os.fstat(self.fd).st_size))
                self._sized = True
                return
            except OSError as trunc_exc:
                error = trunc_exc
        if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            free = shutil.disk_usage(self.path.parent).free
            raise SwapSpaceError(
                f"cannot allocate {length} more bytes in swap file {self.path}: the file "
                f"system is full ({free} bytes free). What was stored so far is kept. Free "
                f"space there, add another directory to nvme_path, or offload less",
                path=self.path,
                needed=length,
                available=free,
            ) from error
        raise NvmePathError(f"cannot allocate swap file {self.path}: {error}") from error

    def release(self, offset: int, length: int) -> None:
        """Gives ``[offset, offset + length)``'s blocks back to the file system (a growing
        file, its range freed): a hole, allocated again by :meth:`reserve` when reused. Where
        holes cannot be punched the blocks stay, for the next extent there."""
        if self._sized or self.fd < 0:
            return
        try:
            _punch_hole(self.fd, offset, length)
        except OSError as exc:
            log.debug("%s: blocks of a freed range kept (%s)", self.path, exc)

    @property
    def disk_bytes(self) -> int:
        """Bytes the file takes on the disk (its allocated blocks: what ``du`` shows)."""
        if self.fd < 0:
            return 0
        return os.fstat(self.fd).st_blocks * 512

    def close(self, remove: bool) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if remove:
            self.path.unlink(missing_ok=True)

    def __repr__(self) -> str:
        return f"SwapFile({str(self.path)!r}, capacity={self.capacity})"


@dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous, aligned run of bytes in one swap file."""

    file: SwapFile
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Extent:
    """Where one object's bytes live: stripe members and the logical byte count.

    ``serial`` is unique per allocation, so a stale extent (freed, its space since handed to a
    new extent with the same layout) never compares equal to the new one: freeing it twice is
    caught instead of freeing the new owner's bytes."""

    segments: tuple[Segment, ...]
    nbytes: int
    stripe_size: int
    serial: int = 0

    @property
    def capacity(self) -> int:
        return sum(s.length for s in self.segments)

    def locate(self, offset: int, length: int) -> list[tuple[SwapFile, int, int, int]]:
        """Maps ``[offset, offset + length)`` of the extent onto (file, file offset, extent
        offset, length) pieces that each stay inside one stripe unit."""
        pieces = []
        count = len(self.segments)
        end = offset + length
        while offset < end:
            if count == 1:
                seg = self.segments[0]
                pieces.append((seg.file, seg.offset + offset, offset, end - offset))
                break
            unit, within = divmod(offset, self.stripe_size)
            seg = self.segments[unit % count]
            take = min(self.stripe_size - within, end - offset)
            pieces.append(
                (seg.file, seg.offset + (unit // count) * self.stripe_size + within, offset, take)
            )
            offset += take
        return pieces


class RangeAllocator:
    """Free byte ranges of one file, kept sorted and coalesced; first fit."""

    def __init__(self, capacity: int) -> None:
        self.starts = [0]
        self.lengths = [capacity]

    def take(self, length: int) -> int | None:
        for i, free in enumerate(self.lengths):
            if free >= length:
                start = self.starts[i]
                if free == length:
                    del self.starts[i], self.lengths[i]
                else:
                    self.starts[i] += length
                    self.lengths[i] -= length
                return start
        return None

    def give(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        if (
            i > 0
            and self.starts[i - 1] + self.lengths[i - 1] > start
            or i < len(self.starts)
            and start + length > self.starts[i]
        ):
            raise ValueError(f"double free of swap range [{start}, {start + length})")
        if i > 0 and self.starts[i - 1] + self.lengths[i - 1] == start:
            i -= 1
            self.lengths[i] += length
        else:
            self.starts.insert(i, start)
            self.lengths.insert(i, length)
        if i + 1 < len(self.starts) and self.starts[i] + self.lengths[i] == self.starts[i + 1]:
            self.lengths[i] += self.lengths[i + 1]
            del self.starts[i + 1], self.lengths[i + 1]

    @property
    def free_bytes(self) -> int:
        return sum(self.lengths)

    def can_take(self, lengths: list[int]) -> bool:
        """Whether ``take`` would find a range for each of ``lengths``, taken in this order."""
        free = list(self.lengths)
        for length in lengths:
            for i, size in enumerate(free):
                if size >= length:
                    free[i] -= length
                    break
            else:
                return False
        return True


class _DriveSpace:
    """The run directory on one drive and its swap files."""

    def __init__(
        self,
        root: Path,
        direct: bool,
        file_size: int,
        index: int,
        label: str = "",
        grow: bool = False,
    ) -> None:
        self.root = root
        self.direct = direct
        self.file_size = file_size
        self.index = index
        self.grow = grow
        # 0700, exclusive; the label (a rank) makes it recognisable, the prefix reclaimable
        self.run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX + label, dir=root))
        if stat.S_IMODE(self.run_dir.stat().st_mode) != 0o700:
            os.chmod(self.run_dir, 0o700)
        try:
            # Held while this process lives: a later run reclaims the directory once it is free.
            self.lock = RunLock(self.run_dir)
        except OSError:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            raise
        self.files: list[SwapFile] = []
        self.free: list[RangeAllocator] = []
        self.slot: dict[SwapFile, int] = {}  # file -> its index in files/free (identity hash)

    def take(self, length: int) -> Segment:
        for file, free in zip(self.files, self.free):
            start = free.take(length)
            if start is not None:
                return self._reserved(file, free, start, length)
        capacity = max(self.file_size, length)
        file = SwapFile(
            self.run_dir / f"swap-{len(self.files):04d}.bin",
            capacity,
            self.direct,
            self.index,
            grow=self.grow,
        )
        self.slot[file] = len(self.files)
        self.files.append(file)
        self.free.append(RangeAllocator(capacity))
        start = self.free[-1].take(length)
        assert start == 0
        return self._reserved(file, self.free[-1], start, length)

    def _reserved(self, file: SwapFile, free: RangeAllocator, start: int, length: int) -> Segment:
        """The segment, its blocks allocated first where the file grows (the range goes back
        to the allocator when the disk is full)."""
        if self.grow:
            try:
                file.reserve(start, length)
            except BaseException:
                free.give(start, length)
                raise
        return Segment(file, start, length)

    def give(self, segment: Segment) -> None:
        self.free[self.slot[segment.file]].give(segment.offset, segment.length)
        if self.grow:
            segment.file.release(segment.offset, segment.length)

    def close(self, keep: bool) -> None:
        for file in self.files:
            file.close(remove=not keep)
        self.lock.close(keep)
        if not keep:
            try:
                self.run_dir.rmdir()
            except OSError as exc:
                log.warning("could not remove swap directory %s: %s", self.run_dir, exc)


class SwapSpace:
    """Allocates extents across the run directories of one or more drives.

    ``file_size`` is the preallocation step: a new file of at least that size is created when no
    existing file has a free range large enough.
    """

    def __init__(
        self,
        paths: list[Path] | tuple[Path, ...] | SwapDirectories,
        *,
        direct: bool,
        file_size: int = 1 << 30,
        stripe_size: int = 1 << 20,
        label: str = "",
        grow: bool = False,
    ) -> None:
        if isinstance(paths, SwapDirectories):
            roots = list(paths.paths)
        else:
            roots = [check_directory(Path(p)) for p in paths]
        if not roots:
            raise NvmePathError("nvme_path lists no directory")
        if stripe_size % ALIGNMENT:
            raise ValueError(f"stripe_size must be a multiple of {ALIGNMENT}")
        #: run directories of runs that died without cleaning up, removed here
        self.reclaimed: list[Leftover] = []
        for root in roots:
            self.reclaimed += reclaim_leftovers(root, RUN_DIR_PREFIX)
        self.stripe_size = stripe_size
        self.file_size = align_up(file_size)
        self._lock = threading.Lock()
        self._drives: list[_DriveSpace] = []
        try:
            for i, root in enumerate(roots):
                self._drives.append(_DriveSpace(root, direct, self.file_size, i, label, grow))
        except OSError as exc:
            self.close(keep=False)
            raise NvmePathError(
                f"cannot create a swap directory in {root}: {exc}. Point nvme_path "
                f"at a writable directory"
            ) from exc
        self._closed = False
        self._next_drive = 0
        self._serial = 0
        self._live: set[int] = set()  # serials of extents allocated and not yet freed
        #: the most bytes the swap files took on the disk, as sampled at each allocation
        self._peak_disk = 0

    @property
    def run_dirs(self) -> list[Path]:
        return [d.run_dir for d in self._drives]

    @property
    def files(self) -> list[SwapFile]:
        return [f for d in self._drives for f in d.files]

    @property
    def lock_files(self) -> list[Path]:
        return [d.lock.path for d in self._drives]

    def allocate(self, nbytes: int) -> Extent:
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        count = len(self._drives)
        per_drive = _per_drive(nbytes, count, self.stripe_size)
        segments = []
        with self._lock:
            if self._closed:
                raise RuntimeError("swap space is closed")
            # Extents that fit in one stripe unit rotate over the drives, so small shards spread.
            first = self._next_drive if len(per_drive) == 1 else 0
            self._next_drive = (self._next_drive + 1) % count
            try:
                for i, length in enumerate(per_drive):
                    if length:
                        segments.append(self._drives[(first + i) % count].take(length))
            except BaseException:
                for segment in segments:
                    self._drive_of(segment).give(segment)
                raise
            self._serial += 1
            self._live.add(self._serial)
            self._peak_disk = max(self._peak_disk, self._disk_bytes())
            return Extent(tuple(segments), nbytes, self.stripe_size, self._serial)

    def free(self, extent: Extent) -> None:
        with self._lock:
            if self._closed:
                return
            if extent.serial not in self._live or not all(
                self._holds(s.file) for s in extent.segments
            ):
                raise ValueError(
                    f"double free (or foreign extent): extent #{extent.serial} of "
                    f"{extent.nbytes} bytes is not allocated from this swap space"
                )
            for segment in extent.segments:
                self._drive_of(segment).give(segment)
            self._live.discard(extent.serial)

    def check_extent(self, extent: Extent) -> None:
        """Raises ValueError unless ``extent`` is allocated from this space and not yet freed:
        I/O on a freed extent would overwrite whoever owns those bytes now."""
        with self._lock:
            if self._closed:
                raise RuntimeError("swap space is closed")
            if extent.serial not in self._live or not all(
                self._holds(s.file) for s in extent.segments
            ):
                raise ValueError(
                    f"extent #{extent.serial} ({extent.nbytes} bytes) is not "
                    f"allocated from this swap space (freed already, or another "
                    f"engine's)"
                )

    def _holds(self, file: SwapFile) -> bool:
        return file.drive < len(self._drives) and file in self._drives[file.drive].slot

    def _drive_of(self, segment: Segment) -> _DriveSpace:
        if not self._holds(segment.file):
            raise ValueError("segment belongs to no drive of this swap space")
        return self._drives[segment.file.drive]

    @property
    def allocated_bytes(self) -> int:
        with self._lock:
            return sum(f.capacity for d in self._drives for f in d.files) - sum(
                fl.free_bytes for d in self._drives for fl in d.free
            )

    @property
    def file_bytes(self) -> int:
        with self._lock:
            return sum(f.capacity for d in self._drives for f in d.files)

    def _disk_bytes(self) -> int:
        return sum(f.disk_bytes for d in self._drives for f in d.files)

    @property
    def disk_bytes(self) -> int:
        """Bytes the swap files take on the disk now (their allocated blocks, as ``du``
        counts them)."""
        with self._lock:
            return self._disk_bytes()

    @property
    def peak_disk_bytes(self) -> int:
        """The most bytes the swap files took on the disk (sampled at each allocation)."""
        with self._lock:
            self._peak_disk = max(self._peak_disk, self._disk_bytes())
            return self._peak_disk

    @staticmethod
    def extent_capacity(nbytes: int, drives: int, stripe_size: int) -> int:
        """Bytes of the swap files an extent of ``nbytes`` takes over ``drives`` drives (as
        :meth:`allocate` lays it out): its size aligned, or whole stripe units per drive."""
        return sum(_per_drive(nbytes, drives, stripe_size))

    def close(self, keep: bool = False) -> None:
        with self._lock:
            self._closed = True
            drives, self._drives = self._drives, []
        for drive in drives:
            drive.close(keep)


def _per_drive(nbytes: int, drives: int, stripe_size: int) -> list[int]:
    """The bytes of each drive's segment of an extent of ``nbytes``: its size aligned on one
    drive, or whole stripe units spread over ``drives`` when it is larger than one."""
    capacity = align_up(max(nbytes, 1))
    if drives > 1 and capacity > stripe_size:
        units = -(-capacity // stripe_size)
        return [
            (units // drives + (1 if i < units % drives else 0)) * stripe_size
            for i in range(drives)
        ]
    return [capacity]


#: fallocate(2)'s modes: free a range's blocks, the file's size unchanged
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc: ctypes.CDLL | None = None


def _punch_hole(fd: int, offset: int, length: int) -> None:
    """fallocate(fd, PUNCH_HOLE | KEEP_SIZE, offset, length) (os has no fallocate with modes)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    function = _libc.fallocate
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    if function(fd, mode, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
