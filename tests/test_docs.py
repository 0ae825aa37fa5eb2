"""The docs: their code examples run, and the site builds without a warning."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gpipe.schedule
from ranks import run_script

ROOT = Path(__file__).parent.parent
# Pages whose every Python block runs, in order, in one namespace per page (a block may use
# what an earlier block on its page defined). A block marked on the line above its fence
# with `<!-- docs-test: skip (why) -->` is skipped, with the reason shown; a torchrun script
# (first line `# torchrun ...`) runs on processes of its own, below. The pages not listed
# are not run yet: planning.md, distributed.md (its fragments), index.md and
# rematerialization.md.
PAGES = [
    "README.md",
    "docs/guide.md",
    "docs/schedules.md",
    "docs/torchgpipe.md",
    "docs/models.md",
    "docs/randomness.md",
]
_FENCE = re.compile(
    r"^(?P<marker><!-- docs-test: skip \((?P<why>.*?)\) -->\n)?"
    r"(?P<indent> *)```python\n(?P<code>.*?)^(?P=indent)```",
    flags=re.DOTALL | re.MULTILINE,
)


def python_blocks(page: str) -> list[tuple[int, str, str | None]]:
    """Each Python block of ``page`` as (line, code, why it is skipped or None), the code
    dedented when the block sits in a list item."""
    text = (ROOT / page).read_text()
    return [
        (
            text.count("\n", 0, match.start("code")) + 1,
            textwrap.dedent(match.group("code")),
            match.group("why"),
        )
        for match in _FENCE.finditer(text)
    ]


def _run_page(page: str, directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(directory)  # examples save pictures and traces where they run
    namespace: dict[str, object] = {"__name__": "docs_example"}
    # NOTE: a page may register a schedule under a name; the registry is process-wide.
    registered = dict(gpipe.schedule.SCHEDULES)
    try:
        for line, code, why in python_blocks(page):
            if why is not None or code.startswith("# torchrun"):
                continue
            if "import transformers" in code and importlib.util.find_spec("transformers") is None:
                continue  # the models extra is not installed
            exec(compile("\n" * (line - 1) + code, str(ROOT / page), "exec"), namespace)
    finally:
        gpipe.schedule.SCHEDULES.clear()
        gpipe.schedule.SCHEDULES.update(registered)


def test_every_block_of_the_run_pages_runs_or_says_why_not() -> None:
    for page in PAGES:
        blocks = python_blocks(page)
        assert blocks, f"{page} has no python example"
        fences = (ROOT / page).read_text().count("```python")
        assert len(blocks) == fences, f"{page}: a python fence the test does not see"
        for line, _, why in blocks:
            assert why is None or why.strip(), f"{page}:{line}: a skip without a reason"


@pytest.mark.parametrize("page", PAGES)  # each page takes seconds at most: all in `make test`
def test_the_pages_python_examples_run(
    page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _run_page(page, tmp_path, monkeypatch)


def _torchrun_scripts() -> list[tuple[str, int, str]]:
    """The complete torchrun scripts of the README, docs/distributed.md and docs/models.md,
    each as (page, ranks, code): the blocks that name their launch and call ``gd.init()``."""
    found = []
    for page in (ROOT / "README.md", ROOT / "docs" / "distributed.md", ROOT / "docs" / "models.md"):
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL):
            launch = re.search(r"torchrun --nproc-per-node (\d+) train\.py", block.split("\n")[0])
            if launch and "gd.init()" in block:
                found.append((page.name, int(launch.group(1)), block))
    return found


SCRIPTS = _torchrun_scripts()


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


def test_the_readme_and_the_distributed_page_have_torchrun_scripts() -> None:
    assert [(page, ranks) for page, ranks, _ in SCRIPTS] == [
        ("README.md", 2),
        ("distributed.md", 4),
        ("models.md", 2),
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("page", "ranks", "code"), SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_the_torchrun_scripts_run_on_hand_launched_ranks(
    page: str, ranks: int, code: str, tmp_path: Path
) -> None:
    # as written, on plain processes with torchrun's variables; each rank must exit 0 on
    # its own (a ZeRO job once aborted at exit, found by running an example by hand)
    script = tmp_path / "train.py"
    script.write_text(code)
    outcomes = run_script(str(script), ranks, timeout=300)
    assert [status for status, _ in outcomes] == [0] * ranks, [e[-2000:] for _, e in outcomes]
