"""A distributed step's timeline: every rank's events on rank 0's clock."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from gpipe.analysis import Event, Timeline, Transfer
from gpipe.distributed.executor import Executor
from gpipe.distributed.json_collectives import all_gather_json
from gpipe.runtime.step import Step
from gpipe.runtime.transport import ACTIVATION, sending_stage
from gpipe.schedule import BACKWARD, FORWARD, Action, Schedule

__all__ = ["gather_timeline"]


def gather_timeline(
    step: Step,
    schedule: Schedule,
    transport: Executor,
    device: int,
    pipeline: list[int],
    offset_ns: int,
    group: Any,
) -> Timeline:
    """The step on every rank of the pipeline, shifted onto the first rank's clock.

    A collective over ``group``: every rank of the pipeline must call it. ``offset_ns`` is
    this rank's clock minus the first rank's; ``transfers`` holds each message from its
    hand-over by the sender to its arrival.
    """

    def seconds(ns: int) -> float:
        return (ns - offset_ns) / 1e9

    step.state.settle()  # NOTE: GPU actions are timed by CUDA events, read only now
    log = transport.transfer_log
    log.settle()  # and so are the messages NCCL carried
    origin = seconds(step.state.origin_ns)
    mine = {
        "events": [
            (str(e.action), origin + e.start, origin + e.end, e.memory, e.left)
            for e in step.state.events[device]
        ],
        "sent": [(tag, peer, seconds(ns)) for tag, peer, ns in log.sent],
        "received": [(t.tag, t.source, seconds(t.done_ns), t.nbytes) for t in log.received],
    }
    try:
        gathered = all_gather_json(mine, group=group)  # NOTE: JSON, so nothing is unpickled
    except RuntimeError as error:  # NOTE: most often one rank asked alone (`if rank == 0:`)
        raise RuntimeError(
            f"gathering the timeline failed on rank {dist.get_rank()}: it is a collective, so "
            "every rank of the pipeline must read pipe.timeline (and predicted_timeline()) "
            "after the same step; read it on every rank, then print or save it on one "
            f"({error})"
        ) from error
    zero = min((e[1] for g in gathered for e in g["events"]), default=origin)
    events = [
        [
            Event(Action.parse(a), start - zero, end - zero, m, left)
            for a, start, end, m, left in g["events"]
        ]
        for g in gathered
    ]
    index = {rank: d for d, rank in enumerate(pipeline)}
    handed = {
        (tuple(tag), d, index[peer]): at
        for d, g in enumerate(gathered)
        for tag, peer, at in g["sent"]
    }
    transfers = []
    for target, g in enumerate(gathered):
        for tag, source_rank, arrived, nbytes in g["received"]:
            source = index[source_rank]
            start = handed.get((tuple(tag), source, target), arrived)
            kind = FORWARD if tag[0] == ACTIVATION else BACKWARD
            transfers.append(
                Transfer(
                    kind,
                    tag[1],
                    tag[2],
                    source,
                    target,
                    start - zero,
                    arrived - zero,
                    nbytes,
                    sending_stage(tuple(tag)),
                )
            )
    return Timeline(events, "s", schedule.name, transfers=transfers, processes=True)
