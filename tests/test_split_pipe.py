"""Stages from gpipe.split run in gpipe.GPipe under every kind of schedule and train exactly
as the plain model does; dropout draws the same masks whatever the cuts.

These need a GPipe that accepts Stages (the route work of issue 10); until it does, they skip.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import gpipe
from gpipe.dataflow import Stages
from split_models import make_encoder_decoder, make_gpt, make_unet


def _gpt_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))


def _pair_loss(output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output[0], target) + output[1].pow(2).mean()


def _case(name: str) -> tuple[nn.Module, Any, dict[str, Any], Any, Callable, list[str], dict]:
    """model, positional input, kwargs, target, loss, split points, GPipe options."""
    if name == "gpt":
        model, ((idx,), kwargs) = make_gpt()
        options = {"input_batch_dims": {"idx": 0, "mask": None}}
        return model, idx, kwargs, torch.roll(idx, 1, dims=1), _gpt_loss, ["h.1", "h.3"], options
    if name == "unet":
        model, ((x,), kwargs) = make_unet()
        target = torch.randn(2, 1, 8, 8, dtype=torch.float64)
        return model, x, kwargs, target, F.mse_loss, ["down2", "bottom", "up2"], {}
    model, ((src, tgt), kwargs) = make_encoder_decoder()
    target = torch.randn(4, 5, 5, dtype=torch.float64)
    return model, (src, tgt), kwargs, target, _pair_loss, ["encoder.1", "decoder.0"], {}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("name", ["gpt", "unet", "encoder-decoder"])
def test_split_stages_train_in_gpipe_as_the_plain_model(name: str, schedule: str) -> None:
    model, input, kwargs, target, loss_fn, points, options = _case(name)
    reference = copy.deepcopy(model)
    args = input if isinstance(input, tuple) else (input,)
    expected = loss_fn(reference(*args, **kwargs), target)
    expected.backward()

    stages = gpipe.split(model, points, example_inputs=args, example_kwargs=kwargs)
    pipe = gpipe.GPipe(stages, chunks=2, schedule=schedule, **options)
    loss = pipe.train_step(input, target, loss_fn, kwargs=kwargs or None)
    assert_close(loss, expected.detach())
    for (param_name, param), theirs in zip(model.named_parameters(), reference.parameters()):
        assert_close(param.grad, theirs.grad, msg=param_name)


def _dropout_gradients(points: list[str], schedule: str) -> list[torch.Tensor]:
    model, ((idx,), kwargs) = make_gpt()
    model.drop.p = 0.5
    for block in model.h:
        block.mlp.gelu = nn.Sequential(nn.GELU(), nn.Dropout(0.3))
    stages = gpipe.split(model, points, example_inputs=(idx,), example_kwargs=kwargs)
    assert isinstance(stages, Stages)
    pipe = gpipe.GPipe(stages, chunks=2, schedule=schedule, input_batch_dims={"mask": None})
    torch.manual_seed(5)
    pipe.train_step(idx, torch.roll(idx, 1, dims=1), _gpt_loss, kwargs=kwargs)
    return [p.grad for p in model.parameters()]


def test_split_dropout_draws_the_same_masks_whatever_the_cuts() -> None:
    # each unit (h.0, h.1, ...) draws from its own stream wherever the cuts put it
    two = _dropout_gradients(["h.2"], "1f1b")
    four = _dropout_gradients(["h.1", "h.2", "h.3"], "gpipe")
    for a, b in zip(two, four):
        assert_close(a, b)


class _DictOut(nn.Module):
    """Returns a dict, and has a non-None default its callers rarely pass."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> dict[str, torch.Tensor]:
        h = self.a(x)
        return {"out": self.c(self.b(h) + h) * scale, "feat": h}


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_dict_output_gathers_under_autograd_and_a_default_stays_baked_in(
    checkpoint: str,
) -> None:
    torch.manual_seed(0)
    model = _DictOut().double()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 4, dtype=torch.float64)
    stages = gpipe.split(model, ["b", "c"], example_inputs=(x[:2],))  # scale=2.0 not given
    assert stages.dataflow.inputs == ("x",)
    pipe = gpipe.GPipe(stages, chunks=4, schedule="1f1b", checkpoint=checkpoint)
    output = pipe(x)
    assert type(output) is dict and list(output) == ["out", "feat"]
    (output["out"].sum() + output["feat"].pow(2).sum()).backward()
    expected = plain(x)
    (expected["out"].sum() + expected["feat"].pow(2).sum()).backward()
    assert_close(output["out"], expected["out"])
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        assert_close(mine.grad, theirs.grad)
