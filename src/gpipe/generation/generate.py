"""``pipe.generate``: what both pipes share: checking the prompt, cutting it into lanes,
the decode schedule, and the output as Hugging Face's ``generate`` returns it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from gpipe.generation.engine import Lane
from gpipe.generation.hf import hf_programs, is_hf_causal_lm
from gpipe.generation.programs import StageProgram, sequential_programs
from gpipe.generation.sampling import Sampling

__all__ = ["GenerationStats", "assemble", "check_prompt", "cut_lanes", "stage_programs"]


@dataclass(frozen=True)
class GenerationStats:
    """What the last ``pipe.generate`` did, read from the pipe's own counts.

    Attributes:
        lanes: how many lanes decoded in turn.
        tokens: the forwards each lane ran (its prompt, then one per new token but the last).
        cache_bytes: the KV cache each stage held at the end, over every lane.
        wire_bytes: bytes of hidden states each stage sent to the next, over the whole run
            (tokens handed back to stage 0 not counted).
        seconds: the run's wall time.
        rows: the prompt's rows.
        predicted_cache_bytes: what each stage's cache was predicted to hold, from its bytes
            per row and position (:func:`gpipe.generation.memory.cache_bytes_per_token`);
            empty where not predicted (a distributed pipe).
    """

    lanes: int
    tokens: int
    cache_bytes: dict[int, int]
    wire_bytes: dict[int, int]
    seconds: float
    rows: int
    predicted_cache_bytes: dict[int, int] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second over every row (the rows of the batch times ``tokens``)."""
        return self.rows * self.tokens / self.seconds if self.seconds > 0 else 0.0


def check_prompt(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """The prompt's mask (ones if none was given), after checking both.

    Raises:
        TypeError: ids that are not an integer tensor, or a mask that is not a tensor.
        ValueError: ids not ``[rows, length]``; a mask of another shape, with values other
            than 0 and 1, padding on the right, or a row of padding only.
    """
    if not isinstance(input_ids, Tensor) or input_ids.is_floating_point() or input_ids.is_complex():
        got = type(input_ids).__name__ if not isinstance(input_ids, Tensor) else input_ids.dtype
        raise TypeError(f"input_ids must be an integer tensor [rows, length], got {got}")
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(
            f"input_ids must be [rows, length] with rows, length >= 1, got shape "
            f"{tuple(input_ids.shape)}: add a batch dimension with input_ids[None]"
        )
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if not isinstance(attention_mask, Tensor):
        raise TypeError(
            f"attention_mask must be a tensor or None, got {type(attention_mask).__name__}"
        )
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
            f"{tuple(input_ids.shape)}: give one mask entry per token"
        )
    mask = attention_mask.long()
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (a token)")
    if bool((mask.sum(-1) == 0).any()):
        raise ValueError("a prompt row is all padding: give every row at least one token")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError(
            "the prompts are padded on the right: generation appends after the last column, so "
            "pad on the left (a Hugging Face tokenizer: tokenizer.padding_side = 'left')"
        )
    return mask


def cut_lanes(input_ids: Tensor, mask: Tensor, lanes: int | None, devices: int) -> list[Lane]:
    """The rows cut into ``lanes`` lanes of consecutive rows (the first ones one larger);
    by default one per pipeline device, and never more than rows.

    Raises:
        TypeError, ValueError: ``lanes`` is not an int from 1 to the number of rows.
    """
    rows = input_ids.shape[0]
    if lanes is None:
        lanes = min(devices, rows)
    if not isinstance(lanes, int) or isinstance(lanes, bool):
        raise TypeError(f"lanes must be an int or None, got {lanes!r}")
    if not 1 <= lanes <= rows:
        raise ValueError(
            f"lanes={lanes} for {rows} prompt rows: give 1 to {rows} lanes (a lane holds at "
            "least one row); None gives one per pipeline device"
        )
    base, extra = divmod(rows, lanes)
    cut: list[Lane] = []
    start = 0
    for index in range(lanes):
        size = base + (1 if index < extra else 0)
        rows_of = slice(start, start + size)
        cut.append(Lane(index, rows_of, input_ids[rows_of], mask[rows_of]))
        start += size
    return cut


def assemble(input_ids: Tensor, lanes: Sequence[Lane], sampling: Sampling) -> Tensor:
    """The prompt followed by each row's new tokens, as HF's ``generate`` returns them: up
    to the step on which the last row finished (every row padded after its eos)."""
    new = torch.cat([torch.stack(lane.tokens, dim=1) for lane in lanes], dim=0)
    eos = sampling.eos_token_ids
    if eos:
        is_eos = torch.isin(new, torch.tensor(eos, device=new.device))
        finished = is_eos.cumsum(dim=1) > 0
        # NOTE: HF stops after the step on which every row has finished
        done = finished.all(dim=0).nonzero()
        if done.numel():
            new = new[:, : int(done[0]) + 1]
    return torch.cat([input_ids.to(new.device), new], dim=1)


def stage_programs(
    stages: Sequence[nn.Module], source: nn.Module | None, names: Sequence[Sequence[str]] | None
) -> list[StageProgram]:
    """Each stage's decode program: by the HF adapter for a split Hugging Face model
    (``source``), by the protocol of :mod:`gpipe.generation.programs` for an nn.Sequential.

    Raises:
        TypeError: a split model that is no known Hugging Face causal LM; a layer that
            cannot decode token by token.
    """
    if source is not None:
        if not is_hf_causal_lm(source):
            raise TypeError(
                f"generate() through gpipe.split stages needs a Hugging Face causal LM "
                f"laid out as Llama or GPT-2; {type(source).__name__} is not one: pipe an "
                "nn.Sequential whose layers follow gpipe.generation.programs' protocol"
            )
        return hf_programs(source, stages)
    if names is None:
        raise TypeError(
            "generate() needs an nn.Sequential pipe or stages that gpipe.split cut from a "
            "Hugging Face causal LM"
        )
    return sequential_programs(stages, names)
