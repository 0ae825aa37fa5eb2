"""Which attempt of a job this is, under torchrun's restarts: store keys name it."""

from __future__ import annotations

import os

__all__ = ["attempt"]


def attempt() -> int:
    """Which attempt of the job this is: torchrun counts restarts from 0
    (``TORCHELASTIC_RESTART_COUNT``); 0 without torchrun. Store keys name it, since every
    attempt gets the same store."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
