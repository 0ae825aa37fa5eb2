"""The pipeline under torch's own data-parallel engines: DDP and FSDP2 per stage, on pp=2 x
dp=2 (gloo), equal to plain training on the whole batch, and what they refuse."""

from __future__ import annotations

import pytest

from ranks import check, launch

EXACT = 1e-12  # float64: only round-off may differ


def assert_plain(results: list[dict], schedules: list[str]) -> None:
    """Loss, every held gradient, eval output and parameters after two optimizer steps
    equal plain training's on every rank."""
    for rank, result in enumerate(results):
        assert sorted(result) == sorted(schedules), result
        for schedule, diffs in result.items():
            assert diffs["held"] == 4, (rank, schedule, diffs)  # 2 Linear layers each
            for key in ("loss", "grad", "eval", "params", "norm"):
                assert diffs[key] < EXACT, (rank, schedule, key, diffs)


@pytest.mark.timeout(120)
def test_ddp_gradients_steps_and_clipping_equal_plain_training_on_uneven_replicas() -> None:
    # a batch of 7 splits 4 + 3 over the replicas, 2 micro-batches each
    schedules = ["gpipe", "1f1b"]
    results = check(
        launch(
            "engine_scenarios:parity", 4, engine="ddp", schedules=schedules, clip=True, timeout=100
        )
    )
    assert_plain(results, schedules)
    for result in results:
        for diffs in result.values():
            assert diffs["sharded"] == 0.0
            # one bucket per stage, reduced once per step, not once per micro-batch
            assert diffs["step 0 ddp_bucket"] == diffs["step 1 ddp_bucket"] == 1.0, diffs


@pytest.mark.timeout(120)
def test_fsdp_gradients_clipping_and_steps_equal_plain_training_on_uneven_replicas() -> None:
    # clipping: the norm of every rank's DTensor shards, over pp and dp, is the whole model's
    schedules = ["gpipe", "1f1b"]
    results = check(
        launch(
            "engine_scenarios:parity", 4, engine="fsdp", schedules=schedules, clip=True, timeout=100
        )
    )
    assert_plain(results, schedules)
    for result in results:
        for diffs in result.values():
            assert diffs["sharded"] == 1.0  # the parameters are DTensors
            assert diffs["step 0 reduce_scatter"] == diffs["step 1 reduce_scatter"] == 1.0, diffs


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fsdp_without_reshard_after_forward_gathers_each_stage_once_per_step() -> None:
    results = check(
        launch(
            "engine_scenarios:parity",
            4,
            engine="fsdp",
            schedules=["1f1b"],
            checkpoint="always",
            reshard=False,
            optimizer="SGD",
            timeout=100,
        )
    )
    assert_plain(results, ["1f1b"])
    for result in results:
        diffs = result["1f1b"]
        for step in (0, 1):
            assert diffs[f"step {step} all_gather"] == 1.0, diffs
            assert diffs[f"step {step} reduce_scatter"] == 1.0, diffs


@pytest.mark.timeout(120)
def test_fsdp_zero_bubble_runs_each_w_on_gathered_parameters_as_plain_training() -> None:
    # a weight gradient that reads the weight, and "w-after-f", whose W follows a forward
    # that freed the parameters: W on freed ones would be wrong (or crash)
    schedules = ["zb-h1", "w-after-f"]
    results = check(
        launch(
            "engine_scenarios:parity",
            4,
            engine="fsdp",
            schedules=schedules,
            batch=8,
            chunks=4,
            squared=True,
            timeout=100,
        )
    )
    assert_plain(results, schedules)
    for result in results:
        for diffs in result.values():
            assert diffs["sharded"] == 1.0
            # one reduce-scatter per step, after the stage's last W
            assert diffs["step 0 reduce_scatter"] == diffs["step 1 reduce_scatter"] == 1.0, diffs


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_runs_every_zero_bubble_schedule_as_plain_training(reshard: bool) -> None:
    schedules = ["zb-h1", "zb-h2", "zb-v", "interleaved-zb", "w-after-f"]
    results = check(
        launch(
            "engine_scenarios:parity",
            4,
            engine="fsdp",
            schedules=schedules,
            batch=8,
            chunks=4,
            reshard=reshard,
            squared=True,
            clip=True,
            timeout=280,
        )
    )
    assert_plain(results, schedules)
    for result in results:
        for diffs in result.values():
            for step in (0, 1):
                # one reduce-scatter per held stage; without resharding, one gather too
                stages = diffs[f"step {step} reduce_scatter"]
                assert stages in (1.0, 2.0), diffs
                if not reshard:
                    assert diffs[f"step {step} all_gather"] == stages, diffs


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("engine", "schedules", "checkpoint"),
    [
        ("ddp", ["zb-h1", "interleaved"], "except_last"),
        ("ddp", ["1f1b"], "never"),
        ("fsdp", ["interleaved"], "always"),
        ("fsdp", ["gpipe", "1f1b"], "never"),
    ],
)
def test_engines_equal_plain_training_in_more_schedules_and_checkpoint_modes(
    engine: str, schedules: list[str], checkpoint: str
) -> None:
    results = check(
        launch(
            "engine_scenarios:parity",
            4,
            engine=engine,
            schedules=schedules,
            checkpoint=checkpoint,
            timeout=280,
        )
    )
    assert_plain(results, schedules)


