"""Skip trackers: where a skippable layer's stashes wait until a later layer pops them."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from gpipe.skip.namespace import Namespace

__all__ = ["SkipKey", "SkipTracker", "current_tracker", "use_tracker"]

# A skip's identity: its namespace (None: not isolated) and its name.
SkipKey = tuple[Namespace | None, str]


class SkipTracker:
    """The skips stashed and not yet popped, by :data:`SkipKey`.

    Outside a pipe each thread has one (a plain ``nn.Sequential`` runs its layers in one
    thread, so a stash is there when the later layer pops it); inside a pipe each call of a
    stage module has its own, filled with the skips the stage receives, so micro-batches,
    stages and recomputations never see each other's skips.
    """

    def __init__(self, waiting: Mapping[SkipKey, Any] | None = None) -> None:
        self.waiting: dict[SkipKey, Any] = dict(waiting or {})

    def save(self, key: SkipKey, value: Any) -> None:
        self.waiting[key] = value

    def has(self, key: SkipKey) -> bool:
        return key in self.waiting

    def take(self, key: SkipKey) -> Any:
        """Remove and return the skip ``key``; the tracker keeps no reference to it."""
        return self.waiting.pop(key)


class _Local(threading.local):
    def __init__(self) -> None:
        self.stack: list[SkipTracker] = [SkipTracker()]


_local = _Local()


def current_tracker() -> SkipTracker:
    """The tracker skippable layers of this thread stash into and pop from now."""
    return _local.stack[-1]


@contextmanager
def use_tracker(tracker: SkipTracker) -> Iterator[SkipTracker]:
    """Make ``tracker`` this thread's current one while the block runs."""
    _local.stack.append(tracker)
    try:
        yield tracker
    finally:
        _local.stack.pop()
