"""gpipe: pipeline-parallel training for PyTorch."""

from gpipe.schedule import Action, Schedule, make_schedule
from gpipe.timeline import Event, Timeline

__version__ = "0.1.0"

__all__ = ["Action", "Event", "Schedule", "Timeline", "make_schedule"]
