"""How much KV cache each stage keeps per token, and how many rows and tokens fit.

A stage's cache grows by the same bytes for every row and every position (its layers' keys
and values), so one probe (one row, a few positions, through every stage in turn, no
pipeline needed) measures it per stage, for any model that decodes: a Hugging Face split or
an nn.Sequential by the protocol. :func:`predicted_cache_bytes` then says what a run will
hold, and :func:`fit` what fits beside each device's weights in a memory budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gpipe.generation.cache import DecodeStep, StageCache
from gpipe.generation.programs import StageProgram

__all__ = ["CacheFit", "cache_bytes_per_token", "fit", "predicted_cache_bytes"]

_PROBE = 2  # positions the probe caches: more than one, so a per-token size is seen


def cache_bytes_per_token(
    programs: Sequence[StageProgram], devices: Sequence[torch.device]
) -> list[int]:
    """Each stage's KV bytes per row per cached position, measured by one small probe.

    Args:
        programs: each stage's decode program, in order.
        devices: each stage's device.
    """
    caches = [StageCache() for _ in programs]
    mask = torch.ones(1, _PROBE, dtype=torch.long)
    x: torch.Tensor = torch.zeros(1, _PROBE, dtype=torch.long)
    with torch.no_grad():
        for program, cache, device in zip(programs, caches, devices):
            x = program(x.to(device), cache, DecodeStep.of(mask, 0, device))
    return [cache.nbytes // _PROBE for cache in caches]


def predicted_cache_bytes(per_token: Sequence[int], rows: int, positions: int) -> list[int]:
    """Each stage's cache once ``rows`` rows hold ``positions`` positions each."""
    return [bytes_ * rows * positions for bytes_ in per_token]


@dataclass(frozen=True)
class CacheFit:
    """What fits on one pipeline device while generating.

    Attributes:
        device: the pipeline device.
        weights: bytes of its stages' parameters and buffers.
        per_token: KV bytes its stages keep per row per position.
        budget: the memory per device given.
        rows: rows of ``length`` positions whose caches fit beside the weights (0: none;
            None: no cache here, the weights alone count).
        positions: positions that fit for each of ``wanted_rows`` rows (as ``rows``).
    """

    device: int
    weights: int
    per_token: int
    budget: int
    rows: int | None
    positions: int | None


def fit(
    programs: Sequence[StageProgram],
    modules: Sequence[nn.Module],
    devices: Sequence[torch.device],
    placement: Sequence[int],
    memory_per_device: int,
    *,
    length: int,
    wanted_rows: int,
) -> list[CacheFit]:
    """Per pipeline device: how many rows of ``length`` positions (prompt plus new tokens)
    fit, and how many positions ``wanted_rows`` rows may reach, in ``memory_per_device``.

    Counts weights and caches; the activations of one forward are left out (a prefill's
    are the prompt's hidden states, freed before the next forward).

    Raises:
        ValueError: a budget, length or row count below 1.
    """
    for name, value in (
        ("memory_per_device", memory_per_device),
        ("length", length),
        ("wanted_rows", wanted_rows),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    per_stage = cache_bytes_per_token(programs, devices)
    fits: list[CacheFit] = []
    for device in sorted(set(placement)):
        stages = [s for s, d in enumerate(placement) if d == device]
        tensors = [t for s in stages for t in (*modules[s].parameters(), *modules[s].buffers())]
        unique = {id(t): t for t in tensors}.values()  # a tied weight counts once
        weights = sum(t.numel() * t.element_size() for t in unique)
        per_token = sum(per_stage[s] for s in stages)
        free = max(memory_per_device - weights, 0)
        fits_weights = memory_per_device >= weights
        rows = free // (per_token * length) if per_token else (None if fits_weights else 0)
        positions = free // (per_token * wanted_rows) if per_token else rows
        fits.append(CacheFit(device, weights, per_token, memory_per_device, rows, positions))
    return fits
