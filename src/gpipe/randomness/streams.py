"""Streams: how each layer draws random numbers, learned as it runs, and the scope it runs in.

A layer runs, for each micro-batch, in one of four ways, learned by probing it:

    plain    it draws nothing: it runs as it is (the stage is watched, see below)
    seeded   it draws only on generators its worker owns: those are seeded from its
             stream around the call and restored after (free per op)
    routed   it draws on a generator other workers share: a dispatch mode hands its
             random ops the stream's private generator (a CPU cost on every op)
    held     it holds the shared generators, seeded, under a lock, for its call: when
             routing would cost more than a tenth of its time (small ops), or when
             some of its draws bypass routing (a custom kernel reading the generator)

All four draw the same numbers: what the layer draws from default generators seeded from
its stream.

A layer is probed the first time it runs (per training mode): it runs routed with its own
generators seeded (a worker that owns every generator, alone in its process, has nothing to
route and runs it as it is), and what moved tells its kind; one found to draw on a shared
generator is then timed routed and held (three runs each), and keeps the cheaper way.
Afterwards the default generators are compared before and after each stage forward, so a
layer that starts drawing (a dropout probability raised from 0) is caught and probed, and the
forward redone on the streams before anything leaves it. So a recomputation always replays
what its forward drew.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from gpipe.randomness.generators import WorkerGenerators
from gpipe.randomness.routing import Routing
from gpipe.randomness.seeds import LOSS_KEY, LayerKey, stream_seed

__all__ = ["StageForward", "Streams"]

PLAIN, SEEDED, ROUTED, HELD = "plain", "seeded", "routed", "held"

# A layer that draws on a shared generator holds it (seeded, under a lock, for its call)
# rather than being routed when routing costs more CPU than this share of the time it would
# hold the generator: a layer of small ops (a tiny transformer block, a lone dropout). A
# layer whose time goes to long kernels (or sleeps) is routed, so it never keeps others
# waiting for long.
# NOTE: both draw the same numbers, so this choice changes the speed, never the result.
_HOLD_ABOVE = 0.1
# Runs of each way a layer is timed before the choice (after its probe).
_TRIALS = 3

# Attempts at one stage forward: the first; one probing every layer after a generator moved;
# one holding the layers found to bypass routing; one spare.
_MAX_ATTEMPTS = 4

LayerScope = Callable[[LayerKey], AbstractContextManager[Any]]
GeneratorStates = tuple[list[bytes], list[bytes]]


class Streams:
    """How each layer of a pipe draws random numbers, kept from step to step.

    Args:
        devices: the devices this process runs workers for, by pipeline device index.
    """

    def __init__(self, devices: dict[int, torch.device]) -> None:
        listed = list(devices.values())
        self._generators = {i: WorkerGenerators.of(d, listed) for i, d in devices.items()}
        if not all(g.owns_every_generator() for g in self._generators.values()):
            Routing.warm_up()  # the probes will route: pay the mode's first entry here
        self._kinds: dict[tuple[LayerKey, bool], str] = {}
        self._suspects: set[tuple[LayerKey, bool]] = set()  # seen bypassing routing once
        # Routed layers still being timed, routed and held, to settle which is cheaper: the
        # CPU seconds of their routed runs, and the CPU and wall seconds of their held runs.
        self._trials: dict[tuple[LayerKey, bool], tuple[list[float], list[tuple[float, float]]]]
        self._trials = {}
        # Layers found drawing by a redo (they started drawing after a probe): timed only
        # from a later step on, keyed to the step seed they were found in (see _probe).
        self._deferred: dict[tuple[LayerKey, bool], int] = {}
        self._warned: set[Any] = set()

    def kind(self, key: LayerKey, training: bool) -> str | None:
        """How layer ``key`` draws: "plain", "seeded", "routed", "held"; None: not yet run."""
        return self._kinds.get((key, training))

    def forward(
        self,
        keys: list[LayerKey],
        *,
        device: int,
        training: bool,
        step_seed: int,
        microbatch: int,
        stage: int,
        watched: GeneratorStates | None = None,
    ) -> StageForward:
        """The streams of one stage forward of one micro-batch on pipeline device ``device``.

        ``watched``: the default generators' states as the device's last forward left them
        (its :attr:`StageForward.watched`), when nothing that may draw ran in between on
        that device; None reads them afresh.
        """
        return StageForward(
            self, self._generators[device], keys, training, step_seed, microbatch, stage, watched
        )

    def _learn(
        self, key: LayerKey, training: bool, kind: str, stage: int, bypassed: bool = False
    ) -> None:
        """Record how ``key`` draws. That it ``bypassed`` routing counts from its second
        probe on.

        NOTE: a probe sees a shared generator move when another worker's layer draws on it
        unrouted at that moment (a layer that starts drawing, not yet caught): the first such
        verdict holds the layer for the redo only, and it is probed again next time.
        """
        if not bypassed:
            self._kinds[key, training] = kind
            return
        if (key, training) not in self._suspects:
            self._suspects.add((key, training))
            self._kinds.pop((key, training), None)
            return
        self._suspects.discard((key, training))
        self._kinds[key, training] = kind
        if ("held", key) not in self._warned:
            self._warned.add(("held", key))
            what = "the loss" if key == LOSS_KEY else f"layer {key!r}"
            warnings.warn(
                f"{what} (stage {stage}) draws random numbers that bypass torch's random ops "
                "(a custom kernel reading the default generator?) on a generator other "
                "stages share, so gpipe cannot hand it a generator of its own; it now runs "
                "holding that generator seeded from its stream, which serializes it with "
                "other such layers",
                RuntimeWarning,
                stacklevel=2,
            )

    def _warn_moving(self, stage: int) -> None:
        if ("moving", stage) not in self._warned:
            self._warned.add(("moving", stage))
            warnings.warn(
                f"torch's default generator keeps moving while stage {stage} runs, though its "
                "layers were probed: another thread is drawing random numbers from it; gpipe "
                "re-runs the stage to check each time this happens",
                RuntimeWarning,
                stacklevel=2,
            )


class StageForward:
    """The random streams of one stage forward of one micro-batch, attempt by attempt.

    Call :meth:`attempt` before each attempt, run it with :attr:`layer_scope` as the
    partition's layer scope and :meth:`scope` around anything else keyed (the loss); then
    :meth:`settled` says whether its output stands or the forward must be redone.

    NOTE: the default generators are read before and after each attempt, to catch a layer
    that starts drawing. A worker's forwards follow one another with nothing that draws in
    between, so the state one forward ends with is the next one's start (``watched``): one
    read per forward instead of two, the larger part of this class's cost per action.
    """

    def __init__(
        self,
        streams: Streams,
        generators: WorkerGenerators,
        keys: list[LayerKey],
        training: bool,
        step_seed: int,
        microbatch: int,
        stage: int,
        watched: GeneratorStates | None = None,
    ) -> None:
        self._streams = streams
        self._generators = generators
        self._keys = keys
        self._training = training
        self._step_seed = step_seed
        self._microbatch = microbatch
        self._stage = stage
        self._probe_all = False
        self._must_redo = False
        self._held_keys: set[LayerKey] = set()  # held for this forward's redo
        self._before: GeneratorStates | None = None
        self._attempts = 0
        # The generators' states after the last attempt that was watched: the next
        # forward's start. None after an attempt that probed every layer (not watched).
        self.watched = watched

    def _kind(self, key: LayerKey) -> str | None:
        if key in self._held_keys:
            return HELD
        kind = self._streams.kind(key, self._training)
        return kind if kind == HELD or not self._probe_all else None

    @property
    def layer_scope(self) -> LayerScope | None:
        """What runs around each layer call; None when every layer runs as it is."""
        if not (self._probe_all or self._held_keys):
            kinds, training = self._streams._kinds, self._training
            if all(kinds.get((key, training)) == PLAIN for key in self._keys):
                return None
        elif all(self._kind(key) == PLAIN for key in self._keys):
            return None
        return self.scope

    def scope(self, key: LayerKey) -> AbstractContextManager[Any]:
        """The context layer ``key`` runs in for this micro-batch."""
        kind = self._kind(key)
        if kind == PLAIN:
            return nullcontext()
        seed = stream_seed(self._step_seed, key, self._microbatch)
        if kind == SEEDED:
            return self._generators.seeded_own(seed)
        if kind is None:
            return self._probe(key, seed)
        if kind == HELD:
            return self._held(seed)
        deferred = self._streams._deferred.get((key, self._training))
        if deferred is not None and deferred != self._step_seed:
            del self._streams._deferred[key, self._training]
            self._streams._trials[key, self._training] = ([], [])
        if (key, self._training) in self._streams._trials:
            return self._trial(key, seed)
        return self._routed(seed)

    @contextmanager
    def _routed(self, seed: int) -> Iterator[None]:
        own = self._generators.own_names
        with self._generators.seeded_own(seed), Routing(seed, own).active():
            yield

    @contextmanager
    def _trial(self, key: LayerKey, seed: int) -> Iterator[None]:
        """Run routed or held, timing it; after a few runs each, keep the cheaper way.

        Routing costs CPU on every op; holding costs other layers that wait for the generator
        while this one runs. So the layer is held if routing costs more CPU than a tenth of
        the time it holds the generator for. NOTE: the least of a few runs each, so a run
        that waited for the GIL (or paid a one-time cost) does not decide.
        """
        routed, held = self._streams._trials[key, self._training]
        began = time.thread_time()
        if len(routed) <= len(held):
            with self._routed(seed):
                yield
            routed.append(time.thread_time() - began)
            return
        with self._generators.seeded_own(seed), self._generators.seeded_shared(seed):
            began, held_from = time.thread_time(), time.perf_counter()
            yield
            held.append((time.thread_time() - began, time.perf_counter() - held_from))
        if len(held) < _TRIALS:
            return
        del self._streams._trials[key, self._training]
        held_cpu, held_for = min(cpu for cpu, _ in held), min(wall for _, wall in held)
        if min(routed) - held_cpu > _HOLD_ABOVE * held_for:
            self._streams._learn(key, self._training, HELD, self._stage)

    @contextmanager
    def _held(self, seed: int) -> Iterator[None]:
        with self._generators.seeded_own(seed), self._generators.seeded_shared(seed):
            yield

    @contextmanager
    def _probe(self, key: LayerKey, seed: int) -> Iterator[None]:
        routing: Routing | None = None
        with self._generators.seeded_own(seed):
            own, shared = self._generators.read()
            if self._generators.owns_every_generator():  # nothing to route: no mode
                yield
            else:
                with Routing(seed, self._generators.own_names).active() as routing:
                    yield
            own_after, shared_after = self._generators.read()
        if shared_after != shared:  # drew on a shared generator, unrouted: redo it held
            self._held_keys.add(key)
            self._must_redo = True
            self._streams._learn(key, self._training, HELD, self._stage, bypassed=True)
            return
        if routing is None or not routing.drew:
            kind = SEEDED if own_after != own else PLAIN
        else:
            kind = ROUTED
            if self._probe_all:
                # NOTE: found by a redo: other stages' layers may also have started drawing
                # unrouted, right now, on the shared generator, and a held run beside them
                # would draw their numbers as its own (silently different masks), so no
                # held trial until a later step.
                self._streams._deferred[key, self._training] = self._step_seed
            else:
                self._streams._trials[key, self._training] = ([], [])  # or held: see _trial
        self._streams._learn(key, self._training, kind, self._stage)

    def attempt(self) -> None:
        """Start one attempt at the forward: note the default generators' states."""
        self._must_redo = False
        # NOTE: when every layer is probed, each probe watches its own layer.
        if self._probe_all:
            self._before = None
        elif self.watched is not None:
            self._before, self.watched = self.watched, None
        else:
            self._before = self._generators.read()

    def settled(self) -> bool:
        """After an attempt: True if its output stands; False to redo it.

        A redo follows a layer found to draw off its stream: one drawing unrouted (the next
        attempt probes every layer), or one bypassing routing (the next one holds it).
        """
        self._attempts += 1
        redo = self._must_redo
        self._probe_all = False
        if self._before is not None:
            after = self._generators.read()
            if after != self._before:
                self._probe_all = redo = True
            else:
                self.watched = after
        if redo and self._attempts >= _MAX_ATTEMPTS:
            self._streams._warn_moving(self._stage)
            return True
        return not redo
