"""The simulator shows a dataflow's skips as messages of their own, and waits for them."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from gpipe import GPipe, make_schedule, simulate
from gpipe.analysis import Costs
from route_models import batch, unet


def test_a_skip_across_three_stages_is_one_message_each_way_per_microbatch() -> None:
    schedule = make_schedule("1f1b", 4, 6)
    timeline = simulate(schedule, Costs(transfer=0.5), skips=[(0, 3, 64.0)])
    skips = [t for t in timeline.transfers if {t.sender, t.stage} == {0, 3}]
    forward = sorted(t.microbatch for t in skips if t.kind == "F")
    backward = sorted(t.microbatch for t in skips if t.kind == "B")
    assert forward == backward == list(range(6))
    assert all(t.nbytes == 64 and t.end - t.start == 0.5 for t in skips)
    assert all((t.source, t.target) == ((0, 3) if t.kind == "F" else (3, 0)) for t in skips)
    chain = [t for t in timeline.transfers if t not in skips]
    assert len(chain) == 2 * 3 * 6  # the neighbours' messages, as before
    assert all(abs(t.stage - t.sender) == 1 for t in chain)


def test_a_slow_skip_delays_its_reader_and_a_free_one_changes_nothing() -> None:
    schedule = make_schedule("gpipe", 4, 4)
    costs = Costs(bandwidth=1.0)
    plain = simulate(schedule, costs)
    assert simulate(schedule, costs, skips=[(0, 3, 0.0)]).makespan == plain.makespan
    slow = simulate(schedule, costs, skips=[(0, 3, 10.0)])
    assert slow.makespan > plain.makespan
    first = next(e for e in slow.events[3] if e.kind == "F" and e.microbatch == 0)
    assert first.start == 1.0 + 10.0  # stage 0's forward ends at 1, then the skip's 10


def test_a_skip_within_one_device_is_free() -> None:
    schedule = make_schedule("zb-v", 2, 4, virtual_stages=2)  # stages 0 and 3 on device 0
    timeline = simulate(schedule, Costs(transfer=1.0), skips=[(0, 3, 8.0)])
    assert not [t for t in timeline.transfers if t.sender in (0, 3) and t.stage in (0, 3)]
    assert timeline.makespan == simulate(schedule, Costs(transfer=1.0)).makespan


@pytest.mark.parametrize("skip", [(3, 0, 1.0), (0, 4, 1.0), (-1, 2, 1.0)])
def test_a_skip_that_is_not_forward_between_stages_is_refused(skip: tuple) -> None:
    with pytest.raises(ValueError, match="is not a message from an earlier stage"):
        simulate(make_schedule("gpipe", 4, 2), skips=[skip])


def test_the_predicted_timeline_of_a_dataflow_pipe_shows_its_skips() -> None:
    stages = unet(tied=False)
    x, mask, target = batch(8)
    pipe = GPipe(stages, chunks=4, input_batch_dims={"mask": None})
    pipe.train_step(x, target, F.mse_loss, kwargs={"mask": mask})
    predicted = pipe.predicted_timeline(transfer=1e-3)
    pairs = {(t.sender, t.stage) for t in predicted.transfers if t.kind == "F"}
    assert pairs == {(0, 1), (1, 2), (2, 3), (0, 2), (0, 3), (1, 3)}
    skip = next(t for t in predicted.transfers if (t.sender, t.stage) == (0, 3))
    assert skip.nbytes == 2 * 4 * torch.float64.itemsize  # as measured: 2 samples x 4
