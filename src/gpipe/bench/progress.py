"""A line that shows a long, silent phase is alive: what runs, and for how long so far.

After ``quiet`` seconds without an end, :func:`progress` writes ``   <what> ... 12 s`` to
stderr, rewritten in place each second on a terminal and once every ``every`` seconds
elsewhere (a log stays short); on a terminal the line is cleared at the end.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

__all__ = ["progress"]


@contextmanager
def progress(
    what: str, *, quiet: float = 5.0, every: float = 30.0, stream: TextIO | None = None
) -> Iterator[None]:
    """Show ``what`` and the seconds it has run, from ``quiet`` seconds on, until the block ends.

    Args:
        what: the phase, as the line names it ("profiling each layer").
        quiet: seconds before the first line; a phase shorter than this shows nothing.
        every: seconds between lines when ``stream`` is not a terminal.
        stream: where to write; stderr by default, so stdout stays the command's output.
    """
    out = stream if stream is not None else sys.stderr
    live = out.isatty()
    done = threading.Event()
    began = time.perf_counter()
    shown = False

    def tick() -> None:
        nonlocal shown
        wait = quiet
        while not done.wait(wait):
            line = f"   {what} ... {time.perf_counter() - began:.0f} s"
            out.write(f"\r{line}" if live else f"{line}\n")
            out.flush()
            shown = True
            wait = 1.0 if live else every

    thread = threading.Thread(target=tick, name="gpipe-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if shown and live:
            out.write("\r\033[K")
            out.flush()
