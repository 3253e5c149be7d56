"""What the command-line tools share: argparse types, and one way of reporting failures (a
line naming the cause and exit code 2 for bad input, 1 for a failed disk, 130 when
interrupted) instead of a traceback."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from infinity.errors import AttachError, BudgetError, ConfigError
from swap import NvmePathError, SwapConfigError, SwapError, SwapSpaceError


class UserError(Exception):
    """Bad input: reported as one line and exit code 2, without a traceback."""


#: What a user fixes by changing flags, config or paths, in every command (each adds its own):
#: one line, exit code 2, no traceback.
USER_ERRORS: tuple[type[Exception], ...] = (
    UserError,
    ConfigError,
    BudgetError,
    AttachError,
    NvmePathError,
    SwapSpaceError,
    SwapConfigError,
)


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: ``kind`` (int, float) of a value > 0."""

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    return convert


def config_size(text: str) -> int:
    """An argparse type: a byte count as the config reads it ('256MiB', '1GB', 4096)."""
    from infinity.config import parse_size as parse_config_size

    try:
        return parse_config_size(text, name="size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
) -> argparse.Namespace | int:
    """The parsed arguments, or the exit code argparse chose (it has printed its message):
    returned, not raised, so tests can check it. Sets up logging (``--verbose``: INFO)."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return args


def guarded(
    prog: str,
    action: Callable[[], Any],
    user_errors: tuple[type[BaseException], ...],
    interrupted: str = "interrupted",
) -> tuple[int, Any]:
    """Runs ``action``: (0, its result), or the exit code after one line on stderr."""
    try:
        return 0, action()
    except user_errors as exc:
        print(f"{prog}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2, None
    except SwapError as exc:  # the disk failed mid-run: its message names file and cause
        print(f"{prog}: swap I/O failed: {exc}", file=sys.stderr)
        return 1, None
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130, None


def spawn_child(module: str, forward: list[str], extra: list[str]) -> Any:
    """Runs ``python -m module *forward *extra`` (a benchmark's configuration in a process of
    its own, so that its peak RSS is its own) and returns the JSON its last line prints."""
    command = [sys.executable, "-m", module, *forward, *extra]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(extra)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
