"""The rules behind :mod:`infinity.config`: byte sizes and their strings, strict keys with the
closest valid name suggested, and the per-field validation its frozen dataclasses share
(:class:`Validated`, each field's :func:`field_rule`). Everything here raises
:class:`~infinity.errors.ConfigError` naming the field, the value, what is allowed and the fix."""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

from infinity.errors import ConfigError

# --------------------------------------------------------------------------- sizes and keys

_SIZE_RE = re.compile(r"^\s*((?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


def parse_size(value: int | float | str, *, name: str = "size") -> int:
    """Bytes from an int, an integral float (``5e8``, common in DeepSpeed JSON) or a size string.

    Raises ConfigError naming ``name`` for anything that is not a whole, non-negative byte count.
    """
    amount, _ = parse_size_parts(value, name)
    return amount


def parse_size_parts(value: object, name: str) -> tuple[int, bool]:
    """(bytes, whether a unit was written); the DeepSpeed mapping reads unit-less as elements."""
    if isinstance(value, bool):
        raise bad_value(
            name,
            value,
            "a byte count (integer or string such as '64MiB')",
            "true/false is not a size; write a number",
        )
    if isinstance(value, int):
        exact, unit = Fraction(value), False
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise bad_value(name, value, "a finite byte count", "write a number such as 67108864")
        exact, unit = Fraction(value), False
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise bad_value(
                name,
                value,
                "a byte count such as 67108864, '64MiB', '512MB' or '1.5G'",
                "units are B, K/KiB, M/MiB, G/GiB, T/TiB (x1024) and KB, MB, GB, TB (x1000)",
            )
        exact = Fraction(match.group(1)) * _UNITS[match.group(2).lower()]
        unit = bool(match.group(2))
    else:
        raise bad_value(
            name,
            value,
            "a byte count (integer or string such as '64MiB')",
            f"got a {type(value).__name__}",
        )
    if exact.denominator != 1 or exact < 0:
        raise bad_value(
            name, value, "a whole, non-negative number of bytes", "round it to a whole byte count"
        )
    return int(exact), unit


def format_size(n: int | None) -> str:
    """Human-readable binary size (``'64.0 MiB'``) for logs; ``None`` reads as ``'auto'``."""
    if n is None:
        return "auto"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def check_keys(data: Mapping[str, Any], valid: Iterable[str], where: str) -> None:
    """Raise ConfigError for keys of ``data`` not in ``valid``, suggesting the closest valid key."""
    valid = list(valid)
    problems = []
    for key in data:
        if key in valid:
            continue
        if not isinstance(key, str):
            problems.append(f"key {key!r} in {where} is not a string")
            continue
        close = difflib.get_close_matches(key, valid, n=1)
        if close:
            problems.append(f"unknown key {key!r} in {where}; did you mean {close[0]!r}?")
        else:
            problems.append(
                f"unknown key {key!r} in {where}; valid keys are: " + ", ".join(sorted(valid))
            )
    if problems:
        first = next(k for k in data if k not in valid)
        raise ConfigError("\n".join(problems), field=str(first))


def load_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON object from ``path``; missing files and bad JSON become ConfigErrors."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"cannot read config file {path}: {exc.strerror or exc}; check the path"
        ) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not valid JSON: {exc.msg} at line {exc.lineno}, "
            f"column {exc.colno}"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a JSON object ({{...}}), not a {type(data).__name__}"
        )
    return data


def bad_value(name: str, value: object, expected: str, fix: str) -> ConfigError:
    return ConfigError(f"{name}={value!r} is invalid: expected {expected}; {fix}", field=name)


# --------------------------------------------------------------------------- field validation


@dataclass(frozen=True)
class Rule:
    kind: str  # int | float | bool | bool_or_auto | choice | paths | device
    #                                | section
    lo: float | None = None
    hi: float | None = None
    optional: bool = False  # None allowed
    choices: tuple[str, ...] = ()
    size: bool = False  # byte count: size strings accepted in from_dict
    fix: str = ""  # what to do, appended to the message


def field_rule(**kwargs: Any) -> dict[str, Rule]:
    return {"rule": Rule(**kwargs)}


def _describe_range(rule: Rule) -> str:
    noun = {"int": "an integer", "float": "a number"}[rule.kind]
    if rule.lo is not None and rule.hi is not None:
        text = f"{noun} in {rule.lo:g}..{rule.hi:g}"
    elif rule.lo is not None:
        text = f"{noun} >= {rule.lo:g}"
    else:
        text = noun
    return f"None or {text}" if rule.optional else text


