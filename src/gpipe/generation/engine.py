"""Running a decode schedule: each device runs its forwards, the last stage samples.

The schedule (:func:`gpipe.schedule.decode`) numbers micro-batch ``i`` as token
``i // lanes`` of lane ``i % lanes``. Forward ``F(s, i)`` reads the lane's prompt (stage 0,
token 0), the token the last stage sampled for the lane's previous forward (stage 0, tagged
``("act", 0, i)``), or the hidden states of stage ``s - 1``; it runs stage ``s``'s program
with the lane's own cache on this stage; the last stage samples and hands the token back to
stage 0 for the lane's next forward. The same loop runs every device of a local pipe (one
thread per device, as a training step) and this rank's device of a distributed one, where
the transport posts the lowered program's messages as it goes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from gpipe.analysis import Event, Timeline
from gpipe.generation.cache import DecodeStep, StageCache
from gpipe.generation.programs import StageProgram
from gpipe.generation.sampling import Sampling, Stopping, next_tokens
from gpipe.runtime.context import CallerContext, worker_entered
from gpipe.runtime.threads import DeviceThreads
from gpipe.runtime.transport import ACTIVATION, Aborted, Transport
from gpipe.schedule import Action, Schedule, in_one_order
from gpipe.schedule.communication import token_tag

__all__ = ["Decoder", "Lane"]


@dataclass
class Lane:
    """One lane: the rows of the batch that decode together, and what they produced."""

    index: int
    rows: slice
    ids: Tensor  # [rows, prompt] token ids (read by stage 0 only)
    mask: Tensor  # [rows, prompt] 1 at real tokens, 0 at left padding
    tokens: list[Tensor] = field(default_factory=list)  # on the last stage: one [rows] each


class Decoder:
    """Runs a decode schedule's forwards over ``programs`` on ``devices``' threads.

    Args:
        programs: each stage's decode program (None for stages another rank holds).
        stage_devices: each stage's ``torch.device``.
        placement: each stage's pipeline device.
        transport: what carries hidden states and tokens between devices.
        lanes: the lanes, in order.
        sampling: how the last stage chooses tokens.
        generator: the random stream sampling draws from (None: torch's global one).
        after: called with each action once it ran (a distributed transport posts then).
        skip_finished: pass None instead of a finished lane's messages, so its stages skip
            their compute (a local transport; a distributed one keeps every message's shape).
    """

    def __init__(
        self,
        programs: Sequence[StageProgram | None],
        stage_devices: Sequence[torch.device],
        placement: Sequence[int],
        transport: Transport,
        lanes: Sequence[Lane],
        sampling: Sampling,
        generator: torch.Generator | None = None,
        after: Callable[[Action], None] | None = None,
        skip_finished: bool = False,
    ) -> None:
        self.programs = list(programs)
        self.skip_finished = skip_finished
        self.stage_devices = list(stage_devices)
        self.placement = tuple(placement)
        self.transport = transport
        self.lanes = list(lanes)
        self.sampling = sampling
        self.generator = generator
        self.after = after
        self.last = len(self.programs) - 1
        self.caches: dict[tuple[int, int], StageCache] = {}
        self._stopping: dict[int, Stopping] = {}
        # Per lane: its prompt mask on each torch.device, and its newest step on each pipeline
        # device (whose stages share it; that device's thread alone writes it).
        self._masks: dict[tuple[int, torch.device], Tensor] = {}
        self._steps: dict[tuple[int, int], DecodeStep] = {}
        self._held = [0] * (max(self.placement) + 1)  # cache bytes per pipeline device
        self.events: list[list[Event]] = [[] for _ in range(max(self.placement) + 1)]
        self._origin = time.perf_counter_ns()
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()

    def run(
        self, schedule: Schedule, devices: Sequence[Sequence[int]], threads: DeviceThreads | None
    ) -> None:
        """Run ``schedule``'s actions of each group in ``devices`` on a thread of its own
        (the first on this one); re-raise the first failure, naming its action.

        A group of several devices (stages that share one GPU) runs their actions in one
        order that keeps every wrap-around token before the forward that reads it.
        """
        actions = schedule.actions
        groups = [[d for d in group if actions[d]] for group in devices]
        groups = [group for group in groups if group]
        context = CallerContext.capture(
            list({self.stage_devices[s] for s in range(len(self.programs))})
        )
        order = in_one_order(actions, schedule.stages, schedule.wrap)
        self._origin = time.perf_counter_ns()
        jobs = []
        try:
            for group in groups[1:]:
                work = partial(self._work, context, group, order)
                assert threads is not None, "several device groups need the pipe's threads"
                jobs.append(threads.submit(group[0], work))
            if groups:
                self._work(context, groups[0], order)
            for job in jobs:
                job.wait()
        except BaseException as interrupted:  # Ctrl-C while waiting
            self.transport.abort(interrupted)
            for job in jobs:
                job.wait()
            raise
        error, self._error = self._error, None
        if error is not None:
            try:
                raise error
            finally:
                del error

    def timeline(self) -> Timeline:
        """What each device ran, in seconds from the start of the run."""
        return Timeline([list(device) for device in self.events], "s", "decode")

    def cache_bytes(self) -> dict[int, int]:
        """The bytes of KV cache each stage holds now, over every lane."""
        held: dict[int, int] = {}
        for (stage, _), cache in self.caches.items():
            held[stage] = held.get(stage, 0) + cache.nbytes
        return held

    def _work(
        self, context: CallerContext, group: list[int], order: list[tuple[int, Action]]
    ) -> None:
        mine = [(d, action) for d, action in order if d in group]
        try:
            device = self.stage_devices[mine[0][1].stage]
            with worker_entered(context, device), torch.no_grad():
                for d, action in mine:
                    if self._error is not None:
                        return
                    try:
                        self._forward(d, action)
                    except Exception as exc:
                        exc.gpipe_action = action  # type: ignore[attr-defined]
                        raise
        except Aborted:
            pass
        except BaseException as exc:
            with self._error_lock:
                if self._error is None:
                    self._error = _named(exc)
            self.transport.abort(exc)

    def _forward(self, device: int, action: Action) -> None:
        stage, i = action.stage, action.microbatch
        token, index = divmod(i, len(self.lanes))
        lane = self.lanes[index]
        if stage == 0 and token == 0:
            x = lane.ids.to(self.stage_devices[0])
        elif stage == 0:
            x = self.transport.recv(token_tag(i, len(self.programs)))
        else:
            x = self.transport.recv((ACTIVATION, stage, i))
        start = time.perf_counter_ns()  # NOTE: after its input came, as a training step times
        out = None
        # NOTE: a lane whose rows have all finished runs nothing more: locally its stages
        # pass None on; across ranks (where every message keeps its agreed shape) its last
        # stage alone skips. Either way no token is drawn for it, so draws match.
        if x is not None and not (stage == self.last and self._finished(index)):
            program = self.programs[stage]
            assert program is not None, f"stage {stage} is not held here"
            cache = self.caches.setdefault((stage, index), StageCache())
            before = cache.nbytes
            out = program(x, cache, self._step(index, token, device, self.stage_devices[stage]))
            self._held[device] += cache.nbytes - before
        message: tuple[Any, Any] | None = ((ACTIVATION, stage + 1, i), out)
        if stage == self.last:
            message = self._sample(lane, out, token, i)
        # NOTE: the action ends before its message goes, so its reader starts after it ends
        end = time.perf_counter_ns()
        if message is not None:
            self.transport.send(*message)
        if self.after is not None:
            self.after(action)
        held, origin = self._held[device], self._origin
        self.events[device].append(
            Event(action, (start - origin) / 1e9, (end - origin) / 1e9, held, held)
        )

    def _step(self, lane: int, token: int, device: int, where: torch.device) -> DecodeStep:
        """Lane ``lane``'s step for forward ``token`` on pipeline ``device`` (``where``),
        made once per device.

        NOTE: the prompt mask goes to the device once per lane; each step after is made
        there by kernels alone, so no forward waits for a copy from the host.
        """
        step = self._steps.get((lane, device))
        if step is None or step.token != token:
            mask = self._masks.get((lane, where))
            if mask is None:
                mask = self._masks[(lane, where)] = self.lanes[lane].mask.to(where)
            step = self._steps[(lane, device)] = DecodeStep.of(mask, token, where)
        return step

    def _finished(self, lane: int) -> bool:
        stopping = self._stopping.get(lane)
        return stopping is not None and stopping.done

    def _sample(
        self, lane: Lane, logits: Tensor | None, token: int, i: int
    ) -> tuple[Any, Any] | None:
        """Choose the lane's next tokens (pad where it finished); the message that hands
        them to stage 0, None after the lane's last token."""
        rows = lane.mask.shape[0]
        stopping = self._stopping.get(lane.index)
        if stopping is None:
            device = self.stage_devices[self.last]
            stopping = self._stopping[lane.index] = Stopping(rows, self.sampling, device)
        if logits is None:  # finished: pad, drawing nothing
            pad = self.sampling.pad_id
            chosen = stopping.unfinished.new_full(
                (rows,), 0 if pad is None else pad, dtype=torch.long
            )
            stopping.steps += 1
        else:
            chosen = stopping.update(next_tokens(logits[:, -1, :], self.sampling, self.generator))
        lane.tokens.append(chosen)
        if token + 1 >= self.sampling.max_new_tokens:
            return None
        following = token_tag(i + len(self.lanes), len(self.programs))
        skip = self.skip_finished and stopping.done
        return following, None if skip else chosen[:, None]


def _named(exc: BaseException) -> BaseException:
    """Add the failing stage, lane and token to the exception's message."""
    action = getattr(exc, "gpipe_action", None)
    if action is None:
        return exc
    lane_token = f"micro-batch {action.microbatch}"
    where = f"[gpipe: in stage {action.stage}'s forward of {lane_token} while decoding ({action})]"
    if exc.args and isinstance(exc.args[0], str) and type(exc).__str__ is BaseException.__str__:
        exc.args = (f"{exc.args[0]} {where}", *exc.args[1:])
    elif hasattr(exc, "add_note"):
        exc.add_note(where)
    return exc