@pytest.mark.timeout(120)
def test_an_fsdp_checkpoint_resumes_under_every_engine_and_layout_as_plain_training() -> None:
    # saved by pp=2 x dp=2 as DTensor shards (model and AdamW state); loaded into fresh
    # pipes of other weights: the same layout, full tensors under DDP, pp=4 x dp=1, and
    # pp=1 x dp=4 (shards of 2, 2, 2 and 0 rows)
    loads = [["fsdp", 2], ["ddp", 2], ["replicate", 1], ["fsdp", 4]]
    results = check(
        launch("engine_scenarios:resumed", 4, saves=["fsdp"], loads=loads, batch=8, timeout=100)
    )
    for result in results:
        assert len(result) == len(loads), result
        for case, diff in result.items():
            assert diff < EXACT, (case, result)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_ddp_checkpoint_resumes_sharded_under_fsdp_and_on_other_layouts() -> None:
    loads = [["fsdp", 2], ["ddp", 2], ["ddp", 1], ["fsdp", 4]]
    results = check(
        launch("engine_scenarios:resumed", 4, saves=["ddp"], loads=loads, batch=8, timeout=280)
    )
    for result in results:
        assert len(result) == len(loads), result
        for case, diff in result.items():
            assert diff < EXACT, (case, result)


@pytest.mark.timeout(120)
def test_dropout_draws_alike_under_every_engine() -> None:
    # checkpoint="always": each recomputation under FSDP's gathered parameters replays the
    # forward's draws; "replicate" is the reference (plain training draws other streams)
    for result in check(
        launch("engine_scenarios:dropout_alike", 4, engines_run=["ddp", "fsdp"], timeout=100)
    ):
        assert result["held"] == 4, result
        assert result["dropped"] > 1e-3, result  # the dropout did change the gradients
        assert result["ddp"] < EXACT and result["fsdp"] < EXACT, result


REFUSED = {
    "unknown": "ValueError: data_parallel must be one of 'replicate', 'ddp', 'fsdp', got 'zero3'",
    "not_a_string": "TypeError: data_parallel must be one of",
    "reshard_not_a_bool": "TypeError: fsdp_reshard_after_forward must be True or False",
    "ddp_zero": "zero=True with data_parallel='ddp' is not supported",
    "fsdp_zero": "FSDP shards the optimizer state itself",
    "fsdp_generate": "pipe.generate with data_parallel='fsdp'",
    "fsdp_uneven_microbatches": "every replica must run the same number of micro-batches",
}


@pytest.mark.timeout(120)
def test_what_the_engines_do_not_run_yet_is_refused_on_every_rank_naming_the_fix() -> None:
    for result in check(launch("engine_scenarios:refusals", 4, timeout=100)):
        assert list(result) == list(REFUSED)
        for case, expected in REFUSED.items():
            error = result[case]
            assert expected in error, (case, error)
            if case not in ("unknown", "not_a_string", "reshard_not_a_bool"):
                assert "data_parallel='replicate'" in error, (case, error)
