"""The trained model writes: speeches begun through the pipe and by the plain model, alike.

Through the pipe (:meth:`gpipe.GPipe.generate`) each stage keeps its own KV cache and only
hidden states cross stages. Each speech is a lane of its own; the lanes take turns, so
while one lane's newest character is in stage 2 another's is in stage 1 and every stage
has work. The last stage draws each lane's character in that turn (lane 0, 1, 2, 3, then
lane 0 again), from one seeded generator. The plain model in one process draws in the same
turn from the same seed and recomputes every earlier character for each new one (no
cache), so both write the same speeches, to the character.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from torch import nn

from gpipe.analysis import Timeline
from gpipe.demo.recipe import PROMPTS, Corpus, DemoSettings
from gpipe.demo.training import virtual_stages
from gpipe.generation.generate import GenerationStats
from gpipe.units import format_bytes

__all__ = ["TEMPERATURE", "Speeches", "speech_rows", "write_speeches"]

TEMPERATURE = 0.8  # below 1: likelier characters, fewer misspelt words


@dataclass(frozen=True)
class Speeches:
    """What the trained model wrote from :data:`~gpipe.demo.recipe.PROMPTS`, both ways.

    Attributes:
        piped: each speech as the pipe wrote it, its prompt first.
        plain: each speech as the plain model wrote it.
        stats: what ``pipe.generate`` did: lanes, KV cache and bytes sent per stage, seconds.
        timeline: what each device ran while the pipe generated.
        plain_seconds: the plain model's wall time for every speech.
        context: the model's positions: the longest prompt and its speech fill them.
    """

    piped: list[str]
    plain: list[str]
    stats: GenerationStats
    timeline: Timeline
    plain_seconds: float
    context: int

    @property
    def same(self) -> bool:
        """Both ways wrote every speech alike."""
        return self.piped == self.plain

    @property
    def differing(self) -> list[str]:
        """The prompts whose speeches differ, without their newline."""
        return [
            prompt.strip()
            for prompt, a, b in zip(PROMPTS, self.piped, self.plain, strict=True)
            if a != b
        ]


def write_speeches(
    settings: DemoSettings, corpus: Corpus, model: nn.Sequential, balance: list[int]
) -> Speeches:
    """Continue each prompt as far as the model's context allows, through a pipe cut as in
    training (in this process, a thread per stage) and by ``model`` itself.

    Args:
        settings: the demo's options: stages, schedule and seed.
        corpus: the tokenizer and the model's context length.
        model: the trained model; it is not changed.
        balance: layers per stage, as trained.
    """
    from gpipe.pipe import GPipe

    tokenizer = corpus.tokenizer
    prompts = [tokenizer.encode(prompt) for prompt in PROMPTS]
    width = max(len(prompt) for prompt in prompts)
    # NOTE: the model has `context` learned positions and no more: a speech stops there.
    new = corpus.config.context - width
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # shorter prompts padded on the left
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    pipe = GPipe(
        copy.deepcopy(model),
        balance,
        devices=["cpu"] * settings.stages,
        chunks=settings.chunks,
        schedule=settings.schedule,
        virtual_stages=virtual_stages(settings.schedule),
    )
    try:
        out = pipe.generate(
            ids,
            mask,
            max_new_tokens=new,
            do_sample=True,
            temperature=TEMPERATURE,
            lanes=len(prompts),  # a lane per speech: the turn the plain model copies
            generator=torch.Generator().manual_seed(settings.seed),
        )
        stats, timeline = pipe.generation_stats, pipe.generation_timeline
    finally:
        pipe.close()
    piped = [tokenizer.decode(row[width - len(p) :]) for row, p in zip(out, prompts)]
    began = time.perf_counter()
    plain = _plain_sampling(model, prompts, new, settings.seed)
    plain_seconds = time.perf_counter() - began
    return Speeches(
        piped=piped,
        plain=[tokenizer.decode(ids) for ids in plain],
        stats=stats,
        timeline=timeline,
        plain_seconds=plain_seconds,
        context=corpus.config.context,
    )


@torch.no_grad()
def _plain_sampling(
    model: nn.Module, prompts: list[torch.Tensor], new: int, seed: int
) -> list[torch.Tensor]:
    """Plain PyTorch: for each new character, each speech in turn runs the whole model on
    everything so far and draws its next character from one generator seeded ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    training = model.training
    model.eval()
    speeches = [prompt[None] for prompt in prompts]
    try:
        for _ in range(new):
            for index, ids in enumerate(speeches):
                logits = model(ids)[:, -1] / TEMPERATURE
                choice = torch.multinomial(logits.softmax(-1), 1, generator=generator)
                speeches[index] = torch.cat([ids, choice], dim=1)
    finally:
        model.train(training)
    return [ids[0] for ids in speeches]


def speech_rows(speeches: Speeches) -> list[tuple[str, float, str]]:
    """(way, seconds, how it works) for the pipe and the plain model."""
    stats = speeches.stats
    return [
        (
            "through the pipe",
            stats.seconds,
            f"{stats.lanes} lanes taking turns through {len(stats.cache_bytes)} stages, "
            f"bubble {speeches.timeline.bubble:.0%}; KV cache per stage "
            f"{_per_stage(stats.cache_bytes)}, hidden states sent per stage "
            f"{_per_stage(stats.wire_bytes)}",
        ),
        (
            "plain model",
            speeches.plain_seconds,
            "one process, no cache: everything so far recomputed for each new character",
        ),
    ]


def _per_stage(sizes: dict[int, int]) -> str:
    """``{0: 2048, 1: 2048}`` as ``"2.0 KiB"``; sizes that differ as a list, by stage."""
    values = [sizes[stage] for stage in sorted(sizes)]
    if len(set(values)) == 1:
        return format_bytes(values[0])
    return ", ".join(format_bytes(value) for value in values)
