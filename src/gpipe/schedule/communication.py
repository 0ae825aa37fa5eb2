"""The messages a schedule implies: who sends what to whom, in which order.

An F sends its output to the next stage and a B its input gradient to the previous one.
When the two stages live on different devices, that is a message between the devices,
received by the action that consumes it (F of the next stage, B of the previous one).
Between one pair of devices, point-to-point libraries such as NCCL match messages in the
order they were posted, with no tag to tell them apart, so a transport that posted its
receives in its own action order would need the sender to send in that same order
(:func:`keeps_pair_order`). Ours do not: the distributed runtime posts what
:mod:`gpipe.schedule.lowering` places, which orders each pair's messages itself, and the
in-process one files messages by tag. So the validator accepts orders that do not keep
each pair's order, torch's zbv and dualpipev among them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from gpipe.schedule.action import BACKWARD, FORWARD, Action, units

if TYPE_CHECKING:
    from gpipe.schedule.schedule import Schedule

__all__ = [
    "ACTIVATION",
    "GRADIENT",
    "RECV",
    "SEND",
    "Message",
    "communication",
    "keeps_pair_order",
]

# The same words the runtime's transport tags use: ("act" | "grad", receiving stage, micro-batch).
ACTIVATION = "act"
GRADIENT = "grad"
SEND = "send"
RECV = "recv"


def token_tag(microbatch: int, stages: int) -> tuple[str, int, int, int]:
    """The tag of the token a decode's last stage hands back to stage 0 for forward
    ``microbatch``. It names its sender (the last stage) on every transport, chain or
    dataflow: it is the one message whose sender is not the stage before."""
    return (ACTIVATION, 0, microbatch, stages - 1)


Tag = tuple[str, int, int] | tuple[str, int, int, int]


class Message(NamedTuple):
    """One message between two devices, seen from one of them.

    Args:
        peer: the other device.
        kind: "act" (an F's output, for the next stage) or "grad" (a B's input gradient,
            for the previous stage).
        stage: the stage that receives it (as in the runtime's tags).
        microbatch: the micro-batch.
        direction: "send" or "recv", from this device's side.
        action: the action on this device that sends it (after running) or receives it
            (before running).
    """

    peer: int
    kind: str
    stage: int
    microbatch: int
    direction: str
    action: Action

    @property
    def tag(self) -> Tag:
        """``(kind, receiving stage, micro-batch)``: the runtime transport's tag."""
        return (self.kind, self.stage, self.microbatch)

    def __str__(self) -> str:
        what = "activation" if self.kind == ACTIVATION else "gradient"
        return f"{what} for stage {self.stage}, micro-batch {self.microbatch}"


def communication(schedule: Schedule) -> list[list[Message]]:
    """Per device, the messages it sends and receives, in the order its actions need them.

    An action receives before it runs and sends after, so for each action its receive (if
    any) comes before its send (if any). Messages to and from the caller (the inputs of
    stage 0, the outputs of the last stage) and hand-offs between stages on the same device
    are not messages between devices and are left out.

    Args:
        schedule: any schedule whose stages are in range (the validator checks that first).

    Returns:
        ``messages[d]``: device ``d``'s sends and receives in order. For every ordered pair
        of devices, a valid schedule's sends from one to the other (in the sender's list)
        come in the same order as the matching receives (in the receiver's list).
    """
    messages: list[list[Message]] = []
    for device, actions in enumerate(schedule.actions):
        mine: list[Message] = []
        for action in actions:
            for part in action.units:
                taken = _received(part, device, schedule)
                if taken is not None:
                    mine.append(Message(taken[0], *taken[1][:3], RECV, action))
            for part in action.units:
                given = _sent(part, device, schedule)
                if given is not None:
                    mine.append(Message(given[0], *given[1][:3], SEND, action))
        messages.append(mine)
    return messages


def _received(action: Action, device: int, schedule: Schedule) -> tuple[int, Tag] | None:
    """(sender, tag) of the message ``action`` takes from another device, if any."""
    placement, stage = schedule.placement, action.stage
    if action.kind == FORWARD and stage > 0 and placement[stage - 1] != device:
        return placement[stage - 1], (ACTIVATION, stage, action.microbatch)
    if action.kind == BACKWARD and stage + 1 < schedule.stages and placement[stage + 1] != device:
        return placement[stage + 1], (GRADIENT, stage, action.microbatch)
    # a decode: stage 0 takes the token the last stage sampled for its lane
    wrap, last = schedule.wrap, schedule.stages - 1
    wrapped = action.kind == FORWARD and stage == 0 and wrap and action.microbatch >= wrap
    if wrapped and placement[last] != device:
        return placement[last], token_tag(action.microbatch, schedule.stages)
    return None


def _sent(action: Action, device: int, schedule: Schedule) -> tuple[int, Tag] | None:
    """(receiver, tag) of the message ``action`` sends to another device, if any."""
    placement, stage = schedule.placement, action.stage
    if action.kind == FORWARD and stage + 1 < schedule.stages and placement[stage + 1] != device:
        return placement[stage + 1], (ACTIVATION, stage + 1, action.microbatch)
    if action.kind == BACKWARD and stage > 0 and placement[stage - 1] != device:
        return placement[stage - 1], (GRADIENT, stage - 1, action.microbatch)
    wrap, last = schedule.wrap, schedule.stages - 1
    wrapped = action.kind == FORWARD and stage == last and wrap
    if wrapped and action.microbatch + wrap < schedule.microbatches and placement[0] != device:
        return placement[0], token_tag(action.microbatch + wrap, schedule.stages)
    return None


def keeps_pair_order(schedule: Schedule) -> bool:
    """Whether every pair's sends come in the order of the matching receives."""
    sent: dict[tuple[int, int], list[Tag]] = {}
    taken: dict[tuple[int, int], list[Tag]] = {}
    for device, actions in enumerate(schedule.actions):
        for action in units(actions):
            received = _received(action, device, schedule)
            if received is not None:
                taken.setdefault((received[0], device), []).append(received[1])
            given = _sent(action, device, schedule)
            if given is not None:
                sent.setdefault((device, given[0]), []).append(given[1])
    return sent == taken
