"""The swap layer: aligned host buffers, async file I/O backends and swap files.

It knows bytes, not models, and imports nothing from ``infinity``.
"""

from swap.backends.base import IOBackend, IORequest, Op
from swap.buffers import (
    ALIGNMENT,
    BufferPool,
    HostBuffer,
    advise_huge_pages,
    align_up,
    huge_pages_on_request,
    release_pages,
)
from swap.engine import EngineSettings, SwapEngine, TransferFuture
from swap.errors import (
    IntegrityError,
    NvmePathError,
    PoolExhaustedError,
    SwapConfigError,
    SwapError,
    SwapIOError,
    SwapSpaceError,
    TransferTimeoutError,
)
from swap.faults import FaultInjectingBackend
from swap.files import Extent, SwapSpace
from swap.probe import (
    BACKENDS,
    choose_backend,
    choose_backend_for,
    clear_probe_cache,
    make_backend,
    probe_direct_io,
)
from swap.stats import EngineStats

__all__ = [
    "ALIGNMENT",
    "BACKENDS",
    "BufferPool",
    "EngineSettings",
    "EngineStats",
    "Extent",
    "FaultInjectingBackend",
    "HostBuffer",
    "IOBackend",
    "IORequest",
    "IntegrityError",
    "NvmePathError",
    "Op",
    "PoolExhaustedError",
    "SwapConfigError",
    "SwapEngine",
    "SwapError",
    "SwapIOError",
    "SwapSpace",
    "SwapSpaceError",
    "TransferFuture",
    "TransferTimeoutError",
    "advise_huge_pages",
    "align_up",
    "choose_backend",
    "choose_backend_for",
    "clear_probe_cache",
    "huge_pages_on_request",
    "make_backend",
    "probe_direct_io",
    "release_pages",
]
