"""Argument types the subcommands share: checked numbers, cost triples, schedule names."""

from __future__ import annotations

import argparse

__all__ = ["costs", "non_negative_float", "positive_int", "schedule_names"]


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
    """A number >= 0 (not nan)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def costs(text: str) -> tuple[float, float, float]:
    """``F,B,W``: three numbers >= 0."""
    parts = text.split(",")
    try:
        values = [float(part) for part in parts]
    except ValueError:
        values = []
    if len(values) != 3 or not all(v >= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected three numbers >= 0 as F,B,W (forward, backward, weight-gradient "
            f"time per stage), e.g. --costs 1,2,0; got {text!r}"
        )
    return values[0], values[1], values[2]


def schedule_names() -> list[str]:
    """Every schedule ``make_schedule`` knows (the registry is torch-free)."""
    from gpipe.schedule import SCHEDULES

    return list(SCHEDULES)
