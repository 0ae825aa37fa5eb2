"""The bytes each device holds follow the memory model (gpipe.analysis.memory), action by action.

The model has K identical stages (Linear(w, w) + Tanh) and every micro-batch has the same
number of samples, so one micro-batch keeps the same bytes on every middle stage: its stage
input (which Linear saves) and its Tanh output; a backward also holds the gradients it
receives and sends, each the size of a stage input. The sizes are worked out by hand below.
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
from gpipe.analysis.memory import memory_per_action
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


# What one micro-batch costs each stage, worked out by hand. Linear saves its input and
# Tanh its output (parameters are not counted); the last stage also holds the target, which
# mse_loss saves. The input of stage 0 takes no gradient; every other stage sends one back.
FULL = (2 * INPUT_BYTES,) * (K - 1) + (3 * INPUT_BYTES,)
KEPT = (INPUT_BYTES,) * K  # a checkpointed micro-batch keeps only its stage input
GRADIENT = (0,) + (INPUT_BYTES,) * (K - 1)
# A zero-bubble B keeps for W the gradient at each Linear's fork (its output's gradient);
# stage 0, which sends no input gradient, keeps the output gradient it received instead.
DEFERRED = (INPUT_BYTES,) * K


@functools.cache
def one_microbatch() -> tuple[int, ...]:
    """A per stage: what one micro-batch keeps there, the memory of its F in a run with M = 1."""
    timeline = run("gpipe", 1)
    return tuple(e.memory for device in timeline.events for e in device if e.kind == "F")


def by_action(events: list[Event]) -> dict[str, int]:
    return {str(e.action): e.memory for e in events}


def modelled(schedule: str, m: int, checkpoint: str, v: int = 1) -> list[list[float]]:
    """What the memory model says each action holds, from the hand-worked sizes."""
    devices = K if v == 1 else 3
    stages = devices * v
    full = [FULL[min(s, 1) if s < stages - 1 else -1] for s in range(stages)]
    gradient = [GRADIENT[min(s, 1)] for s in range(stages)]
    return memory_per_action(
        make_schedule(schedule, devices, m, virtual_stages=v),
        full,
        [INPUT_BYTES] * stages,
        checkpoint,
        gradient=gradient,
        deferred=[INPUT_BYTES] * stages,
    )


def test_one_microbatch_holds_its_stage_input_and_what_autograd_saves() -> None:
    assert one_microbatch() == FULL
    for schedule in ("1f1b", "zb-h1"):
        timeline = run(schedule, 1)
        assert [e.memory for device in timeline.events for e in device if e.kind == "F"] == [*FULL]


def test_a_backward_also_holds_the_gradients_it_receives_and_sends() -> None:
    backwards = [e.memory for device in run("gpipe", 1).events for e in device if e.kind == "B"]
    received = (*GRADIENT[1:], 0)  # the last stage starts from the loss
    assert backwards == [f + r + g for f, r, g in zip(FULL, received, GRADIENT)]


@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 8])
def test_1f1b_stage_k_holds_at_most_min_k_minus_stage_microbatches(m: int) -> None:
    timeline = run("1f1b", m)
    for k in MIDDLE:
        bound = min(K - k, m) * FULL[k]
        forwards = [e.memory for e in timeline.events[k] if e.kind == "F"]
        assert max(forwards) == bound
        # a backward adds the two gradients it passes on to what the forwards keep
        assert timeline.peak_memory[k] == bound + 2 * INPUT_BYTES


@pytest.mark.parametrize("m", [2, 4, 6])
def test_gpipe_holds_every_microbatch_on_every_stage(m: int) -> None:
    timeline = run("gpipe", m)
    for k in MIDDLE:
        forwards = [e.memory for e in timeline.events[k] if e.kind == "F"]
        assert forwards == [(i + 1) * FULL[k] for i in range(m)]
        assert timeline.peak_memory[k] == m * FULL[k] + 2 * INPUT_BYTES


@pytest.mark.parametrize("m", [1, 4, 6])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_checkpoint_always_holds_stage_inputs_and_one_recomputation(schedule: str, m: int) -> None:
    """A checkpointed micro-batch keeps only its stage input (I bytes) until its backward.

    The backward re-runs the forward with autograd, so while it runs the device also holds
    that micro-batch's full activations: ``Event.memory`` of a B is the inputs in flight
    plus ``A - I`` (the recomputation's saved tensors, its input counted once), plus the
    gradients it receives and sends.
    """
    timeline = run(schedule, m, "always")
    for k in MIDDLE:
        in_flight, expected = 0, []
        for event in timeline.events[k]:
            if event.action.kind == "F":
                in_flight += 1
                expected.append(in_flight * INPUT_BYTES)
            else:
                expected.append(in_flight * INPUT_BYTES + FULL[k] - INPUT_BYTES + 2 * INPUT_BYTES)
                in_flight -= 1
        assert [e.memory for e in timeline.events[k]] == expected
        most = m if schedule == "gpipe" else min(K - k, m)
        assert timeline.peak_memory[k] == (most - 1) * INPUT_BYTES + FULL[k] + 2 * INPUT_BYTES


@pytest.mark.parametrize("m", [2, 4, 6])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_simulated_memory_equals_measured(schedule: str, m: int) -> None:
    measured = run(schedule, m)
    costs = Costs(
        activation_bytes=list(FULL), gradient_bytes=list(GRADIENT), deferred_bytes=list(DEFERRED)
    )
    simulated = simulate(make_schedule(schedule, K, m), costs)
    assert measured.peak_memory == simulated.peak_memory
    for k in range(K):
        assert by_action(measured.events[k]) == by_action(simulated.events[k])


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_the_memory_model_equals_the_count_action_by_action(schedule: str, checkpoint: str) -> None:
    measured = run(schedule, 4, checkpoint)
    model = modelled(schedule, 4, checkpoint)
    assert [[e.memory for e in device] for device in measured.events] == model


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_zero_bubble_holds_what_w_needs_until_w(checkpoint: str) -> None:
    """Between B and W a zero-bubble stage keeps its fork gradients, and, if recomputed,
    the recomputed activations (the graph W resumes): counted until W frees them."""
    timeline = run("zb-h1", 1, checkpoint)
    for k in MIDDLE:
        held = {e.kind: e.memory for e in timeline.events[k]}
        assert held["W"] == FULL[k] + DEFERRED[k]


@pytest.mark.parametrize("m", [2, 3, 4, 6])
def test_interleaved_device_of_two_middle_stages_holds_what_the_simulator_says(m: int) -> None:
    # K = 3 devices, v = 2: device 1 holds stages 1 and 4 of 0..5, both middle stages.
    measured = run("interleaved", m, devices=3, v=2)
    schedule = make_schedule("interleaved", 3, m, virtual_stages=2)
    simulated = simulate(schedule, Costs(activation_bytes=FULL[1], gradient_bytes=INPUT_BYTES))
    assert measured.peak_memory[1] == simulated.peak_memory[1]
    assert by_action(measured.events[1]) == by_action(simulated.events[1])
    assert [e.memory for e in measured.events[1]] == modelled("interleaved", m, "never", v=2)[1]


def test_first_and_last_stage_count_a_microbatch_by_its_own_bytes() -> None:
    m = K
    timeline = run("1f1b", m)
    forwards = [max(e.memory for e in device if e.kind == "F") for device in timeline.events]
    assert forwards == [min(K - k, m) * FULL[k] for k in range(K)]


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
