"""Balancing: exact optimal splits, checked against brute force, and the balance_by_* helpers."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gpipe.balance import (
    balance_by_memory,
    balance_by_params,
    balance_by_time,
    balance_costs,
    balance_weighted,
)
from gpipe.balance.profiler import profile
from gpipe.models import SleepLayer


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


def weighted_bottleneck(
    fixed: Sequence[float],
    per_microbatch: Sequence[float],
    kept: Sequence[float],
    balance: Sequence[int],
) -> float:
    pairs = zip(stage_sums(fixed, balance), stage_sums(per_microbatch, balance), kept)
    return max(f + k * a for f, a, k in pairs)


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


@st.composite
def weighted_cases(draw: st.DrawFn) -> tuple[list[float], list[float], list[float]]:
    n = draw(st.integers(1, 8))
    fixed = draw(st.lists(integer_costs, min_size=n, max_size=n))
    per_microbatch = draw(st.lists(integer_costs, min_size=n, max_size=n))
    stages = draw(st.integers(1, n))
    kept = draw(st.lists(st.integers(0, 6).map(float), min_size=stages, max_size=stages))
    return fixed, per_microbatch, kept


@settings(max_examples=300, deadline=None)
@given(weighted_cases())
def test_balance_weighted_is_a_brute_force_optimum_with_the_shortest_last_stage(
    case: tuple[list[float], list[float], list[float]],
) -> None:
    fixed, per_microbatch, kept = case
    balance = balance_weighted(fixed, per_microbatch, kept)
    splits = list(compositions(len(fixed), len(kept)))
    values = {tuple(s): weighted_bottleneck(fixed, per_microbatch, kept, s) for s in splits}
    optimum = min(values.values())

    assert len(balance) == len(kept)
    assert sum(balance) == len(fixed)
    assert min(balance) >= 1
    assert values[tuple(balance)] == optimum
    assert balance[-1] == min(s[-1] for s, v in values.items() if v == optimum)


def test_balance_weighted_with_equal_weights_matches_balance_costs() -> None:
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for stages in range(1, len(costs) + 1):
        zeros = [0.0] * len(costs)
        assert balance_weighted(zeros, costs, [1.0] * stages) == balance_costs(costs, stages)


def test_balance_weighted_gives_fewer_layers_to_stages_that_keep_more_microbatches() -> None:
    # 1F1B with 4 stages: stage 0 keeps 4 micro-batches in flight, stage 3 keeps one.
    balance = balance_weighted([0.0] * 10, [1.0] * 10, [4, 3, 2, 1])
    # stage memory 4·1, 3·2, 2·3, 1·4: the worst is 6, and no split does better
    assert balance == [1, 2, 3, 4]


def test_balance_weighted_handles_a_thousand_layers_quickly() -> None:
    costs = [float((i * 7919) % 13 + 1) for i in range(1000)]
    start = time.perf_counter()
    balance = balance_weighted(costs, costs, [8, 7, 6, 5, 4, 3, 2, 1])
    assert time.perf_counter() - start < 120  # a hang check: usually 1-2 s under load
    assert sum(balance) == 1000 and min(balance) >= 1


def test_balance_weighted_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="one entry per layer"):
        balance_weighted([1.0, 2.0], [1.0], [1])


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 4))


def test_balance_by_params_splits_parameter_counts_evenly() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 10), nn.ReLU())
    # 110, 110, 110 and 1 (parameter-free layers count as one)
    assert balance_by_params(model, 3) == [1, 1, 2]
    assert balance_by_params(model, 2) == [2, 2]


def test_balance_by_memory_counts_kept_microbatches_per_stage() -> None:
    # Four identical parameter-free layers saving the same activation: more micro-batches in
    # flight on a stage means fewer layers there.
    model = nn.Sequential(*[nn.Tanh() for _ in range(6)])
    sample = torch.randn(8, 32)
    assert balance_by_memory(model, sample, 2) == [3, 3]
    assert balance_by_memory(model, sample, 2, kept_microbatches=[2, 1]) == [2, 4]


def test_balance_by_memory_weighs_optimizer_state() -> None:
    # The Linear's weight bytes (4096 floats) dwarf activations; with Adam it triples.
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Tanh(), nn.Tanh())
    sample = torch.randn(2, 64)
    measured = profile(model, sample, repeats=1, warmup=0, optimizer="adam")
    assert measured.optimizer_bytes[0] == 2 * measured.parameter_bytes[0]
    assert balance_by_memory(model, sample, 2, optimizer="adam") == [1, 3]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda m, x: balance_by_time(m, x, 0), ValueError, "at least 1"),
        (lambda m, x: balance_by_time(m, x, 5), ValueError, "at most 4 stages"),
        (lambda m, x: balance_by_memory(m, x, 5), ValueError, "at most 4 stages"),
        (lambda m, x: balance_by_params(m, 5), ValueError, "at most 4 stages"),
        (lambda m, x: balance_by_params(m, 2.0), TypeError, "must be an int"),
        (lambda m, x: balance_by_time(list(m), x, 2), TypeError, r"nn.Sequential\(\*layers\)"),
        (lambda m, x: balance_by_params(nn.Linear(2, 2), 1), TypeError, "nn.Sequential"),
        (lambda m, x: balance_by_time(m, torch.empty(0, 4), 2), ValueError, "non-empty batch"),
        (lambda m, x: balance_by_memory(m, (), 2), ValueError, "non-empty batch"),
        (
            lambda m, x: balance_by_memory(m, x, 2, kept_microbatches=[1]),
            ValueError,
            "one per stage",
        ),
    ],
)
def test_balance_by_functions_reject_bad_arguments_naming_the_fix(
    call, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        call(make_model(), torch.randn(2, 4))


class FakeClock:
    """A clock that moves only when a latency layer sleeps: each layer's time is exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def head_model(head_forward_ms: float, head_backward_ms: float) -> nn.Sequential:
    """An embedding, six blocks of 2 ms forward + 1 ms backward, and a head of the given cost."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh(), SleepLayer(2, 1)) for _ in range(6)]
    head = nn.Sequential(nn.Linear(16, 32), SleepLayer(head_forward_ms, head_backward_ms))
    return nn.Sequential(nn.Embedding(100, 16), *blocks, head)


def test_balance_by_time_gives_a_head_as_costly_as_the_blocks_a_stage_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(time, "sleep", clock.sleep)
    model = head_model(1, 17)  # 18 ms, as much as the six blocks, mostly in backward
    tokens = torch.randint(0, 100, (8, 4))
    measured = profile(model, tokens, repeats=3, warmup=1).costs("time")
    assert measured == pytest.approx([0.0] + [0.003] * 6 + [0.018], abs=1e-12)

    # 18 ms on each stage; an even split by layer count, [4, 4], takes 9 ms and 27 ms, and
    # one by forward time alone (the head's 1 ms looks light) puts three blocks with the head
    assert balance_by_time(model, tokens, 2) == [7, 1]
    # a head as light as a block has company: 12 ms and 9 ms (the shorter last stage of two
    # optimal splits)
    assert balance_by_time(head_model(2, 1), tokens, 2) == [5, 3]
