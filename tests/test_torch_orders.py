"""Torch's own schedule orders as an oracle: they run here as they are, and ours do no worse.

For every schedule torch.distributed.pipelining has and we share, torch 2.13's per-rank
compute order is built in-process (tests/torch_orders.py) and converted to our
:class:`Schedule`. Our validator and NCCL replay must take it as it is, and our own
generator's schedule must be as short and hold as little, simulated under the same costs.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch as pt
from torch import nn
from torch.nn import functional as F

from gpipe import GPipe
from gpipe.analysis import Costs, Timeline, simulate
from gpipe.schedule import Schedule, dualpipev, make_schedule, validate
from gpipe.schedule.lowering import lower, replay
from torch_orders import TORCH_CLASSES, torch_schedule

COSTS = {
    "1:1:1": Costs(forward=1, backward=1, weight=1),
    "1:2:1": Costs(forward=1, backward=2, weight=1),
    "1:2:0.5": Costs(forward=1, backward=2, weight=0.5),
    "2:3:1": Costs(forward=2, backward=3, weight=1),
    "1:1:0": Costs(forward=1, backward=1, weight=0),
    "1:1:1 fused 0.9": Costs(forward=1, backward=1, weight=1, fused=0.9),
}
# M = K, 2K, 4K, and M = 2.5K, which K does not divide (torch's interleaved schedules
# need M to split into M // K rounds of equal size).
SHAPES = [(k, m) for k in (2, 4, 8) for m in (k, 2 * k, 4 * k)] + [(4, 10), (8, 20)]
# DualPipeV needs M >= 2K, in torch and here (test_dualpipev_needs_2k_microbatches_like_torch)
CASES = [
    (name, k, m)
    for name in TORCH_CLASSES
    for k, m in SHAPES
    if not (name == "dualpipev" and m < 2 * k)
]
TOLERANCE = 1e-9  # relative


def _comparisons() -> list:
    return [
        pytest.param(name, k, m, costs, id=f"{name}-K{k}-M{m}-{costs}")
        for name, k, m in CASES
        for costs in COSTS
    ]


@functools.cache
def theirs(name: str, k: int, m: int) -> Schedule:
    return torch_schedule(name, k, m)


@functools.cache
def ours(name: str, k: int, m: int) -> Schedule:
    return make_schedule(name, k, m, virtual_stages=2)


@functools.cache
def timeline(which: str, name: str, k: int, m: int, costs: str) -> Timeline:
    torch = theirs(name, k, m)  # first: skip where torch refuses, as ours may too
    return simulate(torch if which == "theirs" else ours(name, k, m), COSTS[costs])


@pytest.mark.parametrize(("name", "k", "m"), CASES, ids=[f"{n}-K{k}-M{m}" for n, k, m in CASES])
def test_torchs_order_validates_and_replays_under_nccl_rules_as_it_is(name, k, m):
    schedule = theirs(name, k, m)
    validate(schedule)
    assert replay(lower(schedule)) is None


@pytest.mark.parametrize(("name", "k", "m", "costs"), _comparisons())
def test_our_generator_takes_no_longer_than_torchs_order(name, k, m, costs):
    mine, torch = (timeline(w, name, k, m, costs).makespan for w in ("ours", "theirs"))
    assert mine <= torch * (1 + TOLERANCE), f"ours {mine:g}, torch's {torch:g}"


@pytest.mark.parametrize(("name", "k", "m", "costs"), _comparisons())
def test_our_generator_holds_no_more_than_torchs_order(name, k, m, costs):
    mine, torch = (max(timeline(w, name, k, m, costs).peak_memory) for w in ("ours", "theirs"))
    assert mine <= torch * (1 + TOLERANCE), f"ours {mine:g}, torch's {torch:g}"


@pytest.mark.parametrize(
    ("k", "m"), [(k, m) for k in (1, 2, 4, 8) for m in (2 * k, 2 * k + 1, 4 * k)]
)
def test_dualpipev_is_torchs_order_action_for_action(k, m):
    torch = theirs("dualpipev", k, m)
    mine = dualpipev(k, m)
    assert (mine.actions, mine.placement) == (torch.actions, torch.placement)


def test_dualpipev_needs_2k_microbatches_like_torch():
    with pytest.raises(ValueError, match="at least 2K = 8 micro-batches"):
        dualpipev(4, 7)
    with pytest.raises(ValueError, match="at least as many microbatches as stages"):
        torch_schedule("dualpipev", 4, 7)


# --- DualPipeV against its published figures (DualPipe README, PP = 2K stages) -----------


def _idle(timeline: Timeline) -> float:
    """A step's idle time with steps back to back: the most any device idles between its
    first and its last action (:attr:`Timeline.steady_bubble`'s span less that device's work)."""
    return max(span - busy for span, busy in zip(timeline.spans, timeline.busy))


def _published_bubble(k: int, f: float, b: float, w: float, fused: float = 1.0) -> float:
    """``(K-1)(F&B + B - 3W)``, B the full backward (our B + W), F&B a fused pair."""
    return (k - 1) * (fused * (f + b + w) + (b + w) - 3 * w)


DUALPIPEV_SHAPES = [(k, m) for k in (2, 4, 8) for m in (2 * k, 2 * k + 1, 4 * k)]


@pytest.mark.parametrize(("k", "m"), DUALPIPEV_SHAPES)
def test_dualpipev_holds_the_published_2k_plus_1_stage_microbatches_on_every_device(k, m):
    for costs in COSTS.values():
        assert simulate(dualpipev(k, m), costs).peak_memory == [2 * k + 1] * k


@pytest.mark.parametrize(("k", "m"), DUALPIPEV_SHAPES)
def test_dualpipev_idles_the_published_bubble_when_f_is_b_w_is_0_or_b_and_pairs_do_not_overlap(
    k, m
):
    for f, b, w in [(1, 1, 0), (2, 2, 0), (1, 1, 1)]:
        idle = _idle(simulate(dualpipev(k, m), Costs(forward=f, backward=b, weight=w)))
        assert idle == pytest.approx(_published_bubble(k, f, b, w))


@pytest.mark.parametrize(("k", "m"), DUALPIPEV_SHAPES)
def test_dualpipev_idles_at_most_the_published_bubble_when_f_le_b_and_a_pair_outlasts_a_b(k, m):
    # F <= B (input gradient) and F&B >= the full backward B + W.
    for f, b, w, fused in [(1, 2, 1, 1), (1, 2, 0.5, 0.9), (2, 3, 1, 0.8), (1, 1, 0.5, 0.7)]:
        costs = Costs(forward=f, backward=b, weight=w, fused=fused)
        idle = _idle(simulate(dualpipev(k, m), costs))
        assert idle <= _published_bubble(k, f, b, w, fused) + 1e-9


def test_dualpipev_docstring_figures():
    # The table: K = 4, F = B = W = 1; (time, bubble in %, peak) for dualpipev with
    # fused 1 and 0.9, and for zb-v, our order and torch's.
    table = {
        8: [(54, 11.1, 9), (51, 9.6, 9), (51, 5.9, 8)],
        16: [(102, 5.9, 9), (94.2, 5.2, 9), (99, 3.0, 8)],
    }
    for m, rows in table.items():
        zb_v = make_schedule("zb-v", 4, m, virtual_stages=2)
        timelines = [
            simulate(dualpipev(4, m), COSTS["1:1:1"]),
            simulate(dualpipev(4, m), COSTS["1:1:1 fused 0.9"]),
            simulate(zb_v, COSTS["1:1:1"]),
            simulate(theirs("zb-v", 4, m), COSTS["1:1:1"]),
        ]
        figures = [
            (round(t.makespan, 6), round(100 * t.bubble, 1), max(t.peak_memory)) for t in timelines
        ]
        assert figures == [*rows, rows[-1]]
    shapes = [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16), (8, 32)]
    # One step alone with F = B = W: ZB-V takes 6M + K-1; DualPipeV is shorter once a
    # pair costs at most 0.89 (K = 8, M = 16) to 0.97 (K = 2, M = 8) of its parts.
    for k, m in shapes:
        for fused, beats in [(0.89, True), (0.98, False)]:
            costs = Costs(forward=1, backward=1, weight=1, fused=fused)
            assert (simulate(dualpipev(k, m), costs).makespan < 6 * m + k - 1) is beats
    # Steps back to back, torch's ZB-V idles nowhere: 0.79 (K = 8, M = 16) to 0.94.
    for k, m in shapes:
        assert max(simulate(theirs("zb-v", k, m), COSTS["1:1:1"]).spans) == 6 * m
        for fused, beats in [(0.78, True), (0.95, False)]:
            costs = Costs(forward=1, backward=1, weight=1, fused=fused)
            assert (max(simulate(dualpipev(k, m), costs).spans) < 6 * m) is beats, (k, m)
    # 1:2:1, K = 4, M = 8: unfused DualPipeV 74, ZB-V 70 (ours and torch's), which a
    # pair beats at 0.88 of its parts and not at 0.89.
    assert simulate(dualpipev(4, 8), COSTS["1:2:1"]).makespan == 74
    assert simulate(make_schedule("zb-v", 4, 8, virtual_stages=2), COSTS["1:2:1"]).makespan == 70
    assert simulate(theirs("zb-v", 4, 8), COSTS["1:2:1"]).makespan == 70
    for fused, beats in [(0.88, True), (0.89, False)]:
        costs = Costs(forward=1, backward=2, weight=1, fused=fused)
        assert (simulate(dualpipev(4, 8), costs).makespan < 70) is beats


@pytest.mark.parametrize(("k", "m"), [(2, 3), (2, 8), (4, 7), (4, 8), (8, 16)])
def test_zb_v_is_torchs_order_action_for_action_from_2k_minus_1_microbatches(k, m):
    torch = theirs("zb-v", k, m)
    mine = ours("zb-v", k, m)
    assert (mine.actions, mine.placement) == (torch.actions, torch.placement)


@pytest.mark.parametrize(
    ("name", "k", "m"),
    [
        ("interleaved", 2, 4),
        ("looped-bfs", 2, 4),
        ("interleaved-zb", 2, 4),
        ("zb-v", 4, 8),  # its pairs of devices take messages out of send order
        ("dualpipev", 4, 8),  # and so does this one
    ],
)
def test_torchs_own_order_trains_like_plain_pytorch_in_our_runtime(name, k, m):
    # torch's order, converted and run as it is by the local runtime, every checkpoint
    # mode: loss and every gradient equal plain training's (float64)
    schedule = theirs(name, k, m)
    pt.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(6, 6, dtype=pt.float64) for _ in range(2 * k)])
    x, y = pt.randn(2 * m, 6, dtype=pt.float64), pt.randn(2 * m, 6, dtype=pt.float64)
    expected = F.mse_loss(plain(x), y)
    expected.backward()
    for checkpoint in ("always", "except_last", "never"):
        model = copy.deepcopy(plain)
        model.zero_grad(set_to_none=True)
        pipe = GPipe(
            model,
            [1] * (2 * k),
            devices=["cpu"] * k,
            chunks=m,
            checkpoint=checkpoint,
            schedule=schedule,
            virtual_stages=2,
        )
        loss = pipe.train_step(x, y, F.mse_loss)
        assert (loss - expected).abs() < 1e-12, (name, checkpoint)
        for got, want in zip(model.parameters(), plain.parameters()):
            assert (got.grad - want.grad).abs().max() < 1e-12, (name, checkpoint)


@pytest.mark.parametrize("name", ["interleaved", "looped-bfs", "interleaved-zb"])
@pytest.mark.parametrize(("k", "m"), [(2, 4), (4, 8), (4, 10), (8, 16)])
def test_the_looped_schedules_are_torchs_orders_action_for_action(name, k, m):
    torch = theirs(name, k, m)
    mine = ours(name, k, m)
    assert (mine.actions, mine.placement) == (torch.actions, torch.placement)
