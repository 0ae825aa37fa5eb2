"""Schedules as data: actions, generators, and the checks and text forms built on them."""

from gpipe.schedule.action import (
    BACKWARD,
    FORWARD,
    FUSED,
    KINDS,
    WEIGHT,
    Action,
    dependencies,
    units,
)
from gpipe.schedule.communication import Message, communication
from gpipe.schedule.controllable import v_half, v_min
from gpipe.schedule.decode import decode
from gpipe.schedule.dualpipe import dualpipev
from gpipe.schedule.generate import gpipe, interleaved, one_f_one_b
from gpipe.schedule.greedy import greedy
from gpipe.schedule.grid import format_grid
from gpipe.schedule.looped import interleaved_zb, looped_bfs
from gpipe.schedule.placement import round_robin, v_shape
from gpipe.schedule.registry import (
    SCHEDULES,
    check_schedule_type,
    check_virtual_stages,
    default_virtual_stages,
    make_schedule,
    schedule_for,
)
from gpipe.schedule.schedule import Schedule, from_csv
from gpipe.schedule.steps import Steps, in_one_order, run_in_steps
from gpipe.schedule.text import to_csv
from gpipe.schedule.validate import ScheduleError, validate
from gpipe.schedule.zero_bubble import zb_h1, zb_h2, zb_v

__all__ = [
    "BACKWARD",
    "FORWARD",
    "FUSED",
    "KINDS",
    "SCHEDULES",
    "WEIGHT",
    "Action",
    "Message",
    "Schedule",
    "ScheduleError",
    "Steps",
    "check_schedule_type",
    "check_virtual_stages",
    "communication",
    "decode",
    "default_virtual_stages",
    "dependencies",
    "dualpipev",
    "format_grid",
    "from_csv",
    "gpipe",
    "greedy",
    "in_one_order",
    "interleaved",
    "interleaved_zb",
    "looped_bfs",
    "make_schedule",
    "one_f_one_b",
    "round_robin",
    "run_in_steps",
    "schedule_for",
    "to_csv",
    "units",
    "v_half",
    "v_min",
    "v_shape",
    "validate",
    "zb_h1",
    "zb_h2",
    "zb_v",
]
