"""What the demo runs: the pipeline's shape, the training length, the text and the model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from gpipe.data import shakespeare
from gpipe.models import CharTokenizer, GPTConfig, char_config, windows

__all__ = ["PROMPTS", "Corpus", "DemoSettings", "check", "learning_rate"]

HELD_OUT = 0.1  # the last tenth of the text is only ever validated on
VALIDATION_WINDOWS = 64
PROMPTS = ("ROMEO:\n", "JULIET:\n", "HAMLET:\n", "MACBETH:\n")  # where the speeches start


@dataclass(frozen=True)
class DemoSettings:
    """The demo's options (``gpipe demo --help`` explains each)."""

    stages: int = 4
    chunks: int = 8
    schedule: str = "gpipe"
    checkpoint: str = "except_last"
    steps: int = 250
    batch: int = 32
    seed: int = 0
    lr: float = 1e-2
    out: Path = Path("demo-out")
    distributed: int = 0  # processes; 0 runs every stage in this process

    @property
    def warmup(self) -> int:
        """Steps of linear warm-up before the cosine decay."""
        return max(1, min(10, self.steps // 10))


def learning_rate(settings: DemoSettings, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth: what small GPTs train well with."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class Corpus:
    """The text, its tokenizer, the training ids and the held-out validation windows."""

    tokenizer: CharTokenizer
    train: torch.Tensor
    validation: tuple[torch.Tensor, torch.Tensor]
    config: GPTConfig

    @classmethod
    def load(cls, seed: int) -> Corpus:
        """Shakespeare, split: the first nine tenths to train on, the rest held out."""
        text = shakespeare()
        tokenizer = CharTokenizer.from_text(text)
        data = tokenizer.encode(text)
        cut = int(len(data) * (1 - HELD_OUT))
        config = char_config(tokenizer.vocab)
        held_out = windows(
            data[cut:],
            VALIDATION_WINDOWS,
            config.context,
            generator=torch.Generator().manual_seed(seed + 1),
        )
        return cls(tokenizer, data[:cut], held_out, config)

    def batches(self, settings: DemoSettings) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every step's mini-batch, drawn up front so every process trains on the same."""
        generator = torch.Generator().manual_seed(settings.seed)
        return [
            windows(self.train, settings.batch, self.config.context, generator=generator)
            for _ in range(settings.steps)
        ]


def check(settings: DemoSettings, layers: int) -> None:
    """Refuse settings the demo cannot run, naming the fix.

    Args:
        settings: the options.
        layers: how many layers the model has.

    Raises:
        ValueError: a pipeline the model cannot be cut into, fewer samples than
            micro-batches, a schedule that cannot run it, or an output path that is a file.
    """
    from gpipe.schedule import SCHEDULES, default_virtual_stages

    if settings.schedule not in SCHEDULES:
        raise ValueError(
            f"--schedule {settings.schedule!r} is not a schedule: choose from "
            f"{', '.join(sorted(SCHEDULES))}"
        )
    v = default_virtual_stages(settings.schedule)
    if settings.stages * v > layers:
        most = layers // v
        per = f" (x {v} stages per device for {settings.schedule})" if v > 1 else ""
        option = "--distributed" if settings.distributed else "--stages"
        raise ValueError(
            f"{option} {settings.stages}{per} needs {settings.stages * v} stages, but the "
            f"model has {layers} layers: use {option} <= {most}"
        )
    if settings.batch < settings.chunks:
        raise ValueError(
            f"--batch {settings.batch} cannot make {settings.chunks} micro-batches of at "
            f"least one sample: use --batch >= {settings.chunks} or --chunks <= {settings.batch}"
        )
    if settings.out.exists() and not settings.out.is_dir():
        raise ValueError(f"--out {settings.out} is a file: give a folder, e.g. --out demo-out")
