"""Torch's own schedules as our :class:`Schedule`: the oracle of tests/test_torch_orders.py.

torch.distributed.pipelining builds each schedule's per-rank compute order
(``pipeline_order``) in the schedule's constructor, from the stage objects it is given. The
constructor reads four plain attributes of each stage (``num_stages``, ``group_size``,
``group_rank``, ``submod``), writes one (``stage_index_to_group_rank``) and never touches a
process group: the group size and rank come from the stages. So :func:`torch_order` hands
it stand-ins carrying just those attributes and runs the real constructor, torch's own
argument checks and its own lowering with sends and receives included, rather than
re-deriving the order from its private helpers. A later torch that reads more of a stage
fails loudly, naming the attribute (see :class:`_Stage`).

:func:`to_schedule` converts the order: F -> F; I (input gradient) -> B; W -> W; torch's B
(full backward) -> B then W of the same stage and micro-batch in a schedule with W's, else
B; an overlapped pair (F, full B) -> ``Action.fuse(F, B, W)``; idle slots (None) are
dropped. The placement is the one torch derives from the order it built.
"""

from __future__ import annotations

from typing import Any

from gpipe.schedule import BACKWARD, FORWARD, WEIGHT, Action, Schedule

# Our name -> torch's class, for every schedule both have.
TORCH_CLASSES = {
    "interleaved": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zb-v": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


class _Stage:
    """What torch's schedule constructors read of a pipeline stage, and nothing more."""

    def __init__(self, stages: int, devices: int) -> None:
        self.num_stages = stages
        self.group_size = devices
        self.group_rank = 0  # every rank builds every rank's order; this one is unused
        self.submod = None  # not a module: torch skips its torch.compile check
        self.stage_index_to_group_rank: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"torch's schedule constructor read stage.{name}, which the stand-in in "
            "tests/torch_orders.py does not give: add it there"
        )


def torch_order(name: str, devices: int, microbatches: int, virtual_stages: int = 2) -> Any:
    """Torch's schedule object for our ``name``, built with stand-in stages.

    Raises:
        ValueError: torch refuses the counts (its message says why).
    """
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, TORCH_CLASSES[name])
    stages = devices * virtual_stages
    return cls([_Stage(stages, devices) for _ in range(virtual_stages)], microbatches)


def to_schedule(name: str, built: Any) -> Schedule:
    """Our :class:`Schedule` of torch's ``built.pipeline_order`` (see the module)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    order = built.pipeline_order
    kinds = {
        part.computation_type
        for actions in order.values()
        for action in actions
        if action is not None
        for part in (action.sub_actions or (action,))
    }
    split = bool(kinds & {torch_schedules.BACKWARD_INPUT, torch_schedules.BACKWARD_WEIGHT})

    def plain(action: Any) -> list[Action]:
        kind, stage, i = action.computation_type, action.stage_index, action.microbatch_index
        if kind == torch_schedules.FORWARD:
            return [Action(FORWARD, stage, i)]
        if kind == torch_schedules.BACKWARD_INPUT:
            return [Action(BACKWARD, stage, i)]
        if kind == torch_schedules.BACKWARD_WEIGHT:
            return [Action(WEIGHT, stage, i)]
        if kind == torch_schedules.FULL_BACKWARD:
            return [Action(BACKWARD, stage, i)] + ([Action(WEIGHT, stage, i)] if split else [])
        raise ValueError(f"torch action {action} is not a compute action")

    def convert(action: Any) -> list[Action]:
        if action.computation_type != torch_schedules.OVERLAP_F_B:
            return plain(action)
        forward, backward = action.sub_actions
        if (forward.computation_type, backward.computation_type) != (
            torch_schedules.FORWARD,
            torch_schedules.FULL_BACKWARD,
        ):
            raise ValueError(f"torch's overlapped {action} is not a forward and a full backward")
        return [Action.fuse(*plain(forward), *plain(backward))]

    mapping = built.stage_index_to_group_rank
    actions = [
        [ours for action in order[d] if action is not None for ours in convert(action)]
        for d in range(len(order))
    ]
    return Schedule(
        name,
        actions,
        built._n_microbatches,
        len(mapping),
        tuple(mapping[s] for s in range(len(mapping))),
    )


def torch_schedule(name: str, devices: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Torch's order for our ``name`` as our :class:`Schedule` (see the module).

    Raises:
        ValueError: torch refuses the counts.
    """
    return to_schedule(name, torch_order(name, devices, microbatches, virtual_stages))
