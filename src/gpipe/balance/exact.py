"""The exact balancers: the best contiguous split of per-layer costs into stages.

Pure arithmetic on lists of numbers, no PyTorch: the measured balancers of
:mod:`gpipe.balance.measured` and the planner feed them profiled costs.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balance_costs", "balance_weighted"]


def _fits(prefix: Sequence[float], stages: int, limit: float) -> bool:
    """Whether the layers split into ``stages`` non-empty parts each costing at most ``limit``.

    ``prefix`` holds the running sums of the per-layer costs, ``prefix[0] == 0``.
    """
    # NOTE: part costs are prefix differences, the very numbers the limit is chosen from; a
    # running sum rounds differently, and then the optimal limit could be judged unreachable.
    parts, start = 1, 0
    for end in range(1, len(prefix)):
        if prefix[end] - prefix[end - 1] > limit:
            return False
        if prefix[end] - prefix[start] > limit:
            parts, start = parts + 1, end - 1
    # NOTE: with non-negative costs a part can always be split further without raising the
    # maximum, so any count from the greedy minimum up to len(costs) is reachable.
    return parts <= stages <= len(prefix) - 1


def balance_costs(costs: Sequence[float], stages: int) -> list[int]:
    """Layers per stage: the contiguous split that minimizes the costliest stage.

    Exact, not a heuristic: the bottleneck is the smallest sum of a contiguous run of layers
    for which a split exists, found by binary search over those sums. Among optimal splits,
    the one with the fewest layers on the last stage (it also computes the loss). No stage is
    ever empty.

    Args:
        costs: a non-negative cost per layer (time, bytes, parameter count...).
        stages: how many stages to cut into, 1 <= stages <= len(costs).

    Returns:
        The balance: layers per stage, summing to ``len(costs)``.

    Raises:
        ValueError: ``stages`` out of range, or a negative or non-finite cost.
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} non-empty stages")
    _check_costs("costs", costs)

    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(prefix, stages, candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    limit = candidates[lo]

    # Fill each stage as far as the limit allows while leaving one layer for every stage after
    # it: the suffix left to the last stage is then as short (and cheap) as it can be.
    balance: list[int] = []
    start = 0
    for stage in range(stages - 1):
        remaining_stages = stages - stage - 1
        end = start + 1
        while end < n - remaining_stages and prefix[end + 1] - prefix[start] <= limit:
            end += 1
        balance.append(end - start)
        start = end
    balance.append(n - start)
    return balance


def balance_weighted(
    fixed: Sequence[float], per_microbatch: Sequence[float], kept: Sequence[float]
) -> list[int]:
    """Layers per stage minimizing the costliest stage when stages weigh activations unequally.

    Stage ``k`` holding layers ``i..j-1`` costs ``sum(fixed[i:j]) + kept[k] *
    sum(per_microbatch[i:j])``: for memory, parameters and optimizer state once, activations
    once per micro-batch the schedule keeps in flight there (``[M] * K`` for GPipe without
    re-materialization, ``[min(K - k, M) for k in range(K)]`` for 1F1B). Since the weight
    depends on the stage, the split is found by an exact dynamic program over contiguous
    splits, O(K·n²) at worst. Among optimal splits, the one with the fewest layers on the
    last stage; no stage is ever empty.

    Args:
        fixed: a non-negative per-layer cost paid once (parameter, gradient, optimizer bytes).
        per_microbatch: a non-negative per-layer cost paid per kept micro-batch.
        kept: one non-negative weight per stage; its length is the number of stages.

    Returns:
        The balance: layers per stage, summing to ``len(fixed)``.

    Raises:
        ValueError: lengths that differ, a stage count out of range, or a negative or
            non-finite cost or weight.
    """
    n, stages = len(fixed), len(kept)
    if len(per_microbatch) != n:
        raise ValueError(
            f"fixed and per_microbatch need one entry per layer, got {n} and {len(per_microbatch)}"
        )
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} non-empty stages")
    _check_costs("fixed", fixed)
    _check_costs("per_microbatch", per_microbatch)
    _check_costs("kept", kept)

    fixed_sum, micro_sum = [0.0], [0.0]
    for a, b in zip(fixed, per_microbatch):
        fixed_sum.append(fixed_sum[-1] + a)
        micro_sum.append(micro_sum[-1] + b)

    def cost(stage: int, start: int, end: int) -> float:
        # NOTE: the search and the reconstruction must compute a stage's cost the very same
        # way, or float round-off could make the optimum look unreachable.
        weight = kept[stage]
        return (fixed_sum[end] - fixed_sum[start]) + weight * (micro_sum[end] - micro_sum[start])

    inf = float("inf")
    # best[k][j]: the smallest possible costliest stage when stages 0..k-1 hold layers 0..j-1.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for stage in range(stages):
        before, after = best[stage], best[stage + 1]
        for end in range(stage + 1, n - (stages - stage - 1) + 1):
            value = inf
            # Walking the start back only grows this stage, so stop once it alone costs more.
            for start in range(end - 1, stage - 1, -1):
                here = cost(stage, start, end)
                if here >= value:
                    break
                value = min(value, max(before[start], here))
            after[end] = value

    optimum = best[stages][n]
    balance: list[int] = []
    end = n
    for stage in range(stages - 1, -1, -1):
        # The latest start that still allows the optimum keeps later stages short.
        start = end - 1
        while not (best[stage][start] <= optimum and cost(stage, start, end) <= optimum):
            start -= 1
        balance.append(end - start)
        end = start
    return balance[::-1]


def _check_costs(name: str, costs: Sequence[float]) -> None:
    for i, cost in enumerate(costs):
        if not cost >= 0 or cost == float("inf"):
            raise ValueError(f"{name} must be finite and >= 0, got {name}[{i}] = {cost!r}")
