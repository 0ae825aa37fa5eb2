"""The docs: their code examples run, and the site builds without a warning."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ranks import run_script

ROOT = Path(__file__).parent.parent
EXAMPLES = ["models.md", "randomness.md"]


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


@pytest.mark.parametrize("page", EXAMPLES)
def test_the_pages_python_examples_run(page: str) -> None:
    text = (ROOT / "docs" / page).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert blocks, f"{page} has no python example"
    for block in blocks:
        if block.startswith("# torchrun"):  # run on processes of their own, below
            continue
        if "import transformers" in block and importlib.util.find_spec("transformers") is None:
            continue  # the models extra is not installed
        exec(compile(block, f"docs/{page}", "exec"), {"__name__": "docs_example"})


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
    assert (tmp_path / "site" / "api" / "index.html").exists()


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
