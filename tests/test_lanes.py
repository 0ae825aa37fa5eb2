"""Lanes: the stages on one GPU run on one thread, in one order, and train exactly as before.

A GPU is not needed to check the order, the grouping or the result: a pipe on CPU devices is
told to run its devices as one lane (or two), as the stages of one GPU would, and must
match plain PyTorch, draw the same dropout masks and start no thread of its own.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

from conftest import custom_schedules, make_mlp, reference_step
from gpipe import GPipe
from gpipe.runtime.stage_set import lanes_of
from gpipe.schedule import Action, Schedule, dependencies, from_csv, in_one_order, make_schedule
from route_models import unet
from test_randomness import TARGET, X, _expected, _model
from test_route import WHOLE, assert_gradients, reference

BUILT_IN = [
    ("gpipe", 4, 1),
    ("1f1b", 4, 1),
    ("interleaved", 4, 2),
    ("zb-h1", 4, 1),
    ("zb-h2", 4, 1),
    ("zb-v", 4, 2),
]


def test_one_order_of_a_small_gpipe_schedule_is_the_grids_step_by_step() -> None:
    """Step   0     1
    0   0F0
    1   0F1   1F0
    2         1F1
    3         1B1
    4   0B1   1B0
    5   0B0
    """
    schedule = make_schedule("gpipe", 2, 2)
    order = [f"{d}:{action}" for d, action in in_one_order(schedule.actions, schedule.stages)]
    assert order == [
        "0:0F0",
        "0:0F1", "1:1F0",
        "1:1F1",
        "1:1B1",
        "0:0B1", "1:1B0",
        "0:0B0",
    ]  # fmt: skip


CUSTOM = [from_csv(csv) for csv in custom_schedules(4, 12, seed=7)]


@pytest.mark.parametrize(
    "schedule",
    [make_schedule(name, k, 8, virtual_stages=v) for name, k, v in BUILT_IN] + CUSTOM,
    ids=[n for n, _, _ in BUILT_IN] + [f"custom{i}" for i in range(len(CUSTOM))],
)
def test_one_order_keeps_each_devices_order_and_puts_every_action_after_what_it_needs(
    schedule: Schedule,
) -> None:
    order = in_one_order(schedule.actions, schedule.stages)
    assert sorted(order) == sorted(
        (d, action) for d, listed in enumerate(schedule.actions) for action in listed
    )
    for d, listed in enumerate(schedule.actions):
        assert [action for device, action in order if device == d] == list(listed)
    place = {action: i for i, (_, action) in enumerate(order)}
    for action, i in place.items():
        for needed in dependencies(action, schedule.stages):
            assert place[needed] < i, f"{action} comes before {needed}, which it needs"


def test_one_order_of_a_backward_only_run_counts_the_forwards_as_done() -> None:
    backward = [[Action("B", 0, 0), Action("B", 0, 1)], [Action("B", 1, 0), Action("B", 1, 1)]]
    order = in_one_order(backward, 2)
    assert [(d, str(a)) for d, a in order] == [(1, "1B0"), (0, "0B0"), (1, "1B1"), (0, "0B1")]


def test_one_order_refuses_lists_that_wait_on_each_other() -> None:
    stuck = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]]
    with pytest.raises(ValueError, match=r"no device can run its next action \(0B0, 1F0\)"):
        in_one_order(stuck, 2)
    backward_first = [[Action("B", 0, 0), Action("F", 0, 0)]]
    with pytest.raises(ValueError, match="0B0"):
        in_one_order(backward_first, 1)


def test_the_stages_of_one_gpu_share_a_lane_and_every_other_device_has_its_own() -> None:
    gpu0, gpu1, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    assert lanes_of([gpu0, gpu0, gpu0, gpu0]) == [[0, 1, 2, 3]]
    assert lanes_of([cpu, cpu, cpu]) == [[0], [1], [2]]
    assert lanes_of([gpu0, gpu0, cpu, gpu1, gpu0, gpu1]) == [[0, 1, 4], [2], [3, 5]]


def _laned(pipe: GPipe, lanes: list[list[int]]) -> GPipe:
    """The pipe with its devices run in ``lanes``, as the stages of one GPU would be."""
    pipe._stages.lanes = lanes
    return pipe


LANES = {"one lane": [[0, 1, 2, 3]], "two lanes": [[0, 2], [1, 3]]}


@pytest.mark.parametrize("lanes", list(LANES))
@pytest.mark.parametrize(("name", "k", "v"), BUILT_IN, ids=[n for n, _, _ in BUILT_IN])
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_devices_run_in_lanes_train_like_plain_pytorch(
    name: str, k: int, v: int, lanes: str, checkpoint: str
) -> None:
    model = make_mlp(8)
    x = torch.randn(10, 6, dtype=torch.float64)
    target = torch.randn(10, 6, dtype=torch.float64)
    _, loss, grads, _ = reference_step(model, x, target, F.mse_loss)
    pipe = GPipe(
        model,
        [16 // (k * v)] * (k * v),
        devices=["cpu"] * k,
        chunks=5,
        schedule=name,
        virtual_stages=v,
        checkpoint=checkpoint,
    )
    _laned(pipe, LANES[lanes])
    assert_close(pipe.train_step(x, target, F.mse_loss), loss)
    assert_close([p.grad for p in model.parameters()], grads)
    if lanes == "one lane":  # NOTE: the caller's thread runs it all
        assert not pipe._stages.threads._threads


def test_a_lane_runs_pipe_x_then_backward_like_plain_pytorch() -> None:
    model = make_mlp(8)
    x = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    target = torch.randn(8, 6, dtype=torch.float64)
    output, _, grads, x_grad = reference_step(model, x, target, F.mse_loss)
    pipe = _laned(GPipe(model, [4, 4, 4, 4], devices=["cpu"] * 4, chunks=4), [[0, 1, 2, 3]])
    given = x.detach().clone().requires_grad_()
    got = pipe(given)
    F.mse_loss(got, target).backward()
    assert_close(got.detach(), output)
    assert_close([p.grad for p in model.parameters()], grads)
    assert_close(given.grad, x_grad)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_lane_draws_the_dropout_masks_of_the_plain_reference(schedule: str) -> None:
    """The workers of a lane hand each other the generators' last state: nothing is redone
    for nothing, and nothing drawn is missed."""
    expected_loss, expected_grads = _expected(4)
    model = _model()
    pipe = _laned(
        GPipe(model, [2, 2, 2, 2], devices=["cpu"] * 4, chunks=4, schedule=schedule),
        [[0, 1, 2, 3]],
    )
    for _ in range(2):  # the first step probes the layers, the second runs them as learned
        torch.manual_seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loss = pipe.train_step(X, TARGET, F.mse_loss)
        assert_close(loss, expected_loss)
        assert_close([p.grad for p in model.parameters()], expected_grads)
        model.zero_grad(set_to_none=True)


def test_a_failing_stage_in_a_lane_ends_the_step_with_its_error() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    model = nn.Sequential(*make_mlp(3), Boom()).double()
    pipe = _laned(GPipe(model, [2, 2, 2, 1], devices=["cpu"] * 4, chunks=2), [[0, 1], [2, 3]])
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"boom[\s\S]*stage 3"):
        pipe.train_step(x, x, F.mse_loss)


def test_a_lane_catches_a_layer_that_starts_drawing_and_redoes_no_other_stage() -> None:
    """Dropouts raised from 0: each stage that draws is caught and replayed; stage 1 (Tanh,
    Linear), which draws nothing, runs each micro-batch once, though stages that drew ran on
    its thread in between."""
    model = _model(p=0.0)
    pipe = _laned(
        GPipe(model, [2, 2, 2, 2], devices=["cpu"] * 4, chunks=4, checkpoint="never"),
        [[0, 1, 2, 3]],
    )
    pipe.train_step(X, TARGET, F.mse_loss)
    for layer in model:
        if isinstance(layer, nn.Dropout):
            layer.p = 0.5
    model[5].p = 0.25
    model.zero_grad(set_to_none=True)
    calls = []
    model[2].register_forward_hook(lambda *_: calls.append(1))
    torch.manual_seed(3)
    loss = pipe.train_step(X, TARGET, F.mse_loss)
    assert_close(loss, _expected(4)[0])
    assert_close([p.grad for p in model.parameters()], _expected(4)[1])
    assert len(calls) == 4


@pytest.mark.parametrize(("schedule", "virtual"), [("gpipe", 1), ("1f1b", 1), ("zb-v", 2)])
def test_a_dataflow_with_skips_trains_like_plain_pytorch_in_one_lane(
    schedule: str, virtual: int
) -> None:
    stages = unet()
    expected, x, mask, target = reference(stages)
    pipe = GPipe(
        stages, chunks=4, schedule=schedule, virtual_stages=virtual, input_batch_dims=WHOLE
    )
    _laned(pipe, [list(range(len(pipe.devices)))])
    loss = pipe.train_step(x, target, F.mse_loss, kwargs={"mask": mask})
    assert_close(loss, expected["loss"])
    assert_gradients(stages, expected, x, mask)


def test_a_lane_runs_inference_like_the_plain_model() -> None:
    model = make_mlp(8, dropout=0.5)
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = _laned(GPipe(model, [6, 6, 6, 6], devices=["cpu"] * 4, chunks=4), [[0, 1, 2, 3]])
    pipe.eval()
    with torch.no_grad():
        assert_close(pipe(x), model(x))


@pytest.mark.parametrize("schedule", CUSTOM[:4], ids=[f"custom{i}" for i in range(4)])
def test_custom_schedules_the_validator_accepts_train_like_plain_pytorch_in_one_lane(
    schedule: Schedule,
) -> None:
    model = make_mlp(8)
    x = torch.randn(8, 6, dtype=torch.float64)
    target = torch.randn(8, 6, dtype=torch.float64)
    _, loss, grads, _ = reference_step(model, x, target, F.mse_loss)
    pipe = GPipe(model, [4] * 4, devices=["cpu"] * 4, chunks=4, schedule=schedule)
    _laned(pipe, [[0, 1, 2, 3]])
    assert_close(pipe.train_step(x, target, F.mse_loss), loss)
    assert_close([p.grad for p in model.parameters()], grads)
