"""Elastic restarts: under ``torchrun --max-restarts``, the resuming script of
docs/distributed.md, one of whose ranks dies once, carries on from its newest checkpoint
with no step lost or done twice, and ends with the weights of a run that never stopped."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ranks import free_port

ROOT = Path(__file__).parent.parent
STEPS = 12  # as the script says

# Rank 1 of the first attempt dies (SIGKILL) as its fourth step begins; then the script runs.
# NOTE: rank 0 comes up late after the restart, as a loaded machine may make it: the dead
# attempt's addresses in torchrun's store must not mislead rank 1 (they did, before
# gpipe.distributed.init kept each attempt's keys apart).
_DIES_ONCE = """
import os, runpy, signal, sys, time
import gpipe.distributed as gd

if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0" and os.environ["RANK"] == "0":
    time.sleep(2)

if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    real, calls = gd.DistributedGPipe.train_step, []

    def train_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args, **kwargs)

    gd.DistributedGPipe.train_step = train_step
if os.environ["RANK"] == "0":
    print("attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
runpy.run_path(sys.argv[1], run_name="__main__")
"""


def _script() -> str:
    page = (ROOT / "docs" / "distributed.md").read_text()
    blocks = re.findall(r"```python\n(# torchrun [^\n]*--max-restarts.*?)```", page, re.DOTALL)
    assert len(blocks) == 1, "docs/distributed.md: one script to run under --max-restarts"
    return str(blocks[0])


def _torchrun(folder: Path, *args: str) -> list[str]:
    """Run torchrun (2 ranks, 2 restarts at most) in ``folder``; its output's lines."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
        *("--max-restarts", "2", "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.1"),
        *args,
    ]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout.splitlines()


def _steps(lines: list[str]) -> list[tuple[int, float]]:
    return [
        (int(a), float(b)) for a, b in (line.split() for line in lines if "attempt" not in line)
    ]


def _plain_losses() -> tuple[list[float], nn.Module]:
    """The script's training, on the plain model in this process."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        data = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 64, generator=data), torch.randn(32, 64, generator=data)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.mark.timeout(300)
def test_a_rank_dies_once_and_torchrun_restarts_the_job_from_its_last_checkpoint(
    tmp_path: Path,
) -> None:
    import gpipe.distributed as gd

    (tmp_path / "resume.py").write_text(_script())
    (tmp_path / "dies_once.py").write_text(_DIES_ONCE)
    lines = _torchrun(tmp_path, "dies_once.py", "resume.py")
    attempts = [line for line in lines if line.startswith("attempt")]
    assert attempts == ["attempt 0", "attempt 1"], lines  # it died once, and resumed
    done = _steps(lines)
    assert [step for step, _ in done] == list(range(STEPS)), lines  # each step once, in order
    before = lines.index("attempt 1")
    assert 0 < before - 1 < STEPS  # some steps in each attempt
    losses, plain = _plain_losses()
    assert [loss for _, loss in done] == pytest.approx(losses, rel=1e-5)
    gd.consolidate(tmp_path / "ckpt", tmp_path / "model.pt")
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_restarted_job_is_bitwise_the_job_that_never_stopped(tmp_path: Path) -> None:
    import gpipe.distributed as gd

    broken, whole = tmp_path / "broken", tmp_path / "whole"
    for folder in (broken, whole):
        folder.mkdir()
        (folder / "resume.py").write_text(_script())
    (broken / "dies_once.py").write_text(_DIES_ONCE)
    restarted = _steps(_torchrun(broken, "dies_once.py", "resume.py"))
    unbroken = _steps(_torchrun(whole, "resume.py"))
    assert restarted == unbroken  # every loss, to the last bit (repr round-trips a float)
    for folder in (broken, whole):
        gd.consolidate(folder / "ckpt", folder / "model.pt")
    a = torch.load(broken / "model.pt", weights_only=True)
    b = torch.load(whole / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