class Validated:
    """Checks every field against its ``Rule`` after construction, normalising in place."""

    _section: ClassVar[str] = ""

    def _name(self, attr: str) -> str:
        return f"{self._section}.{attr}" if self._section else attr

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            rule: Rule | None = f.metadata.get("rule")
            if rule is not None:
                value = self._check(self._name(f.name), getattr(self, f.name), rule, f)
                object.__setattr__(self, f.name, value)

    @staticmethod
    def _check(name: str, value: Any, rule: Rule, spec: Any) -> Any:
        if value is None and rule.optional:
            return None
        fix = rule.fix or f"set {name} within that range"
        if rule.kind in ("int", "float"):
            expected = _describe_range(rule)
            if rule.size and isinstance(value, str):
                value = parse_size(value, name=name)  # "64MiB" reads the same everywhere
            numeric = (int,) if rule.kind == "int" else (int, float)
            if isinstance(value, bool) or not isinstance(value, numeric):
                hint = (
                    "in Python, pass an int (or use parse_size / from_dict for strings like "
                    "'64MiB')"
                    if rule.size and isinstance(value, str)
                    else f"got a {type(value).__name__}, write it as a number"
                )
                raise bad_value(name, value, expected, hint)
            number = float(value) if rule.kind == "float" else value
            if rule.kind == "float" and not math.isfinite(number):
                raise bad_value(name, value, f"a finite number ({expected})", fix)
            if (rule.lo is not None and number < rule.lo) or (
                rule.hi is not None and number > rule.hi
            ):
                raise bad_value(name, value, expected, fix)
            return number
        if rule.kind == "bool":
            if not isinstance(value, bool):
                raise bad_value(name, value, "true or false", f"got a {type(value).__name__}")
            return value
        if rule.kind == "bool_or_auto":
            if isinstance(value, str) and value.lower() == "auto":
                return "auto"
            if not isinstance(value, bool):
                raise bad_value(name, value, "true, false or 'auto'", f"got {value!r}")
            return value
        if rule.kind == "choice":
            if not isinstance(value, str) or value not in rule.choices:
                allowed = ", ".join(repr(c) for c in rule.choices)
                close = [c for c in rule.choices if isinstance(value, str) and c == value.lower()]
                hint = f"did you mean {close[0]!r}?" if close else f"pick one of {allowed}"
                raise bad_value(name, value, f"one of {allowed}", hint)
            return value
        if rule.kind == "device":
            return check_device(name, value)
        if rule.kind == "paths":
            return normalise_paths(name, value)
        if rule.kind == "section":
            section_cls = spec.default_factory
            if not isinstance(value, section_cls):
                raise bad_value(
                    name,
                    value,
                    f"a {section_cls.__name__} instance",
                    "pass the dataclass, or a dict through from_dict/replace",
                )
            return value
        raise AssertionError(f"unknown rule kind {rule.kind}")


_DEVICE_RE = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


def check_device(name: str, value: Any) -> str:
    if type(value).__name__ == "device" and type(value).__module__.startswith("torch"):
        value = str(value)  # accept torch.device without importing torch here
    match = _DEVICE_RE.match(value) if isinstance(value, str) else None
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise bad_value(
            name,
            value,
            "'auto', 'cpu', 'cuda' or 'cuda:N'",
            "'auto' picks cuda when available, else cpu",
        )
    return value


def normalise_paths(name: str, value: Any) -> tuple[Path, ...]:
    items = [value] if isinstance(value, (str, os.PathLike)) else value
    if not isinstance(items, (list, tuple)):
        raise bad_value(
            name, value, "a path or a list of paths", "use [] for a private temporary directory"
        )
    out: list[Path] = []
    for item in items:
        if isinstance(item, str) and not item.strip():
            raise bad_value(
                name, value, "non-empty paths", "use [] for a private temporary directory"
            )
        if not isinstance(item, (str, os.PathLike)):
            raise bad_value(
                name,
                value,
                "a path or a list of paths",
                f"entry {item!r} is a {type(item).__name__}",
            )
        path = Path(item).expanduser()
        if path in out:
            raise bad_value(
                name, value, "distinct directories", f"{path} is listed twice; list each drive once"
            )
        out.append(path)
    return tuple(out)
