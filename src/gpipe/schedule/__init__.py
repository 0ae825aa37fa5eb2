"""Schedules as data: actions, generators, and the checks and text forms built on them."""

from gpipe.schedule.action import BACKWARD, FORWARD, KINDS, WEIGHT, Action, Schedule
from gpipe.schedule.generate import SCHEDULES, gpipe, make_schedule

__all__ = [
    "BACKWARD",
    "FORWARD",
    "KINDS",
    "SCHEDULES",
    "WEIGHT",
    "Action",
    "Schedule",
    "gpipe",
    "make_schedule",
]
