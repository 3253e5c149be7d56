"""Byte sizes as people type them on a command line, and back."""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}

GIB = 1 << 30


def parse_size(text: str | int) -> int:
    """Bytes from ``"256K"``, ``"1M"``, ``"1GiB"``, ``"4096"``; K/M/G/T are powers of 1024.

    A bench flag is always about binary-aligned I/O sizes, so ``MB`` is read as MiB too rather
    than 10**6, which would never be a valid O_DIRECT size."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 256K, 1M, 1G)")
    number, unit, _ = match.groups()
    value = float(number) * (1 << (10 * _POWERS[unit.lower()]))
    if value != int(value) or value <= 0:
        raise ValueError(f"not a whole, positive number of bytes: {text!r}")
    return int(value)


def parse_list(text: str, item=parse_size) -> list:
    """A comma-separated list, e.g. ``"256K,1M,4M"``."""
    values = [item(part) for part in text.split(",") if part.strip()]
    if not values:
        raise ValueError(f"empty list: {text!r}")
    return values


def format_size(nbytes: int) -> str:
    """The shortest exact binary form: 262144 -> ``256K``, 1073741824 -> ``1G``."""
    for suffix, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{suffix}"
    return str(nbytes)
