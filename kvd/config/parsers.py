"""Value parsers of kvd settings: sizes (``"8GiB"``), bounded numbers, choices, lists, names, port ranges.

Each parser takes ``(name, value)``, where ``name`` is the dotted setting (``cluster.shards``) used in error
messages and ``value`` is typed (from TOML or a flag) or text (from the environment), and returns the parsed value
or raises :class:`~kvd.errors.ConfigError` naming the setting and the bad value. The factories (:func:`integer_in`,
:func:`number_in`, :func:`size_at_least`, :func:`choice`, :func:`optional`) build a parser from bounds.

Pure: nothing here reads the environment or files (that is kvd.config's job); kvd.config attaches these parsers
to its settings and re-exports :func:`parse_size` and :func:`format_size`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from kvd.errors import ConfigError

__all__ = [
    "KIB",
    "MIB",
    "GIB",
    "Parser",
    "parse_size",
    "format_size",
    "integer_in",
    "optional",
    "number_in",
    "size_at_least",
    "choice",
    "int_tuple",
    "text_value",
    "identifier",
    "port_range",
]

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": KIB, "kib": KIB, "ki": KIB, "kb": 1000,
    "m": MIB, "mib": MIB, "mi": MIB, "mb": 1000**2,
    "g": GIB, "gib": GIB, "gi": GIB, "gb": 1000**3,
    "t": 1024 * GIB, "tib": 1024 * GIB, "ti": 1024 * GIB, "tb": 1000**4,
}


def parse_size(value: object, *, name: str = "size") -> int:
    """Bytes from an int or a string such as ``"8GiB"``, ``"512 MiB"``, ``"1.5G"``, ``"4096"``.

    Binary units: ``KiB MiB GiB TiB`` (also ``Ki``/``K``, ``Mi``/``M``, ...); decimal: ``KB MB GB TB``; case is
    ignored. Fractions are rounded to whole bytes. Raises :class:`ConfigError` (naming ``name``) for anything
    else, including negative numbers and booleans.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size such as 8GiB or 512MiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}: size must not be negative, got {value!r}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{name}: size must be a finite non-negative number, got {value!r}")
        return int(round(value))
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected a size such as 8GiB or 512MiB, got {type(value).__name__} {value!r}")
    match = _SIZE_RE.match(value)
    unit_factor = _SIZE_UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit_factor is None:
        raise ConfigError(
            f"{name}: cannot read {value!r} as a size; use bytes or a unit: KiB MiB GiB TiB (binary), "
            "KB MB GB TB (decimal)"
        )
    return int(round(float(match.group(1)) * unit_factor))


def format_size(n_bytes: float) -> str:
    """``n_bytes`` in binary units for people: ``"1.50 GiB"``, ``"512.00 MiB"``, ``"17 B"``."""
    n = float(n_bytes)
    for unit, factor in (("TiB", 1024 * GIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{int(n)} B"


Parser = Callable[[str, object], Any]


def integer_in(low: int, high: int | None = None) -> Parser:
    """An int in ``[low, high]`` (``high`` None: no upper bound); text is read as base 10, bools are refused."""

    def parse(name: str, value: object) -> int:
        if isinstance(value, str):
            try:
                value = int(value.strip(), 10)
            except ValueError:
                raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
        if value < low or (high is not None and value > high):
            bound = f"[{low}, {high}]" if high is not None else f">= {low}"
            raise ConfigError(f"{name}: must be {bound}, got {value!r}")
        return value

    return parse


def optional(parse: Parser) -> Parser:
    """Also accept "" / "none" / "default" (from env or TOML) as None: use the built-in default."""

    def parse_opt(name: str, value: object) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "default")):
            return None
        return parse(name, value)

    return parse_opt


