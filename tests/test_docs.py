"""The docs: every Python block of README.md and docs/*.md runs, and the site builds.

Sybil (a maintained documentation tester) finds each page's blocks and runs them in order in
one namespace per page, so a block may use what an earlier block on its page defined; a
page that needs a model or data first shows that setup in a block of its own. Blocks run on
CPU; where a GPU matters, CUDA is the comment or the ``if`` branch. Markers are HTML
comments on the line above a fence, invisible on the site:

    <!-- skip: next "why" -->              not run: a signature, or shapes with ``...``
    <!-- skip: next if(FAST, "why") -->    a long block: only the slow tier runs it
    <!-- skip: next "a torchrun script: ..." -->   the slow tier launches it under torchrun
    <!-- skip: next "rank code: ..." -->   the slow tier runs it under torchrun, after the
                                           torchrun script above it on its page

A skip must say why, and a Python fence the harness does not see fails the test.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import unittest
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sybil import Document, Example, Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

import gpipe.schedule
from ranks import free_port

ROOT = Path(__file__).parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
SYBIL = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()])
# Sections whose blocks wait for a rewrite in another branch, by page: (heading, why).
PENDING = {
    "docs/distributed.md": (
        "## Checkpoints that reshard",
        "its rewrite lands in another branch; the lead makes it run after the merge",
    ),
}
TORCHRUN = "a torchrun script"
RANK_CODE = "rank code"


@dataclass
class Block:
    """One Python block of a page, and the marker above it."""

    page: str
    line: int
    example: Example
    skip: str | None = None  # the marker's text: a reason, or if(FAST, reason)
    pending: str | None = None

    @property
    def code(self) -> str:
        return str(self.example.parsed)

    @property
    def reason(self) -> str | None:
        """Why it is skipped (the string in the marker), or None."""
        if self.skip is None:
            return None
        text = self.skip.strip()
        if text.startswith("if"):  # if(FAST, "why")
            call = ast.parse(text[2:].strip(), mode="eval").body
            assert isinstance(call, ast.Tuple), text
            return str(ast.literal_eval(call.elts[1]))
        return str(ast.literal_eval(text))

    @property
    def slow(self) -> bool:
        return self.skip is not None and self.skip.strip().startswith("if")


@dataclass
class Page:
    document: Document
    blocks: list[Block] = field(default_factory=list)
    examples: list[Example] = field(default_factory=list)


def parse(page: str) -> Page:
    """The page's examples as Sybil finds them, and its Python blocks with their markers."""
    document = SYBIL.parse(ROOT / page)
    parsed = Page(document, examples=list(document))
    pending = PENDING.get(page)
    skip = None
    for example in parsed.examples:
        if isinstance(example.parsed, tuple):  # a skip marker: (action, arguments)
            action, skip = example.parsed
            assert action == "next", f"{page}:{example.line}: use `skip: next`, not {action}"
            continue
        block = Block(page, example.line, example, skip)
        if pending is not None:
            heading, why = pending
            start = document.text.find(f"\n{heading}\n")
            end = document.text.find("\n## ", start + 1)
            if start >= 0 and start < example.start < (end if end >= 0 else len(document.text)):
                block.pending = why
        parsed.blocks.append(block)
        skip = None
    return parsed


def test_every_python_block_is_seen_and_every_skip_says_why() -> None:
    for page in PAGES:
        text = (ROOT / page).read_text()
        blocks = parse(page).blocks
        fences = len(re.findall(r"^[ \t]*(?:[-*+] +|\d+[.)] +)?```python\b", text, re.MULTILINE))
        assert len(blocks) == fences, f"{page}: a python fence the harness does not see"
        assert "docs-test:" not in text, f"{page}: the old marker; use <!-- skip: next ... -->"
        for block in blocks:
            if block.skip is not None:
                assert block.reason and block.reason.strip(), f"{page}:{block.line}: say why"
            torchrun = block.code.startswith("# torchrun") or "launched as: torchrun" in block.code
            if torchrun:
                assert block.reason and block.reason.startswith(TORCHRUN), (
                    f"{page}:{block.line}: mark a torchrun script "
                    f'<!-- skip: next "{TORCHRUN}: ..." -->'
                )


