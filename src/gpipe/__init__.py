"""gpipe: pipeline-parallel training for PyTorch.

    from gpipe import GPipe
    pipe = GPipe(nn.Sequential(...), balance=[2, 3, 3], chunks=8, schedule="1f1b")
    loss = pipe.train_step(x, target, loss_fn)

Schedules, the simulator and timelines are plain Python; the names that need PyTorch load
it on first use, so ``gpipe simulate`` starts at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gpipe.analysis import Costs, Event, Timeline, simulate
from gpipe.schedule import Action, Schedule, ScheduleError, make_schedule, validate

if TYPE_CHECKING:
    from gpipe.balance import (
        balance_by_memory,
        balance_by_params,
        balance_by_time,
        balance_costs,
        balance_weighted,
    )
    from gpipe.balance.layer_profile import Profile
    from gpipe.balance.profiler import profile
    from gpipe.dataflow import Stages
    from gpipe.microbatch import gather, scatter
    from gpipe.pipe import GPipe
    from gpipe.planning.plan_report import Plan, PlanReport
    from gpipe.planning.planner import plan
    from gpipe.split import split

__version__ = "0.1.0"

_LAZY = {
    "GPipe": "gpipe.pipe",
    "gather": "gpipe.microbatch",
    "scatter": "gpipe.microbatch",
    "balance_by_memory": "gpipe.balance",
    "balance_by_params": "gpipe.balance",
    "balance_by_time": "gpipe.balance",
    "balance_costs": "gpipe.balance",
    "balance_weighted": "gpipe.balance",
    "Profile": "gpipe.balance.layer_profile",
    "profile": "gpipe.balance.profiler",
    "Plan": "gpipe.planning.plan_report",
    "PlanReport": "gpipe.planning.plan_report",
    "plan": "gpipe.planning.planner",
    "Stages": "gpipe.dataflow",
    "split": "gpipe.split",
}

__all__ = [
    "Action",
    "Costs",
    "Event",
    "GPipe",
    "Plan",
    "PlanReport",
    "Profile",
    "Schedule",
    "ScheduleError",
    "Stages",
    "Timeline",
    "balance_by_memory",
    "balance_by_params",
    "balance_by_time",
    "balance_costs",
    "balance_weighted",
    "gather",
    "make_schedule",
    "plan",
    "profile",
    "scatter",
    "simulate",
    "split",
    "validate",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gpipe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
