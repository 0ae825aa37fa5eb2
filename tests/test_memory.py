"""The bytes each stage holds for backward follow the schedule's memory model.

The model has K identical stages (Linear(w, w) + Tanh) and every micro-batch has the same
number of samples, so one micro-batch holds the same A bytes on every middle stage: its
stage input (which Linear saves) and its Tanh output. A is measured from a run with M = 1.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from conftest import make_mlp
from gpipe import GPipe
from gpipe.analysis import Costs, Event, Timeline, simulate
from gpipe.schedule import make_schedule

K = 4
WIDTH = 16
SAMPLES = 4  # per micro-batch
INPUT_BYTES = SAMPLES * WIDTH * 8  # one micro-batch's stage input, float64
MIDDLE = range(1, K - 1)  # stages whose input and output are neither the batch nor the target


def stages(count: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(count):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers).double()


def run(
    schedule: str, microbatches: int, checkpoint: str = "never", *, devices: int = K, v: int = 1
) -> Timeline:
    pipe = GPipe(
        stages(devices * v),
        [2] * (devices * v),
        devices=["cpu"] * devices,
        chunks=microbatches,
        checkpoint=checkpoint,
        schedule=schedule,
        virtual_stages=v,
    )
    n = microbatches * SAMPLES
    x = torch.randn(n, WIDTH, dtype=torch.float64)
    pipe.train_step(x, torch.randn(n, WIDTH, dtype=torch.float64), F.mse_loss)
    return pipe.timeline


@functools.cache
def one_microbatch() -> tuple[int, ...]:
    """A per stage: what one micro-batch holds there, from a run with M = 1."""
    return tuple(run("gpipe", 1).peak_memory)


def by_action(events: list[Event]) -> dict[str, int]:
    return {str(e.action): e.memory for e in events}


def test_one_microbatch_holds_its_stage_input_and_tanh_output() -> None:
    held = one_microbatch()
    # Linear saves its input, Tanh its output (parameters are not counted); the last stage
    # also holds the target, which mse_loss saves for its backward.
    assert held == (2 * INPUT_BYTES,) * (K - 1) + (3 * INPUT_BYTES,)
    for schedule in ("1f1b", "zb-h1"):
        assert tuple(run(schedule, 1).peak_memory) == held


@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 8])
def test_1f1b_stage_k_holds_at_most_min_k_minus_stage_microbatches(m: int) -> None:
    a = one_microbatch()
    timeline = run("1f1b", m)
    for k in MIDDLE:
        bound = min(K - k, m) * a[k]
        assert max(e.memory for e in timeline.events[k]) <= bound
        assert timeline.peak_memory[k] == bound


@pytest.mark.parametrize("m", [2, 4, 6])
def test_gpipe_holds_every_microbatch_on_every_stage(m: int) -> None:
    a = one_microbatch()
    timeline = run("gpipe", m)
    for k in MIDDLE:
        assert timeline.peak_memory[k] == m * a[k]
        forwards = [e.memory for e in timeline.events[k] if e.action.kind == "F"]
        assert forwards == [(i + 1) * a[k] for i in range(m)]


@pytest.mark.parametrize("m", [1, 4, 6])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_checkpoint_always_holds_stage_inputs_and_one_recomputation(schedule: str, m: int) -> None:
    """A checkpointed micro-batch keeps only its stage input (I bytes) until its backward.

    The backward re-runs the forward with autograd, so while it runs the device also holds
    that micro-batch's full activations: ``Event.memory`` of a B is the inputs in flight
    plus ``A - I`` (the recomputation's saved tensors, its input counted once).
    """
    a = one_microbatch()
    timeline = run(schedule, m, "always")
    for k in MIDDLE:
        in_flight, expected = 0, []
        for event in timeline.events[k]:
            if event.action.kind == "F":
                in_flight += 1
                expected.append(in_flight * INPUT_BYTES)
            else:
                expected.append(in_flight * INPUT_BYTES + a[k] - INPUT_BYTES)
                in_flight -= 1
        assert [e.memory for e in timeline.events[k]] == expected
        most = m if schedule == "gpipe" else min(K - k, m)
        assert timeline.peak_memory[k] == (most - 1) * INPUT_BYTES + a[k]
        assert timeline.peak_memory[k] <= m * INPUT_BYTES + a[k]


@pytest.mark.parametrize("m", [2, 4, 6])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_simulated_memory_equals_measured(schedule: str, m: int) -> None:
    a = one_microbatch()
    measured = run(schedule, m)
    simulated = simulate(make_schedule(schedule, K, m), Costs(activation_bytes=list(a)))
    for k in MIDDLE:
        assert measured.peak_memory[k] == simulated.peak_memory[k]
        assert by_action(measured.events[k]) == by_action(simulated.events[k])


@pytest.mark.parametrize("m", [2, 3, 4, 6])
def test_interleaved_device_of_two_middle_stages_holds_what_the_simulator_says(m: int) -> None:
    # K = 3 devices, v = 2: device 1 holds stages 1 and 4 of 0..5, both middle stages.
    measured = run("interleaved", m, devices=3, v=2)
    a = one_microbatch()[1]
    schedule = make_schedule("interleaved", 3, m, virtual_stages=2)
    simulated = simulate(schedule, Costs(activation_bytes=a))
    assert measured.peak_memory[1] == simulated.peak_memory[1]
    assert by_action(measured.events[1]) == by_action(simulated.events[1])


def test_first_and_last_stage_count_a_microbatch_by_its_own_bytes() -> None:
    a = one_microbatch()
    m = K
    timeline = run("1f1b", m)
    expected = [min(K - k, m) * a[k] for k in range(K)]
    simulated = simulate(make_schedule("1f1b", K, m), Costs(activation_bytes=list(a)))
    assert simulated.peak_memory == expected
    assert timeline.peak_memory == expected


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_later_steps_reuse_the_count_and_report_the_same_bytes(checkpoint: str) -> None:
    model = make_mlp(4, width=16)
    pipe = GPipe(model, [2, 2, 2, 2], chunks=3, checkpoint=checkpoint, schedule="1f1b")

    def step(rows: int) -> list[list[tuple[object, int]]]:
        x = torch.randn(rows, 16, dtype=torch.float64)
        pipe.train_step(x, torch.randn(rows, 16, dtype=torch.float64), F.mse_loss)
        return [[(e.action, e.memory) for e in device] for device in pipe.timeline.events]

    counted = step(7)  # micro-batches of 3, 2, 2 rows: counted by the hooks
    assert step(7) == counted  # the same shapes: the count is reused, the bytes are the same
    assert min(pipe.timeline.peak_memory) > 0
    first_peak = pipe.timeline.peak_memory[0]
    step(10)  # 4, 3, 3 rows: a new shape is counted afresh, and holds more
    assert pipe.timeline.peak_memory[0] > first_peak
