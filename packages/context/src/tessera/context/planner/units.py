"""Byte counts and durations in the units people write: ``16GiB``, ``512MiB``, ``16e9``."""

from __future__ import annotations

import re

from tessera.registry import ConfigError

__all__ = ["format_bytes", "format_seconds", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_AMOUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str, key: str = "memory") -> int:
    """``"16GiB"`` -> 17179869184; decimal (GB) and binary (GiB) units, or plain bytes.

    Raises:
        ConfigError: not a positive amount with a known unit; the message starts with ``key``.
    """
    found = _AMOUNT.match(text)
    unit = found.group(2).lower() if found else ""
    if found is None or unit not in _UNITS:
        raise ConfigError(
            f"{key} {text!r} is not an amount of bytes: write e.g. 16GiB, 512MiB, 16GB or "
            f"17179869184 (units: {', '.join(u for u in _UNITS if u)}, any case)"
        )
    value = int(float(found.group(1)) * _UNITS[unit])
    if value < 1:
        raise ConfigError(f"{key} {text!r} is {value} bytes; it must be at least 1 byte")
    return value


def format_bytes(n: float) -> str:
    """``1.50 GiB``, ``195.9 KiB``, ``12 B``: binary units, three significant figures or so."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.2f} {unit}" if value < 100 else f"{value:.1f} {unit}"
    return f"{n:.0f} B"


def format_seconds(s: float) -> str:
    """``1.23 s``, ``45.6 ms``, ``789 us``."""
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"
