"""A U-Net written for torchgpipe's skip interface runs with only the import changed.

The model below is user code in torchgpipe's style (a ``Stash`` and a ``PopCat`` layer, one
:class:`Namespace` per level); only the two import lines differ from torchgpipe.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpipe.skip import Namespace, pop, skippable, stash  # was: from torchgpipe.skip import ...


@skippable(stash=["skip"])
class Stash(nn.Module):
    def forward(self, input):  # type: ignore[no-untyped-def]
        yield stash("skip", input)
        return input


@skippable(pop=["skip"])
class PopCat(nn.Module):
    def forward(self, input):  # type: ignore[no-untyped-def]
        skipped = yield pop("skip")
        return torch.cat((input, skipped), dim=1)


def conv(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 3, padding=1), nn.ReLU())


def unet(depth: int = 3, channels: int = 4) -> nn.Sequential:
    """Conv in, then per level down: conv, Stash, pool; per level up: upsample, PopCat, conv."""
    levels = [Namespace() for _ in range(depth)]
    layers: list[nn.Module] = [conv(1, channels)]
    width = channels
    for ns in levels:
        layers += [conv(width, width * 2), Stash().isolate(ns), nn.AvgPool2d(2)]
        width *= 2
    layers.append(conv(width, width))
    for ns in reversed(levels):
        layers += [nn.Upsample(scale_factor=2), PopCat().isolate(ns), conv(width * 2, width // 2)]
        width //= 2
    layers.append(nn.Conv2d(width, 1, 1))
    return nn.Sequential(*layers)


BALANCE = [6, 5, 5, 5]  # four stages; the outer skip crosses three of them


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return unet().double()


def test_the_unet_runs_as_a_plain_model_and_its_skips_pair_up() -> None:
    from gpipe.skip import verify_skippables

    model = _model()
    verify_skippables(model)
    output = model(torch.randn(2, 1, 16, 16, dtype=torch.float64))
    assert output.shape == (2, 1, 16, 16)


def test_the_unet_cut_into_stages_sends_each_long_skip_straight_to_its_pop() -> None:
    from gpipe.skip import stages

    model = _model()
    assert len(model) == 21
    cut = stages(model, BALANCE)
    # The outer level stashes at layer 2 (stage 0) and pops at layer 18 (stage 3); the
    # middle one stashes at 5 (stage 0), pops at 15 (stage 2); the inner one goes 8 -> 12.
    assert cut.dataflow.skips() == [(0, 2, ("skip:skip@2",)), (0, 3, ("skip:skip@3",))]
    assert [list(taken) for taken in cut.dataflow.takes[1:]] == [
        [("input", 0)],
        [("input", 1), ("skip:skip@2", 0), ("skip:skip@1", 1)],
        [("input", 2), ("skip:skip@3", 0)],
    ]

    plain = copy.deepcopy(model)
    x = torch.randn(2, 1, 16, 16, dtype=torch.float64)
    expected = plain(x)
    expected.square().mean().backward()
    output = cut(x)
    output.square().mean().backward()
    torch.testing.assert_close(output, expected)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("chunks", [1, 4])
def test_the_unet_trains_through_gpipe_as_the_plain_model(chunks: int) -> None:
    from gpipe import GPipe  # was: from torchgpipe import GPipe

    model = _model()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 1, 16, 16, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()

    expected = plain(x_plain)
    expected.square().mean().backward()
    pipe = GPipe(model, balance=BALANCE, chunks=chunks)
    output = pipe(x)
    output.square().mean().backward()

    torch.testing.assert_close(output, expected)
    torch.testing.assert_close(x.grad, x_plain.grad)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
