"""Closed forms of the named schedules' bubbles and memory, to check the simulator against.

Bubbles, of two kinds. :func:`bubble_formula` is the idle fraction of one step alone (what
:attr:`Timeline.bubble` measures and ``train_step`` runs). :func:`paper_bubble` is the idle
time Qi et al. (2024, "Zero Bubble Pipeline Parallelism", table 2) give per schedule, the
time of one step on its busiest device beyond its own work when steps run back to back
(:attr:`Timeline.steady_bubble`): 1F1B ``(p-1)(T_F+T_B+T_W)``, ZB-H1 ``(p-1)(T_F+T_B-T_W)``,
ZB-H2 ``(p-1)(T_F+T_B-2T_W)``. Memory: :func:`memory_formula`, the most a device holds.
"""

from __future__ import annotations

__all__ = ["BUBBLE_FORMULAS", "MEMORY_FORMULAS", "bubble_formula", "memory_formula", "paper_bubble"]


def bubble_formula(name: str, stages: int, microbatches: int, virtual_stages: int) -> float | None:
    """The closed-form bubble fraction of one step with equal costs, where one is known.

    GPipe and 1F1B: ``(K-1)/(M+K-1)`` (GPipe with v stages per device, the looped BFS
    order: as looped BFS below). Interleaved 1F1B: ``(K-1)/(v·M+K-1)`` when K divides M
    (Megatron-LM's groups of K micro-batches). ZB-H1 and ZB-H2 with F = B = W:
    ``(K-1)/(3M+K-1)`` once ``M >= K`` fills the steady state; one step alone cannot be
    shorter, since the last device waits K-1 forwards for its first input. ZB-V with
    F = B = W per stage (each half a device's share): ``(K-1)/(6M+K-1)`` for ``M >= K``,
    that same least possible wait over twice as many actions. Interleaved zero bubble with
    F = B = W: ``(K-1)/(3vM+K-1)`` for ``M >= K``, the same wait again. Looped BFS, as long
    as interleaved 1F1B: ``(K-1)/(vM+K-1)`` for ``M >= K``. V-Half and V-Min with F = B = W
    per stage, for ``M >= K``: ``I/(6M+I)``, where ``I`` is the time a step takes beyond
    the 6M of work, what their generators give (:func:`~gpipe.schedule.v_half`): V-Half
    ``3K-4`` for odd K, ``3K-7`` for even K; V-Min ``4K-5`` when K mod 3 is 1, else
    ``4K-7``; both ``K-1`` for K <= 2. The paper's approximations, against 1F1B's idle
    ``6(K-1)``: V-Half about half of it, V-Min about two thirds. DualPipeV with F = B = W
    per stage and a fused pair costing its parts (``Costs.fused`` = 1), for ``M >= 2K``:
    ``(K-1)/(3M+K-1)``, an idle ``2(K-1)`` over ``6M`` of work (ZB-H1's fraction); less
    as the pairs overlap (its docstring says where it beats ZB-V).

    Args:
        name: the schedule's name.
        stages: K.
        microbatches: M.
        virtual_stages: v (gpipe and the looped schedules; zb-v, v-half, v-min hold 2).

    Returns:
        The bubble fraction, or None where no formula applies.
    """
    k, m, v = stages, microbatches, virtual_stages
    if name == "1f1b" or (name == "gpipe" and v == 1):
        return (k - 1) / (m + k - 1)
    if name == "interleaved" and (v == 1 or m % k == 0):
        return (k - 1) / (v * m + k - 1)
    if name in ("zb-h1", "zb-h2") and m >= k:
        return (k - 1) / (3 * m + k - 1)
    if name == "zb-v" and m >= k:
        return (k - 1) / (6 * m + k - 1)
    if name == "interleaved-zb" and m >= k:
        return (k - 1) / (3 * v * m + k - 1)
    if name in ("gpipe", "looped-bfs") and m >= k:
        return (k - 1) / (v * m + k - 1)
    if name in ("v-half", "v-min") and m >= k:
        idle = _v_idle(name, k)
        return idle / (6 * m + idle)
    if name == "dualpipev" and m >= 2 * k:
        return (k - 1) / (3 * m + k - 1)
    return None


def _v_idle(name: str, k: int) -> int:
    """V-Half's or V-Min's step time beyond its work, F = B = W = 1 per stage, M >= K."""
    if k <= 2:
        return k - 1
    if name == "v-half":
        return 3 * k - 4 if k % 2 else 3 * k - 7
    return 4 * k - 5 if k % 3 == 1 else 4 * k - 7


