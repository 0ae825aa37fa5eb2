"""Argument types the subcommands share: checked numbers, lists, cost triples, schedule names.

Each type raises ``argparse.ArgumentTypeError`` naming the value and the form expected, so a
bad option ends in argparse's usage and a one-line ``gpipe <cmd>: error: ...``, exit code 2.
Errors found after parsing raise :class:`CommandError`, which ``gpipe`` reports the same way.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "CommandError",
    "choices_list",
    "costs",
    "ensure_writable",
    "non_negative_float",
    "positive_float",
    "positive_int",
    "positive_ints",
    "schedule_names",
    "seed",
    "shape",
    "words",
]


class CommandError(Exception):
    """A bad input found after parsing; ``gpipe`` prints it as one error line, exit code 2."""


def ensure_writable(folder: Path, option: str = "--out") -> None:
    """Make ``folder`` and write a scratch file in it, before any long work starts.

    NOTE: the demo and the report write their files at the end; without this check a folder
    that cannot be written fails only after minutes of training.

    Raises:
        CommandError: the folder cannot be made or written, naming it and the reason.
    """
    if folder.exists() and not folder.is_dir():
        raise CommandError(f"{option} {folder} is a file: give a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        raise CommandError(
            f"cannot write to {option} {folder}: {reason}; pass a folder you can write to"
        ) from None


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0 <= value < math.inf:  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """A number > 0 (not nan or infinite)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def costs(text: str) -> tuple[float, float, float]:
    """``F,B,W``: three finite numbers >= 0."""
    parts = text.split(",")
    try:
        values = [float(part) for part in parts]
    except ValueError:
        values = []
    if len(values) != 3 or not all(0 <= v < math.inf for v in values):
        raise argparse.ArgumentTypeError(
            f"expected three finite numbers >= 0 as F,B,W (forward, backward, "
            f"weight-gradient time per stage), e.g. --costs 1,2,0; got {text!r}"
        )
    return values[0], values[1], values[2]


def seed(text: str) -> int:
    """A random seed, in the range ``torch.manual_seed`` takes."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not -(2**63) <= value < 2**64:
        raise argparse.ArgumentTypeError(
            f"expected a whole number from -2**63 to 2**64 - 1, got {text!r}"
        )
    return value


def words(text: str) -> list[str]:
    """A comma-separated list of non-empty names: ``cpu,cpu``."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list without empty entries, e.g. cpu,cpu; got {text!r}"
        )
    return items


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of whole numbers >= 1: ``2,4,8``."""
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers >= 1, e.g. 2,4,8; got {text!r}"
        )
    return values


def shape(text: str) -> tuple[int, ...]:
    """A tensor shape without the batch dimension: ``512`` or ``3,32,32``."""
    try:
        return tuple(positive_ints(text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected one sample's shape without the batch dimension, as comma-separated "
            f"whole numbers >= 1, e.g. 512 or 3,32,32; got {text!r}"
        ) from None


def choices_list(known: list[str] | tuple[str, ...]) -> Callable[[str], list[str]]:
    """A type for a comma-separated list of names, each one of ``known``."""

    def parse(text: str) -> list[str]:
        names = words(text)
        unknown = [name for name in names if name not in known]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, unknown))} in {text!r}; choose from "
                f"{','.join(known)}"
            )
        return names

    return parse


def schedule_names() -> list[str]:
    """Every schedule ``make_schedule`` knows (the registry is torch-free)."""
    from gpipe.schedule import SCHEDULES

    return list(SCHEDULES)
