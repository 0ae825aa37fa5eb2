"""What a report run is asked for, and what each section hands back."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ReportSettings", "SectionResult"]


@dataclass(frozen=True)
class ReportSettings:
    """Where the report goes and how long it may take.

    Attributes:
        out: the folder for ``report.md`` and its pictures.
        quick: fewer points and repeats (a few minutes), same sections.
        sections: which sections to run, by number (1-8); all by default.
    """

    out: Path = Path("report-out")
    quick: bool = False
    sections: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)


@dataclass
class SectionResult:
    """What a section found, for the terminal and the ``RESULT`` line.

    Attributes:
        number: the section's number.
        title: its title.
        headline: one line of what it measured.
        figures: the PNG files it wrote (relative to the report's folder).
        values: ``key=value`` pairs for the ``RESULT`` line.
        seconds: how long it took.
    """

    number: int
    title: str
    headline: str
    figures: list[str] = field(default_factory=list)
    values: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
