"""Headroom: how far a real step's memory peak came above the planner's prediction.

The planner predicts each device's peak from the profile and the schedule: parameters,
gradients, optimizer state and what the stages hold for backward. A real step also holds
what no profile shows (the allocator's rounding and caching, kernels' workspaces,
temporaries between ops), so the first real step of a plan calibrates the prediction: its
measured peak divided by the predicted one, on the device where that ratio is highest, is
the factor later plans multiply their predicted peaks by before checking the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gpipe.planning.plan_report import Plan

__all__ = ["measured_headroom"]


def measured_headroom(plan: Plan, measured: Any) -> float:
    """The headroom factor of ``plan``: its measured peak over its predicted one, at least 1.

    Args:
        plan: the plan the measured step ran (``GPipe.from_plan(model, plan)``).
        measured: the pipe, after a real step (with its optimizer state in place, if the
            optimizer makes it at its first step); or the measured peak bytes, one per
            device. From a pipe: on CUDA the allocator's peak of each GPU
            (:attr:`GPipe.cuda_memory`), compared with ``plan.peak_memory``; otherwise
            gpipe's own count of the bytes the stages held for backward
            (``pipe.timeline.peak_memory``), compared with ``plan.activation_memory``,
            the parameters, gradients and optimizer state counted as predicted.

    Returns:
        ``max(measured[d] / predicted[d])`` over the devices, or 1.0 if that is lower: a
        step that needed less than predicted leaves the prediction as it is, never below.

    Raises:
        ValueError: a pipe that is not this plan's, that counts no memory
            (``track_memory=False``), or a wrong number of measured peaks.
        TypeError: ``measured`` is neither a pipe nor a sequence of byte counts.
    """
    if isinstance(measured, Sequence) and not isinstance(measured, (str, bytes)):
        peaks = list(measured)
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in peaks):
            raise TypeError(f"measured peaks must be byte counts (ints >= 0), got {measured!r}")
        if len(peaks) != len(plan.peak_memory):
            raise ValueError(
                f"got {len(peaks)} measured peaks for a plan of {len(plan.peak_memory)} "
                f"devices ({plan.describe()}): give one per device"
            )
        predicted = list(plan.peak_memory)
    elif hasattr(measured, "timeline") and hasattr(measured, "cuda_memory"):
        peaks, predicted = _pipe_peaks(plan, measured)
    else:
        raise TypeError(
            "measured must be the plan's GPipe after a step, or its peak bytes per device, "
            f"got {type(measured).__name__}"
        )
    ratios = [b / p for b, p in zip(peaks, predicted) if p > 0]
    return max([1.0, *ratios])


def _pipe_peaks(plan: Plan, pipe: Any) -> tuple[list[int], list[int]]:
    """(measured, predicted) peak bytes per device of ``plan``'s pipe after a step."""
    devices = [str(device) for device in pipe.devices]
    balance = list(pipe.balance)
    if devices != list(plan.devices) or balance != list(plan.balance):
        raise ValueError(
            f"the pipe (devices {devices}, balance {balance}) is not the plan's "
            f"({plan.describe()}: devices {plan.devices}, balance {plan.balance}): "
            "measure a pipe built by GPipe.from_plan(model, plan)"
        )
    allocated = pipe.cuda_memory
    if allocated:
        peaks = [allocated[torch.device(device)] for device in plan.devices]
        return peaks, list(plan.peak_memory)
    held = list(pipe.timeline.peak_memory)
    if not any(held):
        raise ValueError(
            "the pipe counted no memory in its last step: build it with track_memory=True "
            "(the default), or pass the measured peak bytes per device"
        )
    fixed = [p - a for p, a in zip(plan.peak_memory, plan.activation_memory)]
    return [f + int(h) for f, h in zip(fixed, held)], list(plan.peak_memory)