def _first_round(k: int, m: int) -> int:
    """The looped schedules' first (largest) round: ``M // K`` rounds (at least one) of
    sizes that differ by at most one (:func:`gpipe.schedule.generate.round_sizes`)."""
    return -(-m // max(1, m // k))


def memory_formula(name: str, stages: int, microbatches: int, virtual_stages: int) -> float | None:
    """The most activation any device holds, where a closed form is known.

    In stage-micro-batches: a micro-batch's forward on a stage holds one unit until its
    backward (its W, in a schedule with W actions), as :func:`simulate` counts with
    ``activation_bytes=1``. A device's share of a micro-batch is v units with v stages per
    device, so 1F1B's K micro-batches are ``v·K`` units there. The forms, each the
    generator's exact peak (the tests check every one but DualPipeV's against the simulator):

    * gpipe, looped-bfs: every micro-batch of every stage, ``v·M``;
    * 1f1b, zb-h1: ``min(K, M)``; zb-h2: ``min(2K-1, M)`` (the paper's ``(2p-1)·M_B``);
    * interleaved (v > 1): ``min(2K-1 + (v-1)·G, v·M)``, ``G`` the first (largest) round's
      size, ``ceil(M / max(1, M // K))``: Megatron-LM's warm-up plus one;
    * zb-v: ``min(2K, 2M)``, 1F1B's K micro-batches (the paper's ``p·M_B``);
    * interleaved-zb: ``min(v·M, (v-1)·G + K)``, ``G`` as for interleaved: ``v·K`` when K
      divides M;
    * v-half: ``min(2M, 2·⌊(K+2)/2⌋)``, the paper's ``(p+2)//2`` micro-batches;
    * v-min: ``min(2M, 2·⌊(K+4)/3⌋)``, the paper's ``(p+4)//3`` micro-batches;
    * dualpipev: ``2K+1`` for ``M >= 2K`` (DeepSeek's DualPipeV).

    Args:
        name: the schedule's name.
        stages: K.
        microbatches: M.
        virtual_stages: v (gpipe, interleaved, interleaved-zb, looped-bfs; the V schedules
            always hold 2).

    Returns:
        The peak per device in stage-micro-batches, or None where no form is known.
    """
    k, m, v = stages, microbatches, virtual_stages
    if name in ("gpipe", "looped-bfs"):
        return float(v * m)
    if name in ("1f1b", "zb-h1") or (name == "interleaved" and v == 1):
        return float(min(k, m))
    if name == "zb-h2":
        return float(min(2 * k - 1, m))
    if name == "interleaved":
        return float(min(2 * k - 1 + (v - 1) * _first_round(k, m), v * m))
    if name == "zb-v":
        return float(min(2 * k, 2 * m))
    if name == "interleaved-zb":
        return float(min(v * m, (v - 1) * _first_round(k, m) + k))
    if name == "v-half":
        return float(min(2 * m, 2 * ((k + 2) // 2)))
    if name == "v-min":
        return float(min(2 * m, 2 * ((k + 4) // 3)))
    if name == "dualpipev" and m >= 2 * k:
        return float(2 * k + 1)
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
    "interleaved-zb": "(K-1)/(3vM+K-1) with F=B=W, when M >= K",
    "looped-bfs": "(K-1)/(v*M+K-1), when M >= K",
    "v-half": "I/(6M+I) with F=B=W, I = 3K-4 (odd K) or 3K-7 (even K >= 4); paper ~K/(2M)",
    "v-min": "I/(6M+I) with F=B=W, I = 4K-5 (K mod 3 = 1) or 4K-7; paper ~2K/(3M)",
    "dualpipev": "(K-1)/(3M+K-1) with F=B=W and unfused pairs (Costs.fused=1), when M >= 2K",
}

MEMORY_FORMULAS = {
    "gpipe": "v*M",
    "1f1b": "min(K, M)",
    "interleaved": "min(2K-1 + (v-1)*G, v*M), G = the first round's size",
    "zb-h1": "min(K, M)",
    "zb-h2": "min(2K-1, M)",
    "zb-v": "min(2K, 2M)",
    "interleaved-zb": "min(v*M, (v-1)*G + K), G = the first round's size; v*K when K divides M",
    "looped-bfs": "v*M",
    "v-half": "min(2M, 2*floor((K+2)/2))",
    "v-min": "min(2M, 2*floor((K+4)/3))",
    "dualpipev": "2K+1, when M >= 2K",
}
