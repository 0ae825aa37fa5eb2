"""The distributed runtime under NCCL's rules, on gloo: no machine here has two GPUs.

The suite's pipes post through ``NcclRulesPoster`` (see tests/conftest.py): one stream per
rank, and sends that complete only once their receiver's stream reaches them. These tests
run the lowered programs under it and under plain gloo, and show it catches a program that
would hang on NCCL.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_new_pipe_trained_as_plain, custom_schedules
from ranks import check, launch

pytestmark = pytest.mark.timeout(240)

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v"]
SCHEDULES += ["interleaved-zb", "looped-bfs", "v-half", "v-min", "dualpipev"]


@pytest.mark.parametrize("poster", ["nccl-rules", "gloo"])
def test_every_schedule_trains_step_after_step_as_plain_training_as_shapes_change(
    poster: str,
) -> None:
    results = check(launch("lowering_scenarios:steps", 2, schedules=SCHEDULES, poster=poster))
    for rank, result in enumerate(results):
        assert sorted(result) == sorted(SCHEDULES)
        for schedule, worst in result.items():
            assert len(worst) == 5 and max(worst) < 1e-12, (poster, rank, schedule, worst)


@pytest.mark.slow
def test_four_ranks_under_nccls_rules_train_every_schedule_as_plain_training() -> None:
    results = check(launch("lowering_scenarios:steps", 4, schedules=SCHEDULES, poster="nccl-rules"))
    for result in results:
        assert all(max(worst) < 1e-12 for worst in result.values()), result


@pytest.mark.slow
def test_messages_of_32_mib_cross_under_nccls_rules() -> None:
    results = check(
        launch(
            "lowering_scenarios:large", 2, timeout=180, schedule="1f1b", poster="nccl-rules", mib=32
        )
    )
    for worst in results:
        assert len(worst) == 3 and max(worst) < 1e-5, worst


def test_a_program_posted_without_rounds_hangs_under_nccls_rules_and_fails_in_time() -> None:
    # Interleaved GPipe with each send posted right after its action: both ranks' streams
    # wait on a send whose receive the other posted behind its own stuck send. The check
    # refuses this program; here it runs anyway, and every rank must end within its timeout.
    outcomes = launch("lowering_scenarios:naive_program", 2, timeout=90, poster="nccl-rules")
    for outcome in outcomes:
        assert outcome.returncode == 1, outcome
        assert "within 8 s" in outcome.error or "lost its link" in outcome.error, outcome.error


def test_a_rank_whose_init_fn_raises_ends_every_rank_within_seconds_naming_it() -> None:
    # the pipe's timeout is 300 s: only the fault channel, made before the first collective,
    # can end the others this soon (usually within a second or two; the bound is a hang check)
    outcomes = launch("lowering_scenarios:init_fn_raises", 3, timeout=90, rank=1)
    raised = outcomes[1].seconds
    for outcome in outcomes:
        assert outcome.returncode == 1, outcome
        assert "out of memory (a test's init_fn)" in outcome.error, outcome.error
        if outcome.rank != 1:
            assert "rank 1" in outcome.error, outcome.error
            assert outcome.seconds - raised < 30, (outcome.seconds, raised)


@pytest.mark.parametrize("world", [2, 4])
def test_random_custom_schedules_the_validator_accepts_run_under_nccls_rules(world: int) -> None:
    csvs = custom_schedules(world, 4, seed=world)
    for worst in check(launch("lowering_scenarios:custom", world, csvs=csvs)):
        assert len(worst) == 3 * len(csvs) and max(worst) < 1e-12, worst


two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs two CUDA GPUs (one per rank, NCCL)",
)


@two_gpus
def test_on_two_gpus_nccl_trains_every_schedule_step_after_step_as_plain_training() -> None:
    # gd.init() takes NCCL and cuda:LOCAL_RANK when CUDA is present: the posts are real
    # batch_isend_irecv groups on each rank's GPU
    results = check(launch("lowering_scenarios:steps", 2, schedules=SCHEDULES, poster="gloo"))
    for result in results:
        assert all(max(worst) < 1e-12 for worst in result.values()), result


@two_gpus
def test_on_two_gpus_nccl_carries_large_activations_for_three_steps() -> None:
    results = check(
        launch("lowering_scenarios:large", 2, timeout=180, schedule="1f1b", poster="gloo", mib=32)
    )
    for worst in results:
        assert max(worst) < 1e-4, worst


@two_gpus
def test_on_two_gpus_a_new_pipe_after_a_failed_step_trains_as_plain_training() -> None:
    results = check(launch("dist_scenarios:new_pipe_after_failure", 2, timeout=90))
    assert_new_pipe_trained_as_plain(results, world=2)
