"""The stage worker: runs one device's actions (forward, backward, weight gradient)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from gpipe.analysis import Event
from gpipe.randomness.streams import GeneratorStates
from gpipe.runtime.backward import backward, receive_gradients, weight
from gpipe.runtime.context import recomputation_autocast, worker_entered
from gpipe.runtime.copies import GpuClock
from gpipe.runtime.forward import forward, receive_inputs
from gpipe.runtime.saved import storage_keys
from gpipe.runtime.stage_set import StageSet
from gpipe.runtime.state import StepState
from gpipe.runtime.transport import Transport
from gpipe.schedule import BACKWARD, FORWARD, Action

__all__ = ["StageWorker"]


class StageWorker:
    """Runs the actions of one device in one step, on that device's stages.

    Forward (F, :func:`~gpipe.runtime.forward.forward`) receives the stage input, runs the
    stage (without autograd when the micro-batch is checkpointed), keeps what the backward
    needs and sends the output on. Backward (B, :func:`~gpipe.runtime.backward.backward`)
    receives the output gradient, recomputes the forward if it was checkpointed, and sends
    the input gradient back; it also computes weight gradients unless the schedule runs them
    as separate W actions (:func:`~gpipe.runtime.backward.weight`). The actions keep their
    per-device state here: the underscored attributes are shared with those modules alone.

    Args:
        stages: the stage modules and their placement.
        device: the pipeline device whose actions this worker runs.
        transport: what carries messages to and from the other stages.
        state: the step being run.
    """

    def __init__(
        self, stages: StageSet, device: int, transport: Transport, state: StepState
    ) -> None:
        self.stages = stages
        self.device = device
        self.transport = transport
        self.state = state
        self.torch_device = stages.devices[device]
        self.routes = stages.routes
        self.events: list[Event] = state.events[device]
        self._last = stages.last
        self.held = 0  # bytes this device holds for backward right now
        self._params: dict[int, set[int]] = {}
        self._trainables: dict[int, list[torch.Tensor]] = {}
        self._redone = False  # whether the last stage call redid its forward (see stage_call)
        # The default generators' states as this worker's last forward left them, within
        # one run (see StageForward): between runs the caller may draw.
        self._watched: GeneratorStates | None = None
        self._autocast_restored: Callable[[], AbstractContextManager[None]] | None = None
        self._autocast_key: tuple[Any, ...] = ()  # the forward's autocast, in saved_bytes keys
        # On a GPU, each action's start and end are CUDA events on its stream, read when the
        # timeline is (StepState.settle), by a clock started as its run began (a new one for
        # each run: pipe(x), then loss.backward(), are two runs of one step).
        self._clock: GpuClock | None = None
        self._started: Any = None
        self._side: Any = None  # a fused action's forward's stream, on a GPU

    def entered(self) -> contextlib.ExitStack:
        """The state a run's actions run in (see :func:`~gpipe.runtime.context.worker_entered`),
        entered by the lane that runs this worker."""
        return worker_entered(self.state.context, self.torch_device)

    def prepare(self) -> None:
        """Start a run: what this worker decides once per run, inside :meth:`entered`."""
        forward_context = self.state.forward_context
        self._watched = None
        self._autocast_key = forward_context.autocast_key if forward_context is not None else ()
        self._autocast_restored = recomputation_autocast(forward_context, self.state.context)
        if self.torch_device.type == "cuda":
            self._clock = GpuClock(self.torch_device)
            self._clock.start()

    def perform(self, action: Action) -> None:
        """Run one action; an error it raises is marked with the action."""
        try:
            if action.parts:
                self._fused(action)
            else:
                self._unit(action)
            after = self.state.after
            if after is not None:
                after(action)
        except Exception as exc:
            exc.gpipe_action = action  # type: ignore[attr-defined]
            raise

    def _unit(self, action: Action) -> None:
        if action.kind == FORWARD:
            forward(self, action)
        elif action.kind == BACKWARD:
            backward(self, action)
        else:
            weight(self, action)

    def _fused(self, action: Action) -> None:
        """Run a fused action's parts so that they can overlap, and record it as one event.

        On a GPU the forward goes on a side stream of the device while the backward (and
        its W) run on the current one, so the GPU can run them at once; the current stream
        then waits for the side one. On a CPU they run one after the other.

        NOTE: the side stream first waits for the current one, so a block the caching
        allocator hands out on it again is never one the current stream still reads.
        """
        forward_part, backward_part, *weight_part = action.parts
        # NOTE: both parts' inputs first: the pair starts once it all could, as simulated
        inputs = receive_inputs(self, forward_part)
        received = receive_gradients(self, backward_part)
        events, timed = len(self.events), len(self.state.timed)
        finished: Any = None
        if self.torch_device.type == "cuda":
            current = torch.cuda.current_stream(self.torch_device)
            if self._side is None:
                self._side = torch.cuda.Stream(self.torch_device)
            self._side.wait_stream(current)
            with torch.cuda.stream(self._side):
                forward(self, forward_part, inputs)
            backward(self, backward_part, received)
            for part in weight_part:
                weight(self, part)
            current.wait_stream(self._side)
            finished = self._clock.mark() if self._clock is not None else None
        else:
            forward(self, forward_part, inputs)
            backward(self, backward_part, received)
            for part in weight_part:
                weight(self, part)
        parts = self.events[events:]
        del self.events[events:]
        self.events.append(
            Event(
                action,
                parts[0].start,
                max(e.end for e in parts),
                max(e.memory for e in parts),
                parts[-1].left,
            )
        )
        marks = self.state.timed[timed:]
        if marks:
            del self.state.timed[timed:]
            # NOTE: from the forward's start mark (side stream) to a mark on the current
            # stream once it waits for the side one
            end = marks[-1][4] if finished is None else finished
            self.state.timed.append((self.device, events, marks[0][2], marks[0][3], end))

    def _begin(self) -> int:
        """Mark an action's start: now, and on a GPU when its stream gets here."""
        if self._clock is not None:
            self._started = self._clock.mark()
        return time.perf_counter_ns()

    def _record(self, action: Action, start_ns: int, memory: int | None = None) -> None:
        """Add the action to the timeline, its times from this thread's clock; on a GPU,
        with its events, which replace them when the timeline is read.

        NOTE: no wait for the GPU here: the next action is queued while this one runs.
        """
        origin = self.state.origin_ns
        end_ns = time.perf_counter_ns()
        if self._clock is not None:
            marks = (self._clock, self._started, self._clock.mark())
            self.state.timed.append((self.device, len(self.events), *marks))
        self.events.append(
            Event(
                action,
                (start_ns - origin) / 1e9,
                (end_ns - origin) / 1e9,
                self.held if memory is None else memory,
                self.held,
            )
        )

    def _trainable(self, stage: int) -> list[torch.Tensor]:
        """The stage's parameters that take gradients, listed once per step."""
        if stage not in self._trainables:
            params = self.stages.parameters(stage)
            self._trainables[stage] = [p for p in params if p.requires_grad]
        return self._trainables[stage]

    def _param_storages(self, stage: int) -> set[int]:
        """Where the stage's parameters and buffers live: not activations, never counted."""
        if stage not in self._params:
            module = self.stages.module(stage)
            params = self.stages.parameters(stage)
            self._params[stage] = storage_keys([*params, *module.buffers()])
        return self._params[stage]
