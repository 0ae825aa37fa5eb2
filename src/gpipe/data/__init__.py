"""Text shipped with the package, so the demo trains on real English with nothing to download.

``shakespeare.txt`` holds five of Shakespeare's plays (public domain) in the classic plain
form, ``SPEAKER:`` above each speech; ``README.md`` beside it says where it came from.
"""

from __future__ import annotations

from importlib import resources

__all__ = ["shakespeare"]


def shakespeare() -> str:
    """Five plays, about 560 KB: Hamlet, Macbeth, Romeo and Juliet, Julius Caesar and
    A Midsummer Night's Dream, speeches separated by blank lines."""
    return resources.files(__name__).joinpath("shakespeare.txt").read_text(encoding="utf-8")
