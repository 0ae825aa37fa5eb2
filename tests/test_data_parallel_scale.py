"""The data-parallel engines on 8 ranks (pp x dp both ways) against plain training, and a
rank failing inside an engine's step ending every rank, naming it."""

from __future__ import annotations

import pytest

from ranks import check, launch

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
@pytest.mark.parametrize("dp", [2, 4])
def test_eight_ranks_train_as_plain_training_under_every_engine(engine: str, dp: int) -> None:
    schedules = ["gpipe", "1f1b"]
    for result in check(launch("engine_scale_scenarios:layouts", 8, timeout=240, engine=engine,
                               dp=dp, schedules=schedules)):  # fmt: skip
        for schedule in schedules:
            diffs = result[schedule]
            assert diffs["loss"] < 1e-12 and diffs["grad"] < 1e-12, (schedule, diffs)
            assert diffs["param"] < 1e-12 and diffs["held"] > 0, (schedule, diffs)


# NOTE: slow tier while a known flake stands: in 1 of 7 runs (a clean clone's) under fsdp the
# failing rank's replica peer (in FSDP's all-gather) ended by SIGABRT instead of status 1;
# its cause is not found yet (see issue 42's note)
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_a_rank_raising_inside_an_engines_step_ends_every_rank_naming_it(engine: str) -> None:
    outcomes = launch("engine_scale_scenarios:fails_inside", 4, timeout=120, engine=engine, rank=1)
    assert [o.returncode for o in outcomes] == [1] * 4, [o.error[-1500:] for o in outcomes]
    assert "RuntimeError: boom inside an fsdp step on rank 1" in outcomes[1].error
    for outcome in outcomes:
        assert "rank 1" in outcome.error and "boom inside" in outcome.error, outcome.error[-2000:]
    assert max(o.seconds for o in outcomes) < 60, [o.seconds for o in outcomes]


@pytest.mark.slow
def test_a_plan_under_fsdp_builds_a_pipe_that_runs_fsdp_and_trains_as_plain_training() -> None:
    for result in check(launch("engine_scale_scenarios:from_plan", 4, timeout=120, engine="fsdp")):
        assert result["engine"] == "fsdp" and "dp=2 fsdp" in result["described"], result
        assert result["loss"] < 1e-12 and result["grad"] < 1e-12 and result["held"] > 0, result
