"""Models that are not a chain across processes (gloo on 127.0.0.1): loss, outputs and every
gradient equal plain training; skips go straight to the rank that reads them."""

from __future__ import annotations

import pytest

from ranks import check, launch

pytestmark = pytest.mark.timeout(240)


def assert_parity(results: list[dict], world: int) -> None:
    for key in results[0]:
        for result in results:
            diffs = result[key]
            assert diffs["loss"] < 1e-12, (key, diffs)
            assert diffs["grad"] < 1e-12, (key, diffs)
            assert diffs["checked"] > 0, (key, diffs, "this rank held no parameter")
            assert diffs["foreign"] == 0, (key, diffs, "a rank kept another rank's stage")
        outputs = [r[key]["output"] for r in results]
        assert outputs.count(-1.0) == world - 1 and max(outputs) < 1e-12, (key, outputs)


def test_two_processes_run_a_skip_a_shared_input_and_a_tied_weight_like_plain_training() -> None:
    # interleaved, v=2: stages 0, 2 on rank 0 and 1, 3 on rank 1, so the skip 0 -> 3 and the
    # tied weight (stages 0 and 3) cross ranks, and both ranks read the inputs
    results = check(
        launch(
            "route_scenarios:parity",
            2,
            runs=[("interleaved", 2, "except_last"), ("zb-v", 2, "always")],
            chunks=4,
            size=10,
            tied=True,
        )
    )
    assert_parity(results, 2)
    # the eval step's skip 0 -> 3 (rank 0 -> rank 1) and 1 -> 3 (local) and 0 -> 2 (local):
    # one transfer per micro-batch jumps stages, seen on every rank's gathered timeline
    assert results[0]["interleaved/2/except_last"]["skips"] == 4
    assert results[0]["zb-v/2/always"]["skips"] == 8  # zb-v: 0 -> 2 and 1 -> 3 cross


@pytest.mark.slow
def test_two_processes_every_checkpoint_mode() -> None:
    runs = [
        (schedule, 2, checkpoint)
        for schedule in ["interleaved", "zb-v"]
        for checkpoint in ["always", "except_last", "never"]
    ]
    results = check(launch("route_scenarios:parity", 2, runs=runs, chunks=3, size=7, tied=True))
    assert_parity(results, 2)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_four_processes_every_one_stage_per_rank_schedule(tied: bool) -> None:
    runs = [
        (schedule, 1, checkpoint)
        for schedule in ["gpipe", "1f1b", "zb-h1", "zb-h2"]
        for checkpoint in ["except_last", "never"]
    ]
    results = check(
        launch("route_scenarios:parity", 4, runs=runs, chunks=4, size=9, tied=tied, timeout=180)
    )
    assert_parity(results, 4)
    assert results[0]["gpipe/1/never"]["skips"] == 4 * 3  # 0 -> 2, 0 -> 3, 1 -> 3


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("interleaved", 2)])
def test_two_processes_route_a_skippable_sequentials_skip_like_gpipe_does(
    schedule: str, v: int
) -> None:
    results = check(
        launch("route_scenarios:skippable_sequential", 2, schedule=schedule, virtual_stages=v)
    )
    for result in results:
        assert result["loss"] < 1e-12 and result["grad"] < 1e-12, result
        assert result["held"] > 0, result
    if v == 2:  # stages 0, 2 on rank 0 and 1, 3 on rank 1: the skip 0 -> 3 crosses ranks
        # once forward and once back per micro-batch, not relayed through stages 1 and 2
        assert results[0]["skips"] == 2 * 4
