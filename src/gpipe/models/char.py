"""A character-level language model: one token per character, as in nanoGPT's Shakespeare.

The model is :func:`gpipe.models.gpt` with a vocabulary of the text's characters; this module
holds what turns text into training windows and a trained model back into text::

    text = gpipe.data.shakespeare()
    chars = CharTokenizer.from_text(text)
    data = chars.encode(text)
    model = gpt(char_config(chars.vocab))
    ids, targets = windows(data, batch=32, context=64)
    print(chars.decode(generate(model, chars.encode("ROMEO:\\n"), 200)))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gpipe.models.gpt import GPTConfig

__all__ = ["CharTokenizer", "char_config", "generate", "windows"]


@dataclass(frozen=True)
class CharTokenizer:
    """Characters to ids and back: id ``i`` is ``chars[i]``."""

    chars: str

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The tokenizer of every character ``text`` uses, sorted."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab(self) -> int:
        """How many distinct characters."""
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """``text`` as a 1-D int64 tensor of ids.

        Raises:
            ValueError: a character the tokenizer does not know.
        """
        index = {c: i for i, c in enumerate(self.chars)}
        unknown = sorted(set(text) - index.keys())
        if unknown:
            raise ValueError(
                f"characters {''.join(unknown)!r} are not in the tokenizer's {self.vocab}: "
                "build it from a text that has them (CharTokenizer.from_text)"
            )
        return torch.tensor([index[c] for c in text], dtype=torch.int64)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """The text of a 1-D sequence of ids."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return "".join(self.chars[i] for i in values)


def char_config(vocab: int) -> GPTConfig:
    """The demo's model: 4 blocks 160 wide over 64 characters, about 1.3 M parameters.

    Sized so that ``gpipe demo`` trains it on 2 CPU cores in about two minutes, long enough
    for the loss to fall below 2.1 nats and for samples to look like a play: four blocks
    (one per stage of a 4-stage pipe), wide enough to be about 1.3 M parameters. No dropout:
    a few hundred steps see a small part of the text, far from over-fitting it.
    """
    return GPTConfig(vocab=vocab, context=64, layers=4, heads=4, width=160, dropout=0.0)


def windows(
    data: torch.Tensor,
    batch: int,
    context: int,
    *,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``context`` ids, and the same shifted by one (targets).

    Raises:
        ValueError: ``data`` is not longer than ``context``.
    """
    if len(data) <= context:
        raise ValueError(f"need more than context={context} ids of text, got {len(data)}")
    starts = torch.randint(0, len(data) - context, (batch,), generator=generator)
    offsets = starts[:, None] + torch.arange(context + 1)
    chunk = data[offsets]
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    length: int,
    *,
    context: int,
    temperature: float = 0.8,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``prompt`` followed by ``length`` ids sampled one at a time from ``model``.

    Args:
        model: maps ``(1, T)`` ids to ``(1, T, vocab)`` logits, ``T <= context``.
        prompt: 1-D ids to start from (at least one).
        length: how many ids to add.
        context: the longest input the model takes; older ids are dropped.
        temperature: below 1 samples likelier characters, above 1 more surprising ones.
        generator: the random stream to sample from.

    Returns:
        The 1-D ids, prompt first. The model is left in the mode it was in.
    """
    if prompt.dim() != 1 or len(prompt) == 0:
        raise ValueError(f"prompt must be a non-empty 1-D tensor of ids, got {prompt.shape}")
    training = model.training
    model.eval()
    ids = prompt[None]
    try:
        for _ in range(length):
            logits = model(ids[:, -context:])[0, -1] / temperature
            choice = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
            ids = torch.cat([ids, choice[None]], dim=1)
    finally:
        model.train(training)
    return ids[0]
