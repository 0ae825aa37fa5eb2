"""A series as one line of block characters, for a loss curve in the terminal."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["sparkline"]

_BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 60) -> str:
    """``values`` drawn as at most ``width`` characters, lowest ``▁``, highest ``█``.

    A longer series is cut into ``width`` equal runs, each drawn at its mean, so noise
    from step to step does not hide the trend. Not-a-number values are skipped.

    >>> sparkline([4, 3, 2, 1])
    '█▆▃▁'
    """
    finite = [v for v in values if math.isfinite(v)]
    if not finite or width < 1:
        return ""
    runs = min(width, len(finite))
    means = []
    for i in range(runs):
        part = finite[i * len(finite) // runs : (i + 1) * len(finite) // runs]
        means.append(sum(part) / len(part))
    low, high = min(means), max(means)
    if high == low:
        return _BLOCKS[0] * runs
    top = len(_BLOCKS) - 1
    return "".join(_BLOCKS[round((m - low) / (high - low) * top)] for m in means)
