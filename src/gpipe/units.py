"""Sizes in bytes, for people: format them (``3.1 MiB``) and parse them (``"200MB"``)."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_bytes"]

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


def format_bytes(size: float) -> str:
    """``size`` bytes in binary units: ``512 B``, ``3.1 KiB``, ``12.0 MiB``, ``1.5 GiB``."""
    if abs(size) < 1024:
        return f"{size:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}"
    raise AssertionError("unreachable")


def parse_bytes(text: str) -> int:
    """Bytes from text: ``"200MB"`` (10**6), ``"1.5GiB"`` (2**30), ``"4096"``.

    Raises:
        ValueError: text that is not a number with an optional unit.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"expected a size like 200MB, 1.5GiB or 4096 (bytes), got {text!r}; units: "
            "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
