"""A save, a load or a mismatched call fails like a step: every rank ends within the pipe's
timeout + 10 s with a Python error naming the rank and what it was doing (issue 39)."""

from __future__ import annotations

import pytest

from ranks import check, launch

pytestmark = pytest.mark.timeout(240)

TIMEOUT = 10.0  # the pipe's timeout in call_scenarios


def _ended_by_python(outcomes: list) -> None:  # type: ignore[type-arg]
    for o in outcomes:
        # NOTE: a negative return code is a signal (gloo's abort is SIGABRT): none may die so
        assert o.returncode is not None and o.returncode >= 0, (o.rank, o.returncode, o.stderr)


@pytest.mark.parametrize(
    ("world", "odd", "odd_call", "call"),
    [
        (2, 1, "eval_step", "train_step"),
        pytest.param(4, 0, "eval_step", "train_step", marks=pytest.mark.slow),
        pytest.param(4, 2, "save", "train_step", marks=pytest.mark.slow),
        pytest.param(2, 1, "clip_grad_norm_", "train_step", marks=pytest.mark.slow),
    ],
)
def test_ranks_making_different_calls_end_with_an_error_naming_each_call(
    world: int, odd: int, odd_call: str, call: str
) -> None:
    outcomes = launch(
        "call_scenarios:mismatched_calls", world, timeout=90, odd=odd, odd_call=odd_call, call=call
    )
    _ended_by_python(outcomes)
    assert all(o.returncode == 1 for o in outcomes), [(o.rank, o.stderr[-500:]) for o in outcomes]
    for o in outcomes:
        assert "PipelineFailure" in o.error, o.error
        assert f"{odd_call}()" in o.error and f"{call}()" in o.error, o.error


# (victim, how, where, phase named): one of each point of a save and a load.
POINTS = [
    (1, "raise", "save_before", "saving"),
    (1, "kill", "save_before", None),
    (1, "stop", "save_before", None),
    (1, "raise", "save_writing", "saving"),
    (1, "kill", "save_writing", None),
    (1, "stop", "save_writing", None),
    (1, "hang", "save_writing", None),
    (0, "raise", "commit", "committing"),
    (0, "stop", "commit", None),
    (1, "raise", "load_before", "loading"),
    (1, "kill", "load_reading", None),
    (1, "stop", "load_reading", None),
]


@pytest.mark.parametrize(
    ("victim", "how", "where", "phase"),
    [
        # NOTE: one point in make test (a raise: no timeout to wait out); all in the slow tier
        pytest.param(
            *point, marks=() if point[:3] == (1, "raise", "save_writing") else pytest.mark.slow
        )
        for point in POINTS
    ],
)
def test_a_rank_failing_in_a_save_or_a_load_ends_every_rank_naming_it(
    victim: int, how: str, where: str, phase: str | None
) -> None:
    hangs = (victim,) if how in ("stop", "hang") else ()
    outcomes = launch(
        "call_scenarios:checkpoint_fault",
        3,
        timeout=120,
        may_hang=hangs,
        victim=victim,
        how=how,
        where=where,
    )
    survivors = [o for o in outcomes if o.rank != victim]
    for o in survivors:
        assert o.returncode == 0, (o.rank, o.error or o.stderr[-2000:])
        told = o.result
        assert told["type"] in ("PipelineFailure", "OSError"), (o.rank, told)
        assert f"rank {victim}" in told["error"], (o.rank, told)
        if phase is not None:
            assert phase in told["error"], (o.rank, told)
        # within the pipe's timeout + 10 s of the call
        assert told["seconds"] < TIMEOUT + 10, (o.rank, told)


def test_nothing_to_load_is_the_same_error_everywhere_and_the_pipe_goes_on() -> None:
    results = check(launch("call_scenarios:save_then_load_alike", 2, timeout=90))
    for r in results:
        assert "no complete checkpoint" in r["missing"]
        assert r["step"] == 7 and r["consolidated"]
    assert results[0]["loss"] == results[1]["loss"]
