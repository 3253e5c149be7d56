"""The engine's settings. Field names match the runtime's ``aio`` config."""

from __future__ import annotations

from dataclasses import dataclass

from swap.buffers import ALIGNMENT
from swap.errors import SwapConfigError

#: bytes per checksum unless set: a whole shard of the runtime's default buffer size
DEFAULT_CHECKSUM_CHUNK = 64 << 20


@dataclass(frozen=True)
class EngineSettings:
    """How the engine talks to the disk. Field names match the runtime's ``aio`` config.

    ``close_timeout`` bounds how long ``close`` waits for transfers still queued or in flight
    before failing them with :class:`TransferTimeoutError`. ``request_timeout`` fails the
    transfer of a request in flight longer than that (None: wait forever).
    ``verify_checksums`` records a checksum of every chunk written and verifies reads against
    it (``swap.integrity``); off, no checksum work is done and tags are ignored.
    ``checksum_chunk`` is the bytes each checksum covers (rounded up to a multiple of
    ``block_size``; None: the larger of ``block_size`` and 64 MiB). Each chunk is hashed in one
    call with the GIL released, so larger chunks mean fewer hand-offs of the interpreter; a
    partial transfer verifies only the chunks it covers whole. ``grow_files``: a swap file's
    blocks are allocated as extents are taken from it (each extent's range with
    ``posix_fallocate`` when allocated), so the disk holds what was stored; ``file_size`` is then
    a file's largest size, not what it takes at creation (off: each file is allocated whole when
    made)."""

    backend: str = "auto"
    block_size: int = 1 << 20
    queue_depth: int = 8
    thread_count: int | None = None
    file_size: int = 1 << 30
    close_timeout: float = 60.0
    request_timeout: float | None = 60.0
    verify_checksums: bool = True
    checksum_chunk: int | None = None
    grow_files: bool = False

    @property
    def chunk_size(self) -> int:
        """The integrity chunk: ``checksum_chunk`` (or its default) on the block grid."""
        wanted = self.checksum_chunk or max(self.block_size, DEFAULT_CHECKSUM_CHUNK)
        return -(-wanted // self.block_size) * self.block_size

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "file_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SwapConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size % ALIGNMENT:
            raise SwapConfigError(
                f"block_size must be a multiple of {ALIGNMENT}, got {self.block_size}"
            )
        if self.thread_count is not None and (
            not isinstance(self.thread_count, int)
            or isinstance(self.thread_count, bool)
            or self.thread_count < 1
        ):
            raise SwapConfigError(
                f"thread_count must be a positive integer, got {self.thread_count!r}"
            )
        for name in ("close_timeout", "request_timeout"):
            value = getattr(self, name)
            if name == "request_timeout" and value is None:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise SwapConfigError(
                    f"{name} must be a positive number of seconds"
                    f"{' or None' if name == 'request_timeout' else ''}, got "
                    f"{value!r}"
                )
        if self.checksum_chunk is not None and (
            not isinstance(self.checksum_chunk, int)
            or isinstance(self.checksum_chunk, bool)
            or self.checksum_chunk < 1
        ):
            raise SwapConfigError(
                f"checksum_chunk must be a positive integer or None, got {self.checksum_chunk!r}"
            )
        if not isinstance(self.verify_checksums, bool):
            raise SwapConfigError(
                f"verify_checksums must be true or false, got {self.verify_checksums!r}"
            )
