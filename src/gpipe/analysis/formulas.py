"""Closed-form bubble fractions of the named schedules, to check the simulator against."""

from __future__ import annotations

__all__ = ["BUBBLE_FORMULAS", "bubble_formula"]


def bubble_formula(name: str, stages: int, microbatches: int, virtual_stages: int) -> float | None:
    """The closed-form bubble fraction with equal costs, where one is known.

    GPipe and 1F1B: ``(K-1)/(M+K-1)``. Interleaved 1F1B: ``(K-1)/(v·M+K-1)`` when K divides M
    (Megatron-LM's groups of K micro-batches). ZB-H1 with F = B = W: ``(K-1)/(3M+K-1)`` once
    ``M >= K`` fills its steady state.

    Args:
        name: the schedule's name.
        stages: K.
        microbatches: M.
        virtual_stages: v (interleaved only).

    Returns:
        The bubble fraction, or None where no formula applies.
    """
    k, m, v = stages, microbatches, virtual_stages
    if name in ("gpipe", "1f1b"):
        return (k - 1) / (m + k - 1)
    if name == "interleaved" and (v == 1 or m % k == 0):
        return (k - 1) / (v * m + k - 1)
    if name == "zb-h1" and m >= k:
        return (k - 1) / (3 * m + k - 1)
    return None


BUBBLE_FORMULAS = {
    "gpipe": "(K-1)/(M+K-1)",
    "1f1b": "(K-1)/(M+K-1)",
    "interleaved": "(K-1)/(v*M+K-1), when K divides M",
    "zb-h1": "(K-1)/(3M+K-1) with F=B=W, when M >= K",
}
