"""Lowering: a schedule's sends and receives placed in each device's list, as data.

A distributed step runs one program per device: its compute actions with the
point-to-point operations between them. Each message is posted, at both ends, in the step
it is made: the sender's send right after the action that made it, the receiver's receive
in that same step, however much later the action that reads it runs. A receive posted
early lets the message land while the receiver computes, so no hand-off waits on the
critical path for its receive to be posted (torch's lowering also posts receives early).
The sends and receives a device posts in one step go out together as one :class:`Batch`
(one ``batch_isend_irecv`` group on NCCL), so two neighbours that trade an activation for
a gradient never wait on each other's half. For 1F1B with 2 devices and 2 micro-batches::

    device 0                                device 1
    0F0
    [send act 1:0 to 1]                     [recv act 1:0 from 0]
    0F1                                     1F0
    [send act 1:1 to 1]                     [recv act 1:1 from 0]
                                            1B0
    [recv grad 0:0 from 1]                  [send grad 0:0 to 0]
    0B0                                     1F1
                                            1B1
    [recv grad 0:1 from 1]                  [send grad 0:1 to 0]
    0B1

Both ends derive the same order for every pair, since each side's list follows from the
same schedule. :func:`replay` then runs the programs under NCCL's rules, which are stricter
than any transport's we use: a device issues its batches on one stream, in order; a batch
starts once the batch before it has completed and the actions whose outputs it sends have
run; it completes once every operation in it has met its counterpart, in a batch the peer
has started (sends and receives between two devices match in the order posted, with no
tags); an action runs once the batches holding its receives have completed. A program that
finishes under these rules cannot hang on NCCL (with per-pair or shared communicators) nor on
gloo.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from gpipe.schedule.action import BACKWARD, FORWARD, Action
from gpipe.schedule.communication import ACTIVATION, GRADIENT, RECV, SEND, token_tag
from gpipe.schedule.steps import run_in_steps

if TYPE_CHECKING:
    from gpipe.schedule.schedule import Schedule

__all__ = ["Batch", "Flow", "Lowered", "Op", "Stuck", "lower", "replay"]

# The runtime transport's tags: (kind, receiving stage, micro-batch), and in a dataflow
# (kind, receiving stage, micro-batch, sending stage).
Tag = tuple[str, int, int] | tuple[str, int, int, int]


class Flow(NamedTuple):
    """Which stages pass values to which, for a model that is not a chain.

    ``sources[s]``: the stages stage ``s`` reads from, in the order its forward receives
    them (-1 is the pipe's input); ``readers[s]``: the stages reading from ``s``, in the
    order it sends to them (the last stage's output goes to the caller, not listed).
    """

    sources: tuple[tuple[int, ...], ...]
    readers: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class Op:
    """One point-to-point operation: ``direction`` ("send"/"recv") of ``tag`` with ``peer``."""

    direction: str
    peer: int
    tag: Tag

    def __str__(self) -> str:
        stage = f"{self.tag[1]}" if len(self.tag) == 3 else f"{self.tag[1]}<-{self.tag[3]}"
        to = "to" if self.direction == SEND else "from"
        return f"{self.direction} {self.tag[0]} {stage}:{self.tag[2]} {to} {self.peer}"


@dataclass(frozen=True, slots=True)
class Batch:
    """Operations posted together, after ``after`` compute actions of the device's list."""

    ops: tuple[Op, ...]
    after: int

    def __str__(self) -> str:
        return "[" + ", ".join(map(str, self.ops)) + "]"


Item = Action | Batch


@dataclass(frozen=True)
class Lowered:
    """Per device, the program it runs: compute actions and batches, in order."""

    schedule: Schedule
    programs: tuple[tuple[Item, ...], ...]
    flow: Flow | None = None

    def batches(self, device: int) -> list[Batch]:
        """``device``'s batches, in the order it posts them."""
        return [item for item in self.programs[device] if isinstance(item, Batch)]

    def __str__(self) -> str:
        lines = []
        for device, program in enumerate(self.programs):
            lines.append(f"device {device}: " + " ".join(map(str, program)))
        return "\n".join(lines)


def lower(schedule: Schedule, flow: Flow | None = None, *, receives: str = "early") -> Lowered:
    """Each device's program: its actions, with every message posted in the step it is made.

    The devices run their lists in lock step (as :func:`~gpipe.schedule.run_in_steps`
    does). At each step, every action that runs sends what it made to the devices that
    read it: the send goes in the maker's batch right after the action, the matching
    receive in the reader's batch of the same step, posted after the reader's own action
    of that step (results of a step are read at later steps only). So every batch of a
    step meets only batches of the same step, which every device reaches once the steps
    before are done: no program lowered this way can hang (:func:`replay` checks it),
    whatever order a custom schedule's devices take their messages in, torch's own
    included. A fused action sends what each of its parts made.

    Args:
        schedule: a schedule that runs to its end (the validator checks that first).
        flow: for a dataflow, which stages pass values to which; None for a chain.
        receives: "early" (the above), or "late": each message posted, at both ends, in the
            step its reader runs, the receive right before the reader (how gpipe posted
            before; kept so ``benchmarks/handoff.py`` can measure what posting early saves).

    Returns:
        Each device's program. Hand-offs between stages on one device are no operations.

    Raises:
        ValueError: ``receives`` other than "early" and "late".
    """
    if receives not in ("early", "late"):
        raise ValueError(f"receives must be 'early' or 'late', got {receives!r}")
    late = receives == "late"
    steps = run_in_steps(schedule)
    devices = schedule.devices
    done = [0] * devices  # actions each device has run before the current step
    programs: list[list[Item]] = [[] for _ in range(devices)]
    for row in steps.rows:
        ops: list[list[Op]] = [[] for _ in range(devices)]
        for device, position in enumerate(row):
            if position is None:
                continue
            for part in schedule.actions[device][position].units:
                if late:  # what it reads, from the devices that made it earlier
                    messages = [
                        (peer, tag, peer, device) for peer, tag in _sources(part, schedule, flow)
                    ]
                else:  # what it made, for the devices that read it later
                    messages = [
                        (device, tag, device, peer) for peer, tag in _made(part, schedule, flow)
                    ]
                for _, tag, sender, reader in messages:
                    ops[sender].append(Op(SEND, reader, tag))
                    ops[reader].append(Op(RECV, sender, tag))
        for device, position in enumerate(row):
            if late and ops[device]:
                mine = sorted(ops[device], key=lambda op: op.direction != SEND)
                programs[device].append(Batch(tuple(mine), done[device]))
            if position is not None:
                programs[device].append(schedule.actions[device][position])
                done[device] += 1
            if not late and ops[device]:
                # NOTE: sends first, as a device's sends of a step leave before it waits
                mine = sorted(ops[device], key=lambda op: op.direction != SEND)
                programs[device].append(Batch(tuple(mine), done[device]))
    return Lowered(schedule, tuple(tuple(program) for program in programs), flow)


def _edges(action: Action, schedule: Schedule, flow: Flow | None) -> tuple[list[int], list[int]]:
    """The stages ``action`` receives from and sends to, in the runtime's order."""
    stage, last = action.stage, schedule.stages - 1
    if flow is None:
        before = [stage - 1] if stage > 0 else []
        after = [stage + 1] if stage < last else []
    else:
        before = [s for s in flow.sources[stage] if s >= 0]
        after = list(flow.readers[stage]) if stage < last else []
    if action.kind == FORWARD:
        return before, after
    if action.kind == BACKWARD:
        return after, before
    return [], []


def _tag(kind: str, receiver: int, microbatch: int, sender: int, flow: Flow | None) -> Tag:
    if flow is None:
        return (kind, receiver, microbatch)
    return (kind, receiver, microbatch, sender)


def _made(action: Action, schedule: Schedule, flow: Flow | None) -> list[tuple[int, Tag]]:
    """(reader's device, tag) of each message ``action`` makes for another device."""
    placement, device = schedule.placement, schedule.placement[action.stage]
    kind = ACTIVATION if action.kind == FORWARD else GRADIENT
    _, readers = _edges(action, schedule, flow)
    made = [
        (placement[s], _tag(kind, s, action.microbatch, action.stage, flow))
        for s in readers
        if placement[s] != device
    ]
    # a decode: the token this lane sampled, for its next forward on stage 0
    wrap, last, i = schedule.wrap, schedule.stages - 1, action.microbatch
    wrapped = wrap and kind == ACTIVATION and action.stage == last
    if wrapped and i + wrap < schedule.microbatches and placement[0] != device:
        made.append((placement[0], token_tag(i + wrap, schedule.stages)))
    return made


def _sources(action: Action, schedule: Schedule, flow: Flow | None) -> list[tuple[int, Tag]]:
    """(maker's device, tag) of each message ``action`` reads from another device."""
    placement, device = schedule.placement, schedule.placement[action.stage]
    kind = ACTIVATION if action.kind == FORWARD else GRADIENT
    sources, _ = _edges(action, schedule, flow)
    read = [
        (placement[s], _tag(kind, action.stage, action.microbatch, s, flow))
        for s in sources
        if placement[s] != device
    ]
    # a decode: the token its lane sampled last
    wrap, last, i = schedule.wrap, schedule.stages - 1, action.microbatch
    wrapped = wrap and kind == ACTIVATION and action.stage == 0 and i >= wrap
    if wrapped and placement[last] != device:
        read.append((placement[last], token_tag(i, schedule.stages)))
    return read


def _read(action: Action, schedule: Schedule, flow: Flow | None) -> list[Tag]:
    """The tags of the messages ``action`` reads from other devices."""
    return [tag for _, tag in _sources(action, schedule, flow)]


class Stuck(NamedTuple):
    """Where a replay stopped: per device, the first batch and action that never finished."""

    batches: list[Batch | None]
    actions: list[int | None]  # position in the device's action list
    problems: list[str]


def replay(lowered: Lowered) -> Stuck | None:
    """Run the programs under NCCL's rules (see the module docstring); None if all finish.

    Returns:
        None when every device finishes; else where each device stopped and why, one line
        per stuck device naming the operation it waits for.
    """
    programs = lowered.programs
    devices = len(programs)
    batches = [lowered.batches(d) for d in range(devices)]
    actions = [[item for item in program if isinstance(item, Action)] for program in programs]
    # The counterpart of every operation: the k-th send from a to b meets b's k-th receive
    # from a. meets[(device, batch)]: (op, peer, the peer's batch) for each of its ops.
    queues: dict[tuple[int, int, str], list[tuple[int, int, Op]]] = {}
    for d, own in enumerate(batches):
        for b, batch in enumerate(own):
            for op in batch.ops:
                src, dst = (d, op.peer) if op.direction == SEND else (op.peer, d)
                queues.setdefault((src, dst, op.direction), []).append((d, b, op))
    meets: dict[tuple[int, int], list[tuple[Op, int, int]]] = {}
    problems: list[str] = []
    for (src, dst, direction), posted in queues.items():
        if direction != SEND:
            continue
        taken = queues.get((src, dst, RECV), [])
        if len(taken) != len(posted):
            problems.append(
                f"device {src} sends device {dst} {len(posted)} messages, which receives "
                f"{len(taken)}"
            )
        for (d, b, op), (p, pb, their) in zip(posted, taken):
            if op.tag != their.tag:
                problems.append(
                    f"device {src} sends device {dst} {op.tag} where it receives {their.tag}: "
                    "the two ends disagree on the order of their messages"
                )
            meets.setdefault((d, b), []).append((op, p, pb))
            meets.setdefault((p, pb), []).append((their, d, b))
    # What each action waits for, besides its device's order: the batches holding the
    # receives of what it reads.
    holding = {
        (d, op.tag): b
        for d, own in enumerate(batches)
        for b, batch in enumerate(own)
        for op in batch.ops
        if op.direction == RECV
    }
    recv_batch: dict[tuple[int, int], list[int]] = {}  # (device, action) -> batches
    for d, own_actions in enumerate(actions):
        for a, action in enumerate(own_actions):
            for part in action.units:
                for tag in _read(part, lowered.schedule, lowered.flow):
                    held = holding.get((d, tag))
                    if held is None:
                        problems.append(f"device {d} never receives {tag}, which {part} reads")
                    else:
                        recv_batch.setdefault((d, a), []).append(held)
    started = [0] * devices  # batches started (each one before it has completed)
    completed = [0] * devices
    ran = [0] * devices  # actions run
    todo = deque(range(devices))
    queued = [True] * devices
    while todo:
        d = todo.popleft()
        queued[d] = False
        moved = True
        while moved:
            moved = False
            b = started[d]
            # a batch starts once the one before has completed and its sender has run
            if b < len(batches[d]) and completed[d] == b and ran[d] >= batches[d][b].after:
                started[d] += 1
                moved = True
                for _, peer, _ in meets.get((d, b), []):
                    if not queued[peer]:
                        queued[peer] = True
                        todo.append(peer)
            b = completed[d]
            if b < started[d] and all(pb < started[p] for _, p, pb in meets.get((d, b), [])):
                completed[d] += 1
                moved = True
            a = ran[d]
            if a < len(actions[d]) and all(b < completed[d] for b in recv_batch.get((d, a), [])):
                ran[d] += 1
                moved = True
    if all(ran[d] == len(actions[d]) and completed[d] == len(batches[d]) for d in range(devices)):
        return None if not problems else Stuck([None] * devices, [None] * devices, problems)
    stuck_batches: list[Batch | None] = []
    stuck_actions: list[int | None] = []
    for d in range(devices):
        done = ran[d] == len(actions[d]) and completed[d] == len(batches[d])
        stuck_actions.append(None if done or ran[d] >= len(actions[d]) else ran[d])
        if done or completed[d] >= len(batches[d]):
            stuck_batches.append(None)
            continue
        batch = batches[d][completed[d]]
        stuck_batches.append(batch)
        waiting = [
            f"{op} (device {p} has not reached it)"
            for op, p, pb in meets.get((d, completed[d]), [])
            if pb >= started[p]
        ]
        if completed[d] >= started[d]:
            why = f"device {d} cannot start batch {batch}: " + (
                f"it sends what {actions[d][batch.after - 1]} makes, which waits for its "
                "own receives"
                if ran[d] < batch.after
                else "the batch before it never completed"
            )
        else:
            why = f"device {d} is stuck in batch {batch}, waiting for " + ", ".join(
                waiting or ["its peers"]
            )
        problems.append(why)
    return Stuck(stuck_batches, stuck_actions, problems)
