"""Skip connections for a Sequential, without tracing: torchgpipe's ``skippable`` interface.

    from gpipe.skip import Namespace, pop, skippable, stash, verify_skippables

A layer decorated with ``@skippable(stash=[...], pop=[...])`` yields ``stash(name, x)`` to
hand ``x`` to a later layer and ``x = yield pop(name)`` to take it. The Sequential still runs
as a plain PyTorch model; ``gpipe.GPipe`` (or :func:`stages`) sends each skip straight from
the stage that stashes it to the stage that pops it.
"""

from __future__ import annotations

from gpipe.skip.layout import SkipLayout, inspect_skip_layout
from gpipe.skip.namespace import Namespace
from gpipe.skip.skippable import Skippable, pop, skippable, stash
from gpipe.skip.stages import stages
from gpipe.skip.verify import has_skippables, verify_skippables

__all__ = [
    "Namespace",
    "SkipLayout",
    "Skippable",
    "has_skippables",
    "inspect_skip_layout",
    "pop",
    "skippable",
    "stages",
    "stash",
    "verify_skippables",
]
