"""Balancing: exact optimal splits, checked against brute force."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe.balance import balance_costs


def compositions(n: int, stages: int) -> Iterator[list[int]]:
    """Every way to cut ``n`` layers into ``stages`` non-empty contiguous stages."""
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        yield [bounds[i + 1] - bounds[i] for i in range(stages)]


def stage_sums(values: Sequence[float], balance: Sequence[int]) -> list[float]:
    sums, start = [], 0
    for size in balance:
        sums.append(sum(values[start : start + size]))
        start += size
    return sums


def bottleneck(costs: Sequence[float], balance: Sequence[int]) -> float:
    return max(stage_sums(costs, balance))


@st.composite
def costs_and_stages(draw: st.DrawFn, elements: st.SearchStrategy) -> tuple[list, int]:
    costs = draw(st.lists(elements, min_size=1, max_size=9))
    return costs, draw(st.integers(1, len(costs)))


# Integers: sums are exact in float64, so "optimal" and "tie" mean exactly that.
integer_costs = st.integers(0, 20).map(float)


@settings(max_examples=300, deadline=None)
@given(costs_and_stages(integer_costs))
def test_balance_costs_is_a_brute_force_optimum_with_the_shortest_last_stage(
    case: tuple[list[float], int],
) -> None:
    costs, stages = case
    balance = balance_costs(costs, stages)
    splits = list(compositions(len(costs), stages))
    optimum = min(bottleneck(costs, split) for split in splits)

    assert len(balance) == stages
    assert sum(balance) == len(costs)
    assert min(balance) >= 1
    assert bottleneck(costs, balance) == optimum
    optimal = [split for split in splits if bottleneck(costs, split) == optimum]
    assert balance[-1] == min(split[-1] for split in optimal)


@settings(max_examples=300, deadline=None)
@given(costs_and_stages(st.sampled_from([0.1, 0.2, 0.3, 0.7, 1e-3, 2.5])))
def test_balance_costs_is_optimal_for_decimal_costs_that_do_not_add_exactly(
    case: tuple[list[float], int],
) -> None:
    costs, stages = case
    balance = balance_costs(costs, stages)
    optimum = min(bottleneck(costs, split) for split in compositions(len(costs), stages))
    assert bottleneck(costs, balance) == pytest.approx(optimum, rel=1e-12)


def test_balance_costs_finds_the_optimum_when_running_sums_round_up() -> None:
    # 0.2 + 0.2 rounds differently from the prefix difference 0.9 - 0.5: a feasibility check
    # that re-added costs judged the 0.4 split impossible and settled for 0.5.
    assert balance_costs([0.2, 0.3, 0.2, 0.2], 3) == [1, 1, 2]


def test_balance_costs_prefers_the_shorter_last_stage_on_ties() -> None:
    assert balance_costs([1.0, 1.0, 1.0], 2) == [2, 1]
    assert balance_costs([0.0, 0.0, 0.0, 0.0], 2) == [3, 1]


@pytest.mark.parametrize(("costs", "stages"), [([], 1), ([1.0], 2), ([1.0, 2.0], 0)])
def test_balance_costs_rejects_an_impossible_stage_count(costs: list[float], stages: int) -> None:
    with pytest.raises(ValueError, match="non-empty stages"):
        balance_costs(costs, stages)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_balance_costs_rejects_negative_or_non_finite_costs(bad: float) -> None:
    with pytest.raises(ValueError, match=r"costs\[1\]"):
        balance_costs([1.0, bad], 1)
