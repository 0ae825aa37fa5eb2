"""``gpipe demo``: a character-level GPT learns Shakespeare on a 4-stage pipeline, measured.

:func:`run_demo` trains (in this process, or in N processes with ``distributed=N``), then
prints and writes what the run showed: the loss curve, the bubble beside its formula and the
simulator's prediction, each stage's busy time and memory, the step time of plain training
on the same model and micro-batches, and speeches the trained model writes through the pipe
and in one process, alike.
"""

from gpipe.demo.recipe import DemoSettings
from gpipe.demo.summary import run_demo

__all__ = ["DemoSettings", "run_demo"]
