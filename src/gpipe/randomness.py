"""Random streams: every (stage, micro-batch) draws from its own seed, whatever the threads do.

Stages in one process share a device's generator (all "cpu" stages share the one CPU
generator), so concurrent stages would draw dropout masks in an order that changes from run
to run, and restoring "the RNG state" before a recomputation would replay masks another
thread drew in between. Instead, a stage that draws random numbers runs each forward (and its
recomputation) holding its device's generator, seeded from (step seed, stage, micro-batch),
and restores the generator afterwards. Stages that draw nothing never take the lock, so
they stay fully parallel.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["RandomProbe", "draw_step_seed", "seeded", "stream_seed"]

_MASK = (1 << 64) - 1
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def draw_step_seed() -> int:
    """A seed for one training step, drawn from the global CPU generator.

    Drawing (rather than reading ``torch.initial_seed()``) makes consecutive steps differ while
    ``torch.manual_seed(s)`` still fixes every step that follows it.
    """
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


def stream_seed(step_seed: int, stage: int, microbatch: int) -> int:
    """The seed of one (stage, micro-batch) stream: a SplitMix64 hash of the three numbers."""
    z = (step_seed + 0x9E3779B97F4A7C15 * (1 + stage * 65_537 + microbatch)) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


def _lock(device: torch.device) -> threading.Lock:
    key = str(device) if device.type != "cpu" else "cpu"
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


@contextmanager
def seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Hold ``device``'s default generator, seeded with ``seed``; restore it on exit."""
    generator = _generator(device)
    with _lock(device):
        state = generator.get_state()
        generator.manual_seed(seed)
        try:
            yield
        finally:
            generator.set_state(state)


class RandomProbe(TorchDispatchMode):
    """Notes whether any op run under it draws random numbers (e.g. dropout's bernoulli_).

    Dispatch modes are thread-local, so probing one stage does not see other stages' ops.
    """

    def __init__(self) -> None:
        super().__init__()
        self.found = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.found = True
        return func(*args, **(kwargs or {}))
