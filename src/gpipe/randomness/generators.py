"""The devices' default generators: those a worker may seed as its own, and watching them.

Random ops without an explicit generator draw from their device's default generator. A
worker that is the only one in its process to use a generator (a GPU's, or the CPU's in a
one-device pipe or a one-stage process) may simply seed it for each layer that draws and
restore it afterwards: exact, and free per op. A generator that several workers use at once
(the CPU's, shared by every "cpu" stage of a local pipe) must never be reseeded under another
worker's feet: ops on it are handed a private generator instead (see ``routing``), and only
draws that cannot be handed one hold it, seeded, under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass

import torch

__all__ = ["WorkerGenerators", "generator_name", "lent"]

# NOTE: reentrant, since a held layer may run an op that also holds its generator.
_locks: dict[str, threading.RLock] = {}
_locks_guard = threading.Lock()


def generator_name(device: torch.device) -> str | None:
    """The name of ``device``'s default generator ("cpu", "cuda:1"), None if not handled."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}"
    return None


def _generator(name: str) -> torch.Generator:
    if name == "cpu":
        return torch.default_generator
    return torch.cuda.default_generators[int(name.split(":")[1])]


def _lock(name: str) -> threading.RLock:
    lock = _locks.get(name)  # NOTE: no guard once made: this runs on every stage forward
    if lock is not None:
        return lock
    with _locks_guard:
        if name not in _locks:
            _locks[name] = threading.RLock()
        return _locks[name]


@contextmanager
def _seeded(names: tuple[str, ...], seed: int) -> Iterator[None]:
    generators = [_generator(name) for name in names]
    states = [generator.get_state() for generator in generators]
    for generator in generators:
        generator.manual_seed(seed)
    try:
        yield
    finally:
        for generator, state in zip(generators, states):
            generator.set_state(state)


@contextmanager
def _holding(names: tuple[str, ...]) -> Iterator[None]:
    with ExitStack() as stack:
        for name in names:  # NOTE: always in name order, so no two workers deadlock
            stack.enter_context(_lock(name))
        yield


@contextmanager
def lent(name: str, stream: torch.Generator) -> Iterator[None]:
    """Lend ``stream``'s state to the default generator ``name`` for the body, under its lock.

    The body's draws from the default generator continue ``stream`` exactly (the state comes
    back to it afterwards), and the default generator is restored. For random ops that take
    no generator. NOTE: held for one op only, never across a stage's forward.
    """
    default = _generator(name)
    with _lock(name):
        saved = default.get_state()
        default.set_state(stream.get_state())
        try:
            yield
        finally:
            stream.set_state(default.get_state())
            default.set_state(saved)


@dataclass(frozen=True)
class WorkerGenerators:
    """The default generators one worker's layers draw from, split by who else uses them.

    Generators are named ("cpu", "cuda:0"), not held, so this stays plain data (a copy of
    the pipe must still seed the process's own default generators).

    Args:
        own: generators no other worker of this process uses: seeded per layer, no lock.
        shared: generators other workers use at the same time.
    """

    own: tuple[str, ...]
    shared: tuple[str, ...]

    @classmethod
    def of(cls, device: torch.device, devices: list[torch.device]) -> WorkerGenerators:
        """The generators of the worker on ``device``, among workers on ``devices``.

        Every worker may draw on the CPU, so the CPU generator is its own only when it is
        the only worker; a GPU's generator is its own unless another worker runs there too.
        """
        names = {"cpu": len(devices)}
        name = generator_name(device)
        if name is not None and name != "cpu":
            names[name] = sum(generator_name(d) == name for d in devices)
        own = tuple(n for n in sorted(names) if names[n] == 1)
        shared = tuple(n for n in sorted(names) if names[n] > 1)
        return cls(own, shared)

    @property
    def own_names(self) -> frozenset[str]:
        return frozenset(self.own)

    def owns_every_generator(self) -> bool:
        """Whether every default generator an op could draw on is this worker's own.

        Then routing has nothing to do (it leaves ops on own generators alone), so a probe
        need not run a dispatch mode. NOTE: the first dispatch mode a process enters imports
        torch._dynamo, which would take seconds inside the first step's first forward of
        every one-stage process.
        """
        if self.shared or "cpu" not in self.own or torch.backends.mps.is_available():
            return False
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return sum(name.startswith("cuda:") for name in self.own) == gpus

    def seeded_own(self, seed: int) -> AbstractContextManager[None]:
        """Seed this worker's own generators with ``seed``; restore them on exit."""
        return _seeded(self.own, seed)

    @contextmanager
    def seeded_shared(self, seed: int) -> Iterator[None]:
        """Hold the shared generators, seeded with ``seed``; restore and release them on exit.

        For a layer whose draws bypass routing: for its duration, the shared generators are
        its own. NOTE: held for that one layer call, never across a stage's forward.
        """
        with _holding(self.shared), _seeded(self.shared, seed):
            yield

    def read(self) -> tuple[list[bytes], list[bytes]]:
        """The states of the own and the shared generators, to compare later."""
        own = [_generator(name).get_state().numpy().tobytes() for name in self.own]
        if not self.shared:
            return own, []
        # NOTE: shared ones are read under their locks, so a generator another worker
        # holds seeded (and restores) is never seen half-way. The locks are taken by hand,
        # not with _holding's ExitStack, too dear for a call made once per stage forward.
        locks = [_lock(name) for name in self.shared]
        for lock in locks:
            lock.acquire()
        try:
            shared = [_generator(name).get_state().numpy().tobytes() for name in self.shared]
        finally:
            for lock in reversed(locks):
                lock.release()
        return own, shared
