"""Generating through a local pipe: every stage in this process, a thread per device."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.analysis import Timeline
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
from gpipe.generation.programs import StageProgram
from gpipe.generation.sampling import Sampling
from gpipe.runtime.mailbox import LocalTransport
from gpipe.runtime.stage_set import StageSet
from gpipe.schedule import decode
from gpipe.units import parse_bytes

__all__ = ["LocalGeneration", "fit_locally", "generate_locally"]


def generate_locally(
    stages: StageSet,
    source: nn.Module | None,
    names: Sequence[Sequence[str]] | None,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    lanes: int | None,
    generator: torch.Generator | None,
    settings: dict[str, Any],
    probed: dict[Any, list[int]],
) -> tuple[Tensor, GenerationStats, Decoder]:
    """Run a local pipe's stages as a decode schedule; the ids, what it did, and the run.

    ``settings`` are :class:`~gpipe.generation.sampling.Sampling`'s arguments; ``probed``
    keeps each stage's cache bytes per position for the pipe, for the prediction.
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
        _per_token(stages, modules, programs, probed), rows, positions
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


def _per_token(
    stages: StageSet,
    modules: Sequence[nn.Module],
    programs: Sequence[StageProgram],
    probed: dict[Any, list[int]],
) -> list[int]:
    """Each stage's cache bytes per row and position, probed once per layout and dtype
    (``probed`` keeps them for the pipe).

    NOTE: kept, not probed per call: the probe is a forward through every stage, measured
    at 2 % of a small model's decode run.
    """
    key = tuple((id(m), *{(t.dtype, t.device) for t in m.parameters()}) for m in modules)
    if key not in probed:
        probed.clear()
        devices = [stages.device_of(stage) for stage in range(stages.count)]
        probed[key] = cache_bytes_per_token(programs, devices)
    return probed[key]


class LocalGeneration:
    """``generate`` and ``generation_fit`` of :class:`gpipe.GPipe`, over its stage set."""

    _stages: StageSet
    _flow: Any
    partitions: Any
    #: What the last :meth:`generate` did (KV bytes per stage, bytes sent, tokens per second).
    generation_stats: GenerationStats
    #: What each device ran in the last :meth:`generate`, as a training step's timeline.
    generation_timeline: Timeline

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        lanes: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Generate tokens through the pipe, each stage keeping its own KV cache.

        The rows decode in ``lanes`` lanes that take turns: a lane's next token enters the
        first stage as soon as the last stage sampled it, so with at least one lane per
        device every device stays busy (see :func:`gpipe.schedule.decode`). Only hidden
        states cross stages; each stage's cache stays on its device. Greedy ids are Hugging
        Face ``generate``'s; sampling follows its warpers (see :mod:`gpipe.generation`).

        Works for stages that :func:`gpipe.split` cut from a Hugging Face causal LM (Llama,
        Qwen2, Mistral, GPT-2 and their look-alikes, cut at whole decoder layers) and for an
        nn.Sequential whose layers follow :mod:`gpipe.generation.programs`' protocol.
        ``pipe.generation_stats`` then holds what the run did (KV bytes per stage, bytes sent,
        tokens per second); ``pipe.generation_timeline`` what each device ran.

        Args:
            input_ids: ``[rows, length]`` prompts, left-padded to one length.
            attention_mask: ``[rows, length]`` 1 at tokens, 0 at padding; None: no padding.
            max_new_tokens: tokens to generate per row at most.
            do_sample, temperature, top_k, top_p: as HF's (``top_k=None`` keeps every token).
            eos_token_id: id(s) that finish a row; finished rows emit ``pad_token_id``
                (default: the first eos id), and the output ends once every row finished.
            lanes: lanes to cut the rows into (default: one per device, at most one per row).
            generator: the random stream to sample from; None: torch's global one.

        Returns:
            ``[rows, length + new]`` ids: the prompt, then the new tokens.
        """
        names, source = self._generation_sources()
        settings = dict(
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
        ids, self.generation_stats, decoder = generate_locally(
            self._stages,
            source,
            names,
            input_ids,
            attention_mask,
            lanes,
            generator,
            settings,
            self.__dict__.setdefault("_probed", {}),
        )
        self.generation_timeline = decoder.timeline()
        return ids

    def generation_fit(
        self, memory_per_device: int | str, *, length: int, rows: int = 1
    ) -> list[CacheFit]:
        """Per device, what fits while generating: rows of ``length`` positions (prompt plus
        new tokens), and positions for ``rows`` rows, beside its weights in the budget.

        Each stage's KV bytes per row and position are measured by a one-row probe, so any
        model :meth:`generate` takes is covered. Activations of one forward are left out.

        Args:
            memory_per_device: bytes, or a size such as ``"16GiB"``.
            length: prompt plus new tokens per row.
            rows: the rows to find the longest length for.
        """
        budget = (
            parse_bytes(memory_per_device)
            if isinstance(memory_per_device, str)
            else memory_per_device
        )
        names, source = self._generation_sources()
        return fit_locally(self._stages, source, names, budget, length, rows)

    def _generation_sources(self) -> tuple[list[list[str]] | None, nn.Module | None]:
        """What decodes each stage: the layer names of a Sequential, or the split model."""
        if self._flow is None:
            return [list(partition._modules) for partition in self.partitions], None
        return None, getattr(self._flow, "source", None)