def run_page(page: str, *, fast: bool, directory: Path) -> tuple[list[int], list[int]]:
    """Run the page's blocks in order in one namespace; the lines run and the lines left
    for the slow tier."""
    parsed = parse(page)
    parsed.document.namespace.update({"__name__": "docs_example", "FAST": fast})
    ran, later = [], []
    blocks = {id(b.example): b for b in parsed.blocks}
    # NOTE: a page may register a schedule under a name; the registry is process-wide.
    registered = dict(gpipe.schedule.SCHEDULES)
    here = Path.cwd()
    os.chdir(directory)  # examples save pictures and traces where they run
    try:
        for example in parsed.examples:
            block = blocks.get(id(example))
            if block is not None and block.pending:
                continue
            if (
                block is not None
                and "import transformers" in block.code
                and importlib.util.find_spec("transformers") is None
            ):
                continue  # the models extra is not installed
            try:
                example.evaluate()
            except unittest.SkipTest:
                if block is not None and block.slow:
                    later.append(block.line)
                continue
            if block is not None:
                ran.append(block.line)
    finally:
        os.chdir(here)
        gpipe.schedule.SCHEDULES.clear()
        gpipe.schedule.SCHEDULES.update(registered)
    return ran, later


def _has_python(page: str) -> bool:
    return bool(parse(page).blocks)


RUN_PAGES = [page for page in PAGES if _has_python(page)]
SLOW_PAGES = [page for page in RUN_PAGES if any(b.slow for b in parse(page).blocks)]


@pytest.mark.parametrize("page", RUN_PAGES)
def test_the_pages_python_blocks_run(page: str, tmp_path: Path) -> None:
    ran, _ = run_page(page, fast=True, directory=tmp_path)
    runnable = [b for b in parse(page).blocks if b.skip is None and not b.pending]
    assert len(ran) >= len(runnable) - sum("import transformers" in b.code for b in runnable)


@pytest.mark.slow
@pytest.mark.parametrize("page", SLOW_PAGES)
def test_the_pages_long_blocks_run(page: str, tmp_path: Path) -> None:
    ran, later = run_page(page, fast=False, directory=tmp_path)
    assert not later and ran


def torchrun_jobs(page: str) -> list[tuple[int, int, str]]:
    """The page's torchrun scripts as (line, processes, code), each followed by the rank
    code below it on the page, up to the next script."""
    jobs: list[tuple[int, int, str]] = []
    for block in parse(page).blocks:
        reason = block.reason or ""
        if block.pending:
            continue
        if reason.startswith(TORCHRUN):
            launch = re.search(r"torchrun --nproc-per-node (\d+)", block.code.split("\n")[0])
            assert launch, f"{page}:{block.line}: the first line names the launch"
            jobs.append((block.line, int(launch.group(1)), block.code))
        elif reason.startswith(RANK_CODE):
            assert jobs, f"{page}:{block.line}: rank code needs a torchrun script above it"
            line, ranks, code = jobs[-1]
            jobs[-1] = (line, ranks, f"{code}\n# {page}:{block.line}\n{block.code}")
    return jobs


JOBS = [(page, *job) for page in RUN_PAGES for job in torchrun_jobs(page)]


def test_the_readme_and_the_distributed_page_have_torchrun_scripts() -> None:
    assert [(page, ranks) for page, _, ranks, _ in JOBS] == [
        ("README.md", 2),
        ("docs/distributed.md", 4),
        ("docs/distributed.md", 4),
        ("docs/models.md", 2),
    ]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("page", "line", "ranks", "code"), JOBS, ids=[f"{j[0]}:{j[1]}" for j in JOBS]
)
def test_the_torchrun_scripts_run_under_torchrun(
    page: str, line: int, ranks: int, code: str, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(code)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--max-restarts",
        "0",
        str(script),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and the ranks it started
        output, _ = process.communicate()
        pytest.fail(f"{page}:{line} under torchrun did not finish in 540 s:\n{output[-3000:]}")
    assert process.returncode == 0, f"{page}:{line}:\n{output[-4000:]}"


@pytest.mark.slow
def test_docs_site_builds_offline_without_warnings(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]'")
    done = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    # docstrings' Sphinx roles render as links or code (tools/sphinx_roles.py), not as text
    assert not re.findall(r":(?:class|func|meth|attr|mod|data|exc|obj):", api)
    assert 'class="autorefs autorefs-internal"' in api
