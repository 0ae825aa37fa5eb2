"""``gpipe demo``: a character-level GPT learns Shakespeare on a 4-stage pipeline, measured.

:func:`run_demo` trains (in this process, or in N processes with ``distributed=N``), then
prints and writes what the run showed: the loss curve, the bubble beside its formula and the
simulator's prediction, each stage's busy time and memory, a sample of generated text, and
the step time of plain training on the same model and micro-batches.
"""

from gpipe.demo.recipe import DemoSettings
from gpipe.demo.summary import run_demo

__all__ = ["DemoSettings", "run_demo"]
