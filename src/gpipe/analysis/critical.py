"""The critical path of a step: the chain of actions, and the waits between them, that set
its length.

Walked back from the action that ended last: each action waited for the latest-ending of
what it needs, the previous action on its own device or the action that made its input
(:func:`gpipe.schedule.dependencies`; a dataflow's recorded transfers add the stages that
sent past their neighbours). The step's length is then the path's actions plus its waits,
so the waits say where a runtime loses time:

- a **device** wait follows an action on the same device: the runtime's own work between
  two actions (or a device idling though its next action could run);
- a **message** wait follows an action on another device: the hand-off, from the end of the
  action that made a message to the start of the action that used it.

A simulated timeline has no waits unless its cost model has a transfer cost; a measured one
shows what a runtime adds to the ideal, action by action.

A fused action is one link: it waits for what any of its parts needs from outside the
pair, and what needs one of its parts waits for the whole pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpipe.schedule import Action, dependencies

if TYPE_CHECKING:
    from gpipe.analysis.timeline import Event, Timeline

__all__ = ["CriticalPath", "Link", "critical_path"]


@dataclass(frozen=True, slots=True)
class Link:
    """One action on the critical path, and what it waited for.

    ``after`` is "start" for the path's first action, "device" when the previous action on
    its device ended last, "message" when an action on another device (``source``) did;
    ``wait`` is from that action's end to this one's start.
    """

    event: Event
    device: int
    after: str
    source: int
    wait: float


@dataclass(frozen=True)
class CriticalPath:
    """The critical path of one timeline, first action first."""

    links: list[Link]
    unit: str = "s"  # the timeline's: seconds measured, or the cost model's units

    @property
    def length(self) -> float:
        """From the path's first action's start to its last action's end."""
        if not self.links:
            return 0.0
        return self.links[-1].event.end - self.links[0].event.start

    @property
    def compute(self) -> float:
        """The time in the path's actions."""
        return sum(link.event.duration for link in self.links)

    def waits(self, after: str) -> list[float]:
        """The waits that followed ``after`` ("device" or "message"), in path order."""
        return [link.wait for link in self.links if link.after == after]

    @property
    def device_wait(self) -> float:
        """The total wait after an action on the same device."""
        return sum(self.waits("device"))

    @property
    def message_wait(self) -> float:
        """The total wait for messages from other devices (the hand-offs)."""
        return sum(self.waits("message"))

    def __str__(self) -> str:
        """A summary: how the path's length splits into actions, device waits and hand-offs."""
        device, message = self.waits("device"), self.waits("message")

        def share(part: float) -> str:
            return f"{part / self.length:6.1%}" if self.length > 0 else "     -"

        def mean(waits: list[float]) -> str:
            return f", {sum(waits) / len(waits):.4g} {self.unit} each" if waits else ""

        unit = self.unit
        return "\n".join(
            [
                f"critical path: {len(self.links)} actions, {self.length:.4g} {unit} long",
                f"  actions        {self.compute:10.4g} {unit}  {share(self.compute)}",
                f"  device waits   {self.device_wait:10.4g} {unit}  {share(self.device_wait)}"
                f"  ({len(device)}{mean(device)})",
                f"  hand-offs      {self.message_wait:10.4g} {unit}  {share(self.message_wait)}"
                f"  ({len(message)}{mean(message)})",
            ]
        )


def critical_path(timeline: Timeline) -> CriticalPath:
    """The chain of actions and waits that set ``timeline``'s length (see the module doc).

    An action whose producer is missing from the timeline (not recorded) waits on its
    device only.
    """
    events = timeline.events
    # NOTE: keyed by plain actions, a fused event's parts each pointing at the whole event,
    # since a dependency names the part it needs.
    where = {
        unit: (d, i)
        for d, device in enumerate(events)
        for i, e in enumerate(device)
        for unit in e.action.units
    }
    if not where:
        return CriticalPath([], timeline.unit)
    stages = max(action.stage for action in where) + 1
    skips: dict[Action, set[int]] = {}  # a dataflow's senders beyond the neighbour
    for t in timeline.transfers:
        if t.sender is not None:
            skips.setdefault(Action(t.kind, t.stage, t.microbatch), set()).add(t.sender)

    def end(at: tuple[int, int]) -> float:
        return events[at[0]][at[1]].end

    last = max(((d, len(device) - 1) for d, device in enumerate(events) if device), key=end)
    links: list[Link] = []
    device, i = last
    while True:
        event = events[device][i]
        made = [
            where[a]
            for a in _inputs(event.action, stages, skips)
            if a in where and where[a] != (device, i)
        ]
        binding = max(made, key=end, default=None)
        if binding is not None and (i == 0 or end(binding) > end((device, i - 1))):
            after = "device" if binding[0] == device else "message"
        elif i > 0:
            after, binding = "device", (device, i - 1)
        else:
            links.append(Link(event, device, "start", device, 0.0))
            break
        links.append(Link(event, device, after, binding[0], max(0.0, event.start - end(binding))))
        device, i = binding
    return CriticalPath(links[::-1], timeline.unit)


def _inputs(action: Action, stages: int, skips: dict[Action, set[int]]) -> list[Action]:
    """The actions whose results ``action`` (each of its parts, if fused) needs: the
    schedule's dependencies, and the stages that sent to it past their neighbours (a
    dataflow's skips)."""
    sent = [
        Action(unit.kind, sender, unit.microbatch)
        for unit in action.units
        for sender in skips.get(unit, ())
    ]
    return [*dependencies(action, stages), *sent]
