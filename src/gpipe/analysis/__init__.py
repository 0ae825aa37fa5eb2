"""Torch-free analysis: simulate a schedule, hold and draw timelines, model memory and bubbles.

The simulator and the runtime both produce a :class:`Timeline`; the chart, the PNG and the
Perfetto trace draw either one the same way.
"""

from gpipe.analysis.critical import CriticalPath, Link, critical_path
from gpipe.analysis.formulas import (
    BUBBLE_FORMULAS,
    MEMORY_FORMULAS,
    bubble_formula,
    memory_formula,
    paper_bubble,
)
from gpipe.analysis.memory import activation_peaks, kept_microbatches
from gpipe.analysis.search import search
from gpipe.analysis.simulator import Costs, costs_from_timeline, simulate, skips_from_timeline
from gpipe.analysis.timeline import Event, Timeline, Transfer

__all__ = [
    "BUBBLE_FORMULAS",
    "MEMORY_FORMULAS",
    "Costs",
    "CriticalPath",
    "Event",
    "Link",
    "Timeline",
    "Transfer",
    "activation_peaks",
    "bubble_formula",
    "costs_from_timeline",
    "critical_path",
    "kept_microbatches",
    "memory_formula",
    "paper_bubble",
    "search",
    "simulate",
    "skips_from_timeline",
]
