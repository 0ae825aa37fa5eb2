"""Every measured figure in the docs names the saved run or report that holds it, and it does.

The convention: a passage (a paragraph, a list item or a table row) that states measured
figures names, in backticks, the saved file they come from: ``benchmarks/runs/NAME.txt`` (a
benchmark's output, saved by ``tools/benchmarks_page.py``), ``docs/report/report.md``
(``gpipe report``) or ``docs/demo/report.md`` (``gpipe demo``). A table row that names no
file takes the files of the paragraph right above its table, or else right below it (the
table's caption). Each figure must appear, digit for digit, in one of the files its passage
names, and every passage of README.md and docs/*.md that holds a figure must name one.

A figure is a decimal (``0.172``, ``1.069x``), a number in scientific notation
(``3.2e-16``), or a whole number with ``x``, ``%``, ``s`` or ``min`` after it (``607x``,
``75 %``, ``155 s``). Code (fenced or indented blocks, text in backticks) holds none, nor does
a dotted version or address (``0.0.7``, ``127.0.0.1``). A figure that is no measurement (a
formula's value, a setting, a goal) is written inside one of its page's ``NOT_MEASURED``
phrases.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# docs/benchmarks.md is the saved runs themselves, printed verbatim by tools/benchmarks_page.py;
# the two reports are saved outputs, not claims about them.
PAGES = sorted(
    path.relative_to(ROOT).as_posix()
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    if path.name != "benchmarks.md"
)
SAVED = re.compile(r"`(benchmarks/runs/[\w.-]+\.txt|docs/report/report\.md|docs/demo/report\.md)`")
FIGURE = re.compile(
    r"(?<!\w)(?<!\d\.)(\d+(?:\.\d+)?e-\d+|\d+\.\d+|\d+(?=x\b| ?%| s\b| min\b))(?![\d+])(?!\.\d)"
)
# Figures that are not measurements, each in the phrase of its page that says what it is.
NOT_MEASURED = {
    "README.md": ["torch 2.4 or newer"],
    "docs/concepts.md": ["75 % for K = 4, M = 1 above; 27 % for M = 8"],  # the bubble formula
    "docs/demo.md": ["ln 63 = 4.14"],
    "docs/distributed.md": [  # the failure watcher's settings
        "about 4 s later",
        "watches the beats for 3 s",
        "gives up after 3 s",
    ],
    "docs/planning.md": [
        "a per-block factor from 0.5 to 2",  # the benchmark model's setting
        "so the headroom is 1.0",  # exact by construction
        "planner_over_best ≤ 1.10, memory error ≤ 10 %",  # the benchmark's goals
    ],
    "docs/schedules.md": [  # formulas, and the paper's table they reproduce
        "11/2 = 5.5",
        "(p-1)/m = 0.25",
        "(p-1)/3m = 0.083",
        '("2x")',
        '("1x")',
    ],
}


def passages(text: str) -> list[tuple[str, list[str]]]:
    """The paragraphs, list items and table rows of a page, each with the saved files it names."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    blocks = [block.strip("\n") for block in re.split(r"\n\s*\n|\n(?=- )", text) if block.strip()]
    indented_code = [
        block for block in blocks if all(line[:4] == "    " for line in block.split("\n"))
    ]
    blocks = [block for block in blocks if block not in indented_code]
    found = []
    for i, block in enumerate(blocks):
        if not block.startswith("|"):
            paragraph = " ".join(block.split())
            found.append((paragraph, SAVED.findall(paragraph)))
            continue
        captions = [SAVED.findall(blocks[j]) for j in (i - 1, i + 1) if 0 <= j < len(blocks)]
        caption = next((files for files in captions if files), [])
        found += [(row, SAVED.findall(row) or caption) for row in block.splitlines()]
    return found


def figures(passage: str, page: str = "") -> list[str]:
    for phrase in NOT_MEASURED.get(page, []):
        passage = passage.replace(phrase, "")
    return FIGURE.findall(re.sub(r"`[^`]*`", "", passage))


def holds(text: str, figure: str) -> bool:
    return re.search(rf"(?<!\d)(?<!\d\.){re.escape(figure)}(?!\d)", text) is not None


def unsaved_figures(page: str, text: str) -> list[str]:
    """Each figure of the page that no file its passage names holds, or that names no file."""
    missing = []
    for passage, files in passages(text):
        texts = [(ROOT / name).read_text() for name in files if (ROOT / name).is_file()]
        for figure in figures(passage, page):
            if not any(holds(saved, figure) for saved in texts):
                where = ", ".join(files) or "no saved file named"
                missing.append(f"{figure} ({where}): {passage[:100]}...")
    return missing


@pytest.mark.parametrize("page", PAGES)
def test_every_figure_names_a_saved_file_that_holds_it(page: str) -> None:
    text = (ROOT / page).read_text()
    for _, files in passages(text):
        for name in files:
            assert (ROOT / name).is_file(), f"{page} names {name}, which is not saved"
    missing = unsaved_figures(page, text)
    assert not missing, f"{page}: figures no saved file holds:\n" + "\n".join(missing)


@pytest.mark.parametrize("page", sorted(NOT_MEASURED))
def test_every_phrase_not_measured_is_still_on_its_page(page: str) -> None:
    text = " ".join((ROOT / page).read_text().split())
    assert [phrase for phrase in NOT_MEASURED[page] if phrase not in text] == []


def test_a_table_row_takes_the_saved_file_of_its_caption() -> None:
    page = (
        "Measured (`benchmarks/runs/latency.txt`):\n\n"
        "| schedule | ms |\n| --- | --- |\n| gpipe | 617.3 |\n| 1f1b | 999.9 |\n\n"
        "A ratio of 1.5x and a setting, `F = 10.0`.\n"
    )
    assert unsaved_figures("", page) == [
        "999.9 (benchmarks/runs/latency.txt): | 1f1b | 999.9 |...",
        "1.5 (no saved file named): A ratio of 1.5x and a setting, `F = 10.0`....",
    ]


def test_the_readme_cites_the_saved_runs_of_its_headline_figures() -> None:
    # the figures the README leads with, and the file each must come from
    expected = {
        "0.021": "docs/report/report.md",
        "220": "docs/demo/report.md",
        "0.172": "benchmarks/runs/overhead_turns.txt",
        "1.069": "benchmarks/runs/latency.txt",
        "3.2e-16": "benchmarks/runs/gpu_check.txt",
    }
    text = (ROOT / "README.md").read_text()
    pairs = {(f, name) for passage, files in passages(text) for f in figures(passage)
             for name in files}  # fmt: skip
    assert {(f, name) for f, name in expected.items()} <= pairs
