"""Placements: which device holds each model stage."""

from __future__ import annotations

__all__ = ["round_robin", "v_shape"]


def round_robin(stages: int, devices: int) -> tuple[int, ...]:
    """Stage ``s`` on device ``s % devices``: one stage each, or Megatron's interleaved layout.

    For 4 stages on 2 devices: ``(0, 1, 0, 1)``.
    """
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    return tuple(stage % devices for stage in range(stages))


def v_shape(devices: int) -> tuple[int, ...]:
    """Two stages per device in a V: device ``d`` holds stages ``d`` and ``2K-1-d``.

    The forward goes down the devices and back up, so the first and the last stage share
    device 0, and the middle two share device K-1, which hands between them for free. For 2
    devices: ``(0, 1, 1, 0)``.
    """
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    return tuple(range(devices)) + tuple(reversed(range(devices)))
