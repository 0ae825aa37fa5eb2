"""A Markdown page built a block at a time: headings, paragraphs, tables, pictures."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Document"]


class Document:
    """A Markdown document; :meth:`write` saves it, pictures linked relative to it.

    Args:
        title: the page's first heading.
    """

    def __init__(self, title: str) -> None:
        self.blocks: list[str] = [f"# {title}"]

    def heading(self, text: str, level: int = 2) -> None:
        self.blocks.append(f"{'#' * level} {text}")

    def paragraph(self, text: str) -> None:
        """A paragraph; line breaks inside ``text`` are kept as typed."""
        self.blocks.append(text.strip())

    def bullets(self, items: Sequence[str]) -> None:
        self.blocks.append("\n".join(f"- {item}" for item in items))

    def table(self, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        """A table; numbers right-aligned, everything else left."""
        numeric = [
            all(isinstance(row[c], int | float) for row in rows) and bool(rows)
            for c in range(len(header))
        ]
        lines = [
            "| " + " | ".join(header) + " |",
            "| " + " | ".join("---:" if n else "---" for n in numeric) + " |",
        ]
        lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
        self.blocks.append("\n".join(lines))

    def image(self, path: str | os.PathLike[str], alt: str) -> None:
        """A picture; ``path`` is relative to where the document is written."""
        self.blocks.append(f"![{alt}]({Path(path).as_posix()})")

    def code(self, text: str, language: str = "text") -> None:
        self.blocks.append(f"```{language}\n{text.rstrip()}\n```")

    def __str__(self) -> str:
        return "\n\n".join(self.blocks) + "\n"

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Save the document (creating its folder); returns the path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(str(self), encoding="utf-8")
        return out


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")
