"""Schedules as data: actions, generators, and the checks and text forms built on them."""

from gpipe.schedule.action import BACKWARD, FORWARD, KINDS, WEIGHT, Action, dependencies
from gpipe.schedule.generate import (
    SCHEDULES,
    gpipe,
    interleaved,
    make_schedule,
    one_f_one_b,
    zb_h1,
)
from gpipe.schedule.grid import format_grid
from gpipe.schedule.schedule import Schedule, from_csv
from gpipe.schedule.steps import Steps, run_in_steps
from gpipe.schedule.text import to_csv
from gpipe.schedule.validate import ScheduleError, validate

__all__ = [
    "BACKWARD",
    "FORWARD",
    "KINDS",
    "SCHEDULES",
    "WEIGHT",
    "Action",
    "Schedule",
    "ScheduleError",
    "Steps",
    "dependencies",
    "format_grid",
    "from_csv",
    "gpipe",
    "interleaved",
    "make_schedule",
    "one_f_one_b",
    "run_in_steps",
    "to_csv",
    "validate",
    "zb_h1",
]
