"""Closed-form bubbles of the named schedules, to check the simulator against.

Two kinds. :func:`bubble_formula` is the idle fraction of one step alone (what
:attr:`Timeline.bubble` measures and ``train_step`` runs). :func:`paper_bubble` is the idle
time Qi et al. (2024, "Zero Bubble Pipeline Parallelism", table 2) give per schedule, the
time of one step on its busiest device beyond its own work when steps run back to back
(:attr:`Timeline.steady_bubble`): 1F1B ``(p-1)(T_F+T_B+T_W)``, ZB-H1 ``(p-1)(T_F+T_B-T_W)``,
ZB-H2 ``(p-1)(T_F+T_B-2T_W)``.
"""

from __future__ import annotations

__all__ = ["BUBBLE_FORMULAS", "bubble_formula", "paper_bubble"]


def bubble_formula(name: str, stages: int, microbatches: int, virtual_stages: int) -> float | None:
    """The closed-form bubble fraction of one step with equal costs, where one is known.

    GPipe and 1F1B: ``(K-1)/(M+K-1)``. Interleaved 1F1B: ``(K-1)/(v·M+K-1)`` when K divides M
    (Megatron-LM's groups of K micro-batches). ZB-H1 and ZB-H2 with F = B = W:
    ``(K-1)/(3M+K-1)`` once ``M >= K`` fills the steady state; one step alone cannot be
    shorter, since the last device waits K-1 forwards for its first input. ZB-V with
    F = B = W per stage (each half a device's share): ``(K-1)/(6M+K-1)`` for ``M >= K``,
    that same least possible wait over twice as many actions.

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
    if name in ("zb-h1", "zb-h2") and m >= k:
        return (k - 1) / (3 * m + k - 1)
    if name == "zb-v" and m >= k:
        return (k - 1) / (6 * m + k - 1)
    return None


def paper_bubble(
    name: str, stages: int, microbatches: int, forward: float, backward: float, weight: float
) -> float | None:
    """Qi et al.'s bubble: a step's idle time on its busiest device, steps back to back.

    That is the longest span of one device (first action's start to last action's end)
    minus its work ``M(F+B+W)``, with equal costs on every stage. The paper's formulas, which
    the simulator reproduces exactly where they apply (``W <= min(F, B)``, the paper's
    setting; the zero-bubble ones once M fills their steady state):

    * gpipe, 1f1b: ``(K-1)(F+B+W)`` (B and W run as one backward), any M;
    * zb-h1: ``(K-1)(F+B-W)`` for ``M >= K``;
    * zb-h2: ``(K-1)(F+B-2W)`` for ``M >= 2K-1``; 0 with F = B = W.

    Args:
        name: the schedule's name.
        stages: K.
        microbatches: M.
        forward: F, per stage.
        backward: B, per stage (the input gradient only).
        weight: W, per stage.

    Returns:
        The idle time, in the costs' units, or None where no formula applies.
    """
    k, m, f, b, w = stages, microbatches, forward, backward, weight
    if name in ("gpipe", "1f1b"):
        return (k - 1) * (f + b + w)
    if w > min(f, b):
        return None
    if name == "zb-h1" and m >= k:
        return (k - 1) * (f + b - w)
    if name == "zb-h2" and m >= 2 * k - 1:
        return (k - 1) * (f + b - 2 * w)
    return None


BUBBLE_FORMULAS = {
    "gpipe": "(K-1)/(M+K-1)",
    "1f1b": "(K-1)/(M+K-1)",
    "interleaved": "(K-1)/(v*M+K-1), when K divides M",
    "zb-h1": "(K-1)/(3M+K-1) with F=B=W, when M >= K",
    "zb-h2": "(K-1)/(3M+K-1) with F=B=W, when M >= K (0 with steps back to back, M >= 2K-1)",
    "zb-v": "(K-1)/(6M+K-1) with F=B=W, when M >= K",
}
