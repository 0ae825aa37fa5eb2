"""Devices: the names a user gives, checked against the machine, as ``torch.device``s."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["as_devices"]


def as_devices(devices: Any) -> list[torch.device]:
    """``devices`` as ``torch.device``s, each one this machine has.

    Args:
        devices: a list of ``torch.device``s, names (``"cuda:1"``) or GPU indices.

    Raises:
        TypeError: not a list, or an entry that is not a device, a name or a GPU index.
        ValueError: an empty list, a name torch does not know, a meta device, or a device
            this machine does not have.
    """
    if isinstance(devices, (str, torch.device, int)) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be a list, one device per stage, got {devices!r}")
    if not devices:
        raise ValueError("devices is empty: give one device per stage, e.g. ['cpu', 'cpu']")
    return [_as_device(device) for device in devices]


def _as_device(device: Any) -> torch.device:
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(
            f"each device must be a torch.device, a name like 'cuda:1' or a GPU index, got "
            f"{device!r}"
        )
    try:
        found = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"unknown device {device!r}: use a name torch knows, like 'cpu' or 'cuda:0'"
        ) from None
    if found.type == "meta":
        raise ValueError(
            f"device {device!r} holds no data, so no stage can run on it: build the model on "
            "meta if you like, but give the pipe real devices ('cpu', 'cuda:0', ...)"
        )
    available, count = _available(found.type)
    if not available:
        raise ValueError(
            f"device {device!r}: this machine has no {found.type} device "
            f"(torch.{found.type}.is_available() is False); use devices=['cpu', ...] here"
        )
    if count is not None and found.index is not None and found.index >= count:
        raise ValueError(
            f"device {device!r}: this machine has {count} {found.type} device(s), "
            f"{found.type}:0 to {found.type}:{count - 1}"
        )
    return found


def _available(kind: str) -> tuple[bool, int | None]:
    """Whether this machine has devices of ``kind``, and how many (None: not known)."""
    if kind == "cuda":
        return torch.cuda.is_available(), torch.cuda.device_count()
    if kind == "xpu":
        return torch.xpu.is_available(), torch.xpu.device_count()
    if kind == "mps":
        return torch.backends.mps.is_available(), 1
    return True, None  # cpu, and kinds torch cannot tell us about