def number_in(low: float, high: float | None = None, *, open_low: bool = False) -> Parser:
    """A finite float in ``[low, high]`` (``(low, high]`` with ``open_low``); ints and text accepted."""

    def parse(name: str, value: object) -> float:
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                raise ConfigError(f"{name}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
        number = float(value)
        too_low = number <= low if open_low else number < low
        if not math.isfinite(number) or too_low or (high is not None and number > high):
            lo = f"({low}" if open_low else f"[{low}"
            bound = f"{lo}, {high}]" if high is not None else (f"> {low}" if open_low else f">= {low}")
            raise ConfigError(f"{name}: must be in {bound}, got {value!r}")
        return number

    return parse


def _unit_hint(value: object) -> str:
    """What a size without a unit means (bytes), and how to write one with a unit, for an error message."""
    text = str(value).strip()
    if isinstance(value, bool) or not re.fullmatch(r"[0-9]+(\.[0-9]*)?", text):
        return ""
    return (f" ({text} bytes: a size without a unit is in bytes; write {text}GiB for {text} x 2^30 bytes "
            f"(binary: KiB MiB GiB TiB) or {text}GB for {text} x 10^9 bytes (decimal: KB MB GB TB))")


def size_at_least(minimum: int, *, or_zero: bool = False) -> Parser:
    """A size in bytes (:func:`parse_size`) of at least ``minimum`` bytes (or 0, with ``or_zero``: "off")."""

    def parse(name: str, value: object) -> int:
        n = parse_size(value, name=name)
        if n < minimum and not (or_zero and n == 0):
            raise ConfigError(f"{name}: must be {'0 or ' if or_zero else ''}at least {format_size(minimum)}, "
                              f"got {value!r}{_unit_hint(value)}")
        return n

    return parse


def choice(*choices: str) -> Parser:
    """One of ``choices`` (lower-case); the value is stripped and lower-cased first."""

    def parse(name: str, value: object) -> str:
        if not isinstance(value, str) or value.strip().lower() not in choices:
            raise ConfigError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
        return value.strip().lower()

    return parse


def boolean(name: str, value: object) -> bool:
    """true or false; from the environment ``1``/``0``, ``true``/``false``, ``yes``/``no``, ``on``/``off``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
    raise ConfigError(f"{name}: expected true or false, got {value!r}")


def int_tuple(name: str, value: object) -> tuple[int, ...]:
    """A list of non-negative ints; from the environment a comma-separated string ("0,1,31")."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        try:
            items: list[object] = [int(p, 10) for p in parts]
        except ValueError:
            raise ConfigError(f"{name}: expected comma-separated integers, got {value!r}") from None
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ConfigError(f"{name}: expected a list of integers, got {type(value).__name__} {value!r}")
    out: list[int] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ConfigError(f"{name}: expected non-negative integers, got {item!r}")
        out.append(item)
    if len(set(out)) != len(out):
        raise ConfigError(f"{name}: duplicate entries in {value!r}")
    return tuple(sorted(out))


def text_value(name: str, value: object) -> str:
    """A string, stripped of surrounding whitespace."""
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected a string, got {type(value).__name__} {value!r}")
    return value.strip()


def identifier(name: str, value: object) -> str:
    """A name such as a Ray namespace: 1-63 of letters, digits, ``_ . -``, starting with a letter or digit."""
    text = text_value(name, value)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", text):
        raise ConfigError(f"{name}: expected 1-63 letters, digits, '_', '.' or '-', got {value!r}")
    return text


def port_range(name: str, value: object) -> str:
    """"" (any free port) or "LOW-HIGH" (inclusive, 1..65535)."""
    text = text_value(name, value)
    if text in ("", "0"):
        return ""
    match = re.fullmatch(r"(\d{1,5})\s*-\s*(\d{1,5})", text)
    if match is None or not 1 <= int(match.group(1)) <= int(match.group(2)) <= 65535:
        raise ConfigError(f"{name}: expected a port range LOW-HIGH within 1-65535 (or empty), got {value!r}")
    return f"{int(match.group(1))}-{int(match.group(2))}"
