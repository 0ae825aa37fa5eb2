"""Checkpoints survive a crash at any point of a save: the job resumes bit for bit from the
newest complete checkpoint, as if it had never stopped.

Each run resumes from the folder, trains, saves once, and then dies (one rank, SIGKILL) at a
point of its second save: before or after one of its file-system or collective calls. The
next run must load exactly the newest save that got as far as its commit (bit for bit: the
model, the optimizer, extra), and every step any run computes must give the loss, bit for
bit, of a run that never stopped; so must the final weights and optimizer state.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from ranks import launch

WORLD = 2


def _crash_and_resume(tmp_path: Path, points: list[dict[str, float]]) -> dict[str, int]:
    """Run once per point, each dying there, then once to the end; check every resume.
    How many saves died before their commit, and after it."""
    path, log = str(tmp_path / "ckpt"), tmp_path / "log"
    log.mkdir()
    start, outcomes = 0, {"before the commit": 0, "after the commit": 0}
    for number, point in enumerate(points):
        ranks = launch(
            "crash_scenarios:resume_and_crash",
            WORLD,
            timeout=180,
            path=path,
            log=str(log),
            stop=10 * len(points) + 10,
            point=point,
        )
        died = json.loads((log / "died").read_text())
        assert died["rank"] == point["rank"], (point, died)
        code = ranks[died["rank"]].returncode
        assert code is not None and code < 0, (point, died, ranks[died["rank"]].stderr[-2000:])
        (log / "died").unlink()
        committed = (log / "committed").exists()
        if committed:
            (log / "committed").unlink()
        outcomes["after the commit" if committed else "before the commit"] += 1
        _check_resumed(log, start, f"run {number} ({point}, died {died['at']})")
        start = start + 2 if committed else start + 1
    final = launch(
        "crash_scenarios:resume_and_crash",
        WORLD,
        timeout=180,
        path=path,
        log=str(log),
        stop=2 * len(points) + 2,
        point=None,
    )
    failed = [r for r in final if r.returncode != 0]
    assert not failed, "\n".join(r.error or r.stderr[-3000:] for r in failed)
    _check_resumed(log, start, "the last run")
    reference = final[0].result["reference"]
    for rank, outcome in enumerate(final):
        assert outcome.result["start"] == start
        assert outcome.result["differences"] == [], (rank, outcome.result["differences"])
        computed = [json.loads(line) for line in (log / f"losses-rank{rank}.jsonl").open()]
        wrong = [(step, loss) for step, loss in computed if loss != reference[step]]
        assert not wrong, f"rank {rank}: steps whose loss differs from the unbroken run: {wrong}"
    return outcomes


def _check_resumed(log: Path, expected: int, what: str) -> None:
    """Each rank's last load read the save of step ``expected``, bit for bit."""
    for rank in range(WORLD):
        lines = (log / f"loaded-rank{rank}.jsonl").read_text().splitlines()
        start, differences = json.loads(lines[-1])
        assert start == expected, f"{what}: rank {rank} resumed at step {start}, not {expected}"
        assert differences == [], f"{what}: rank {rank} loaded other values at {differences}"


@pytest.mark.timeout(600)
def test_a_save_cut_short_twice_resumes_bitwise_from_the_newest_complete_checkpoint(
    tmp_path: Path,
) -> None:
    # one death early in DCP's writing, one in the commit's last calls
    _crash_and_resume(tmp_path, [{"rank": 1, "at": 0.3}, {"rank": 0, "at": 0.97}])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_twenty_saves_cut_short_at_random_points_each_resume_bitwise(tmp_path: Path) -> None:
    chooser = random.Random(28)
    # NOTE: one point in each twentieth of the save, so the commit's few last calls are hit too
    points = [
        {"rank": chooser.randrange(WORLD), "at": (i + chooser.random()) / 20} for i in range(20)
    ]
    outcomes = _crash_and_resume(tmp_path, points)
    assert outcomes["before the commit"] and outcomes["after the commit"], outcomes
