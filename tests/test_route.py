"""Models that are not a chain, on the local runtime: every schedule and checkpoint mode
gives the loss, outputs and gradients of plain training of the same stages."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe import GPipe
from gpipe.dataflow import INPUT, Dataflow, Stages
from gpipe.tied import TiedParameters
from route_models import FLOW, batch, unet

# The mask is one (4,) tensor for every sample: given whole to every micro-batch.
WHOLE = {"mask": None}
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)]


def assert_gradients(stages: Stages, expected: dict, x: torch.Tensor, mask: torch.Tensor) -> None:
    for param, grad in zip(stages.parameters(), expected["grads"], strict=True):
        torch.testing.assert_close(param.grad, grad)
    torch.testing.assert_close(x.grad, expected["x"])
    torch.testing.assert_close(mask.grad, expected["mask"])


def reference(stages: Stages, size: int = 10) -> tuple[dict, torch.Tensor, torch.Tensor, Any]:
    x, mask, target = batch(size)
    x.requires_grad_()
    mask.requires_grad_()
    output = stages(x, mask=mask)
    loss = F.mse_loss(output, target)
    loss.backward()
    expected = {
        "loss": loss.detach(),
        "output": output.detach(),
        "grads": [p.grad.clone() for p in stages.parameters()],
        "x": x.grad.clone(),
        "mask": mask.grad.clone(),
    }
    stages.zero_grad(set_to_none=True)
    x.grad = mask.grad = None
    return expected, x, mask, target


@pytest.mark.parametrize(("schedule", "virtual"), SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_dataflow_trains_like_plain_pytorch_under_every_schedule(
    schedule: str, virtual: int, checkpoint: str
) -> None:
    stages = unet()
    expected, x, mask, target = reference(stages)
    pipe = GPipe(
        stages,
        chunks=4,
        schedule=schedule,
        virtual_stages=virtual,
        checkpoint=checkpoint,
        input_batch_dims=WHOLE,
    )
    loss = pipe.train_step(x, target, F.mse_loss, kwargs={"mask": mask})
    torch.testing.assert_close(loss, expected["loss"])
    assert_gradients(stages, expected, x, mask)


def test_the_forward_call_and_its_backward_equal_plain_pytorch() -> None:
    stages = unet()
    expected, x, mask, target = reference(stages)
    pipe = GPipe(stages, chunks=3, input_batch_dims=WHOLE)
    output = pipe(x, mask=mask)
    torch.testing.assert_close(output, expected["output"])
    F.mse_loss(output, target).backward()
    assert_gradients(stages, expected, x, mask)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x, mask), expected["output"])


def test_a_tuple_input_gives_the_positional_inputs() -> None:
    stages = unet()
    expected, x, mask, target = reference(stages)
    loss = GPipe(stages, chunks=2, input_batch_dims=WHOLE).train_step((x, mask), target, F.mse_loss)
    torch.testing.assert_close(loss, expected["loss"])
    assert_gradients(stages, expected, x, mask)


def test_the_pipe_takes_balance_and_devices_from_the_stages() -> None:
    stages = unet()
    pipe = GPipe(stages, chunks=2)
    assert pipe.balance == [2, 1, 1, 1]
    assert pipe.devices == [torch.device("cpu")] * 4
    assert len(GPipe(stages, chunks=2, schedule="interleaved", virtual_stages=2).devices) == 2
    assert gpipe.Stages is Stages


def test_a_balance_other_than_the_stages_is_refused() -> None:
    with pytest.raises(ValueError, match=r"conflicts with the Stages' own balance \[2, 1, 1, 1\]"):
        GPipe(unet(), balance=[1, 1, 1, 2])
    GPipe(unet(), balance=[2, 1, 1, 1]).close()  # the same balance is fine


def test_a_stage_count_that_does_not_fit_the_devices_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 3"):
        GPipe(unet(), virtual_stages=3)
    with pytest.raises(ValueError, match="4 stages but devices lists 3 devices"):
        GPipe(unet(), devices=["cpu"] * 3)


def test_a_skip_across_three_stages_is_one_transfer_per_microbatch() -> None:
    stages = unet(tied=False)
    x, mask, target = batch(8)
    pipe = GPipe(stages, chunks=4, input_batch_dims=WHOLE)
    pipe.train_step(x, target, F.mse_loss, kwargs={"mask": mask})
    forward = [t for t in pipe.timeline.transfers if t.kind == "F"]
    pairs = sorted({(t.sender, t.stage) for t in forward})
    # stage 3 hears from stages 0 (skip, tag, nothing), 1 (side) and 2 (h), directly
    assert pairs == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert len(forward) == 6 * 4
    skips = [t for t in forward if (t.sender, t.stage) == (0, 3)]
    assert sorted(t.microbatch for t in skips) == [0, 1, 2, 3]
    assert all((t.source, t.target) == (0, 3) for t in skips)
    assert all(t.nbytes == 2 * WIDTH_BYTES for t in skips)  # 2 samples x 4 float64s
    backward = [t for t in pipe.timeline.transfers if t.kind == "B"]
    assert sorted({(t.sender, t.stage) for t in backward}) == sorted((b, a) for a, b in pairs)


WIDTH_BYTES = 4 * 8


def test_relayed_stages_send_the_skip_through_every_stage_in_between() -> None:
    direct, relayed = unet(tied=False), unet(tied=False).relayed()
    x, mask, target = batch(8)
    sent = {}
    for name, stages in [("direct", direct), ("relayed", relayed)]:
        pipe = GPipe(stages, chunks=4, input_batch_dims=WHOLE)
        pipe.train_step(x, target, F.mse_loss, kwargs={"mask": mask})
        forward = [t for t in pipe.timeline.transfers if t.kind == "F"]
        assert {(t.sender, t.stage) for t in forward} <= (
            {(0, 1), (1, 2), (2, 3)}
            if name == "relayed"
            else {(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)}
        )
        sent[name] = sum(t.nbytes for t in forward)
    # relayed, the skip (2 samples x 4) also crosses 1 -> 2 -> 3... and the mask rides along
    assert sent["relayed"] > sent["direct"]
    assert relayed.dataflow.skips() == []


def test_relayed_stages_compute_the_same_loss_and_gradients() -> None:
    direct = unet()
    expected, x, mask, target = reference(direct)
    relayed = direct.relayed()
    assert [id(p) for p in relayed.parameters()] == [id(p) for p in direct.parameters()]
    loss = GPipe(relayed, chunks=4, schedule="1f1b", input_batch_dims=WHOLE).train_step(
        x, target, F.mse_loss, kwargs={"mask": mask}
    )
    torch.testing.assert_close(loss, expected["loss"])
    assert_gradients(direct, expected, x, mask)


def test_a_tied_weight_on_one_device_is_one_parameter_with_both_stages_gradients() -> None:
    stages = unet(tied=True)
    assert stages[0].lin.weight is stages[3].lin.weight
    expected, x, mask, target = reference(stages)
    GPipe(stages, chunks=4, input_batch_dims=WHOLE).train_step(
        x, target, F.mse_loss, kwargs={"mask": mask}
    )
    torch.testing.assert_close(stages[0].lin.weight.grad, expected["grads"][0])


def test_a_tied_weight_gets_a_copy_only_when_its_stages_are_on_two_devices() -> None:
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert len(TiedParameters(unet(tied=True), (0, 0, 1, 1), devices)) == 1
    assert len(TiedParameters(unet(tied=True), (0, 1, 1, 0), devices)) == 0


def test_a_stage_that_returns_too_little_names_the_stage_and_the_missing_value() -> None:
    class Forgets(nn.Module):
        def forward(self, values: dict) -> dict:
            return {"h": values["x"]}

    stages = unet()
    broken = Stages([Forgets(), *list(stages)[1:]], FLOW, balance=[2, 1, 1, 1])
    x, mask, target = batch(4)
    pipe = GPipe(broken, chunks=2, input_batch_dims=WHOLE)
    with pytest.raises(ValueError, match=r"stage 0 returned \['h'\].*'skip'"):
        pipe.train_step(x, target, F.mse_loss, kwargs={"mask": mask})


def test_named_inputs_are_checked_and_a_sequential_takes_no_keywords() -> None:
    x, mask, target = batch(4)
    pipe = GPipe(unet(), chunks=2, input_batch_dims=WHOLE)
    with pytest.raises(TypeError, match="unknown input 'mask2'"):
        pipe.train_step(x, target, F.mse_loss, kwargs={"mask2": mask})
    with pytest.raises(TypeError, match=r"missing.*'mask'"):
        pipe(x)
    sequential = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).double(), chunks=2)
    with pytest.raises(TypeError, match="takes one input"):
        sequential.train_step(x, target, F.mse_loss, kwargs={"mask": mask})
    with pytest.raises(TypeError, match="takes one input, got 2"):
        sequential(x, mask)
    assert sequential(input=x).shape == x.shape


def test_a_batch_dim_per_named_input() -> None:
    stages = unet()
    expected, x, mask, target = reference(stages)
    rows = mask.expand(10, -1).detach().clone().requires_grad_()  # a mask per sample: batched
    pipe = GPipe(stages, chunks=4, input_batch_dims={"mask": 0})
    pipe.train_step(x, target, F.mse_loss, kwargs={"mask": rows})
    torch.testing.assert_close(rows.grad.sum(0), expected["mask"])
    with pytest.raises(ValueError, match=r"names \['masks'\]"):
        GPipe(unet(), chunks=2, input_batch_dims={"masks": None}).train_step(
            x, target, F.mse_loss, kwargs={"mask": mask}
        )


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_dropout_draws_the_same_masks_in_every_schedule_and_checkpoint_mode(
    checkpoint: str,
) -> None:
    grads = []
    for schedule, virtual in [("gpipe", 1), ("zb-h1", 1), ("interleaved", 2)]:
        stages = unet(dropout=0.5)
        x, mask, target = batch(8)
        torch.manual_seed(7)  # the step seed
        pipe = GPipe(
            stages,
            chunks=4,
            schedule=schedule,
            virtual_stages=virtual,
            checkpoint=checkpoint,
            input_batch_dims=WHOLE,
        )
        pipe.train_step(x, target, F.mse_loss, kwargs={"mask": mask})
        grads.append([p.grad for p in stages.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            torch.testing.assert_close(a, b)
    assert any(not torch.equal(g, torch.zeros_like(g)) for g in grads[0])


class _WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, values: dict) -> torch.Tensor:
        a = values["a"]
        a.mul_(2.0)  # writes into the value it received
        return self.lin(a) + values["b"]


class _Makes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, values: dict) -> dict:
        return {"a": self.lin(values["x"]), "b": values["x"] * 3}


def test_a_stage_writing_into_its_input_gets_a_copy() -> None:
    torch.manual_seed(0)
    flow = Dataflow(("x",), ((("x", INPUT),), (("a", 0), ("b", 0))))
    stages = Stages([_Makes(), _WritesItsInput()], flow).double()
    x, _, target = batch(6)
    x.requires_grad_()
    loss = F.mse_loss(stages(x), target)
    loss.backward()
    expected = [p.grad.clone() for p in stages.parameters()]
    x_grad = x.grad.clone()
    stages.zero_grad(set_to_none=True)
    x.grad = None
    for checkpoint in ["always", "never"]:
        pipe = GPipe(stages, chunks=3, checkpoint=checkpoint)
        for _ in range(2):  # the first step learns that the stage writes, the second copies
            got = pipe.train_step(x, target, F.mse_loss)
            torch.testing.assert_close(got, loss.detach())
            for param, grad in zip(stages.parameters(), expected, strict=True):
                torch.testing.assert_close(param.grad, grad)
            torch.testing.assert_close(x.grad, x_grad)
            stages.zero_grad(set_to_none=True)
            x.grad = None


class _Normalized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)

    def forward(self, values: dict) -> dict:
        return {"h": self.norm(values["x"]), "x": values["x"]}


class _Sums(nn.Module):
    def forward(self, values: dict) -> torch.Tensor:
        return values["h"] + values["x"]


def test_deferred_batch_norm_keeps_the_running_statistics_of_plain_training() -> None:
    flow = Dataflow(("x",), ((("x", INPUT),), (("h", 0), ("x", 0))))
    torch.manual_seed(0)
    plain_stages = Stages([_Normalized(), _Sums()], flow).double()
    piped = Stages([_Normalized(), _Sums()], flow).double()
    x, _, target = batch(8)
    F.mse_loss(plain_stages(x), target).backward()
    pipe = GPipe(piped, chunks=4, deferred_batch_norm=True)
    pipe.train_step(x, target, F.mse_loss)
    norm = piped[0].norm
    torch.testing.assert_close(norm.running_mean, plain_stages[0].norm.running_mean)
    torch.testing.assert_close(norm.running_var, plain_stages[0].norm.running_var)
