"""``gpipe.split``: cut a model that is not an nn.Sequential into pipeline stages.

    stages = gpipe.split(model, split_points=["h.4", "h.8"], example_inputs=(idx,))
    pipe = gpipe.GPipe(stages, chunks=8, schedule="1f1b")

The model is traced with torch.fx, not torch.export: measured on seven real-shaped models
(``python tests/test_split_tracers.py`` prints the table), fx keeps the user's submodules
as calls, so leaf modules stay opaque (control flow inside them works), BatchNorm updates
the user's own running statistics and a split point can name any submodule; export inlines
every module into ATen operations and cannot be told to leave one alone. See
:mod:`gpipe.split.trace`.
"""

import sys
import types
from typing import Any

from gpipe.dataflow import Stages
from gpipe.split.errors import UntraceableError
from gpipe.split.splitter import split
from gpipe.split.stage import SplitStage

__all__ = ["SplitStage", "UntraceableError", "split"]


class _CallableModule(types.ModuleType):
    """This package, callable as the function it is named after."""

    def __call__(self, *args: Any, **kwargs: Any) -> Stages:
        return split(*args, **kwargs)


# NOTE: importing the package gpipe.split makes `gpipe.split` the package, shadowing the
# function gpipe/__init__.py exports under that name; calling the package calls the
# function, so `gpipe.split(model, ...)` works whichever of the two the name holds.
sys.modules[__name__].__class__ = _CallableModule
