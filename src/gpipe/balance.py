"""Balancing: the optimal contiguous split of per-layer costs into stages."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balance_costs"]


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
    for i, cost in enumerate(costs):
        if not cost >= 0 or cost == float("inf"):
            raise ValueError(f"costs must be finite and >= 0, got costs[{i}] = {cost!r}")

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
