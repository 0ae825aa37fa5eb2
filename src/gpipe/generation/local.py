"""Generating through a local pipe: every stage in this process, a thread per device."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.generation.engine import Decoder
from gpipe.generation.generate import (
    GenerationStats,
    assemble,
    check_prompt,
    cut_lanes,
    stage_programs,
)
from gpipe.generation.memory import (
    CacheFit,
    cache_bytes_per_token,
    fit,
    predicted_cache_bytes,
)
from gpipe.generation.sampling import Sampling
from gpipe.runtime.mailbox import LocalTransport
from gpipe.runtime.stage_set import StageSet
from gpipe.schedule import decode

__all__ = ["fit_locally", "generate_locally"]


def generate_locally(
    stages: StageSet,
    source: nn.Module | None,
    names: Sequence[Sequence[str]] | None,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    lanes: int | None,
    generator: torch.Generator | None,
    settings: dict[str, Any],
) -> tuple[Tensor, GenerationStats, Decoder]:
    """Run a local pipe's stages as a decode schedule; the ids, what it did, and the run.

    ``settings`` are :class:`~gpipe.generation.sampling.Sampling`'s arguments.
    """
    sampling = Sampling(**settings)
    mask = check_prompt(input_ids, attention_mask)
    devices = len(stages.devices)
    cut = cut_lanes(input_ids, mask, lanes, devices)
    modules = [stages.module(stage) for stage in range(stages.count)]
    programs = stage_programs(modules, source, names)
    virtual = stages.count // devices
    schedule = decode(
        devices,
        len(cut),
        sampling.max_new_tokens,
        virtual_stages=virtual,
        placement=stages.placement,
    )
    transport = LocalTransport(stages.placement, stages.devices)
    transport.reset()
    stage_devices = [stages.device_of(stage) for stage in range(stages.count)]
    decoder = Decoder(
        programs, stage_devices, stages.placement, transport, cut, sampling, generator,
        skip_finished=True,
    )  # fmt: skip
    start = time.perf_counter()
    decoder.run(schedule, stages.lanes, stages.threads)
    seconds = time.perf_counter() - start
    wire: dict[int, int] = {}
    for tag, _, size in transport._sent:
        sender = tag[1] - 1
        wire[sender] = wire.get(sender, 0) + size
    rows, positions = input_ids.shape[0], input_ids.shape[1] + sampling.max_new_tokens - 1
    predicted = predicted_cache_bytes(
        cache_bytes_per_token(programs, stage_devices), rows, positions
    )
    stats = GenerationStats(
        lanes=len(cut),
        tokens=sampling.max_new_tokens,
        cache_bytes=decoder.cache_bytes(),
        wire_bytes=wire,
        seconds=seconds,
        rows=rows,
        predicted_cache_bytes=dict(enumerate(predicted)),
    )
    return assemble(input_ids, cut, sampling), stats, decoder


def fit_locally(
    stages: StageSet,
    source: nn.Module | None,
    names: Sequence[Sequence[str]] | None,
    memory_per_device: int,
    length: int,
    rows: int,
) -> list[CacheFit]:
    """:func:`gpipe.generation.memory.fit` for a local pipe's stages."""
    modules = [stages.module(stage) for stage in range(stages.count)]
    programs = stage_programs(modules, source, names)
    devices = [stages.device_of(stage) for stage in range(stages.count)]
    return fit(
        programs,
        modules,
        devices,
        stages.placement,
        memory_per_device,
        length=length,
        wanted_rows=rows,
    )
