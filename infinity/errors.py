"""Errors raised by the infinity runtime.

Messages are read by training users in a log, so each one says what is wrong, with which value,
and what to do about it.
"""

from __future__ import annotations

from swap.errors import OffloadError

#: Base class of every error the runtime raises, the swap layer's included (it is the swap
#: layer's root class, so ``except InfinityError`` catches a bad nvme_path or a full disk too).
InfinityError = OffloadError


class ConfigError(InfinityError, ValueError):
    """A configuration value or key is invalid.

    ``field`` is the dotted name of the offending setting (``"aio.queue_depth"``) when one is
    known, so callers such as CLIs can point at it without parsing the message.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class AttachError(InfinityError):
    """The model or optimizer cannot be attached as given."""


class BudgetError(InfinityError):
    """A device or host budget cannot hold what must be resident at once."""


class ParameterAccessError(InfinityError, RuntimeError):
    """An operation on an attached parameter or its gradient that the store cannot honour where
    it was called (an in-place write outside ``store.gathered(..., modify=True)``). The message
    names the parameter and the way to do it."""


class RankError(InfinityError, RuntimeError):
    """A collective across data-parallel ranks failed (a rank died or stopped, the process
    group's timeout passed) or the ranks disagree on what they attached. The message names the
    operation and this rank."""


class CheckpointError(InfinityError):
    """A checkpoint that cannot be saved or loaded as given (missing file, bad index, corrupt or
    truncated data, a tensor whose shape does not match the model). The message names the
    file."""
