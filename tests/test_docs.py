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
    <!-- skip: next "one process: ..." -->  a script of its own: the slow tier runs it with
                                           python in the folder of the torchrun script above,
                                           once that job has ended
    <!-- skip: next "a torchrun script: tests/test_x.py runs it ..." -->   run by that test
                                           (a launch this harness cannot make, such as one
                                           that kills a rank), not here; "the torchrun
                                           script above" of the blocks below it is then the
                                           one above it

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
TORCHRUN = "a torchrun script"
RANK_CODE = "rank code"
ONE_PROCESS = "one process"
# a torchrun script that another test runs names it: "a torchrun script: tests/test_x.py runs it"
RUN_BY = re.compile(r"^a torchrun script: (tests/test_\w+\.py) runs it\b")


@dataclass
class Block:
    """One Python block of a page, and the marker above it."""

    page: str
    line: int
    example: Example
    skip: str | None = None  # the marker's text: a reason, or if(FAST, reason)

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
    skip = None
    for example in parsed.examples:
        if isinstance(example.parsed, tuple):  # a skip marker: (action, arguments)
            action, skip = example.parsed
            assert action == "next", f"{page}:{example.line}: use `skip: next`, not {action}"
            continue
        parsed.blocks.append(Block(page, example.line, example, skip))
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
    runnable = [b for b in parse(page).blocks if b.skip is None]
    assert len(ran) >= len(runnable) - sum("import transformers" in b.code for b in runnable)


@pytest.mark.slow
@pytest.mark.parametrize("page", SLOW_PAGES)
def test_the_pages_long_blocks_run(page: str, tmp_path: Path) -> None:
    ran, later = run_page(page, fast=False, directory=tmp_path)
    assert not later and ran


@dataclass
class Job:
    """A torchrun script of a page with the rank code below it, up to the next script, and
    the one-process scripts to run after it."""

    page: str
    line: int
    ranks: int
    code: str
    after: list[tuple[int, str]] = field(default_factory=list)  # (line, code)


def torchrun_jobs(page: str) -> list[Job]:
    """The page's torchrun scripts that this harness launches, in page order."""
    jobs: list[Job] = []
    for block in parse(page).blocks:
        reason = block.reason or ""
        if RUN_BY.match(reason):
            continue  # another test runs it
        if reason.startswith(TORCHRUN):
            launch = re.search(r"torchrun --nproc-per-node (\d+)", block.code.split("\n")[0])
            assert launch, f"{page}:{block.line}: the first line names the launch"
            jobs.append(Job(page, block.line, int(launch.group(1)), block.code))
        elif reason.startswith((RANK_CODE, ONE_PROCESS)):
            assert jobs, f"{page}:{block.line}: {reason} needs a torchrun script above it"
            if reason.startswith(RANK_CODE):
                jobs[-1].code += f"\n# {page}:{block.line}\n{block.code}"
            else:
                jobs[-1].after.append((block.line, block.code))
    return jobs


JOBS = [job for page in RUN_PAGES for job in torchrun_jobs(page)]


def test_the_readme_and_the_distributed_page_have_torchrun_scripts() -> None:
    assert [(job.page, job.ranks, len(job.after)) for job in JOBS] == [
        ("README.md", 2, 0),
        ("docs/distributed.md", 4, 0),
        ("docs/distributed.md", 4, 1),  # and consolidate.py, in one process
        ("docs/models.md", 2, 0),
    ]


def test_a_torchrun_script_run_by_another_test_names_a_test_that_reads_its_page() -> None:
    named = []
    for page in RUN_PAGES:
        for block in parse(page).blocks:
            run_by = RUN_BY.match(block.reason or "")
            if run_by:
                test = ROOT / run_by.group(1)
                assert test.is_file(), f"{page}:{block.line}: no {run_by.group(1)}"
                assert page in test.read_text(), f"{run_by.group(1)} does not read {page}"
                named.append((page, run_by.group(1)))
    assert named == [("docs/distributed.md", "tests/test_elastic_resume.py")]


def _run(command: list[str], where: str, cwd: Path, timeout: float) -> None:
    """Run ``command`` in ``cwd`` (its own process group, ended on a timeout); fail the test
    with its output unless it exits 0."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and the ranks it started
        output, _ = process.communicate()
        pytest.fail(f"{where} did not finish in {timeout:g} s:\n{output[-3000:]}")
    assert process.returncode == 0, f"{where}:\n{output[-4000:]}"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("job", JOBS, ids=[f"{job.page}:{job.line}" for job in JOBS])
def test_the_torchrun_scripts_run_under_torchrun(job: Job, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(job.code)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(job.ranks),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--max-restarts",
        "0",
        str(script),
    ]
    _run(command, f"{job.page}:{job.line} under torchrun", tmp_path, timeout=480)
    for line, code in job.after:  # in the job's folder, where it left its files
        after = tmp_path / f"after_{line}.py"
        after.write_text(code)
        _run([sys.executable, str(after)], f"{job.page}:{line}", tmp_path, timeout=60)


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
