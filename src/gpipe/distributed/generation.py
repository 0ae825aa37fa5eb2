"""``DistributedGPipe.generate``: each rank decodes with its own stages and their caches.

Every rank of the pipeline calls it with the same settings; the rank of the first stage
must be given the prompt (the others may pass it too, or None). The call begins with the
header every call begins with, so ranks that call something else meet there; then the first
stage's rank tells the others what each stage needs: the prompt's mask (positions and masks
are worked out on every stage), the lanes and the settings, which every rank compares with
its own. The decode schedule is lowered like a training step's, so the transport posts its
messages in an order that cannot hang under NCCL's rules, and the tokens the last stage
samples go back to the first over the pipe. At the end the last stage's rank tells every
rank the new tokens, so every rank returns the same ids.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from gpipe.analysis import Timeline
from gpipe.distributed.header import agree
from gpipe.distributed.json_collectives import all_gather_json, broadcast_json
from gpipe.distributed.programs import Programs
from gpipe.generation.engine import Decoder
from gpipe.generation.generate import (
    GenerationStats,
    assemble,
    check_prompt,
    cut_lanes,
    stage_programs,
)
from gpipe.generation.sampling import Sampling
from gpipe.schedule import decode

if TYPE_CHECKING:
    from gpipe.distributed.pipe import DistributedGPipe

__all__ = ["DistributedGeneration", "generate_distributed"]


def generate_distributed(
    pipe: DistributedGPipe,
    input_ids: Tensor | None,
    attention_mask: Tensor | None,
    lanes: int | None,
    generator: torch.Generator | None,
    settings: dict[str, Any],
) -> tuple[Tensor, GenerationStats, Decoder]:
    """Run this rank's part of a decode; the ids (on every rank), what it did, the run.

    Raises:
        ValueError, TypeError: bad settings or prompt (on the first stage's rank; the others
            fail naming it), or settings that differ between ranks (on every rank).
        PipelineFailure: a rank failed while decoding, naming its rank, stage and action.
    """
    guard = pipe._guard
    first, last = pipe._rank_of(0), pipe._rank_of(pipe._stages.last)
    group = pipe.groups.control
    sampling = Sampling(**settings)
    prompt: dict[str, Any] | None = None
    if pipe.rank == first:
        if input_ids is None:
            raise ValueError(
                f"input_ids=None on rank {pipe.rank}, which holds the first stage: pass the "
                "prompt on this rank (every rank may pass it; the others ignore it)"
            )
        mask = check_prompt(input_ids, attention_mask)
        rows = input_ids.shape[0]
        count = len(cut_lanes(input_ids, mask, lanes, pipe.layout.pp))
        prompt = {
            "ids": input_ids.tolist(),
            "mask": mask.tolist(),
            "lanes": count,
            "settings": _comparable(settings),
        }
    settings_key = (pipe.schedule, pipe.checkpoint, pipe.chunks)
    agree(guard, None, 0, settings_key, first, group, "generate")
    told = broadcast_json(prompt, first, group=group, wait=guard.wait)
    if told["settings"] != _comparable(settings):
        raise guard.fail(
            f"rank {pipe.rank} called generate({_comparable(settings)}) while rank {first}, "
            f"which holds the first stage, called generate({told['settings']}): give every "
            "rank the same settings"
        )
    mask = torch.tensor(told["mask"], dtype=torch.long)
    ids = torch.tensor(told["ids"], dtype=torch.long)
    rows = mask.shape[0]
    cut = cut_lanes(ids, mask, told["lanes"], pipe.layout.pp)
    stages = pipe._stages
    modules = list(pipe._rank.modules)
    source = getattr(pipe._flow, "source", None) if pipe._flow is not None else None
    names = None if pipe._flow is not None else [list(m._modules) for m in modules]
    held = [stages.modules[s] is not None for s in range(stages.count)]
    every = stage_programs(modules, source, names)
    programs = [program if held[s] else None for s, program in enumerate(every)]
    schedule = decode(
        pipe.layout.pp,
        len(cut),
        sampling.max_new_tokens,
        virtual_stages=stages.count // pipe.layout.pp,
        placement=stages.placement,
    )
    transport = pipe._transport
    transport.reset()
    key = ("generate", rows, mask.shape[1], tuple(c.mask.shape[0] for c in cut), str(sampling))
    # NOTE: lowered as a chain, whatever the pipe's dataflow: decoding sends only hidden
    # states to the next stage, and tokens back to the first
    programs_of = pipe.__dict__.setdefault("_decode_programs", Programs(None, pipe.layout.position))
    transport.begin(programs_of.of(schedule), key=key)
    stage_devices = [pipe.torch_device] * stages.count
    decoder = Decoder(
        programs,
        stage_devices,
        stages.placement,
        transport,
        cut,
        sampling,
        generator,
        transport.ran,
    )
    start = time.perf_counter()
    decoder.run(schedule, [[pipe.layout.position]], None)
    transport.finish()
    seconds = time.perf_counter() - start
    pipe._ran = True
    new = None
    if pipe.rank == last:
        new = assemble(torch.zeros(rows, 0, dtype=torch.long), cut, sampling).tolist()
    tokens = torch.tensor(broadcast_json(new, last, group=group, wait=guard.wait), dtype=torch.long)
    # What each rank's stages hold and received, told to every rank: the run's whole picture.
    wire: dict[int, int] = {}
    for transfer in transport.transfer_log.received:
        _, stage, *_ = transfer.tag
        if stage > 0:  # hidden states from stage - 1; tokens handed back to stage 0 are not
            wire[stage - 1] = wire.get(stage - 1, 0) + transfer.nbytes
    mine = {"cache": decoder.cache_bytes(), "wire": wire}
    told_all = all_gather_json(mine, group=group, wait=guard.wait)
    stats = GenerationStats(
        lanes=len(cut),
        tokens=sampling.max_new_tokens,
        cache_bytes={int(s): n for each in told_all for s, n in each["cache"].items()},
        wire_bytes={int(s): n for each in told_all for s, n in each["wire"].items()},
        seconds=seconds,
        rows=rows,
    )
    return torch.cat([ids, tokens.reshape(rows, -1)], dim=1), stats, decoder


def _comparable(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings as JSON values, to compare between ranks."""
    eos = settings.get("eos_token_id")
    return {**settings, "eos_token_id": list(eos) if isinstance(eos, (list, tuple)) else eos}


class DistributedGeneration:
    """``generate`` of :class:`~gpipe.distributed.DistributedGPipe`."""

    _guard: Any
    _data_parallel: Any
    _ran: bool
    #: What the last :meth:`generate` did: every stage's KV bytes, hidden-state bytes sent.
    generation_stats: GenerationStats
    #: What this rank's device ran in the last :meth:`generate`.
    generation_timeline: Timeline

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | None,
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
        """Generate through the pipeline, each rank's stages keeping their own KV caches.

        As :meth:`gpipe.GPipe.generate`; every rank calls it with the same settings. The
        rank of the first stage must be given the prompt (the others may pass it or None);
        the last stage's rank samples (``generator`` is read there). Every rank returns the
        same ids. ``pipe.generation_stats`` holds every stage's KV bytes and the hidden-state
        bytes each stage sent, counted by the transport.
        """
        settings = dict(
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
        self._data_parallel.refuse("generate")
        self._ran = False
        self._guard.state = None
        with self._guard.stepping(lambda: self._ran):
            ids, self.generation_stats, decoder = generate_distributed(
                cast("DistributedGPipe", self),
                input_ids,
                attention_mask,
                lanes,
                generator,
                settings,
            )
        self.generation_timeline = decoder.timeline()
        return ids
