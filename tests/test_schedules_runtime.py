"""Every schedule, run by the runtime, trains exactly like plain PyTorch on the whole batch.

Parity (loss and every gradient) for each schedule × checkpoint mode × (K, M, batch); with
dropout, each schedule equals GPipe's fill-drain; each action runs once (forwards counted);
runs are reproducible bit for bit; a failing stage ends the step without a hang.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

from conftest import make_mlp, reference_step
from gpipe import GPipe
from gpipe.analysis import Costs, search
from gpipe.schedule import v_shape

LAYERS = 8  # make_mlp blocks; without dropout the model has 2 * LAYERS modules

# (schedule, virtual stages): interleaved at v = 2 and v = 3 (K·v <= 12 model stages here);
# zb-v, v-half, v-min and auto with two stages per device lay them out in a V,
# interleaved-zb and looped-bfs round-robin.
SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved", 2),
    ("interleaved", 3),
    ("zb-h1", 1),
    ("zb-h2", 1),
    ("zb-v", 2),
    ("auto", 1),
    ("auto", 2),
    ("interleaved-zb", 2),
    ("looped-bfs", 2),
    ("v-half", 2),
    ("v-min", 2),
    ("dualpipev", 2),
]
SCHEDULE_IDS = [name if v == 1 else f"{name}-v{v}" for name, v in SCHEDULES]
# schedules with separate W actions
SPLIT = ("zb-h1", "zb-h2", "zb-v", "auto", "interleaved-zb", "v-half", "v-min", "dualpipev")
CHECKPOINTS = ["always", "except_last", "never"]

# (K devices, M micro-batches, batch size): one micro-batch; M < K; M not a multiple of K with
# an uneven split (11 = 3+2+2+2+2); M = 2K with an uneven split (10 = 2+2+1+1+...).
CASES = [(2, 1, 3), (4, 2, 6), (3, 5, 11), (4, 8, 10)]
CASE_IDS = [f"K{k}-M{m}-N{n}" for k, m, n in CASES]


def fitted(schedule: str, k: int, m: int, n: int) -> tuple[int, int]:
    """(micro-batches, batch) of a case for ``schedule``: dualpipev needs M >= 2K, so its
    cases run 2K micro-batches (and a batch at least as large) where they have fewer."""
    if schedule == "dualpipev" and m < 2 * k:
        m = 2 * k
    return m, max(n, m)


def uneven_balance(modules: int, stages: int) -> list[int]:
    """``modules`` layers over ``stages`` stages, deliberately not all the same size."""
    sizes = [modules // stages] * stages
    for i in range(modules % stages):
        sizes[-1 - i] += 1
    if stages > 1 and sizes[0] > 1:
        sizes[0] -= 1
        sizes[1] += 1
    return sizes


def make_pipe(
    model: nn.Sequential, schedule: str, v: int, devices: int, chunks: int, checkpoint: str
) -> GPipe:
    return GPipe(
        model,
        uneven_balance(len(model), devices * v),
        devices=["cpu"] * devices,
        chunks=chunks,
        checkpoint=checkpoint,
        schedule=schedule,
        virtual_stages=v,
    )


def batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, dtype=torch.float64, generator=generator)
    return x, torch.randn(n, 6, dtype=torch.float64, generator=generator)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


# -- parity with plain training ----------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize(("schedule", "v"), SCHEDULES, ids=SCHEDULE_IDS)
def test_every_schedule_equals_plain_training(
    schedule: str, v: int, checkpoint: str, case: tuple[int, int, int]
) -> None:
    k, m, n = case
    m, n = fitted(schedule, k, m, n)
    x, target = batch(n)
    _, expected_loss, expected_grads, _ = reference_step(make_mlp(LAYERS), x, target, F.mse_loss)

    model = make_mlp(LAYERS)
    pipe = make_pipe(model, schedule, v, k, m, checkpoint)
    loss = pipe.train_step(x, target, F.mse_loss)

    assert_close(loss, expected_loss)
    for param, expected in zip(model.parameters(), expected_grads):
        assert_close(param.grad, expected)
    # the step ran the schedule it was asked for: every F (and B, W) of every micro-batch once
    kinds = "BFW" if schedule in SPLIT else "BF"
    for device in pipe.timeline.events:
        ran = [unit for e in device for unit in e.action.units]  # a fused action's parts
        stages = {unit.stage for unit in ran}
        assert len(stages) == v
        assert sorted((unit.stage, unit.kind, unit.microbatch) for unit in ran) == [
            (s, kind, i) for s in sorted(stages) for kind in kinds for i in range(m)
        ]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize(("k", "m", "n"), [(2, 3, 7), (3, 2, 5), (4, 8, 8)], ids=str)
def test_zb_v_pipe_holds_stages_in_a_v_for_train_step_and_pipe_call(
    k: int, m: int, n: int, checkpoint: str
) -> None:
    x, target = batch(n)
    expected_out, expected_loss, expected_grads, _ = reference_step(
        make_mlp(LAYERS), x, target, F.mse_loss
    )
    model = make_mlp(LAYERS)
    pipe = make_pipe(model, "zb-v", 2, k, m, checkpoint)
    held = [{s for s, d in enumerate(v_shape(k)) if d == device} for device in range(k)]

    loss = pipe.train_step(x, target, F.mse_loss)
    assert_close(loss, expected_loss)
    for param, expected in zip(model.parameters(), expected_grads):
        assert_close(param.grad, expected)
    assert [{e.action.stage for e in d} for d in pipe.timeline.events] == held

    # pipe(x) runs GPipe's fill-drain over the same V placement.
    model.zero_grad(set_to_none=True)
    output = pipe(x)
    F.mse_loss(output, target).backward()
    assert_close(output, expected_out)
    for param, expected in zip(model.parameters(), expected_grads):
        assert_close(param.grad, expected)
    assert [{e.action.stage for e in d} for d in pipe.timeline.events] == held


def test_pipe_runs_a_schedule_object_searched_with_given_costs() -> None:
    x, target = batch(9)
    _, expected_loss, expected_grads, _ = reference_step(make_mlp(LAYERS), x, target, F.mse_loss)
    schedule = search(3, 5, costs=Costs(forward=1, backward=2, weight=1), memory_limit=4)
    model = make_mlp(LAYERS)
    pipe = GPipe(model, [6, 5, 5], devices=["cpu"] * 3, chunks=5, schedule=schedule)
    loss = pipe.train_step(x, target, F.mse_loss)
    assert_close(loss, expected_loss)
    for param, expected in zip(model.parameters(), expected_grads):
        assert_close(param.grad, expected)
    assert pipe.timeline.schedule == "auto"


def test_pipe_rejects_a_schedule_object_for_another_size() -> None:
    schedule = search(3, 5)
    with pytest.raises(ValueError, match=r"3 devices x 3 stages, but the pipe has 2 devices"):
        GPipe(make_mlp(LAYERS), [8, 8], devices=["cpu"] * 2, chunks=5, schedule=schedule)
    with pytest.raises(ValueError, match="virtual_stages=2"):
        GPipe(make_mlp(LAYERS), [8, 8], devices=["cpu"] * 2, chunks=5, schedule="zb-v")
    pipe = GPipe(make_mlp(LAYERS), [6, 5, 5], devices=["cpu"] * 3, chunks=5, schedule=schedule)
    x, target = batch(3)  # 3 samples split into 3 micro-batches, not 5
    with pytest.raises(ValueError, match=r"built for 5 micro-batches, but this batch splits"):
        pipe.train_step(x, target, F.mse_loss)


def test_sgd_steps_follow_plain_training_under_every_schedule() -> None:
    data = [batch(7, seed) for seed in range(4)]
    plain = make_mlp(LAYERS)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    expected = []
    for x, target in data:
        opt_plain.zero_grad()
        loss = F.mse_loss(plain(x), target)
        loss.backward()
        opt_plain.step()
        expected.append(loss.detach())
    for schedule, v in SCHEDULES:
        model = make_mlp(LAYERS)
        pipe = make_pipe(model, schedule, v, 2, fitted(schedule, 2, 3, 7)[0], "except_last")
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for x, target in data:
            opt.zero_grad()
            losses.append(pipe.train_step(x, target, F.mse_loss))
            opt.step()
        assert_close(torch.stack(losses), torch.stack(expected), msg=schedule)
        for got, want in zip(model.parameters(), plain.parameters()):
            assert_close(got, want, msg=schedule)


# -- dropout: every schedule draws the masks GPipe draws ---------------------------------


def dropout_step(
    schedule: str, v: int, devices: int, chunks: int, checkpoint: str, n: int, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = make_mlp(LAYERS, dropout=0.3)
    pipe = make_pipe(model, schedule, v, devices, chunks, checkpoint)
    x, target = batch(n)
    torch.manual_seed(seed)
    loss = pipe.train_step(x, target, F.mse_loss)
    return loss, grads(model)


@pytest.mark.parametrize(("k", "m", "n"), [(3, 5, 11), (4, 2, 6)], ids=["K3-M5", "K4-M2"])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize(("schedule", "v"), SCHEDULES, ids=SCHEDULE_IDS)
def test_dropout_gradients_equal_gpipe_with_the_same_seed(
    schedule: str, v: int, checkpoint: str, k: int, m: int, n: int
) -> None:
    # GPipe over the same layers, one stage per device: masks follow (layer, micro-batch), so
    # only the order in which gradients accumulate may differ.
    m, n = fitted(schedule, k, m, n)
    expected_loss, expected = dropout_step("gpipe", 1, k * v, m, "never", n, seed=7)
    loss, got = dropout_step(schedule, v, k, m, checkpoint, n, seed=7)
    assert_close(loss, expected_loss)
    for a, b in zip(got, expected):
        assert_close(a, b)


def test_dropout_is_on_and_depends_on_the_seed() -> None:
    """Guards the test above: dropout masks differ between seeds and from no dropout."""
    _, first = dropout_step("1f1b", 1, 3, 5, "never", 11, seed=7)
    _, second = dropout_step("1f1b", 1, 3, 5, "never", 11, seed=8)
    model = make_mlp(LAYERS)
    x, target = batch(11)
    _, _, without, _ = reference_step(model, x, target, F.mse_loss)
    assert not torch.equal(first[0], second[0])
    assert not torch.allclose(first[0], without[0])


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_two_runs_with_the_same_seed_are_bitwise_identical(
    schedule: str, v: int, checkpoint: str
) -> None:
    runs = [dropout_step(schedule, v, 3, 7, checkpoint, 13, seed=11) for _ in range(2)]
    (loss_a, grads_a), (loss_b, grads_b) = runs
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


# -- each action runs once ---------------------------------------------------------------


class CountingLinear(nn.Linear):
    """A Linear that counts its forward calls."""

    def __init__(self, width: int) -> None:
        super().__init__(width, width, dtype=torch.float64)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize(("schedule", "v"), SCHEDULES, ids=SCHEDULE_IDS)
def test_forward_runs_once_per_microbatch_twice_when_recomputed(
    schedule: str, v: int, checkpoint: str
) -> None:
    k, m = 2, 5
    layers = [layer for _ in range(k * v * 2) for layer in (CountingLinear(6), nn.Tanh())]
    model = nn.Sequential(*layers)
    pipe = make_pipe(model, schedule, v, k, m, checkpoint)
    x, target = batch(10)
    pipe.train_step(x, target, F.mse_loss)

    # "never": the backward (and zero-bubble's separate W) reuses the saved graph;
    # "always": every micro-batch's forward is recomputed once, right before its backward;
    # "except_last": all but the last micro-batch are.
    expected = {"never": m, "always": 2 * m, "except_last": 2 * m - 1}[checkpoint]
    counters = [layer for layer in model if isinstance(layer, CountingLinear)]
    assert [c.calls for c in counters] == [expected] * len(counters)


# -- failures ----------------------------------------------------------------------------


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ArithmeticError("broken gradient")


class FailingLinear(nn.Linear):
    """A Linear that can fail: in the forward of micro-batch 1, in its input gradient, or in
    its weight gradient (a failing node on the weight's branch only, so zero-bubble schedules
    fail in W and the others in B)."""

    def __init__(self, width: int) -> None:
        super().__init__(width, width, dtype=torch.float64)
        self.when = "never"
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.when == "forward" and self.calls == 2:
            raise ArithmeticError("broken forward")
        weight = _FailBackward.apply(self.weight) if self.when == "weight" else self.weight
        out = F.linear(x, weight, self.bias)
        return _FailBackward.apply(out) if self.when == "input" else out


@pytest.mark.timeout(20)
@pytest.mark.parametrize("when", ["forward", "input", "weight"])
@pytest.mark.parametrize(
    ("schedule", "v"), [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)], ids=str
)
def test_exception_in_a_stage_propagates_without_hang_and_next_step_works(
    schedule: str, v: int, when: str
) -> None:
    torch.manual_seed(0)
    failing = FailingLinear(6)
    model = nn.Sequential(
        nn.Linear(6, 6), nn.Tanh(), failing, nn.Tanh(),
        nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
    ).double()  # fmt: skip
    plain = copy.deepcopy(model)
    k = 4 // v
    pipe = GPipe(model, [2, 2, 2, 2], devices=["cpu"] * k, chunks=4, checkpoint="never",
                 schedule=schedule, virtual_stages=v)  # fmt: skip
    x, target = batch(8)

    failing.when = when
    kind = "forward" if when == "forward" else "backward"
    if when == "weight" and schedule in SPLIT:
        kind = "weight gradient"
    with pytest.raises(ArithmeticError, match=rf"broken .*stage 1, .*during {kind}"):
        pipe.train_step(x, target, F.mse_loss)

    failing.when = "never"
    pipe.zero_grad(set_to_none=True)
    _, expected_loss, expected_grads, _ = reference_step(plain, x, target, F.mse_loss)
    loss = pipe.train_step(x, target, F.mse_loss)
    assert_close(loss, expected_loss)
    for param, expected in zip(model.parameters(), expected_grads):
        assert_close(param.grad, expected)


def test_zb_v_without_virtual_stages_says_to_pass_two_not_to_add_devices() -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    with pytest.raises(
        ValueError, match=r"'zb-v' holds 2 stages per device: pass virtual_stages=2"
    ):
        GPipe(model, balance=[1, 1, 1, 1], devices=["cpu"] * 2, chunks=4, schedule="zb-v")
